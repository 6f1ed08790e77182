"""Settings: frozen dataclasses, their loading from the environment, and validation.

Owns every tunable number of elasticd (timeouts, TTLs, retry counts, world bounds) and the worker
environment contract. It is the only module that reads ``os.environ``. Configuration is loaded once
in an entry point and the relevant sub-dataclass is passed down; nothing else reads settings.

Durations are ``*_s`` numbers in files and variables and ``timedelta`` properties in code.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar

from elasticd.errors import ConfigError

ENV_PREFIX = "ELASTICD_"


def _seconds(doc: str, default: float) -> float:
    return field(default=default, metadata={"doc": doc, "unit": "s"})


def _positive_finite(value: object) -> bool:
    return (
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


@dataclass(frozen=True)
class Timeouts:
    """Every wait in elasticd is bounded by one of these (seconds)."""

    join_s: float = _seconds("Bound on one whole rendezvous (joining a generation).", 120.0)
    join_window_s: float = _seconds(
        "After the set of waiting members last changed, how long to wait for more before a "
        "generation that adds newcomers is published (skipped at max size).",
        0.25,
    )
    last_call_s: float = _seconds(
        "After a generation broke, how long to wait for its live members that have not come to "
        "the rendezvous yet; the rest are left out and rejoin as newcomers.",
        0.3,
    )
    lease_ttl_s: float = _seconds(
        "TTL of a member's etcd lease: a member that stops renewing is gone after this.", 3.0
    )
    keepalive_s: float = _seconds("Interval between lease renewals (must be < lease_ttl_s / 2).", 0.75)
    collective_s: float = _seconds("Bound on one collective (gradient all_reduce, vote).", 30.0)
    group_build_s: float = _seconds("Bound on building the process group of a generation.", 15.0)
    checkpoint_transfer_s: float = _seconds(
        "Bound on the state broadcast from rank 0 to newcomers.", 120.0
    )
    etcd_request_s: float = _seconds("Bound on one etcd request.", 2.0)
    abort_poll_s: float = _seconds(
        "How often a waiting collective checks whether its generation was aborted.", 0.02
    )
    shutdown_grace_s: float = _seconds("Grace given to workers to finish a step on shutdown.", 10.0)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not _positive_finite(value):
                raise ConfigError(f"{f.name}: must be a positive, finite number of seconds, got {value!r}")
        if self.keepalive_s * 2 > self.lease_ttl_s:
            raise ConfigError(
                f"keepalive_s: must be at most half of lease_ttl_s ({self.lease_ttl_s}), "
                f"got {self.keepalive_s}"
            )
        if self.lease_ttl_s < 1:
            raise ConfigError(f"lease_ttl_s: etcd grants leases of at least 1 s, got {self.lease_ttl_s}")

    def td(self, name: str) -> timedelta:
        """The setting ``<name>_s`` as a timedelta (``td("collective")``)."""
        return timedelta(seconds=float(getattr(self, f"{name}_s")))


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds on the two places that retry: idempotent etcd calls, and a whole training step."""

    etcd_attempts: int = field(default=6, metadata={"doc": "Attempts of one idempotent etcd call."})
    etcd_backoff_initial_s: float = field(
        default=0.05, metadata={"doc": "First backoff between etcd attempts (exponential, jittered)."}
    )
    etcd_backoff_max_s: float = field(default=1.0, metadata={"doc": "Largest backoff between etcd attempts."})
    step_retries: int = field(
        default=8, metadata={"doc": "Times one step may fail and be retried before the worker gives up."}
    )

    def __post_init__(self) -> None:
        for name in ("etcd_attempts", "step_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("etcd_backoff_initial_s", "etcd_backoff_max_s"):
            value = getattr(self, name)
            if not _positive_finite(value):
                raise ConfigError(f"{name}: must be a positive, finite number, got {value!r}")


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how keys are laid out."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = "/elasticd"

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd_endpoints: at least one host:port is required")
        for ep in self.endpoints:
            parse_endpoint(ep)
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ConfigError(f"etcd_prefix: must start with '/' and not end with '/', got {self.prefix!r}")


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port`` (an ``http://`` scheme is allowed and dropped).

    Raises:
        ConfigError: the endpoint is not ``host:port`` with a port in 1..65535.
    """
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
    host, sep, port_text = text.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"etcd_endpoints: expected host:port, got {endpoint!r}")
    return host.strip("[]"), int(port_text)


@dataclass(frozen=True)
class WorldConfig:
    """The job's size bounds and how its global batch behaves when the size changes."""

    job_id: str = "default"
    min_workers: int = 1
    max_workers: int = 1024

    def __post_init__(self) -> None:
        if not self.job_id or any(c in self.job_id for c in "/ \t\n"):
            raise ConfigError(f"job_id: must be non-empty with no '/' or spaces, got {self.job_id!r}")
        for name in ("min_workers", "max_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.min_workers > self.max_workers:
            raise ConfigError(
                f"min_workers: must be <= max_workers ({self.max_workers}), got {self.min_workers}"
            )


@dataclass(frozen=True)
class WorkerEnv:
    """Everything a worker process needs, as handed over by its launcher in ``ELASTICD_*`` variables."""

    world: WorldConfig = field(default_factory=WorldConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    node_id: str = field(default_factory=socket.gethostname)
    local_rank: int = 0
    advertise_addr: str = "127.0.0.1"
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend: must be one of auto, gloo, nccl, got {self.backend!r}")
        if self.local_rank < 0:
            raise ConfigError(f"local_rank: must be >= 0, got {self.local_rank}")
        if not self.node_id or "/" in self.node_id:
            raise ConfigError(f"node_id: must be non-empty with no '/', got {self.node_id!r}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> WorkerEnv:
        """Parse the worker environment contract (``ELASTICD_*`` variables).

        Raises:
            ConfigError: a variable is malformed; the message names it.
        """
        env = os.environ if environ is None else environ
        world = _load(WorldConfig, env)
        etcd_kwargs: dict[str, object] = {}
        if f"{ENV_PREFIX}ETCD_ENDPOINTS" in env:
            etcd_kwargs["endpoints"] = tuple(
                e for e in env[f"{ENV_PREFIX}ETCD_ENDPOINTS"].split(",") if e.strip()
            )
        if f"{ENV_PREFIX}ETCD_PREFIX" in env:
            etcd_kwargs["prefix"] = env[f"{ENV_PREFIX}ETCD_PREFIX"]
        etcd = _build(EtcdConfig, etcd_kwargs, "ELASTICD_ETCD_")
        top = _load(cls, env, skip=("world", "etcd", "timeouts", "retry"))
        return dataclasses.replace(
            top, world=world, etcd=etcd, timeouts=_load(Timeouts, env), retry=_load(RetryPolicy, env)
        )

    def to_environ(self) -> dict[str, str]:
        """The variables that make ``from_environ`` return this value (for launchers)."""
        out: dict[str, str] = {
            f"{ENV_PREFIX}ETCD_ENDPOINTS": ",".join(self.etcd.endpoints),
            f"{ENV_PREFIX}ETCD_PREFIX": self.etcd.prefix,
        }
        for obj in (self.world, self.timeouts, self.retry, self):
            for f in dataclasses.fields(obj):
                if f.name in ("world", "etcd", "timeouts", "retry"):
                    continue
                out[ENV_PREFIX + f.name.upper()] = str(getattr(obj, f.name))
        return out


_T = TypeVar("_T")


def _build(cls: type[_T], kwargs: Mapping[str, object], where: str) -> _T:
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _load(cls: type[_T], env: Mapping[str, str], skip: tuple[str, ...] = ()) -> _T:
    """Build ``cls`` from ``ELASTICD_<FIELD>`` variables, converting by the field's default type."""
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in skip:
            continue
        name = ENV_PREFIX + f.name.upper()
        if name not in env:
            continue
        kwargs[f.name] = convert(name, env[name], _default_of(f))
    return _build(cls, kwargs, cls.__name__)


def _default_of(f: dataclasses.Field[object]) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return ""


def convert(name: str, raw: str, like: object) -> object:
    """Convert text to the type of ``like``.

    Raises:
        ConfigError: ``raw`` is not a valid value of that type; the message names ``name``.
    """
    text = raw.strip()
    try:
        if isinstance(like, bool):
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if isinstance(like, int):
            return int(text)
        if isinstance(like, float):
            return float(text)
    except ValueError as exc:
        raise ConfigError(f"{name}: expected a {type(like).__name__}, got {raw!r}") from exc
    return text
