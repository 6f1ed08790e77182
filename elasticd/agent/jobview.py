"""The node agent's read model of a job's progress, and the hang test over it.

Owns ``JobView`` (one read of a job's keys, parsed: generation, world size, the job's committed
step, each member's record and progress record), how one local worker looks in it
(``observe_worker``, found by node and pid as the agent's lease lookup does), and the pure
bookkeeping of the hang test: a worker's ``ProgressMark`` (when its progress last advanced, and
where the job stood then) and ``is_hung``. Never writes to etcd, never reads a clock: the caller
passes the time of the read. Imports no torch.

A worker *advances* when, in a read, it is waiting for a generation (a ready record: waiting is
legitimate, e.g. at ``max_workers``), or when its (phase, generation, step) differs from the
previous read while its member record exists. A worker whose record vanished (a SIGSTOPped
process loses its lease) does not advance. It is hung when one read taken at least
``hang_timeout_s`` after its last advance still shows no advance while the job's committed step is
higher than when it last advanced: without a fresh read (etcd down) there is no evidence, so no
verdict. A finished job has no hung workers: its members revoke their leases as they leave, and a
worker that reached the last step between two reads looks, until it exits, like one that vanished.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import DECODE_ERRORS, MemberRecord
from elasticd.wire.snapshot import parse_snapshot


@dataclass(frozen=True)
class MemberProgress:
    """A member's last progress record (``progress/<id>``); fields that do not parse are None."""

    step: int
    generation: int
    step_time_s: float | None = None
    recoveries: int = 0
    last_recovery_s: float | None = None  # how long the member's last recovery took
    last_recovery_cause: str | None = None  # what broke the generation it recovered from
    rank: int = -1  # its rank in ``generation`` (-1: unknown)


@dataclass(frozen=True)
class JobView:
    """One read of a job's keys, as the agent uses it."""

    read_at: float  # monotonic time of the read
    generation: int = 0  # 0: none published
    world_size: int = 0
    in_generation: frozenset[str] = frozenset()
    job_step: int = -1  # the newest committed step anyone published (-1: none)
    members: Mapping[str, MemberRecord] = field(default_factory=dict)
    waiting: frozenset[str] = frozenset()  # members with a ready record
    progress: Mapping[str, MemberProgress] = field(default_factory=dict)
    finished: bool = False  # the job reached its target step (``finished`` record)


def _number(data: Mapping[str, object], name: str) -> float | None:
    v = data.get(name)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def parse_progress(raw: bytes) -> MemberProgress:
    """Parse a progress record written by the trainer (extra fields allowed).

    Raises:
        ValueError, TypeError, UnicodeDecodeError, RecursionError: not a progress record.
    """
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    step, generation, recoveries = data.get("step"), data.get("generation"), data.get("recoveries", 0)
    for name, v in (("step", step), ("generation", generation), ("recoveries", recoveries)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"field {name} is not an integer")
    assert isinstance(step, int) and isinstance(generation, int) and isinstance(recoveries, int)
    cause, rank = data.get("last_recovery_cause"), data.get("rank")
    return MemberProgress(step, generation, _number(data, "step_time_s"), recoveries,
                          _number(data, "last_recovery_s"), cause if isinstance(cause, str) else None,
                          rank if isinstance(rank, int) and not isinstance(rank, bool) else -1)


def read_job_view(keys: Keys, kvs: Iterable[KeyValue], read_at: float) -> JobView:
    """Parse the rows of a job (``keys.rendezvous`` and ``progress/``); records that do not parse are
    left out."""
    rows = list(kvs)
    snap = parse_snapshot(keys, rows)
    progress: dict[str, MemberProgress] = {}
    under = keys.progress("")
    for kv in rows:
        if kv.key.startswith(under):
            try:
                progress[kv.key[len(under):]] = parse_progress(kv.value)
            except DECODE_ERRORS:
                continue
    g = snap.generation
    steps = [snap.committed_step, g.committed_step if g else -1, *(p.step for p in progress.values())]
    return JobView(
        read_at=read_at,
        generation=g.generation if g else 0,
        world_size=g.world_size if g else 0,
        in_generation=frozenset(g.members) if g else frozenset(),
        job_step=max(steps),
        members=dict(snap.members),
        waiting=frozenset(snap.ready),
        progress=progress,
        finished=snap.finished is not None,
    )


class WorkerPhase(StrEnum):
    ABSENT = "absent"  # no member record (not registered yet, or its lease is gone)
    REGISTERED = "registered"  # a member record, neither waiting nor in the generation
    WAITING = "waiting"  # a ready record: waiting for the next generation
    TRAINING = "training"  # in the current generation


@dataclass(frozen=True)
class WorkerObservation:
    """How one local worker looks in a ``JobView``."""

    phase: WorkerPhase
    member_id: str = ""
    step: int = -1
    generation: int = 0
    progress: MemberProgress | None = None


def local_members(view: JobView, node: str, pids: Collection[int]) -> list[str]:
    """Ids of the member records of ``node`` whose pid is in ``pids`` (newest incarnation last)."""
    return sorted(m for m, rec in view.members.items() if rec.node == node and rec.pid in pids)


def observe_worker(view: JobView, node: str, pids: Collection[int]) -> WorkerObservation:
    """The phase and progress of the local worker whose process (or a child) has one of ``pids``."""
    best = WorkerObservation(WorkerPhase.ABSENT)
    order = [WorkerPhase.ABSENT, WorkerPhase.REGISTERED, WorkerPhase.WAITING, WorkerPhase.TRAINING]
    for mid in local_members(view, node, pids):
        prog = view.progress.get(mid)
        if mid in view.waiting:
            phase = WorkerPhase.WAITING
        elif mid in view.in_generation:
            phase = WorkerPhase.TRAINING
        else:
            phase = WorkerPhase.REGISTERED
        obs = WorkerObservation(phase, mid, prog.step if prog else -1, prog.generation if prog else 0, prog)
        if order.index(obs.phase) >= order.index(best.phase):
            best = obs
    return best


@dataclass(frozen=True)
class ProgressMark:
    """When a worker's progress last advanced, what it was, and the job's step at that moment."""

    key: tuple[str, int, int]  # (phase, generation, step)
    at: float  # monotonic time of the read that showed the advance
    job_step: int


def advance_mark(mark: ProgressMark | None, obs: WorkerObservation, view: JobView) -> ProgressMark | None:
    """The worker's mark after ``view``. Pure.

    A worker never seen in etcd has no mark (no hang verdict before its first registration).
    """
    if obs.phase is WorkerPhase.ABSENT:
        return mark
    key = (str(obs.phase), obs.generation, obs.step)
    if obs.phase is WorkerPhase.WAITING or mark is None or key != mark.key:
        return ProgressMark(key, view.read_at, view.job_step)
    return mark


def is_hung(mark: ProgressMark | None, view: JobView | None, hang_timeout_s: float) -> bool:
    """True when ``view``, read at least ``hang_timeout_s`` after the worker last advanced, shows the
    job's committed step past where it stood then. Pure; False without a mark, a view, or a timeout,
    and once the job has finished (its workers leave, and their records vanish, as they exit)."""
    if mark is None or view is None or hang_timeout_s <= 0 or view.finished:
        return False
    return view.read_at - mark.at >= hang_timeout_s and view.job_step > mark.job_step
