"""Settings: frozen dataclasses, their loading (environment, TOML file, flags), and validation.

Owns every tunable number of elasticd (timeouts, TTLs, retry counts, world bounds, the agent's
restart policy), the worker environment contract (``WorkerEnv``) and the node agent's settings
(``AgentConfig``, loaded by ``load_agent_config``: flag > ``ELASTICD_*`` variable > TOML file >
default). It is the only module that reads ``os.environ``. Configuration is loaded once in an entry
point and the relevant sub-dataclass is passed down; nothing else reads settings.

Durations are ``*_s`` numbers in files and variables and ``timedelta`` properties in code.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

import tomllib

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
    etcd_outage_s: float = _seconds(
        "How long a worker waits for an unreachable etcd (to register, to publish an abort, or "
        "within a rendezvous, on top of join_s), and an agent at its start, before giving up. "
        "Training with no membership change does not need etcd and goes on meanwhile.",
        600.0,
    )
    standby_s: float = _seconds(
        "How long a worker waits as a standby (the job is at max_workers and healthy) for a place "
        "before it gives up; this time does not count against join_s.",
        86400.0,
    )
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
    etcd_reconnect_max_s: float = field(default=0.5, metadata={
        "doc": "Longest wait between two attempts to reconnect to an etcd endpoint that went away "
               "(gRPC's own default grows to 120 s, so a restarted etcd would be noticed seconds "
               "late, after the leases it restored had expired)."})
    step_retries: int = field(
        default=8, metadata={"doc": "Times one step may fail and be retried before the worker gives up."}
    )

    def __post_init__(self) -> None:
        for name in ("etcd_attempts", "step_retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("etcd_backoff_initial_s", "etcd_backoff_max_s", "etcd_reconnect_max_s"):
            value = getattr(self, name)
            if not _positive_finite(value):
                raise ConfigError(f"{name}: must be a positive, finite number, got {value!r}")


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how keys are laid out."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = "/elasticd"
    ca_cert: str = field(default="", metadata={
        "doc": "CA bundle (PEM file) that signs the etcd servers' certificates; set: talk TLS to etcd."})
    cert_cert: str = field(default="", metadata={
        "doc": "Client certificate (PEM file) for etcd mutual TLS; needs etcd_cert_key and etcd_ca_cert."})
    cert_key: str = field(default="", metadata={"doc": "Private key (PEM file) of etcd_cert_cert."})
    user: str = field(default="", metadata={"doc": "etcd user (role-based access); needs a password."})
    password: str = field(default="", repr=False, metadata={
        "doc": "Password of etcd_user (prefer etcd_password_file or ELASTICD_ETCD_PASSWORD; never logged)."})
    password_file: str = field(default="", metadata={
        "doc": "File whose first line is etcd_user's password (instead of etcd_password)."})

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd_endpoints: at least one host:port is required")
        for ep in self.endpoints:
            parse_endpoint(ep)
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ConfigError(f"etcd_prefix: must start with '/' and not end with '/', got {self.prefix!r}")
        for name in ("ca_cert", "cert_cert", "cert_key", "password_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"etcd_{name}: no such file: {path!r}")
        if bool(self.cert_cert) != bool(self.cert_key):
            raise ConfigError("etcd_cert_cert: a client certificate needs its key, and the key its certificate "
                              "(set both etcd_cert_cert and etcd_cert_key, or neither)")
        if self.cert_cert and not self.ca_cert:
            raise ConfigError("etcd_cert_cert: a client certificate needs etcd_ca_cert (TLS) too")
        if self.password and self.password_file:
            raise ConfigError("etcd_password: give etcd_password or etcd_password_file, not both")
        has_password = bool(self.password or self.password_file)
        if bool(self.user) != has_password:
            raise ConfigError("etcd_user: a user needs a password and a password its user (set etcd_user and "
                              "etcd_password or etcd_password_file, or neither)")

    @property
    def tls(self) -> bool:
        return bool(self.ca_cert)

    def resolved_password(self) -> str:
        """The password: ``password``, else the first line of ``password_file`` ("" without a user).

        Raises:
            ConfigError: the password file cannot be read or is empty.
        """
        if not self.password_file:
            return self.password
        try:
            text = Path(self.password_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"etcd_password_file: cannot read {self.password_file!r}: {exc}") from exc
        lines = text.splitlines()
        if not lines or not lines[0]:
            raise ConfigError(f"etcd_password_file: {self.password_file!r} is empty")
        return lines[0]

    def to_environ(self) -> dict[str, str]:
        """The ``ELASTICD_ETCD_*`` variables that ``etcd_from_environ`` turns back into this value
        (security settings only when set: a password given by file travels as the file's name)."""
        out = {f"{ENV_PREFIX}ETCD_ENDPOINTS": ",".join(self.endpoints), f"{ENV_PREFIX}ETCD_PREFIX": self.prefix}
        for f in dataclasses.fields(self):
            if f.name not in ("endpoints", "prefix") and getattr(self, f.name):
                out[f"{ENV_PREFIX}ETCD_{f.name.upper()}"] = str(getattr(self, f.name))
        return out


ETCD_SECURITY_FIELDS = ("ca_cert", "cert_cert", "cert_key", "user", "password", "password_file")


def etcd_security_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The TLS and auth settings given as ``ELASTICD_ETCD_*`` variables (field -> raw text, unvalidated)."""
    env = os.environ if environ is None else environ
    return {name: env[f"{ENV_PREFIX}ETCD_{name.upper()}"] for name in ETCD_SECURITY_FIELDS
            if f"{ENV_PREFIX}ETCD_{name.upper()}" in env}


def without_etcd_security(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment minus the etcd TLS and auth variables (for a caller that takes those from
    elsewhere too, such as elasticctl's flags, and validates them together itself)."""
    env = os.environ if environ is None else environ
    drop = {f"{ENV_PREFIX}ETCD_{name.upper()}" for name in ETCD_SECURITY_FIELDS}
    return {k: v for k, v in env.items() if k not in drop}


def etcd_from_environ(environ: Mapping[str, str], base: EtcdConfig | None = None) -> EtcdConfig:
    """``EtcdConfig`` from ``ELASTICD_ETCD_*`` variables, on top of ``base`` (default: the defaults).

    Raises:
        ConfigError: a variable is malformed or the settings do not go together; the message names it.
    """
    kwargs: dict[str, object] = {}
    for f in dataclasses.fields(EtcdConfig):
        name = f"{ENV_PREFIX}ETCD_{f.name.upper()}"
        if name not in environ:
            continue
        if f.name == "endpoints":
            kwargs["endpoints"] = tuple(e for e in environ[name].split(",") if e.strip())
        else:
            kwargs[f.name] = environ[name]
    if base is not None:
        return _build_replace(base, kwargs, "ELASTICD_ETCD_")
    return _build(EtcdConfig, kwargs, "ELASTICD_ETCD_")


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


EVENTS_KEEP_DOC = ("Most events kept in the job's history in etcd (events/); each writer prunes the "
                   "oldest beyond it after it writes.")


def _check_events_keep(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"events_keep: must be an integer >= 1, got {value!r}")


CHECKPOINT_ALLOW_NEW_MODEL_DOC = (
    "Allow a job to start over from step 1 with a model whose signature differs from the "
    "checkpoints in its directory (they are kept: retention deletes only checkpoints of the saving "
    "model). Off: such a worker stops with CheckpointModelChanged and deletes nothing.")


@dataclass(frozen=True)
class CheckpointConfig:
    """Durable checkpoints (``elasticd.durable``): where, how often, how many are kept.

    Off unless ``checkpoint_dir`` is set. With a directory, a worker also resumes from it: a job
    whose members hold no live state loads the newest good checkpoint found there.
    """

    checkpoint_dir: str = field(default="", metadata={
        "doc": "Directory of durable checkpoints (local or shared); checkpoints of a job go to "
               "<dir>/<job_id>/. Empty: no checkpoints, and no resume from disk."})
    checkpoint_every_steps: int = field(default=0, metadata={
        "doc": "Save when the committed step is a multiple of this (0: not by steps)."})
    checkpoint_every_s: float = field(default=0.0, metadata={
        "doc": "Save at the first step boundary this many seconds after the last save began (0: not by time)."})
    checkpoint_keep: int = field(default=3, metadata={
        "doc": "Good checkpoints kept in the directory; older ones are deleted after a save."})
    checkpoint_wait_s: float = field(default=60.0, metadata={
        "doc": "Longest a due save waits at a step boundary for the previous write to finish; past "
               "it, this save is skipped (checkpoint_skipped) and the next one is tried."})
    checkpoint_allow_new_model: bool = field(default=False, metadata={"doc": CHECKPOINT_ALLOW_NEW_MODEL_DOC})

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_allow_new_model, bool):
            raise ConfigError(f"checkpoint_allow_new_model: must be true or false, "
                              f"got {self.checkpoint_allow_new_model!r}")
        if "\0" in self.checkpoint_dir:
            raise ConfigError(f"checkpoint_dir: not a valid path: {self.checkpoint_dir!r}")
        for name, least in (("checkpoint_every_steps", 0), ("checkpoint_keep", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name}: must be an integer >= {least}, got {value!r}")
        value = self.checkpoint_every_s
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value >= 0):
            raise ConfigError(f"checkpoint_every_s: must be a finite number >= 0, got {value!r}")
        if not _positive_finite(self.checkpoint_wait_s):
            raise ConfigError(f"checkpoint_wait_s: must be a positive, finite number of seconds, "
                              f"got {self.checkpoint_wait_s!r}")

    @property
    def enabled(self) -> bool:
        """A directory is set: resume from it, and save when a schedule is set."""
        return bool(self.checkpoint_dir)

    @property
    def saves(self) -> bool:
        return self.enabled and (self.checkpoint_every_steps > 0 or self.checkpoint_every_s > 0)


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
    events_keep: int = field(default=500, metadata={"doc": EVENTS_KEEP_DOC})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        _check_events_keep(self.events_keep)
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
        etcd = etcd_from_environ(env)
        top = _load(cls, env, skip=("world", "etcd", "timeouts", "retry", "checkpoint"))
        return dataclasses.replace(
            top, world=world, etcd=etcd, timeouts=_load(Timeouts, env), retry=_load(RetryPolicy, env),
            checkpoint=_load(CheckpointConfig, env),
        )

    def to_environ(self) -> dict[str, str]:
        """The variables that make ``from_environ`` return this value (for launchers)."""
        out: dict[str, str] = self.etcd.to_environ()
        for obj in (self.world, self.timeouts, self.retry, self.checkpoint, self):
            for f in dataclasses.fields(obj):
                if f.name in ("world", "etcd", "timeouts", "retry", "checkpoint"):
                    continue
                out[ENV_PREFIX + f.name.upper()] = str(getattr(obj, f.name))
        return out


_T = TypeVar("_T")


def _build(cls: type[_T], kwargs: Mapping[str, object], where: str) -> _T:
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _build_replace(base: _T, kwargs: Mapping[str, object], where: str) -> _T:
    try:
        return dataclasses.replace(base, **kwargs)  # type: ignore[type-var]
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


# ---------------------------------------------------------------------------------------------
# The node agent

DEFAULT_CONFIG_FILE = Path("/etc/elasticd/elasticd.toml")
AGENT_MODES = ("elastic", "restart")  # AgentConfig.mode
CONFIG_FILE_VARIABLE = f"{ENV_PREFIX}CONFIG"


@dataclass(frozen=True)
class AgentConfig:
    """Everything the node agent (``elasticd``) needs; built by ``load_agent_config``.

    Its settings share one flat namespace (``AGENT_SETTINGS``): the TOML key ``lease_ttl_s`` is the
    variable ``ELASTICD_LEASE_TTL_S`` and the flag ``--lease-ttl-s``. The restart policy allows
    ``max_restarts`` worker restarts per ``restart_window_s`` over the whole node; each restart
    waits ``restart_backoff_initial_s * 2**(restarts in the window)``, at most
    ``restart_backoff_max_s``.
    """

    program: tuple[str, ...] = field(default=(), metadata={
        "doc": "The training program each worker runs (argv); a first element ending in .py is run "
               "with the agent's Python. Not read from the environment."})
    world: WorldConfig = field(default_factory=WorldConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    nproc_per_node: int = field(default=1, metadata={
        "doc": "Workers this agent runs (default: one per device in CUDA_VISIBLE_DEVICES, else 1)."})
    node_id: str = field(default_factory=socket.gethostname, metadata={
        "doc": "This node's id in the job (default: the host name)."})
    advertise_addr: str = field(default="127.0.0.1", metadata={
        "doc": "Address the workers of this node listen on for their peers."})
    backend: str = field(default="auto", metadata={"doc": "torch.distributed backend: auto, gloo or nccl."})
    checkpoint_dir: Path | None = field(default=None, metadata={
        "doc": "Directory of durable checkpoints, passed to the workers (ELASTICD_CHECKPOINT_DIR); "
               "unset: no checkpoints."})
    checkpoint_every_steps: int = field(default=CheckpointConfig.checkpoint_every_steps, metadata={
        "doc": CheckpointConfig.__dataclass_fields__["checkpoint_every_steps"].metadata["doc"]})
    checkpoint_every_s: float = field(default=CheckpointConfig.checkpoint_every_s, metadata={
        "doc": CheckpointConfig.__dataclass_fields__["checkpoint_every_s"].metadata["doc"]})
    checkpoint_keep: int = field(default=CheckpointConfig.checkpoint_keep, metadata={
        "doc": CheckpointConfig.__dataclass_fields__["checkpoint_keep"].metadata["doc"]})
    checkpoint_wait_s: float = field(default=CheckpointConfig.checkpoint_wait_s, metadata={
        "doc": CheckpointConfig.__dataclass_fields__["checkpoint_wait_s"].metadata["doc"]})
    checkpoint_allow_new_model: bool = field(default=False, metadata={"doc": CHECKPOINT_ALLOW_NEW_MODEL_DOC})
    max_restarts: int = field(default=3, metadata={
        "doc": "Worker restarts allowed per restart_window_s on this node; one more failure stops the "
               "agent (restarts_exhausted, exit 1)."})
    restart_window_s: float = field(default=300.0, metadata={
        "doc": "The window over which restarts are counted against max_restarts."})
    restart_backoff_initial_s: float = field(default=0.5, metadata={
        "doc": "Wait before the first restart in a window; doubled for each further one."})
    restart_backoff_max_s: float = field(default=30.0, metadata={"doc": "The longest wait before a restart."})
    kill_wait_s: float = field(default=5.0, metadata={
        "doc": "After SIGKILL, how long to wait for workers to be reaped before the agent exits anyway."})
    poll_interval_s: float = field(default=0.1, metadata={
        "doc": "Longest sleep of the agent loop (a worker's exit wakes it at once; this is the fallback)."})
    stats_interval_s: float = field(default=5.0, metadata={
        "doc": "Interval between samples of each worker's memory and CPU use (and, at least, between "
               "writes of the node record in etcd)."})
    events_keep: int = field(default=500, metadata={"doc": EVENTS_KEEP_DOC})
    mode: str = field(default="elastic", metadata={
        "doc": "elastic: workers use the in-process worker API and the job goes on without a failed "
               "one; restart: unmodified torchrun scripts (RANK, WORLD_SIZE, MASTER_ADDR, ...), and "
               "any failure restarts every worker of the job (group_restart.py)."})
    hang_timeout_s: float = field(default=60.0, metadata={
        "doc": "A worker whose progress in etcd has not advanced for this long while the job's committed "
               "step grew is killed and restarted like a crashed one (0: never)."})
    stopped_worker_s: float = field(default=0.5, metadata={
        "doc": "A worker process seen stopped (SIGSTOP or SIGTSTP: state T; a debugger's tracing stop "
               "is not counted) for this long has its lease revoked by its agent, so that the others "
               "regroup without it now rather than after lease_ttl_s; it is not killed, and rejoins as a "
               "newcomer when it continues (0: never)."})
    metrics_port: int = field(default=0, metadata={
        "doc": "TCP port of the Prometheus metrics endpoint (/metrics); 0: no endpoint."})
    metrics_addr: str = field(default="127.0.0.1", metadata={
        "doc": "Address the metrics endpoint listens on (0.0.0.0: every interface)."})

    def __post_init__(self) -> None:
        if not self.program or not all(isinstance(a, str) for a in self.program) or not self.program[0]:
            raise ConfigError(
                "program: no training program given (put it after --, e.g. "
                "`elasticd [flags] -- python train.py`, or set program = [...] in the config file)"
            )
        for name in ("nproc_per_node", "max_restarts"):
            value = getattr(self, name)
            least = 1 if name == "nproc_per_node" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name}: must be an integer >= {least}, got {value!r}")
        for name in ("restart_window_s", "restart_backoff_initial_s", "restart_backoff_max_s",
                     "kill_wait_s", "poll_interval_s", "stats_interval_s"):
            value = getattr(self, name)
            if not _positive_finite(value):
                raise ConfigError(f"{name}: must be a positive, finite number of seconds, got {value!r}")
        if not (isinstance(self.hang_timeout_s, (int, float)) and not isinstance(self.hang_timeout_s, bool)
                and math.isfinite(self.hang_timeout_s) and self.hang_timeout_s >= 0):
            raise ConfigError(f"hang_timeout_s: must be a finite number of seconds >= 0 (0: off), "
                              f"got {self.hang_timeout_s!r}")
        if 0 < self.hang_timeout_s < 2 * self.timeouts.keepalive_s:
            raise ConfigError(f"hang_timeout_s: must be 0 (off) or at least twice keepalive_s "
                              f"({self.timeouts.keepalive_s}), the interval of progress records, "
                              f"got {self.hang_timeout_s}")
        if not (isinstance(self.stopped_worker_s, (int, float)) and not isinstance(self.stopped_worker_s, bool)
                and math.isfinite(self.stopped_worker_s) and self.stopped_worker_s >= 0):
            raise ConfigError(f"stopped_worker_s: must be a finite number of seconds >= 0 (0: off), "
                              f"got {self.stopped_worker_s!r}")
        if (not isinstance(self.metrics_port, int) or isinstance(self.metrics_port, bool)
                or not 0 <= self.metrics_port < 65536):
            raise ConfigError(f"metrics_port: must be an integer in 0..65535 (0: off), got {self.metrics_port!r}")
        if not self.metrics_addr or any(c.isspace() for c in self.metrics_addr):
            raise ConfigError(f"metrics_addr: must be an address to listen on, got {self.metrics_addr!r}")
        if self.restart_backoff_max_s < self.restart_backoff_initial_s:
            raise ConfigError(
                f"restart_backoff_max_s: must be >= restart_backoff_initial_s "
                f"({self.restart_backoff_initial_s}), got {self.restart_backoff_max_s}"
            )
        if self.nproc_per_node > self.world.max_workers:
            raise ConfigError(
                f"nproc_per_node: must be <= max_workers ({self.world.max_workers}), got {self.nproc_per_node}"
            )
        if self.checkpoint_dir is not None:
            text = str(self.checkpoint_dir)
            if not text or "\0" in text:
                raise ConfigError(f"checkpoint_dir: not a valid path: {text!r}")
            if self.checkpoint_dir.exists() and not self.checkpoint_dir.is_dir():
                raise ConfigError(f"checkpoint_dir: {text} exists and is not a directory")
        if self.mode not in AGENT_MODES:
            raise ConfigError(f"mode: must be one of {', '.join(AGENT_MODES)}, got {self.mode!r}")
        self.worker_env(0)  # validates node_id, advertise_addr, backend and events_keep as a worker would

    def worker_env(self, local_rank: int) -> WorkerEnv:
        """The settings of this node's worker ``local_rank``."""
        return WorkerEnv(world=self.world, etcd=self.etcd, timeouts=self.timeouts, retry=self.retry,
                         node_id=self.node_id, local_rank=local_rank, advertise_addr=self.advertise_addr,
                         backend=self.backend, events_keep=self.events_keep,
                         checkpoint=self.checkpoint_config())

    def checkpoint_config(self) -> CheckpointConfig:
        """The workers' durable-checkpoint settings."""
        return CheckpointConfig(
            checkpoint_dir=str(self.checkpoint_dir) if self.checkpoint_dir is not None else "",
            checkpoint_every_steps=self.checkpoint_every_steps, checkpoint_every_s=self.checkpoint_every_s,
            checkpoint_keep=self.checkpoint_keep, checkpoint_wait_s=self.checkpoint_wait_s,
            checkpoint_allow_new_model=self.checkpoint_allow_new_model)

    def worker_environ(self, local_rank: int) -> dict[str, str]:
        """The ``ELASTICD_*`` variables of worker ``local_rank`` (what ``WorkerEnv.from_environ`` reads)."""
        return self.worker_env(local_rank).to_environ()


SYSTEMD_NOTIFY_VARIABLES = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def systemd_notify_environ(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """What systemd tells a ``Type=notify`` service: ``NOTIFY_SOCKET``, ``WATCHDOG_USEC``,
    ``WATCHDOG_PID`` (each None when unset)."""
    env = os.environ if environ is None else environ
    return {name: env.get(name) for name in SYSTEMD_NOTIFY_VARIABLES}


def child_environ(extra: Mapping[str, str]) -> dict[str, str]:
    """The environment of a process the agent starts: its own, with ``extra`` on top.

    Output is unbuffered unless the caller says otherwise, so a worker's last lines before a crash
    reach the agent's log. systemd's notify variables are the agent's alone: a worker must not
    talk to systemd for it.
    """
    env = {k: v for k, v in os.environ.items() if k not in SYSTEMD_NOTIFY_VARIABLES}
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra)
    return env


def default_nproc_per_node(environ: Mapping[str, str] | None = None) -> int:
    """One worker per device listed in ``CUDA_VISIBLE_DEVICES``; 1 when it is unset or empty.

    The agent imports no torch, so it cannot ask CUDA; this variable is what a scheduler sets.
    """
    env = os.environ if environ is None else environ
    devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return max(1, len(devices))


def parse_nnodes(text: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX`` nodes.

    Raises:
        ConfigError: not ``N`` or ``MIN:MAX`` with ``1 <= MIN <= MAX``.
    """
    lo_text, sep, hi_text = text.strip().partition(":")
    try:
        lo = int(lo_text)
        hi = int(hi_text) if sep else lo
    except ValueError as exc:
        raise ConfigError(f"nnodes: expected N or MIN:MAX, got {text!r}") from exc
    if lo < 1 or hi < lo:
        raise ConfigError(f"nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


@dataclass(frozen=True)
class Setting:
    """One agent setting: TOML key ``name``, variable ``ELASTICD_<NAME>``, flag ``--<name>``."""

    name: str
    section: str  # the dataclass that holds it: world, etcd, timeouts, retry or agent
    attr: str  # its field there
    kind: type  # int, float, str, bool, or tuple (a list of strings)
    doc: str
    from_env: bool = True

    @property
    def variable(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


_EXTRA_DOCS = {
    "job_id": "The job this node's workers join.",
    "min_workers": "Smallest world size the job trains at.",
    "max_workers": "Largest world size; further workers wait.",
    "etcd_endpoints": "etcd endpoints, host:port (several for an etcd cluster).",
    "etcd_prefix": "Key prefix of all jobs in etcd.",
}
_SECTIONS = ("world", "etcd", "timeouts", "retry")


def _agent_settings() -> dict[str, Setting]:
    out: dict[str, Setting] = {}
    tables: list[tuple[str, type, str]] = [
        ("world", WorldConfig, ""), ("etcd", EtcdConfig, "etcd_"), ("timeouts", Timeouts, ""),
        ("retry", RetryPolicy, ""), ("agent", AgentConfig, ""),
    ]
    for section, cls, rename in tables:
        for f in dataclasses.fields(cls):
            if f.name in _SECTIONS:
                continue
            name = rename + f.name
            like = _default_of(f)
            kind: type = str if like is None else type(like)
            doc = str(f.metadata.get("doc", _EXTRA_DOCS.get(name, "")))
            assert name not in out, f"setting {name} defined twice"
            out[name] = Setting(name, section, f.name, kind, doc, from_env=name != "program")
    return out


AGENT_SETTINGS: Mapping[str, Setting] = _agent_settings()

_KIND_WORDS = {int: "an integer", float: "a number", str: "a string", tuple: "a list of strings",
               bool: "true or false"}
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def _from_toml(setting: Setting, raw: object, where: str) -> object:
    kind = setting.kind
    ok = (
        (kind is bool and isinstance(raw, bool))
        or (kind is int and isinstance(raw, int) and not isinstance(raw, bool))
        or (kind is float and isinstance(raw, (int, float)) and not isinstance(raw, bool))
        or (kind is str and isinstance(raw, str))
        or (kind is tuple and isinstance(raw, list) and all(isinstance(x, str) for x in raw))
    )
    if not ok:
        raise ConfigError(f"{setting.name}: expected {_KIND_WORDS[kind]}, got {raw!r} "
                          f"({type(raw).__name__}) {where}")
    if kind is float:
        return float(raw)  # type: ignore[arg-type]
    if kind is tuple:
        return tuple(raw)  # type: ignore[arg-type]
    return raw


def _from_text(setting: Setting, raw: str, where: str) -> object:
    text = raw.strip()
    kind = setting.kind
    if kind is bool:
        if text.lower() in _TRUE_WORDS + _FALSE_WORDS:
            return text.lower() in _TRUE_WORDS
        raise ConfigError(f"{setting.name}: expected {_KIND_WORDS[kind]}, got {raw!r} ({where})")
    try:
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
    except ValueError as exc:
        raise ConfigError(f"{setting.name}: expected {_KIND_WORDS[kind]}, got {raw!r} ({where})") from exc
    if kind is tuple:
        return tuple(part.strip() for part in text.split(",") if part.strip())
    return text


def _config_path(explicit: str | Path | None, env: Mapping[str, str], default: Path) -> Path | None:
    if explicit is not None:
        where = "--config"
        path = Path(explicit)
    elif CONFIG_FILE_VARIABLE in env:
        where = CONFIG_FILE_VARIABLE
        path = Path(env[CONFIG_FILE_VARIABLE])
    else:
        return default if default.is_file() else None
    if not path.is_file():
        raise ConfigError(f"config: no such file: {str(path)!r} (from {where})")
    return path


def _read_toml(path: Path) -> dict[str, object]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from exc


def load_agent_config(
    flags: Mapping[str, str | None] | None = None,
    *,
    program: Sequence[str] = (),
    nnodes: str | None = None,
    config_file: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    default_config_file: Path = DEFAULT_CONFIG_FILE,
) -> AgentConfig:
    """Load the agent's settings: flag > ``ELASTICD_*`` variable > TOML file > default.

    Args:
        flags: setting name -> the flag's text, for the flags given (None: not given).
        program: the program from the command line (overrides ``program`` in the file).
        nnodes: torchrun's ``--nnodes N|MIN:MAX``: ``min_workers``/``max_workers`` become
            ``MIN``/``MAX`` times ``nproc_per_node``.
        config_file: ``--config``; else ``$ELASTICD_CONFIG``; else ``default_config_file`` if it exists.
        environ: the environment (default: ``os.environ``).
        default_config_file: the file read when none is named.

    Returns:
        The validated configuration.

    Raises:
        ConfigError: a setting is unknown, ill-typed or invalid, or no program is given; the
            message has one line per bad field, naming it and where its value came from.
    """
    env = os.environ if environ is None else environ
    given = {k: v for k, v in (flags or {}).items() if v is not None}
    values: dict[str, object] = {}
    sources: dict[str, str] = {}
    errors: list[str] = []
    path = _config_path(config_file, env, default_config_file)
    if path is not None:
        where = f"in {path}"
        for key, raw in _read_toml(path).items():
            known = AGENT_SETTINGS.get(key)
            if known is None:
                close = difflib.get_close_matches(key, list(AGENT_SETTINGS), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                errors.append(f"{key}: unknown setting {where}{hint}")
                continue
            try:
                values[key] = _from_toml(known, raw, where)
                sources[key] = where
            except ConfigError as exc:
                errors.append(str(exc))
    for known in AGENT_SETTINGS.values():
        if known.from_env and known.variable in env:
            try:
                values[known.name] = _from_text(known, env[known.variable], f"from {known.variable}")
                sources[known.name] = f"from {known.variable}"
            except ConfigError as exc:
                errors.append(str(exc))
    for name, raw in given.items():
        known = AGENT_SETTINGS[name]  # the command line offers only known settings
        try:
            values[name] = _from_text(known, raw, f"from {known.flag}")
            sources[name] = f"from {known.flag}"
        except ConfigError as exc:
            errors.append(str(exc))
    if program:
        values["program"] = tuple(program)
        sources["program"] = "from the command line"
    if errors:
        raise ConfigError("\n".join(errors))
    if "nproc_per_node" not in values:
        values["nproc_per_node"] = default_nproc_per_node(env)
        if "CUDA_VISIBLE_DEVICES" in env:
            sources["nproc_per_node"] = "from CUDA_VISIBLE_DEVICES"
    if nnodes is not None:
        if "min_workers" in given or "max_workers" in given:
            raise ConfigError("nnodes: give either --nnodes or --min-workers/--max-workers, not both")
        nproc = values["nproc_per_node"]
        if not isinstance(nproc, int) or nproc < 1:
            raise ConfigError(f"nproc_per_node: must be an integer >= 1, got {nproc!r} "
                              f"({sources.get('nproc_per_node', 'default')})")
        lo, hi = parse_nnodes(nnodes)
        values["min_workers"], values["max_workers"] = lo * nproc, hi * nproc
        sources["min_workers"] = sources["max_workers"] = "from --nnodes"
    prog = values.get("program")
    if isinstance(prog, tuple) and prog and str(prog[0]).endswith(".py"):
        values["program"] = (sys.executable, *prog)
    ckpt = values.get("checkpoint_dir")
    if isinstance(ckpt, str):
        values["checkpoint_dir"] = Path(ckpt) if ckpt else None
    try:
        config = _assemble(values)
    except ConfigError as exc:
        raise ConfigError(_with_sources(str(exc), sources)) from exc
    _check_program(config.program)
    return config


def _with_sources(message: str, sources: Mapping[str, str]) -> str:
    """Say where the values a validation message talks about came from."""
    named = message.split(":", 1)[0]
    mentioned = [n for n in sources if n != named and re.search(rf"\b{n}\b", message)]
    if named in sources and not mentioned:
        return f"{message} ({sources[named]})"
    notes = [f"{n} {sources[n]}" for n in ([named] if named in sources else []) + mentioned]
    return f"{message} ({'; '.join(notes)})" if notes else message


def _assemble(values: Mapping[str, object]) -> AgentConfig:
    parts: dict[str, dict[str, object]] = {section: {} for section in (*_SECTIONS, "agent")}
    for name, value in values.items():
        known = AGENT_SETTINGS[name]
        parts[known.section][known.attr] = value
    top: dict[str, object] = dict(parts["agent"])
    top["world"] = _build(WorldConfig, parts["world"], "world")
    top["etcd"] = _build(EtcdConfig, parts["etcd"], "etcd")
    top["timeouts"] = _build(Timeouts, parts["timeouts"], "timeouts")
    top["retry"] = _build(RetryPolicy, parts["retry"], "retry")
    return _build(AgentConfig, top, "agent")


def _check_program(program: tuple[str, ...]) -> None:
    exe = program[0]
    found = shutil.which(exe) if os.sep not in exe else (exe if os.access(exe, os.X_OK) else None)
    if found is None or os.path.isdir(found):
        raise ConfigError(f"program: {exe!r} is not an executable file or a command on PATH")
