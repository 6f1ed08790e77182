"""Records for operators: node records, drain requests and events (JSON in etcd), pure.

Owns the shape of four kinds of keys under a job (the key names are in ``wire.keys.Keys``, but
for ``save_failed``, named by ``save_failed_key``):

* ``nodes/<node>`` (``NodeRecord``): written by the node agent under its own lease; the agent's pid
  and state, and each local worker's pid, slot state, starts, restarts, last exit, memory and CPU;
* ``drain/<node>`` (``DrainRecord``): written by ``elasticctl drain``; who asked, and when;
* ``events/<name>`` (``EventRecord``): one entry of the job's history. ``event_name`` makes names
  that sort by wall-clock time and never collide between writers (time in ns, then the writer's
  id, then a per-process counter);
* ``save_failed`` (``SaveFailedRecord``, not leased): the last durable checkpoint save that failed,
  written by the rank 0 whose writer thread saw it (time, step, node, directory, errno, error).

Encoding and decoding only: no I/O, no clock reads (times are passed in). Decoders trust nothing
and raise ``ValueError`` (or ``TypeError``/``UnicodeDecodeError``/``RecursionError``) on garbage,
so that readers can list a bad record as malformed. Imports nothing from elasticd.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class EventKind(StrEnum):
    """The kinds of events elasticd writes (readers accept other kinds too: forward compatible)."""

    GENERATION_PUBLISHED = "generation_published"  # by the member whose compare-and-set won
    RECOVERED = "recovered"  # by rank 0, at its first commit in a generation that was a recovery
    WORKER_EXITED = "worker_exited"  # by the agent
    WORKER_RESTARTED = "worker_restarted"  # by the agent
    WORKER_STOPPED = "worker_stopped"  # by the agent: a stopped worker's lease revoked (stopped_worker_s)
    REPLICA_ENDED = "replica_ended"  # by the agent: a replica's workers ended with one that failed or stopped
    RESTARTS_EXHAUSTED = "restarts_exhausted"  # by the agent
    GRADIENTS_NOT_FINITE = "gradients_not_finite"  # by a member whose own gradients held a NaN or an infinity
    WORKER_HUNG = "worker_hung"  # by the agent: a worker killed as hung (hang_timeout_s)
    NODE_CORDONED = "node_cordoned"  # by the agent: more than cordon_crashes crashes within cordon_window_s
    STRAGGLER_DETECTED = "straggler_detected"  # by the agent: its worker was slow for straggler_s
    STRAGGLER_REPLACED = "straggler_replaced"  # by the agent: it drains its node, a waiting spare takes the place
    HEALTH_CHECK_FAILED = "health_check_failed"  # by the agent: its node's check failed (its workers stop)
    HEALTH_CHECK_PASSED = "health_check_passed"  # by the agent: the check passes again (or at first)
    WORKER_FATAL = "worker_fatal"  # by the agent: a worker exited EXIT_NO_RESTART (not restarted)
    JOB_FAILED = "job_failed"  # by each agent: a bug (the same exception at the same step) stopped the job
    NODE_DRAINING = "node_draining"  # by the agent (SIGTERM or elasticctl drain)
    NODE_DRAINED = "node_drained"  # by the agent, before it exits 0
    PROGRESS = "progress"  # by rank 0, every progress_event_s: the committed step (elasticctl timeline)
    CHECKPOINT_SAVED = "checkpoint_saved"  # by rank 0's checkpoint writer, once a save is durable


@dataclass(frozen=True)
class EventRecord:
    """One event: when (wall clock, seconds), what, who wrote it, and kind-specific details."""

    time: float
    kind: str
    source: str  # the writer: a member id, or agent.<node>.<pid>
    detail: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerRecord:
    """One local worker slot, as its agent last saw it."""

    local_rank: int
    pid: int  # 0: not running
    state: str  # the agent's SlotState
    starts: int
    restarts: int
    last_exit: str | None  # how it last ended ("was killed by SIGKILL"); None: never
    rss_bytes: int | None  # None: not sampled yet
    cpu_percent: float | None  # 100 is one full core; None: not sampled yet


@dataclass(frozen=True)
class NodeRecord:
    """``nodes/<node>`` (leased by the agent): the agent and its workers."""

    node: str
    host: str
    agent_pid: int
    state: str  # the agent's AgentState
    time: float  # wall clock of the write
    workers: tuple[WorkerRecord, ...]
    since: float | None = None  # wall clock when the agent claimed the node id; None: not recorded
    health: str | None = None  # its health check: "passing", "failing: <output's tail>"; None: no check (yet)

    @property
    def restarts(self) -> int:
        return sum(w.restarts for w in self.workers)


@dataclass(frozen=True)
class DrainRecord:
    """``drain/<node>``: an operator asked this node to drain."""

    node: str
    requested_by: str
    time: float


@dataclass(frozen=True)
class SaveFailedRecord:
    """``save_failed``: the job's last failed checkpoint save (a later good save does not delete
    it; readers compare its time with the ``checkpoint`` record's)."""

    time: float  # wall clock of the failure, on the writer's host
    step: int
    generation: int
    node: str
    directory: str
    error: str
    errno: str | None  # the symbolic errno (ENOSPC, EROFS, ...) of an OSError; None: another error


# -- names --------------------------------------------------------------------------------------

_sequence = itertools.count()


def event_name(time_ns: int, source: str) -> str:
    """The key name (under ``events/``) of an event written now by ``source``.

    Names sort by time (a zero-padded nanosecond count first); the writer's id and a per-process
    counter make two writers, or two events of one writer in the same nanosecond, never collide.
    """
    if "/" in source or not source:
        raise ValueError(f"an event source must be non-empty with no '/', got {source!r}")
    return f"{max(0, time_ns):020d}.{source}.{next(_sequence)}"


def save_failed_key(job_key: str) -> str:
    """The ``save_failed`` key of the job whose keys live under ``job_key`` (``wire.keys.Keys.job``).

    Not a prefix of any other key of the job, so no member's prefix read of the rendezvous keys
    (``checkpoint`` among them) returns it.
    """
    return f"{job_key}/save_failed"


def prune_plan(names: list[str], keep: int) -> list[str]:
    """Which event names to delete so that the newest ``keep`` remain (oldest first). Pure."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    ordered = sorted(names)
    return ordered[: max(0, len(ordered) - keep)]


# -- encoding -----------------------------------------------------------------------------------


def encode_event(record: EventRecord) -> bytes:
    return json.dumps(
        {"time": record.time, "kind": record.kind, "source": record.source, "detail": dict(record.detail)},
        sort_keys=True,
        default=str,
    ).encode()


def encode_node(record: NodeRecord) -> bytes:
    return json.dumps(
        {
            "node": record.node,
            "host": record.host,
            "agent_pid": record.agent_pid,
            "state": record.state,
            "time": record.time,
            "since": record.since,
            "health": record.health,
            "workers": [
                {
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "state": w.state,
                    "starts": w.starts,
                    "restarts": w.restarts,
                    "last_exit": w.last_exit,
                    "rss_bytes": w.rss_bytes,
                    "cpu_percent": w.cpu_percent,
                }
                for w in record.workers
            ],
        },
        sort_keys=True,
    ).encode()


def encode_save_failed(record: SaveFailedRecord) -> bytes:
    return json.dumps(
        {
            "time": record.time,
            "step": record.step,
            "generation": record.generation,
            "node": record.node,
            "directory": record.directory,
            "error": record.error,
            "errno": record.errno,
        },
        sort_keys=True,
    ).encode()


def encode_drain(record: DrainRecord) -> bytes:
    return json.dumps(
        {"node": record.node, "requested_by": record.requested_by, "time": record.time}, sort_keys=True
    ).encode()


# -- decoding (extra fields are allowed, missing or ill-typed ones are not) ---------------------


def _object(raw: bytes) -> dict[str, object]:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _int(data: Mapping[str, object], name: str, optional: bool = False) -> int | None:
    value = data[name] if name in data else _missing(name)
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"field {name} is not an integer")
    return value


def _float(data: Mapping[str, object], name: str, optional: bool = False) -> float | None:
    value = data[name] if name in data else _missing(name)
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"field {name} is not a finite number")
    return float(value)


def _str(data: Mapping[str, object], name: str, optional: bool = False) -> str | None:
    value = data[name] if name in data else _missing(name)
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValueError(f"field {name} is not a string")
    return value


def _missing(name: str) -> object:
    raise ValueError(f"field {name} is missing")


def _req_int(data: Mapping[str, object], name: str) -> int:
    value = _int(data, name)
    assert value is not None
    return value


def _req_float(data: Mapping[str, object], name: str) -> float:
    value = _float(data, name)
    assert value is not None
    return value


def _req_str(data: Mapping[str, object], name: str) -> str:
    value = _str(data, name)
    assert value is not None
    return value


def decode_event(raw: bytes) -> EventRecord:
    """Parse an event.

    Raises:
        ValueError: not JSON, not an object, or a field is missing or of the wrong type.
    """
    data = _object(raw)
    kind = _req_str(data, "kind")
    if not kind:
        raise ValueError("field kind is empty")
    detail = data["detail"] if "detail" in data else _missing("detail")
    if not isinstance(detail, dict):
        raise ValueError("field detail is not an object")
    return EventRecord(time=_req_float(data, "time"), kind=kind, source=_req_str(data, "source"), detail=detail)


def decode_node(raw: bytes) -> NodeRecord:
    """Parse a node record.

    Raises:
        ValueError: not JSON, not an object, or a field is missing or of the wrong type.
    """
    data = _object(raw)
    workers = data["workers"] if "workers" in data else _missing("workers")
    if not isinstance(workers, list):
        raise ValueError("field workers is not a list")
    parsed = []
    for i, w in enumerate(workers):
        if not isinstance(w, dict):
            raise ValueError(f"workers[{i}] is not an object")
        parsed.append(
            WorkerRecord(
                local_rank=_req_int(w, "local_rank"),
                pid=_req_int(w, "pid"),
                state=_req_str(w, "state"),
                starts=_req_int(w, "starts"),
                restarts=_req_int(w, "restarts"),
                last_exit=_str(w, "last_exit", optional=True),
                rss_bytes=_int(w, "rss_bytes", optional=True),
                cpu_percent=_float(w, "cpu_percent", optional=True),
            )
        )
    return NodeRecord(
        node=_req_str(data, "node"),
        host=_req_str(data, "host"),
        agent_pid=_req_int(data, "agent_pid"),
        state=_req_str(data, "state"),
        time=_req_float(data, "time"),
        workers=tuple(parsed),
        since=_float(data, "since", optional=True) if "since" in data else None,
        health=_str(data, "health", optional=True) if "health" in data else None,
    )


def decode_drain(raw: bytes) -> DrainRecord:
    """Parse a drain request.

    Raises:
        ValueError: not JSON, not an object, or a field is missing or of the wrong type.
    """
    data = _object(raw)
    return DrainRecord(
        node=_req_str(data, "node"), requested_by=_req_str(data, "requested_by"), time=_req_float(data, "time")
    )


def decode_save_failed(raw: bytes) -> SaveFailedRecord:
    """Parse a ``save_failed`` record.

    Raises:
        ValueError: not JSON, not an object, or a field is missing or of the wrong type.
    """
    data = _object(raw)
    return SaveFailedRecord(
        time=_req_float(data, "time"),
        step=_req_int(data, "step"),
        generation=_req_int(data, "generation"),
        node=_req_str(data, "node"),
        directory=_req_str(data, "directory"),
        error=_req_str(data, "error"),
        errno=_str(data, "errno", optional=True),
    )
