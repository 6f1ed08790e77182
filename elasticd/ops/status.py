"""The read model of one job: what ``elasticctl status`` and ``elasticctl events`` show.

Owns reading a job's keys (one ``get_prefix``, so one etcd revision) and turning them into a frozen
``JobStatus``: the current generation, every live member with its rank, state and last progress (and,
joined by node and pid from its agent's ``nodes/<node>`` record, its restarts, memory and CPU), the
node agents, the last recoveries (from ``events/``), pending drain requests, the finished and abort
records, the records that could not be parsed, and a health verdict with its reason (``ops.health``
judges; ``ops.parse`` parses the rows). ``job_events`` does the same for ``elasticctl events``.

It never writes to etcd (the only store method it uses is ``get_prefix``), never imports torch (so
``elasticctl status`` starts at once), never fails on a malformed record (it lists it), and never
formats text (``ops.render``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from elasticd.ops.health import (
    STALL_AFTER_S,
    Health,
    classify,
    classify_restart,
    derived_generation,
    last_activity,
    save_failing,
)
from elasticd.ops.parse import (
    RestartStatus,
    parse_abort,
    parse_drains,
    parse_events,
    parse_nodes,
    parse_cordons,
    parse_failures,
    parse_save_failed,
    restart_status,
)
from elasticd.store.kv import KeyValue
from elasticd.wire.failures import DeterministicFailure, FailureRecord, deterministic_failure
from elasticd.wire.keys import Keys
from elasticd.wire.nodefaults import node_faults
from elasticd.wire.ops import EventKind, EventRecord, SaveFailedRecord, WorkerRecord
from elasticd.wire.progress import ProgressRecord, parse_progress
from elasticd.wire.records import AbortRecord, CheckpointRecord, FinishedRecord, MemberRecord
from elasticd.wire.restart import parse_view
from elasticd.wire.snapshot import Snapshot, parse_snapshot
from elasticd.wire.stragglers import straggler_scores

RECOVERIES_SHOWN = 5  # how many of the newest ``recovered`` events ``status`` reports
FAULT_WINDOW_S = 3600.0  # the window of each node's fault counts (``NodeStatus.faults``)


class PrefixReader(Protocol):
    """All that the read model needs from etcd (``etcd.EtcdClient`` satisfies it): no writes."""

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...


class WorkerState(StrEnum):
    """Where one live member stands."""

    TRAINING = "training"  # in the current generation
    WAITING = "waiting"  # has a ready record, not in the current generation
    SPARE = "spare"  # a warm spare outside the current generation (waits until one needs it)
    REGISTERED = "registered"  # alive (member record), neither of the above


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
    restarts: int | None = None  # of its local rank, by its agent (None: no node record for it)
    rss_bytes: int | None = None  # from its agent's last sample
    cpu_percent: float | None = None  # since the sample before; 100 is one full core
    compute_s: float | None = None  # its own compute time per step, smoothed (progress record)
    straggler_score: float | None = None  # compute_s over the median of the other members' (``wire.stragglers``)


@dataclass(frozen=True)
class NodeStatus:
    """One node agent, from its ``nodes/<node>`` record."""

    node: str
    host: str
    agent_pid: int
    state: str  # the agent's state: starting, running, draining, stopping
    workers_running: int
    workers: int
    restarts: int
    heartbeat_age_s: float  # now - the record's write time
    drain_requested: bool
    spares: int = 0  # its live warm spares outside the current generation
    standby: bool = False  # a standby node: its live workers are all spares of a --standby agent
    health: str | None = None  # its health check: "passing", "failing: <output>"; None: no check
    faults: Mapping[str, int] = field(default_factory=dict)  # its faults by kind in the last FAULT_WINDOW_S
    cordoned: str | None = None  # why it is cordoned (``cordon/<node>``); None: not cordoned


@dataclass(frozen=True)
class RecoveryStatus:
    """One ``recovered`` event: rank 0's first commit after a fault (or a regroup)."""

    time: float
    generation: int | None
    cause: str
    duration_s: float | None


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
    nodes: tuple[NodeStatus, ...] = ()
    recoveries: tuple[RecoveryStatus, ...] = ()  # the newest RECOVERIES_SHOWN, oldest first
    drains: tuple[str, ...] = ()  # nodes with a pending drain request
    checkpoint: CheckpointRecord | None = None  # the latest good durable checkpoint, if recorded
    checkpoint_age_s: float | None = None  # now - its creation time (wall clocks of two hosts)
    restart: RestartStatus | None = None  # a restart-mode job (unmodified torchrun scripts): its round
    save_failed: SaveFailedRecord | None = None  # the job's last failed checkpoint save, if recorded
    save_failing: bool = False  # that failure is newer than the last good checkpoint
    stall_after_s: float = STALL_AFTER_S  # the bound given (0: stalls not checked)
    last_activity_age_s: float | None = None  # now - the generation's last commit or join; None: unknown
    bug: DeterministicFailure | None = None  # the bug the failure records show (health ``failed``)
    cordoned: Mapping[str, str] = field(default_factory=dict)  # every cordoned node (with an agent or not) -> why
    failures: tuple[FailureRecord, ...] = ()  # workers' uncaught exceptions, oldest first

    @property
    def exit_code(self) -> int:
        return self.health.exit_code


def read_status(
    store: PrefixReader,
    keys: Keys,
    *,
    now: float,
    min_workers: int | None = None,
    max_workers: int | None = None,
    stall_after_s: float = STALL_AFTER_S,
) -> JobStatus:
    """Read one job's keys and build its status.

    Args:
        store: where the job lives (only ``get_prefix`` is called).
        keys: the job's key layout.
        now: the wall clock (``time.time()``), to age progress records written by other hosts.
        min_workers: the job's lower bound, if known (it is not stored in etcd).
        max_workers: the job's upper bound, if known.
        stall_after_s: how long without a committed step makes the job ``stalled`` (0: never).

    Raises:
        EtcdUnavailable: etcd could not be reached within the store's retry bound.
    """
    return build_status(
        keys,
        store.get_prefix(keys.prefix),
        now=now,
        min_workers=min_workers,
        max_workers=max_workers,
        stall_after_s=stall_after_s,
    )


def _member(
    mid: str,
    rec: MemberRecord,
    snap: Snapshot,
    progress: Mapping[str, ProgressRecord],
    slots: Mapping[tuple[str, int], WorkerRecord],
    in_generation: set[str],
    now: float,
    scores: Mapping[str, float],
) -> MemberStatus:
    """One live member as ``status`` shows it: its state, rank and progress, and its worker's
    restarts, memory and CPU from its agent's node record."""
    g = snap.generation
    ready = snap.ready.get(mid)
    prog = progress.get(mid)
    if mid in in_generation:
        state = WorkerState.TRAINING
    elif rec.spare:
        state = WorkerState.SPARE
    elif ready is not None:
        state = WorkerState.WAITING
    else:
        state = WorkerState.REGISTERED
    slot = slots.get((rec.node, rec.pid))
    step: int | None = None
    if prog is not None:
        step = prog.step
    elif ready is not None and ready.committed_step >= 0:
        step = ready.committed_step
    return MemberStatus(
        member_id=mid,
        node=rec.node,
        local_rank=rec.local_rank,
        pid=rec.pid,
        host=rec.host,
        rank=(g.rank_of(mid) if g is not None else prog.rank if prog is not None else None)
        if mid in in_generation
        else None,
        state=state,
        committed_step=step,
        step_time_s=prog.step_time_s if prog else None,
        recoveries=prog.recoveries if prog else None,
        heartbeat_age_s=now - prog.time if prog else None,
        restarts=slot.restarts if slot else None,
        rss_bytes=slot.rss_bytes if slot else None,
        cpu_percent=slot.cpu_percent if slot else None,
        compute_s=prog.compute_s if prog else None,
        straggler_score=scores.get(mid),
    )


def build_status(
    keys: Keys,
    kvs: Iterable[KeyValue],
    *,
    now: float,
    min_workers: int | None = None,
    max_workers: int | None = None,
    stall_after_s: float = STALL_AFTER_S,
) -> JobStatus:
    """The status of a job from its raw keys (pure; see ``read_status`` for the arguments)."""
    rows = list(kvs)
    snap = parse_snapshot(keys, rows)
    progress, bad_progress = parse_progress(keys, rows)
    node_records, bad_nodes = parse_nodes(keys, rows)
    events, bad_events = parse_events(keys, rows)
    drains, bad_drains = parse_drains(keys, rows)
    save_failed, bad_save = parse_save_failed(keys, rows)
    failures, bad_failures = parse_failures(keys, rows)
    faults = node_faults((e for _, e in events), now, FAULT_WINDOW_S)
    cordons = parse_cordons(keys, rows)
    bug = deterministic_failure(failures)
    slots = {(n.node, w.pid): w for n in node_records.values() for w in n.workers if w.pid}
    last_abort = parse_abort(keys, rows)
    g = snap.generation
    in_generation = set(g.members) if g else set()
    derived = derived_generation(snap, progress, now, stall_after_s)
    if derived is not None:  # the record is garbage, but these members train: show them so
        in_generation = set(derived[1])
    published: dict[int, float] = {}
    for _, e in events:
        number = e.detail.get("generation")
        if e.kind == EventKind.GENERATION_PUBLISHED and isinstance(number, int) and not isinstance(number, bool):
            published[number] = max(e.time, published.get(number, e.time))
    activity = last_activity(g.members, progress, published.get(g.generation)) if g else None
    compute = {m: p.compute_s for m, p in progress.items() if m in in_generation and p.compute_s is not None}
    scores = straggler_scores(compute)
    members = [
        _member(mid, rec, snap, progress, slots, in_generation, now, scores) for mid, rec in snap.members.items()
    ]
    order = {WorkerState.TRAINING: 0, WorkerState.WAITING: 1, WorkerState.SPARE: 2, WorkerState.REGISTERED: 3}
    by_node = {n: [m for m in members if m.node == n] for n in node_records}
    spares = {n: sum(1 for m in on if m.state is WorkerState.SPARE) for n, on in by_node.items()}
    # a standby node: every live worker of it waits as a spare of a --standby agent
    standby = {
        n: bool(on) and all(m.state is WorkerState.SPARE and snap.members[m.member_id].standby for m in on)
        for n, on in by_node.items()
    }
    members.sort(
        key=lambda m: (
            order[m.state],
            m.rank if m.rank is not None else 0,
            snap.ready_order.get(m.member_id, 0),
            m.member_id,
        )
    )
    restart_view = parse_view(keys, rows)
    restart = restart_status(restart_view)
    failing = save_failing(save_failed, snap.checkpoint)
    health, reason = classify(
        snap,
        bool(rows),
        keys.prefix,
        min_workers,
        max_workers,
        now=now,
        progress=progress,
        stall_after_s=stall_after_s,
        activity=activity,
        save_failed=save_failed if failing else None,
    )
    if snap.generation is None and snap.finished is None and restart is not None:
        health, reason = classify_restart(restart, min_workers, max_workers)
    if bug is not None and health is not Health.FINISHED:
        health, reason = Health.FAILED, f"stopped by a bug at {bug.describe()}"
    return JobStatus(
        job_id=keys.job.rpartition("/")[2],
        prefix=keys.prefix,
        health=health,
        reason=reason,
        generation=GenerationStatus(g.generation, g.world_size, g.members, g.reason, g.committed_step) if g else None,
        members=tuple(members),
        missing=tuple(m for m in g.members if m not in snap.members) if g else (),
        finished=snap.finished,
        last_abort=last_abort,
        malformed=(
            snap.malformed
            + bad_progress
            + bad_nodes
            + bad_drains
            + bad_events
            + restart_view.malformed
            + bad_save
            + bad_failures
        ),
        min_workers=min_workers,
        max_workers=max_workers,
        nodes=tuple(
            NodeStatus(
                node=n.node,
                host=n.host,
                agent_pid=n.agent_pid,
                state=n.state,
                workers_running=sum(1 for w in n.workers if w.pid),
                workers=len(n.workers),
                restarts=n.restarts,
                heartbeat_age_s=now - n.time,
                drain_requested=n.node in drains,
                spares=spares[n.node],
                standby=standby[n.node],
                health=n.health,
                faults=dict(faults.get(n.node, {})),
                cordoned=cordons.get(n.node),
            )
            for _, n in sorted(node_records.items())
        ),
        recoveries=tuple(_recovery(e) for _, e in events if e.kind == EventKind.RECOVERED)[-RECOVERIES_SHOWN:],
        drains=tuple(sorted(drains)),
        checkpoint=snap.checkpoint,
        restart=restart,
        checkpoint_age_s=now - snap.checkpoint.time if snap.checkpoint and snap.checkpoint.time else None,
        save_failed=save_failed,
        save_failing=failing,
        stall_after_s=stall_after_s,
        last_activity_age_s=now - activity if activity is not None else None,
        bug=bug,
        failures=failures,
        cordoned=cordons,
    )


def _recovery(e: EventRecord) -> RecoveryStatus:
    d = e.detail
    generation, duration = d.get("generation"), d.get("duration_s")
    cause = d.get("cause")
    reason = d.get("generation_reason")
    text = str(cause) if cause is not None else "unknown"
    if isinstance(reason, str) and reason:
        text += f" ({reason})"
    return RecoveryStatus(
        time=e.time,
        generation=generation if isinstance(generation, int) and not isinstance(generation, bool) else None,
        cause=text,
        duration_s=float(duration)
        if isinstance(duration, (int, float)) and not isinstance(duration, bool) and math.isfinite(duration)
        else None,
    )


@dataclass(frozen=True)
class JobEvents:
    """The job's event history as ``elasticctl events`` shows it (oldest first)."""

    job_id: str
    prefix: str
    exists: bool  # any key of the job exists
    events: tuple[tuple[str, EventRecord], ...]  # (key, event), the newest ``limit``
    total: int  # events that parsed, before the limit
    malformed: tuple[str, ...]  # event keys that did not parse: "<key>: <why>"


def job_events(keys: Keys, kvs: Iterable[KeyValue], limit: int | None = None) -> JobEvents:
    """The newest ``limit`` events of a job (all when None), oldest first. Pure."""
    rows = list(kvs)
    events, bad = parse_events(keys, rows)
    shown = events if limit is None else events[max(0, len(events) - limit) :]
    return JobEvents(
        job_id=keys.job.rpartition("/")[2],
        prefix=keys.prefix,
        exists=bool(rows),
        events=tuple(shown),
        total=len(events),
        malformed=bad,
    )
