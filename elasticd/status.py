"""The read model of one job (what ``elasticctl status`` shows), and pure renderers of it.

Owns reading a job's keys (one ``get_prefix``, so one etcd revision) and turning them into a frozen
``JobStatus``: the current generation, every live member with its rank, state and last progress, the
finished and abort records, the records that could not be parsed, and a health verdict with its
reason. ``render_table`` and ``render_json`` turn a ``JobStatus`` into text and do no I/O.

It never writes to etcd (the only store method it uses is ``get_prefix``), never imports torch (so
``elasticctl status`` starts at once), and never fails on a malformed record: it lists it.

Health (``classify``), first match wins:

* ``finished``: a ``finished`` record exists for the current (or a later) generation.
* ``down``: no key of the job exists; there is no (parseable) generation; a member of the generation
  lost its lease; the generation was aborted (a re-rendezvous is under way); or its world size is
  below ``min_workers`` (when given).
* ``degraded``: the generation runs, but below ``max_workers`` (when given); without
  ``max_workers``, some live member is not in the generation.
* ``healthy``: the generation runs at ``max_workers`` (when given), or holds every live member.

``min_workers`` and ``max_workers`` are not stored in etcd, so the caller passes them (or not).

Exit codes of ``elasticctl status`` (``JobStatus.exit_code``; ``EXIT_*`` below):

* 0: healthy or finished;
* 1: degraded;
* 2: down, no such job, or etcd did not answer (the last one is decided in ``cli.py``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from elasticd.membership import (
    AbortRecord,
    CheckpointRecord,
    FinishedRecord,
    KeyValue,
    Keys,
    Snapshot,
    decode_abort,
    parse_snapshot,
)

EXIT_OK = 0
EXIT_DEGRADED = 1
EXIT_DOWN = 2


class PrefixReader(Protocol):
    """All that the read model needs from etcd (``etcd.EtcdClient`` satisfies it): no writes."""

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...


class Health(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    DOWN = "down"
    FINISHED = "finished"

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self]


_EXIT_CODES = {
    Health.HEALTHY: EXIT_OK,
    Health.FINISHED: EXIT_OK,
    Health.DEGRADED: EXIT_DEGRADED,
    Health.DOWN: EXIT_DOWN,
}


class WorkerState(StrEnum):
    """Where one live member stands."""

    TRAINING = "training"  # in the current generation
    WAITING = "waiting"  # has a ready record, not in the current generation
    REGISTERED = "registered"  # alive (member record), neither of the above


@dataclass(frozen=True)
class Progress:
    """A member's last progress record (``progress/<id>``, written after commits)."""

    step: int
    generation: int
    rank: int
    step_time_s: float | None
    recoveries: int
    time: float  # wall clock (time.time()) of the writer


@dataclass(frozen=True)
class MemberStatus:
    """One live member as ``elasticctl`` shows it."""

    member_id: str
    node: str
    local_rank: int
    pid: int
    host: str
    rank: int | None  # in the current generation; None when not in it
    state: WorkerState
    committed_step: int | None  # from progress, else from the ready record; None: nothing yet
    step_time_s: float | None
    recoveries: int | None
    heartbeat_age_s: float | None  # now - progress time (can be < 0 when clocks disagree)


@dataclass(frozen=True)
class GenerationStatus:
    number: int
    world_size: int
    members: tuple[str, ...]  # rank order
    reason: str  # why it was published: start, join, member_lost, aborted, regroup, resume
    committed_step: int  # the step its rank 0 held when it was published


@dataclass(frozen=True)
class JobStatus:
    """Everything ``elasticctl status`` reports about one job, read at one etcd revision."""

    job_id: str
    prefix: str
    health: Health
    reason: str
    generation: GenerationStatus | None
    members: tuple[MemberStatus, ...]  # training (rank order), then waiting, then registered
    missing: tuple[str, ...]  # members of the generation whose member record is gone
    finished: FinishedRecord | None
    last_abort: AbortRecord | None
    malformed: tuple[str, ...]  # "<key>: <why>", never fatal
    min_workers: int | None = None
    max_workers: int | None = None
    checkpoint: CheckpointRecord | None = None  # the latest good durable checkpoint, if recorded
    checkpoint_age_s: float | None = None  # now - its creation time (wall clocks of two hosts)

    @property
    def exit_code(self) -> int:
        return self.health.exit_code


# ---------------------------------------------------------------------------------------------
# Reading


def read_status(
    store: PrefixReader,
    keys: Keys,
    *,
    now: float,
    min_workers: int | None = None,
    max_workers: int | None = None,
) -> JobStatus:
    """Read one job's keys and build its status.

    Args:
        store: where the job lives (only ``get_prefix`` is called).
        keys: the job's key layout.
        now: the wall clock (``time.time()``), to age progress records written by other hosts.
        min_workers: the job's lower bound, if known (it is not stored in etcd).
        max_workers: the job's upper bound, if known.

    Raises:
        EtcdUnavailable: etcd could not be reached within the store's retry bound.
    """
    return build_status(keys, store.get_prefix(keys.prefix), now=now,
                        min_workers=min_workers, max_workers=max_workers)


def build_status(
    keys: Keys,
    kvs: Iterable[KeyValue],
    *,
    now: float,
    min_workers: int | None = None,
    max_workers: int | None = None,
) -> JobStatus:
    """The status of a job from its raw keys (pure; see ``read_status`` for the arguments)."""
    rows = list(kvs)
    snap = parse_snapshot(keys, rows)
    progress, bad_progress = _parse_progress(keys, rows)
    last_abort = _parse_abort(keys, rows)
    g = snap.generation
    in_generation = set(g.members) if g else set()
    members = []
    for mid, rec in snap.members.items():
        ready = snap.ready.get(mid)
        prog = progress.get(mid)
        if mid in in_generation:
            state = WorkerState.TRAINING
        elif ready is not None:
            state = WorkerState.WAITING
        else:
            state = WorkerState.REGISTERED
        step: int | None = None
        if prog is not None:
            step = prog.step
        elif ready is not None and ready.committed_step >= 0:
            step = ready.committed_step
        members.append(MemberStatus(
            member_id=mid,
            node=rec.node,
            local_rank=rec.local_rank,
            pid=rec.pid,
            host=rec.host,
            rank=g.rank_of(mid) if g is not None and mid in in_generation else None,
            state=state,
            committed_step=step,
            step_time_s=prog.step_time_s if prog else None,
            recoveries=prog.recoveries if prog else None,
            heartbeat_age_s=now - prog.time if prog else None,
        ))
    order = {WorkerState.TRAINING: 0, WorkerState.WAITING: 1, WorkerState.REGISTERED: 2}
    members.sort(key=lambda m: (order[m.state], m.rank if m.rank is not None else 0,
                                snap.ready_order.get(m.member_id, 0), m.member_id))
    health, reason = classify(snap, bool(rows), keys.prefix, min_workers, max_workers)
    return JobStatus(
        job_id=keys.job.rpartition("/")[2],
        prefix=keys.prefix,
        health=health,
        reason=reason,
        generation=GenerationStatus(g.generation, g.world_size, g.members, g.reason, g.committed_step)
        if g else None,
        members=tuple(members),
        missing=tuple(m for m in g.members if m not in snap.members) if g else (),
        finished=snap.finished,
        last_abort=last_abort,
        malformed=snap.malformed + bad_progress,
        min_workers=min_workers,
        max_workers=max_workers,
        checkpoint=snap.checkpoint,
        checkpoint_age_s=now - snap.checkpoint.time if snap.checkpoint and snap.checkpoint.time else None,
    )


def classify(
    snap: Snapshot, any_keys: bool, prefix: str, min_workers: int | None, max_workers: int | None
) -> tuple[Health, str]:
    """The health of a job and a one-line reason (pure; the rules are in the module docstring)."""
    g = snap.generation
    if snap.finished is not None and (g is None or snap.finished.generation >= g.generation):
        return Health.FINISHED, (f"finished at step {snap.finished.step} "
                                 f"(generation {snap.finished.generation})")
    if not any_keys:
        return Health.DOWN, f"no such job: nothing under {prefix}"
    if g is None:
        if snap.generation_revision:
            return Health.DOWN, "the generation record is malformed (see malformed)"
        alive = [r for r in snap.ready.values() if r.member_id in snap.members]
        want = f" of min_workers {min_workers}" if min_workers is not None else ""
        return Health.DOWN, (f"no generation yet: {len(snap.members)} registered, "
                             f"{len(alive)} ready{want}")
    missing = [m for m in g.members if m not in snap.members]
    if missing:
        return Health.DOWN, (f"generation {g.generation} lost {len(missing)} of {g.world_size} "
                             f"members; re-rendezvous pending")
    if snap.aborted >= g.generation:
        return Health.DOWN, f"generation {g.generation} was aborted; re-rendezvous pending"
    if min_workers is not None and g.world_size < min_workers:
        return Health.DOWN, f"world size {g.world_size} < min_workers {min_workers}"
    if max_workers is not None:
        if g.world_size < max_workers:
            return Health.DEGRADED, f"world size {g.world_size} < max_workers {max_workers}"
        relation = "=" if g.world_size == max_workers else ">"
        return Health.HEALTHY, f"world size {g.world_size} {relation} max_workers {max_workers}"
    outside = [m for m in snap.members if m not in g.members]
    if outside:
        return Health.DEGRADED, (f"{len(outside)} live member(s) not in generation {g.generation} "
                                 f"(world size {g.world_size})")
    return Health.HEALTHY, f"all {g.world_size} live members are in generation {g.generation}"


def _parse_progress(keys: Keys, rows: Sequence[KeyValue]) -> tuple[dict[str, Progress], tuple[str, ...]]:
    """Progress records by member id; unparseable ones as ``"<key>: <why>"``."""
    under = keys.progress("")
    out: dict[str, Progress] = {}
    bad: list[str] = []
    for kv in rows:
        if not kv.key.startswith(under):
            continue
        try:
            mid = kv.key[len(under):]
            if not mid or "/" in mid:
                raise ValueError("not progress/<member id>")
            out[mid] = decode_progress(kv.value)
        except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
            bad.append(f"{kv.key}: {exc}")
    return out, tuple(bad)


def decode_progress(raw: bytes) -> Progress:
    """Parse a progress record written by the trainer; extra fields are allowed, wrong types not.

    Raises:
        ValueError: not JSON, not an object, or a field is missing or of the wrong type.
    """
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    step_time = _number(data, "step_time_s", optional=True)
    moment = _number(data, "time")
    assert moment is not None
    return Progress(
        step=_integer(data, "step"),
        generation=_integer(data, "generation"),
        rank=_integer(data, "rank"),
        step_time_s=step_time,
        recoveries=_integer(data, "recoveries"),
        time=moment,
    )


def _integer(data: Mapping[str, object], name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"field {name} is not an integer")
    return value


def _number(data: Mapping[str, object], name: str, optional: bool = False) -> float | None:
    value = data.get(name)
    if value is None and optional and name in data:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"field {name} is not a finite number")
    return float(value)


def _parse_abort(keys: Keys, rows: Sequence[KeyValue]) -> AbortRecord | None:
    for kv in rows:
        if kv.key == keys.abort:
            try:
                return decode_abort(kv.value)
            except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError):
                return None  # parse_snapshot already listed it as malformed
    return None


# ---------------------------------------------------------------------------------------------
# Rendering (pure)


def to_dict(status: JobStatus) -> dict[str, object]:
    """The JSON shape of a status: every key is always present (``null`` when unknown)."""
    g = status.generation
    return {
        "job": status.job_id,
        "prefix": status.prefix,
        "health": str(status.health),
        "reason": status.reason,
        "exit_code": status.exit_code,
        "min_workers": status.min_workers,
        "max_workers": status.max_workers,
        "generation": None if g is None else {
            "number": g.number,
            "world_size": g.world_size,
            "members": list(g.members),
            "reason": g.reason,
            "committed_step": g.committed_step,
        },
        "members": [
            {
                "member_id": m.member_id,
                "node": m.node,
                "local_rank": m.local_rank,
                "pid": m.pid,
                "host": m.host,
                "rank": m.rank,
                "state": str(m.state),
                "committed_step": m.committed_step,
                "step_time_s": _round(m.step_time_s, 6),
                "recoveries": m.recoveries,
                "heartbeat_age_s": _round(m.heartbeat_age_s, 3),
            }
            for m in status.members
        ],
        "missing": list(status.missing),
        "finished": None if status.finished is None else {
            "generation": status.finished.generation,
            "step": status.finished.step,
        },
        "last_abort": None if status.last_abort is None else {
            "generation": status.last_abort.generation,
            "member_id": status.last_abort.member_id,
            "reason": status.last_abort.reason,
        },
        "malformed": list(status.malformed),
        "checkpoint": None if status.checkpoint is None else {
            "step": status.checkpoint.step,
            "path": status.checkpoint.path,
            "node": status.checkpoint.node,
            "generation": status.checkpoint.generation,
            "bytes": status.checkpoint.bytes,
            "age_s": _round(status.checkpoint_age_s, 3),
        },
    }


def render_json(status: JobStatus) -> str:
    """One JSON object on one line (so ``--watch --json`` prints JSON lines)."""
    return json.dumps(to_dict(status))


_COLUMNS = ("MEMBER", "NODE", "LOCAL", "PID", "HOST", "RANK", "STATE", "STEP", "STEP_TIME",
            "RECOVERIES", "HEARTBEAT")


def render_table(status: JobStatus) -> str:
    """A human-readable report: a summary, one aligned row per live member, then problems."""
    g = status.generation
    bounds = f"min_workers {_opt(status.min_workers)}, max_workers {_opt(status.max_workers)}"
    if status.min_workers is None or status.max_workers is None:
        bounds += " (not stored in etcd: pass --min-workers/--max-workers)"
    lines = [
        ("job", f"{_clean(status.job_id)} ({_clean(status.prefix)})"),
        ("health", f"{status.health.upper()}: {_clean(status.reason)}"),
        ("generation", "none" if g is None else
         f"{g.number}, world size {g.world_size}, published for {_clean(g.reason)} "
         f"at step {g.committed_step}"),
        ("bounds", bounds),
        ("finished", "no" if status.finished is None else
         f"at step {status.finished.step} (generation {status.finished.generation})"),
        ("last abort", "none" if status.last_abort is None else
         f"generation {status.last_abort.generation} by {_clean(status.last_abort.member_id)}: "
         f"{_clean(status.last_abort.reason)}"),
        ("checkpoint", _checkpoint_line(status)),
    ]
    out = [f"{k:<11} {v}" for k, v in lines]
    out.append("")
    if status.members:
        rows = [_COLUMNS] + [_row(m) for m in status.members]
        widths = [max(len(r[i]) for r in rows) for i in range(len(_COLUMNS))]
        out += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    else:
        out.append("no live members")
    if status.missing:
        out.append("")
        out.append("missing (in the generation, lease gone): " + ", ".join(map(_clean, status.missing)))
    if status.malformed:
        out.append("")
        out.append(f"malformed records ({len(status.malformed)}, ignored):")
        out += [f"  {_clean(m)}" for m in status.malformed]
    return "\n".join(out) + "\n"


def _checkpoint_line(status: JobStatus) -> str:
    ck = status.checkpoint
    if ck is None:
        return "none recorded"
    age = "" if status.checkpoint_age_s is None else f", {status.checkpoint_age_s:.1f}s ago"
    return f"step {ck.step} on {_clean(ck.node)}: {_clean(ck.path)} ({ck.bytes} bytes{age})"


def _row(m: MemberStatus) -> tuple[str, ...]:
    return (
        _clean(m.member_id),
        _clean(m.node),
        str(m.local_rank),
        str(m.pid),
        _clean(m.host),
        _opt(m.rank),
        str(m.state),
        _opt(m.committed_step),
        "-" if m.step_time_s is None else f"{m.step_time_s:.3f}s",
        _opt(m.recoveries),
        "-" if m.heartbeat_age_s is None else f"{m.heartbeat_age_s:.1f}s ago",
    )


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _clean(text: str) -> str:
    """Escape control characters: record fields come from etcd and must not drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
