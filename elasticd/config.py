"""Settings as values: elasticd's frozen dataclasses and the rules that make each one valid.

Owns every tunable number of elasticd and its default (where etcd is and how to reach it:
``EtcdConfig`` and the endpoint rules; timeouts, TTLs, retry counts, world bounds,
durable checkpoints, the agent's restart policy), the worker's settings (``WorkerEnv``) and the
node agent's (``AgentConfig``); constructing one validates it, and a bad value raises
``ConfigError`` naming the setting. Durations are ``*_s`` numbers.

It never reads ``os.environ``, a file or a command line, and never touches the filesystem:
``settings.py`` loads these values (flags, ``ELASTICD_*`` variables, the TOML file) and checks the
files they name. Configuration is loaded once in an entry point and the relevant sub-dataclass is
passed down.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

from elasticd.errors import ConfigError


# ---------------------------------------------------------------------------------------------
# Where etcd is and how to reach it


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how keys are laid out, and how to reach it (TLS, auth).

    The certificate and password files are names here: ``settings.etcd_config`` checks that they
    exist, and the etcd client reads them.
    """

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = "/elasticd"
    ca_cert: str = field(
        default="",
        metadata={
            "doc": "CA bundle (PEM file) that signs the etcd servers' certificates; set: talk TLS to etcd "
            "(https:// endpoints talk TLS too, trusting the system's CA bundle when this is unset)."
        },
    )
    cert_cert: str = field(
        default="", metadata={"doc": "Client certificate (PEM file) for etcd mutual TLS; needs etcd_cert_key, and TLS."}
    )
    cert_key: str = field(default="", metadata={"doc": "Private key (PEM file) of etcd_cert_cert."})
    user: str = field(default="", metadata={"doc": "etcd user (role-based access); needs a password."})
    password: str = field(
        default="",
        repr=False,
        metadata={"doc": "Password of etcd_user (prefer etcd_password_file or ELASTICD_ETCD_PASSWORD; never logged)."},
    )
    password_file: str = field(
        default="", metadata={"doc": "File whose first line is etcd_user's password (instead of etcd_password)."}
    )
    insecure: bool = field(
        default=False,
        metadata={
            "doc": "Allow etcd_user's password to cross the network in plaintext, to an etcd that is not on "
            "loopback and is reached without TLS; off: such a configuration is refused."
        },
    )

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd_endpoints: at least one host:port is required")
        for ep in self.endpoints:
            parse_endpoint(ep)
        if len({endpoint_scheme(ep) == "https" for ep in self.endpoints}) > 1:
            raise ConfigError(
                f"etcd_endpoints: https:// and plaintext endpoints mixed in one list "
                f"({', '.join(self.endpoints)}); use https:// for all of them or for none"
            )
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ConfigError(f"etcd_prefix: must start with '/' and not end with '/', got {self.prefix!r}")
        if bool(self.cert_cert) != bool(self.cert_key):
            raise ConfigError(
                "etcd_cert_cert: a client certificate needs its key, and the key its certificate "
                "(set both etcd_cert_cert and etcd_cert_key, or neither)"
            )
        if self.ca_cert and any(endpoint_scheme(ep) == "http" for ep in self.endpoints):
            raise ConfigError(
                "etcd_ca_cert: set, but etcd_endpoints ask for plaintext (http://); write them "
                "as https://host:port, or as host:port"
            )
        if self.cert_cert and not self.tls:
            raise ConfigError(
                "etcd_cert_cert: a client certificate needs TLS: set etcd_ca_cert, or write "
                "etcd_endpoints as https://host:port"
            )
        if self.password and self.password_file:
            raise ConfigError("etcd_password: give etcd_password or etcd_password_file, not both")
        has_password = bool(self.password or self.password_file)
        if bool(self.user) != has_password:
            raise ConfigError(
                "etcd_user: a user needs a password and a password its user (set etcd_user and "
                "etcd_password or etcd_password_file, or neither)"
            )
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"etcd_insecure: must be true or false, got {self.insecure!r}")
        remote = [ep for ep in self.endpoints if not is_loopback(parse_endpoint(ep)[0])]
        if self.user and remote and not self.tls and not self.insecure:
            raise ConfigError(
                f"etcd_user: its password would cross the network in plaintext to {remote[0]}; "
                "talk TLS (write etcd_endpoints as https://host:port, or set etcd_ca_cert), or "
                "set etcd_insecure (--insecure) to allow it"
            )

    @property
    def tls(self) -> bool:
        """Talk TLS: a CA bundle is set, or the endpoints are ``https://``."""
        return bool(self.ca_cert) or endpoint_scheme(self.endpoints[0]) == "https"


def endpoint_scheme(endpoint: str) -> str:
    """``"https"``, ``"http"`` or ``""`` (no scheme) of an etcd endpoint."""
    scheme, sep, _ = endpoint.strip().partition("://")
    return scheme.lower() if sep else ""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port``, after an ``http://`` or ``https://`` scheme (see ``endpoint_scheme``).

    Raises:
        ConfigError: the endpoint is not ``host:port`` with a port in 1..65535, or has another scheme.
    """
    text = endpoint.strip()
    scheme = endpoint_scheme(text)
    host, sep, port_text = (text.partition("://")[2] if scheme else text).rpartition(":")
    if (
        scheme not in ("", "http", "https")
        or not sep
        or not host
        or not port_text.isdigit()
        or not 0 < int(port_text) < 65536
    ):
        raise ConfigError(f"etcd_endpoints: expected host:port (or http:// or https:// before it), got {endpoint!r}")
    return host.strip("[]"), int(port_text)


def is_loopback(host: str) -> bool:
    """``localhost``, or an address in 127.0.0.0/8 or ``::1`` (a name is not resolved)."""
    try:
        return host.lower() == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# Timeouts, retries, the world


def _seconds(doc: str, default: float) -> float:
    return field(default=default, metadata={"doc": doc, "unit": "s"})


def _positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class Timeouts:
    """Every wait in elasticd is bounded by one of these (seconds)."""

    join_s: float = _seconds("Bound on one whole rendezvous (joining a generation).", 120.0)
    join_window_s: float = _seconds(
        "After the set of waiting newcomers last changed, how long to wait for more before a "
        "generation that adds them is published (skipped at max size); the members train on "
        "meanwhile and are told of the newcomers when it closes.",
        0.25,
    )
    last_call_s: float = _seconds(
        "After a generation broke, how long to wait for its live members that have not come to "
        "the rendezvous yet; the rest are left out and rejoin as newcomers.",
        0.3,
    )
    probe_s: float = _seconds(
        "How long a connect to a member's store port may go unanswered before its host counts as out "
        "of reach (rendezvous.probe): the coordinator leaves a missing member of a broken generation "
        "out at once when its host refuses the connect (its process is gone) or does not answer within "
        "this (a host down or cut off), and keeps its last call when it accepts; the reach check "
        "(reach_check_s) asks with the same bound. A host still silent halfway through gets a second "
        "connect (one lost SYN does not count); a false alarm costs a rejoin, never a step.",
        0.25,
    )
    reach_check_s: float = _seconds(
        "A member whose collective has waited this long, while it is the coordinator or rank 0, 1 or "
        "2 of its generation, asks the hosts of every member of the generation whether they still "
        "answer (rendezvous.reach; again at doubling intervals while the wait lasts): a member whose "
        "host is out of reach or whose process is gone gets the generation aborted at once, instead "
        "of holding it until its lease expires (a host lost with its power or its link). The wait of "
        "a generation's group build and state sync is asked about the same way. 0: off "
        "(may be 0). A job whose waits for the sum stay short asks sooner: at four times its longest "
        "recent wait, at least reach_check_min_s (rendezvous.reach.reach_after_s).",
        0.5,
    )
    reach_check_min_s: float = _seconds(
        "The earliest a reach check asks, in a job whose recent waits for the sum were all short (it "
        "asks at four times the longest of the last 32, between this and reach_check_s): a host cut "
        "off from such a job is left behind sooner; one whose waits are long is asked about at "
        "reach_check_s as before.",
        0.1,
    )
    unresponsive_s: float = _seconds(
        "A reach check that finds a member's host answering asks a Python thread of the member for "
        "one byte (rendezvous.answer): a member whose byte does not come within this (a process hung "
        "with every thread, e.g. a C call that holds the GIL) counts as gone and the generation is "
        "aborted, as its own lease would have ended (a lease renewed every keepalive_s from a Python "
        "thread is lost to a hang of about the TTL); behind the agent's relay nothing else notices such "
        "a hang before collective_s. Asked only while a collective waits (reach_check_s); a false alarm "
        "costs a regroup, never a step. 0: not asked.",
        2.0,
    )
    reach_hold_s: float = _seconds(
        "How long a member whose host a reach check found out of reach is kept out of new "
        "generations, from when the check's abort was written (rendezvous.decide.held_out): a link "
        "that flaps answers in its up phases, and a member taken back during the flap holds the next "
        "group build until its connections get through. It comes back as a newcomer after this.",
        5.0,
    )
    coordinator_grace_s: float = _seconds(
        "How long rank 0 or 1 of the generation left (a deputy) waits in a rendezvous before it "
        "publishes itself beside the coordinator (0: at once; may be 0), covering a coordinator "
        "that died unrevoked; a deputy that left the coordinator out takes its place.",
        0.0,
    )
    deputy_step_s: float = _seconds(
        "While the coordinator has said nothing about a broken generation (no verdict), each further "
        "tier of deputies (two ranks, spread over the rank order; up to four tiers) begins its own "
        "rounds this much later than the tier before it: covers a coordinator lost together with rank 0 "
        "and 1 (rendezvous.deputy.deputy_starts_s).",
        0.5,
    )
    round_poll_s: float = _seconds(
        "While a broken generation's rendezvous is open, how often the coordinator reads the job again "
        "with no change seen: a watch event that a loaded etcd or host delivers late must not hold the "
        "round (otherwise the coordinator wakes on each change, or every view_poll_s).",
        0.25,
    )
    lease_ttl_s: float = _seconds("TTL of a member's etcd lease: a member that stops renewing is gone after this.", 3.0)
    keepalive_s: float = _seconds("Interval between lease renewals (must be < lease_ttl_s / 2).", 0.75)
    view_poll_s: float = _seconds(
        "How often a member re-reads its view of the job besides what its watches deliver at once "
        "(a broken watch is re-armed and re-read on its own), and an idle coordinator the job (what "
        "changed since its last read): a safety net whose cost grows with the nodes.",
        3.0,
    )
    collective_s: float = _seconds("Bound on one collective (gradient all_reduce, vote).", 30.0)
    group_build_s: float = _seconds("Bound on building the process group of a generation.", 15.0)
    group_abort_s: float = _seconds(
        "Bound on aborting a NCCL group (one retired, or one whose build was given up); past it the "
        "worker exits with code 75 so that its agent restarts it, since a hung abort would hang "
        "training. NCCL's own non-blocking waits are bounded by at most half of it.",
        30.0,
    )
    checkpoint_transfer_s: float = _seconds("Bound on the state broadcast from rank 0 to newcomers.", 120.0)
    etcd_request_s: float = _seconds("Bound on one etcd request.", 2.0)
    lease_renew_s: float = _seconds(
        "Bound on a lease renewal's first attempt while its keepalive stream answers nothing (doubling up "
        "to etcd_request_s): one held by an etcd member that lost its leader moves on early, so the next "
        "renewal is asked sooner; a stream that answers other renewals meanwhile is waited on up to "
        "etcd_request_s.",
        0.5,
    )
    etcd_outage_s: float = _seconds(
        "How long a worker waits for an unreachable etcd (to register, to publish an abort, or "
        "within a rendezvous, on top of join_s), and an agent at its start, before giving up. "
        "Training with no membership change does not need etcd and goes on meanwhile.",
        600.0,
    )
    resume_hold_s: float = _seconds(
        "Once every lease of the job's last generation ended, how long until a generation resuming from older state "
        "(the checkpoint, a member left behind) is published: one cut off from etcd trains on, and if it reconnects "
        "meanwhile it rejoins with its newest step, none done twice. A new job never waits. Keep it below join_s.",
        60.0,
    )
    standby_s: float = _seconds(
        "How long a worker waits as a standby (the job is at max_workers and healthy) for a place "
        "before it gives up; this time does not count against join_s.",
        86400.0,
    )
    abort_poll_s: float = _seconds("How often a waiting collective checks whether its generation was aborted.", 0.02)
    shutdown_grace_s: float = _seconds("Grace given to workers to finish a step on shutdown.", 10.0)
    relay_heartbeat_s: float = _seconds(
        "How often a node's relay (the agent's relay setting) sends its workers their view of the job "
        "with no change seen, as still current when nothing changed since its read and etcd answered the "
        "node's last lease renewal; a worker serves its view from one current at most twice this long "
        "ago. The relay reads etcd on each change and every view_poll_s (this often while etcd fails).",
        0.5,
    )
    relay_stale_s: float = _seconds(
        "A worker that hears nothing from its node's relay for this long (a stopped agent) "
        "reads and watches etcd itself from then on, and moves its records to an etcd lease of its own; "
        "more than twice relay_heartbeat_s, and less than lease_ttl_s, so that they move before the node's "
        "lease can end (else the job regroups once).",
        2.0,
    )
    progress_event_s: float = _seconds(
        "How often rank 0 records its committed step in the job's history "
        "(elasticctl timeline's points; each is one of events_keep).",
        10.0,
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            zero_ok = (
                f.name in ("coordinator_grace_s", "reach_check_s", "unresponsive_s")
                and value == 0
                and not isinstance(value, bool)
            )
            if not (zero_ok or _positive_finite(value)):
                raise ConfigError(f"{f.name}: must be a positive, finite number of seconds, got {value!r}")
        if self.keepalive_s * 2 > self.lease_ttl_s:
            raise ConfigError(
                f"keepalive_s: must be at most half of lease_ttl_s ({self.lease_ttl_s}), got {self.keepalive_s}"
            )
        if self.lease_ttl_s < 1:
            raise ConfigError(f"lease_ttl_s: etcd grants leases of at least 1 s, got {self.lease_ttl_s}")
        if self.reach_check_min_s > self.reach_check_s > 0:
            raise ConfigError(
                f"reach_check_min_s: must be at most reach_check_s ({self.reach_check_s}), got {self.reach_check_min_s}"
            )
        if self.relay_stale_s <= 2 * self.relay_heartbeat_s:
            raise ConfigError(
                f"relay_stale_s: must be more than twice relay_heartbeat_s ({self.relay_heartbeat_s}), "
                f"got {self.relay_stale_s}"
            )


@dataclass(frozen=True)
class RetryPolicy:
    """Bounds on the two places that retry: idempotent etcd calls, and a whole training step."""

    etcd_attempts: int = field(default=6, metadata={"doc": "Attempts of one idempotent etcd call."})
    etcd_backoff_initial_s: float = field(
        default=0.05, metadata={"doc": "First backoff between etcd attempts (exponential, jittered)."}
    )
    etcd_backoff_max_s: float = field(default=1.0, metadata={"doc": "Largest backoff between etcd attempts."})
    etcd_reconnect_max_s: float = field(
        default=0.5,
        metadata={
            "doc": "Longest wait between two attempts to reconnect to an etcd endpoint that went away "
            "(gRPC's own default grows to 120 s, so a restarted etcd would be noticed seconds "
            "late, after the leases it restored had expired)."
        },
    )
    step_retries: int = field(
        default=8, metadata={"doc": "Times one step may fail and be retried before the worker gives up."}
    )
    nonfinite_steps: int = field(
        default=3,
        metadata={
            "doc": "A member whose own gradients hold a NaN or an infinity makes every member skip the step "
            "(no update anywhere; not checked where a GradScaler owns that decision). At this many such "
            "steps in a row, its node is taken as bad: the member leaves and its worker exits 78 "
            "(EXIT_NO_RESTART), so its agent stops."
        },
    )

    def __post_init__(self) -> None:
        for name in ("etcd_attempts", "step_retries", "nonfinite_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("etcd_backoff_initial_s", "etcd_backoff_max_s", "etcd_reconnect_max_s"):
            value = getattr(self, name)
            if not _positive_finite(value):
                raise ConfigError(f"{name}: must be a positive, finite number, got {value!r}")


def _check_stragglers_and_health(c: AgentConfig) -> None:
    """The straggler, cordon and health check settings of ``AgentConfig``.

    Raises:
        ConfigError: naming the first bad one.
    """
    if not isinstance(c.cordon_crashes, int) or isinstance(c.cordon_crashes, bool) or c.cordon_crashes < 0:
        raise ConfigError(f"cordon_crashes: must be an integer >= 0 (0: never), got {c.cordon_crashes!r}")
    for name in ("health_check_timeout_s", "straggler_s", "straggler_cooldown_s", "cordon_window_s"):
        if not _positive_finite(getattr(c, name)):
            raise ConfigError(f"{name}: must be a positive, finite number of seconds, got {getattr(c, name)!r}")
    if not (_positive_finite(c.straggler_score) and c.straggler_score > 1):
        raise ConfigError(f"straggler_score: must be a finite number > 1, got {c.straggler_score!r}")
    if c.straggler_policy not in STRAGGLER_POLICIES:
        raise ConfigError(
            f"straggler_policy: must be one of {', '.join(STRAGGLER_POLICIES)}, got {c.straggler_policy!r}"
        )
    interval = c.health_check_interval_s
    if not (_positive_finite(interval) or (type(interval) in (int, float) and interval == 0)):
        raise ConfigError(
            f"health_check_interval_s: must be a finite number of seconds >= 0 (0: only before starts), got {interval!r}"
        )


# A job id and a node id are etcd key segments, file names (a job's checkpoints go to
# <checkpoint_dir>/<job_id>/) and parts of member ids (<node>.<local_rank>.<pid>). Starting with a
# letter or digit keeps out '.', '..' and what looks like a flag.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
NAME_RULE = "1 to 128 of the characters A-Z a-z 0-9 . _ -, the first a letter or digit"


def check_name(setting: str, value: object) -> None:
    """Raises ConfigError naming ``setting`` unless ``value`` is a name (``NAME``)."""
    if not isinstance(value, str) or not NAME.fullmatch(value):
        raise ConfigError(f"{setting}: must be {NAME_RULE} (so no '/' or spaces, and not '.' or '..'), got {value!r}")


@dataclass(frozen=True)
class WorldConfig:
    """The job's size bounds and how its global batch behaves when the size changes."""

    job_id: str = "default"
    min_workers: int = 1
    max_workers: int = 1024

    def __post_init__(self) -> None:
        check_name("job_id", self.job_id)
        for name in ("min_workers", "max_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}: must be an integer >= 1, got {value!r}")
        if self.min_workers > self.max_workers:
            raise ConfigError(f"min_workers: must be <= max_workers ({self.max_workers}), got {self.min_workers}")


EVENTS_KEEP_DOC = (
    "Most events kept in the job's history in etcd (events/); each writer prunes the oldest beyond it after it writes."
)


def _check_events_keep(value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"events_keep: must be an integer >= 1, got {value!r}")


@dataclass(frozen=True)
class CheckpointConfig:
    """Durable checkpoints (``elasticd.durable``): where, how often, how many are kept.

    Off unless ``checkpoint_dir`` is set. With a directory, a worker also resumes from it: a job
    whose members hold no live state loads the newest good checkpoint found there.
    """

    checkpoint_dir: str = field(
        default="",
        metadata={
            "doc": "Directory of durable checkpoints (local or shared); checkpoints of a job go to "
            "<dir>/<job_id>/. Empty: no checkpoints, and no resume from disk."
        },
    )
    checkpoint_every_steps: int = field(
        default=0, metadata={"doc": "Save when the committed step is a multiple of this (0: not by steps)."}
    )
    checkpoint_every_s: float = field(
        default=0.0,
        metadata={
            "doc": "Save at the first step boundary this many seconds after the last save began (0: not by time)."
        },
    )
    checkpoint_keep: int = field(
        default=3, metadata={"doc": "Good checkpoints kept in the directory; older ones are deleted after a save."}
    )
    checkpoint_wait_s: float = field(
        default=60.0,
        metadata={
            "doc": "Longest a due save waits at a step boundary for the previous write to finish; past "
            "it, this save is skipped (checkpoint_skipped) and the next one is tried. A sharded model's "
            "ranks also wait at most this long for one another's writes of one save."
        },
    )
    checkpoint_allow_new_model: bool = field(
        default=False,
        metadata={
            "doc": "Allow a job to start over from step 1 with a model whose signature differs from the "
            "checkpoints in its directory (they are kept: retention deletes only checkpoints of the saving "
            "model). Off: such a worker stops with CheckpointModelChanged and deletes nothing."
        },
    )

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_allow_new_model, bool):
            raise ConfigError(
                f"checkpoint_allow_new_model: must be true or false, got {self.checkpoint_allow_new_model!r}"
            )
        if "\0" in self.checkpoint_dir:
            raise ConfigError(f"checkpoint_dir: not a valid path: {self.checkpoint_dir!r}")
        for name, least in (("checkpoint_every_steps", 0), ("checkpoint_keep", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name}: must be an integer >= {least}, got {value!r}")
        value = self.checkpoint_every_s
        if not (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        ):
            raise ConfigError(f"checkpoint_every_s: must be a finite number >= 0, got {value!r}")
        if not _positive_finite(self.checkpoint_wait_s):
            raise ConfigError(
                f"checkpoint_wait_s: must be a positive, finite number of seconds, got {self.checkpoint_wait_s!r}"
            )

    @property
    def enabled(self) -> bool:
        """A directory is set: resume from it, and save when a schedule is set."""
        return bool(self.checkpoint_dir)

    @property
    def saves(self) -> bool:
        return self.enabled and (self.checkpoint_every_steps > 0 or self.checkpoint_every_s > 0)


AUDIT_DIR_DOC = (
    "Directory of audit files: a trainer given no audit_path appends one JSON line per start, sync, "
    "resume and committed step to <dir>/<job_id>/<node_id>.<local_rank>.jsonl (a restarted worker "
    "appends to the same file). Empty: no audit file."
)


@dataclass(frozen=True)
class WorkerEnv:
    """Everything a worker process needs, as handed over by its launcher in ``ELASTICD_*`` variables
    (``settings.worker_env_from_environ`` reads them, ``settings.worker_env_to_environ`` writes them)."""

    world: WorldConfig = field(default_factory=WorldConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    node_id: str = field(
        default_factory=socket.gethostname, metadata={"doc": "The node this worker runs on (its agent's node_id)."}
    )
    local_rank: int = field(default=0, metadata={"doc": "This worker's index among its node's workers."})
    advertise_addr: str = field(
        default="127.0.0.1",
        metadata={"doc": "Address this worker listens on for its peers (its agent's advertise_addr)."},
    )
    backend: str = field(
        default="auto",
        metadata={"doc": "torch.distributed backend: auto (NCCL where CUDA is present, else gloo), gloo or nccl."},
    )
    events_keep: int = field(default=500, metadata={"doc": EVENTS_KEEP_DOC})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    spare: bool = field(
        default=False,
        metadata={"doc": "This worker starts as a warm spare: it waits outside every generation until one needs it."},
    )
    standby: bool = field(default=False, metadata={"doc": "... a spare of a standby node (taken last)."})
    replica_size: int = field(
        default=1,
        metadata={"doc": "Processes of this worker's replica (sharded training; 1: data parallel)."},
    )
    replica: str = field(
        default="", metadata={"doc": "This worker's replica: an id of its agent's, new at each start of the replica."}
    )
    shard: int = field(default=0, metadata={"doc": "This worker's index in its replica (0 .. replica_size - 1)."})
    replica_store: str = field(
        default="",
        metadata={"doc": "host:port where shard 0 of the replica serves the store the replica's group meets over."},
    )
    stop_after_sum: int = field(
        default=0,
        metadata={
            "doc": "Fault injection: the worker stops itself (SIGSTOP) once, right after the gradient sum of this "
            "step arrives and before it applies the step; 0: never."
        },
    )
    miss_sum_at: int = field(
        default=0,
        metadata={
            "doc": "Fault injection: once, at this step, the worker drops the "
            "sum that arrived and fails the step (its last hop broke); 0: never."
        },
    )
    kill_after_apply: int = field(
        default=0,
        metadata={
            "doc": "Fault injection: the worker SIGKILLs itself as it "
            "begins the step after this one (applied, unconfirmed); 0: never."
        },
    )
    relay_socket: str = field(
        default="",
        metadata={
            "doc": "The Unix socket of this node's relay (set by an agent with relay on): the worker's view "
            "of the job and its watches come from it; empty: from etcd."
        },
    )
    audit_dir: str = field(default="", metadata={"doc": AUDIT_DIR_DOC})

    def __post_init__(self) -> None:
        _check_events_keep(self.events_keep)
        if "\0" in self.audit_dir:
            raise ConfigError(f"audit_dir: not a valid path: {self.audit_dir!r}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"backend: must be one of auto, gloo, nccl, got {self.backend!r}")
        if self.local_rank < 0:
            raise ConfigError(f"local_rank: must be >= 0, got {self.local_rank}")
        for name in ("stop_after_sum", "miss_sum_at", "kill_after_apply"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0 (0: never), got {getattr(self, name)}")
        check_name("node_id", self.node_id)
        if self.replica_size < 1 or not 0 <= self.shard < self.replica_size:
            raise ConfigError(
                f"replica_size, shard: need replica_size >= 1 and 0 <= shard < replica_size, "
                f"got {self.replica_size} and {self.shard}"
            )
        if self.replica_size > 1 and (not self.replica or not self.replica_store):
            raise ConfigError("replica, replica_store: a worker of a replica (replica_size > 1) needs both")

    @property
    def audit_file(self) -> Path | None:
        """This worker's audit file under ``audit_dir``: ``<audit_dir>/<job_id>/<node_id>.<local_rank>.jsonl``
        (a restarted worker appends to its predecessor's); None without ``audit_dir``."""
        if not self.audit_dir:
            return None
        return Path(self.audit_dir) / self.world.job_id / f"{self.node_id}.{self.local_rank}.jsonl"


# ---------------------------------------------------------------------------------------------
# The node agent

AGENT_MODES = ("elastic", "restart")  # AgentConfig.mode
STRAGGLER_POLICIES = ("report", "replace")  # AgentConfig.straggler_policy


@dataclass(frozen=True)
class AgentConfig:
    """Everything the node agent (``elasticd``) needs; built by ``settings.load_agent_config``.

    Its settings share one flat namespace (``settings.AGENT_SETTINGS``): the TOML key ``lease_ttl_s`` is the
    variable ``ELASTICD_LEASE_TTL_S`` and the flag ``--lease-ttl-s``. The restart policy allows
    ``max_restarts`` worker restarts per ``restart_window_s`` over the whole node; each restart
    waits ``restart_backoff_initial_s * 2**(restarts in the window)``, at most
    ``restart_backoff_max_s``.
    """

    program: tuple[str, ...] = field(
        default=(),
        metadata={
            "doc": "The training program each worker runs (argv); a first element ending in .py is run "
            "with the agent's Python. Not read from the environment."
        },
    )
    world: WorldConfig = field(default_factory=WorldConfig)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    timeouts: Timeouts = field(default_factory=Timeouts)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    nproc_per_node: int = field(
        default=1,
        metadata={"doc": "Workers this agent runs (default: one per device in CUDA_VISIBLE_DEVICES, else 1)."},
    )
    node_id: str = field(
        default_factory=socket.gethostname, metadata={"doc": "This node's id in the job (default: the host name)."}
    )
    advertise_addr: str = field(
        default="127.0.0.1", metadata={"doc": "Address the workers of this node listen on for their peers."}
    )
    backend: str = field(default="auto", metadata={"doc": "torch.distributed backend: auto, gloo or nccl."})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    audit_dir: Path | None = field(
        default=None,
        metadata={
            "doc": "Directory of the workers' audit files, passed to them (ELASTICD_AUDIT_DIR): each appends to "
            "<dir>/<job_id>/<node_id>.<local_rank>.jsonl unless its program gives the trainer an "
            "audit_path; unset: no audit files. Elastic mode."
        },
    )
    spares_per_node: int = field(
        default=0,
        metadata={
            "doc": "Warm spare workers this agent keeps besides nproc_per_node (--spares): each imports torch and "
            "the program, registers and waits outside every generation; when the job runs below its "
            "full size (a worker crashed or hung, a node was lost or drained; never past max_workers) "
            "a spare is taken at the next step boundary and rank 0 sends it the state. A crashed "
            "worker comes back as a spare. On GPUs each spare needs a device of its own."
        },
    )
    standby_node: bool = field(
        default=False,
        metadata={
            "doc": "A standby node (--standby): all nproc_per_node workers wait as warm spares, taken after "
            "the other nodes' spares, when a node of the job is lost or drained."
        },
    )
    replica_size: int = field(
        default=1,
        metadata={
            "doc": "Sharded training (--replica-size K): each K consecutive local workers form one replica "
            "that shards the model (FSDP2) among its ranks over a process group of its own; the job is "
            "data parallel across replicas. A replica joins and leaves generations whole: when one of "
            "its workers ends, hangs or stays stopped, the agent ends the others and starts all K "
            "again. nproc_per_node must be a multiple of K; 1: data parallel (every worker a replica)."
        },
    )
    relay: bool = field(
        default=True,
        metadata={
            "doc": "Run this node's relay (--relay): the agent watches the job's generation keys once and "
            "reads the workers' view once per change for all of them (relay.node), so etcd serves one "
            "watcher per node instead of one per worker, and its workers hold member leases of the relay "
            "(relay.leases) under the node's one etcd lease, so etcd renews one lease per node instead of "
            "one per worker. false: each worker watches, reads and holds its lease itself. Elastic mode "
            "(restart mode has a rendezvous of its own, and ignores it)."
        },
    )
    max_restarts: int = field(
        default=3,
        metadata={
            "doc": "Worker restarts allowed per restart_window_s on this node; one more failure stops the "
            "agent (restarts_exhausted, exit 1)."
        },
    )
    restart_window_s: float = field(
        default=300.0, metadata={"doc": "The window over which restarts are counted against max_restarts."}
    )
    restart_backoff_initial_s: float = field(
        default=0.5, metadata={"doc": "Wait before the first restart in a window; doubled for each further one."}
    )
    restart_backoff_max_s: float = field(default=30.0, metadata={"doc": "The longest wait before a restart."})
    kill_wait_s: float = field(
        default=5.0,
        metadata={"doc": "After SIGKILL, how long to wait for workers to be reaped before the agent exits anyway."},
    )
    poll_interval_s: float = field(
        default=0.1,
        metadata={"doc": "Longest sleep of the agent loop (a worker's exit wakes it at once; this is the fallback)."},
    )
    stats_interval_s: float = field(
        default=5.0,
        metadata={
            "doc": "Interval between samples of each worker's memory and CPU use (and, at least, between "
            "writes of the node record in etcd)."
        },
    )
    events_keep: int = field(default=500, metadata={"doc": EVENTS_KEEP_DOC})
    mode: str = field(
        default="elastic",
        metadata={
            "doc": "elastic: workers use the in-process worker API and the job goes on without a failed "
            "one; restart: unmodified torchrun scripts (RANK, WORLD_SIZE, MASTER_ADDR, ...), and "
            "any failure restarts every worker of the job (agent/restart.py)."
        },
    )
    hang_timeout_s: float = field(
        default=60.0,
        metadata={
            "doc": "A worker whose progress in etcd has not advanced for this long while the job's committed "
            "step grew is killed and restarted like a crashed one (0: never)."
        },
    )
    stopped_worker_s: float = field(
        default=0.5,
        metadata={
            "doc": "A worker process seen stopped (SIGSTOP or SIGTSTP: state T; a debugger's tracing stop "
            "is not counted) for this long has its lease revoked by its agent, so that the others "
            "regroup without it now rather than after lease_ttl_s; it is not killed, and rejoins as a "
            "newcomer when it continues (0: never)."
        },
    )
    straggler_score: float = field(
        default=1.5,
        metadata={
            "doc": "A worker whose own compute time per step (smoothed; its batch, forward and backward) is at "
            "least this many times the median of the others' in its generation is slow (its straggler score)."
        },
    )
    straggler_s: float = field(
        default=10.0,
        metadata={"doc": "A worker slow for this long is a straggler: its agent reports it (straggler_detected)."},
    )
    straggler_policy: str = field(
        default="report",
        metadata={
            "doc": "report: a straggler is logged, recorded as an event and scored in elasticctl status and the "
            "metrics; replace: also, when a warm spare waits on another node, the straggler's node is drained "
            "so that the spare takes its place (one node per straggler_cooldown_s, never below min_workers)."
        },
    )
    straggler_cooldown_s: float = field(
        default=60.0,
        metadata={
            "doc": "After a node is replaced as a straggler, no other is for this long (the job's straggler lease)."
        },
    )
    cordon_crashes: int = field(
        default=5,
        metadata={
            "doc": "A node whose workers crashed (or hung) more than this many times within cordon_window_s, "
            "counted from the job's events across agent restarts, is cordoned: its agent writes cordon/<node> "
            "and runs no worker until elasticctl uncordon (0: never)."
        },
    )
    cordon_window_s: float = field(default=3600.0, metadata={"doc": "The window in which cordon_crashes are counted."})
    health_check: str = field(
        default="",
        metadata={
            "doc": "A shell command (run with sh -c) that checks this node before its workers start, before each "
            "restart and every health_check_interval_s; exit 0 passes. A failing check keeps the node out of "
            "the job: its workers are stopped (as in a drain) and none starts until a check passes. Its "
            "output goes to the log, an event and elasticctl status. Empty: no check."
        },
    )
    health_check_timeout_s: float = field(
        default=60.0, metadata={"doc": "A health check that has not ended after this long fails (it is killed)."}
    )
    health_check_interval_s: float = field(
        default=300.0,
        metadata={"doc": "How often the health check runs while the node is up (0: only before starts)."},
    )
    metrics_port: int = field(
        default=0, metadata={"doc": "TCP port of the Prometheus metrics endpoint (/metrics); 0: no endpoint."}
    )
    metrics_addr: str = field(
        default="127.0.0.1", metadata={"doc": "Address the metrics endpoint listens on (0.0.0.0: every interface)."}
    )

    def __post_init__(self) -> None:
        if not self.program or not all(isinstance(a, str) for a in self.program) or not self.program[0]:
            raise ConfigError(
                "program: no training program given (put it after --, e.g. "
                "`elasticd [flags] -- python train.py`, or set program = [...] in the config file)"
            )
        for name in ("nproc_per_node", "max_restarts", "spares_per_node"):
            value = getattr(self, name)
            least = 1 if name == "nproc_per_node" else 0
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name}: must be an integer >= {least}, got {value!r}")
        for name in (
            "restart_window_s",
            "restart_backoff_initial_s",
            "restart_backoff_max_s",
            "kill_wait_s",
            "poll_interval_s",
            "stats_interval_s",
        ):
            value = getattr(self, name)
            if not _positive_finite(value):
                raise ConfigError(f"{name}: must be a positive, finite number of seconds, got {value!r}")
        _check_stragglers_and_health(self)
        if not (
            isinstance(self.hang_timeout_s, (int, float))
            and not isinstance(self.hang_timeout_s, bool)
            and math.isfinite(self.hang_timeout_s)
            and self.hang_timeout_s >= 0
        ):
            raise ConfigError(
                f"hang_timeout_s: must be a finite number of seconds >= 0 (0: off), got {self.hang_timeout_s!r}"
            )
        if 0 < self.hang_timeout_s < 2 * self.timeouts.keepalive_s:
            raise ConfigError(
                f"hang_timeout_s: must be 0 (off) or at least twice keepalive_s "
                f"({self.timeouts.keepalive_s}), the interval of progress records, "
                f"got {self.hang_timeout_s}"
            )
        if not (
            isinstance(self.stopped_worker_s, (int, float))
            and not isinstance(self.stopped_worker_s, bool)
            and math.isfinite(self.stopped_worker_s)
            and self.stopped_worker_s >= 0
        ):
            raise ConfigError(
                f"stopped_worker_s: must be a finite number of seconds >= 0 (0: off), got {self.stopped_worker_s!r}"
            )
        if (
            not isinstance(self.metrics_port, int)
            or isinstance(self.metrics_port, bool)
            or not 0 <= self.metrics_port < 65536
        ):
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
        if not isinstance(self.standby_node, bool):
            raise ConfigError(f"standby_node: must be true or false, got {self.standby_node!r}")
        if self.audit_dir is not None and self.mode != "elastic":
            raise ConfigError(
                "audit_dir: the audit files are written by the elastic worker API (restart mode "
                "runs unmodified torchrun scripts)"
            )
        _check_replicas(self)
        if (self.spares_per_node or self.standby_node) and self.mode != "elastic":
            raise ConfigError(
                "spares_per_node, standby_node: spares need mode elastic (a restart-mode job "
                "restarts every worker at once)"
            )
        if self.audit_dir is not None and (not str(self.audit_dir) or "\0" in str(self.audit_dir)):
            raise ConfigError(f"audit_dir: not a valid path: {str(self.audit_dir)!r}")
        if self.mode not in AGENT_MODES:
            raise ConfigError(f"mode: must be one of {', '.join(AGENT_MODES)}, got {self.mode!r}")
        self.worker_env(0, replica="-", replica_store="-")  # node_id, advertise_addr, ... as a worker would

    def replica_ranks(self, local_rank: int) -> tuple[int, ...]:
        """The local ranks of ``local_rank``'s replica (itself alone with ``replica_size`` 1). Pure."""
        k = self.replica_size
        first = local_rank - local_rank % k
        return tuple(range(first, first + k))

    @property
    def slots(self) -> int:
        """Worker processes this agent keeps: ``nproc_per_node`` plus ``spares_per_node``."""
        return self.nproc_per_node + self.spares_per_node

    def starts_spare(self, local_rank: int, starts: int) -> bool:
        """Whether the worker of ``local_rank`` starts (for the ``starts``-th time before this one)
        as a warm spare: every worker of a standby node, the slots past ``nproc_per_node``, and
        every restart once the node keeps spares (the crashed one's place went to a spare). Pure."""
        return self.standby_node or local_rank >= self.nproc_per_node or (starts > 0 and self.spares_per_node > 0)

    def worker_env(
        self, local_rank: int, spare: bool = False, relay_socket: str = "", replica: str = "", replica_store: str = ""
    ) -> WorkerEnv:
        """The settings of this node's worker ``local_rank`` (``spare``: it starts as a warm spare;
        ``relay_socket``: its node's relay; ``replica``, ``replica_store``: with ``replica_size`` > 1,
        its replica's id for this start and where the replica's store listens)."""
        return WorkerEnv(
            world=self.world,
            etcd=self.etcd,
            timeouts=self.timeouts,
            retry=self.retry,
            node_id=self.node_id,
            local_rank=local_rank,
            advertise_addr=self.advertise_addr,
            backend=self.backend,
            events_keep=self.events_keep,
            checkpoint=self.checkpoint,
            spare=spare,
            standby=spare and self.standby_node,
            relay_socket=relay_socket,
            audit_dir=str(self.audit_dir) if self.audit_dir is not None else "",
            replica_size=self.replica_size,
            replica=replica,
            shard=local_rank % self.replica_size,
            replica_store=replica_store,
        )


def _check_replicas(config: AgentConfig) -> None:
    """``replica_size``: a positive integer dividing ``nproc_per_node``, in elastic mode, with no
    spares (a spare replica is not supported yet).

    Raises:
        ConfigError: it is not.
    """
    k = config.replica_size
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"replica_size: must be an integer >= 1, got {k!r}")
    if k == 1:
        return
    if config.nproc_per_node % k:
        raise ConfigError(f"replica_size: must divide nproc_per_node ({config.nproc_per_node}), got {k}")
    if config.mode != "elastic":
        raise ConfigError("replica_size: sharded replicas need mode elastic")
    if config.spares_per_node or config.standby_node:
        raise ConfigError(
            "replica_size: warm spares and standby nodes take single workers; use replica_size 1 with them"
        )
