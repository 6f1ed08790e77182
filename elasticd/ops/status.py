"""The read model of one job (what ``elasticctl status`` shows), and pure renderers of it.

Owns reading a job's keys (one ``get_prefix``, so one etcd revision) and turning them into a frozen
``JobStatus``: the current generation, every live member with its rank, state and last progress (and,
joined by node and pid from its agent's ``nodes/<node>`` record, its restarts, memory and CPU), the
node agents, the last recoveries (from ``events/``), pending drain requests, the finished and abort
records, the records that could not be parsed, and a health verdict with its reason.
``render_table`` and ``render_json`` turn a ``JobStatus`` into text and do no I/O; ``job_events``,
``render_events_table`` and ``render_events_json`` do the same for ``elasticctl events``.

It never writes to etcd (the only store method it uses is ``get_prefix``), never imports torch (so
``elasticctl status`` starts at once), and never fails on a malformed record: it lists it.

Health (``classify``), first match wins:

* ``finished``: a ``finished`` record exists for the current (or a later) generation.
* ``degraded`` (first): the ``generation`` record does not parse (written by hand), but live members
  report by their progress records (written within the stall bound) that they train in a
  generation: health comes from those live records, and they are shown as training.
* ``down``: no key of the job exists; there is no generation (or a malformed one and no live member
  reports training); a member of the generation lost its lease; the generation was aborted (a
  re-rendezvous is under way); or its world size is below ``min_workers`` (when given).
* ``stalled``: the generation's members are all alive, but none has committed a step (nor finished
  joining) for longer than the stall bound: ``stall_after_s`` (default ``STALL_AFTER_S``; 0: never
  stalled), or ``STALL_STEP_FACTOR`` times the slowest member's last step time if that is longer.
  The last activity is the newest ``time`` of the members' progress records, or the
  ``generation_published`` event of the generation when none has one yet.
* ``degraded``: the generation runs, but below ``max_workers`` (when given); without
  ``max_workers``, some live member is not in the generation; or the job's last checkpoint save
  failed (a ``save_failed`` record newer than the ``checkpoint`` record).
* ``healthy``: the generation runs at ``max_workers`` (when given), or holds every live member, and
  no checkpoint save failed since the last good one.

``min_workers`` and ``max_workers`` are not stored in etcd, so the caller passes them (or not).

Exit codes of ``elasticctl status`` (``JobStatus.exit_code``; ``EXIT_*`` below):

* 0: healthy or finished;
* 1: degraded;
* 2: down, stalled, no such job, or etcd did not answer (the last one is decided in ``cli.py``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.ops import (
    EventKind,
    EventRecord,
    NodeRecord,
    SaveFailedRecord,
    decode_drain,
    decode_event,
    decode_node,
    decode_save_failed,
    save_failed_key,
)
from elasticd.wire.records import (
    DECODE_ERRORS,
    AbortRecord,
    CheckpointRecord,
    FinishedRecord,
    GenerationRecord,
    decode_abort,
)
from elasticd.wire.restart import RestartKeys, RoundView, parse_view
from elasticd.wire.snapshot import Snapshot, parse_snapshot

EXIT_OK = 0
EXIT_DEGRADED = 1
EXIT_DOWN = 2
RECOVERIES_SHOWN = 5  # how many of the newest ``recovered`` events ``status`` reports
# Default of ``stall_after_s`` (``elasticctl status --stall-after-s``): no committed step for this long
# while every member of the generation is alive is a stall. Far above what a recovery takes with
# the default timeouts (a broken collective is abandoned after ``collective_s`` = 30 s), so a job
# that recovers is never reported stalled.
STALL_AFTER_S = 120.0
STALL_STEP_FACTOR = 10.0  # a job whose steps are slow gets this many step times before it is stalled


class PrefixReader(Protocol):
    """All that the read model needs from etcd (``etcd.EtcdClient`` satisfies it): no writes."""

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...


class Health(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    DOWN = "down"
    STALLED = "stalled"
    FINISHED = "finished"

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self]


_EXIT_CODES = {
    Health.HEALTHY: EXIT_OK,
    Health.FINISHED: EXIT_OK,
    Health.DEGRADED: EXIT_DEGRADED,
    Health.DOWN: EXIT_DOWN,
    Health.STALLED: EXIT_DOWN,
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
    restarts: int | None = None  # of its local rank, by its agent (None: no node record for it)
    rss_bytes: int | None = None  # from its agent's last sample
    cpu_percent: float | None = None  # since the sample before; 100 is one full core


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
class RestartStatus:
    """A restart-mode job (``group_restart.py``): the agents' current round, from ``restart/``."""

    round: int
    world_size: int
    nodes: tuple[str, ...]  # node rank order
    nproc_per_node: int
    master: str
    restart_count: int
    reason: str
    agents: tuple[str, ...]  # nodes whose agent is alive (leased record)
    failed_round: int  # the last round marked failed (0: none)
    finished_round: int  # the round that finished (0: none)


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
    return build_status(keys, store.get_prefix(keys.prefix), now=now, min_workers=min_workers,
                        max_workers=max_workers, stall_after_s=stall_after_s)


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
    progress, bad_progress = _parse_progress(keys, rows)
    node_records, bad_nodes = parse_nodes(keys, rows)
    events, bad_events = parse_events(keys, rows)
    drains, bad_drains = _parse_drains(keys, rows)
    save_failed, bad_save = _parse_save_failed(keys, rows)
    slots = {(n.node, w.pid): w for n in node_records.values() for w in n.workers if w.pid}
    last_abort = _parse_abort(keys, rows)
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
        slot = slots.get((rec.node, rec.pid))
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
            rank=(g.rank_of(mid) if g is not None else prog.rank if prog is not None else None)
            if mid in in_generation else None,
            state=state,
            committed_step=step,
            step_time_s=prog.step_time_s if prog else None,
            recoveries=prog.recoveries if prog else None,
            heartbeat_age_s=now - prog.time if prog else None,
            restarts=slot.restarts if slot else None,
            rss_bytes=slot.rss_bytes if slot else None,
            cpu_percent=slot.cpu_percent if slot else None,
        ))
    order = {WorkerState.TRAINING: 0, WorkerState.WAITING: 1, WorkerState.REGISTERED: 2}
    members.sort(key=lambda m: (order[m.state], m.rank if m.rank is not None else 0,
                                snap.ready_order.get(m.member_id, 0), m.member_id))
    root, _, job_id = keys.job.rpartition("/")
    restart_view = parse_view(RestartKeys(root, job_id), rows)
    restart = _restart_status(restart_view)
    failing = save_failing(save_failed, snap.checkpoint)
    health, reason = classify(snap, bool(rows), keys.prefix, min_workers, max_workers, now=now,
                              progress=progress, stall_after_s=stall_after_s, activity=activity,
                              save_failed=save_failed if failing else None)
    if snap.generation is None and snap.finished is None and restart is not None:
        health, reason = classify_restart(restart, min_workers, max_workers)
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
        malformed=(snap.malformed + bad_progress + bad_nodes + bad_drains + bad_events + restart_view.malformed
                   + bad_save),
        min_workers=min_workers,
        max_workers=max_workers,
        nodes=tuple(
            NodeStatus(node=n.node, host=n.host, agent_pid=n.agent_pid, state=n.state,
                       workers_running=sum(1 for w in n.workers if w.pid), workers=len(n.workers),
                       restarts=n.restarts, heartbeat_age_s=now - n.time, drain_requested=n.node in drains)
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
    )


def parse_nodes(keys: Keys, rows: Iterable[KeyValue]) -> tuple[dict[str, NodeRecord], tuple[str, ...]]:
    """Node records by node; unparseable ones (or one whose node differs from its key) as
    ``"<key>: <why>"``. Pure."""
    under = keys.node("")
    out: dict[str, NodeRecord] = {}
    bad: list[str] = []
    for kv in rows:
        if not kv.key.startswith(under):
            continue
        try:
            rec = decode_node(kv.value)
            if kv.key != keys.node(rec.node):
                raise ValueError("node does not match its key")
            out[rec.node] = rec
        except DECODE_ERRORS as exc:
            bad.append(f"{kv.key}: {exc}")
    return out, tuple(bad)


def parse_events(keys: Keys, rows: Iterable[KeyValue]) -> tuple[list[tuple[str, EventRecord]], tuple[str, ...]]:
    """(key, event) in key order, which is time order; unparseable ones as ``"<key>: <why>"``. Pure."""
    out: list[tuple[str, EventRecord]] = []
    bad: list[str] = []
    for kv in sorted(rows, key=lambda kv: kv.key):
        if not kv.key.startswith(keys.events):
            continue
        try:
            out.append((kv.key, decode_event(kv.value)))
        except DECODE_ERRORS as exc:
            bad.append(f"{kv.key}: {exc}")
    return out, tuple(bad)


def _parse_drains(keys: Keys, rows: Iterable[KeyValue]) -> tuple[set[str], tuple[str, ...]]:
    """Nodes with a drain request. A value that does not parse is still a request (the agent
    drains on the key) but is listed as malformed too."""
    under = keys.drain("")
    nodes: set[str] = set()
    bad: list[str] = []
    for kv in rows:
        if not kv.key.startswith(under):
            continue
        nodes.add(kv.key[len(under):])
        try:
            decode_drain(kv.value)
        except DECODE_ERRORS as exc:
            bad.append(f"{kv.key}: {exc}")
    return nodes, tuple(bad)


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
        duration_s=float(duration) if isinstance(duration, (int, float)) and not isinstance(duration, bool)
        and math.isfinite(duration) else None,
    )


def _restart_status(view: RoundView) -> RestartStatus | None:
    r = view.round
    if r is None and not view.finished and not view.failed_round:
        return None
    return RestartStatus(
        round=r.round if r else 0, world_size=r.world_size if r else 0, nodes=r.nodes if r else (),
        nproc_per_node=r.nproc_per_node if r else 0, master=f"{r.master_addr}:{r.master_port}" if r else "",
        restart_count=r.restart_count if r else 0, reason=r.reason if r else "", agents=tuple(sorted(view.agents)),
        failed_round=view.failed_round, finished_round=view.finished)


def classify_restart(r: RestartStatus, min_workers: int | None, max_workers: int | None) -> tuple[Health, str]:
    """The health of a restart-mode job (pure): finished; down while a failed round is being
    replaced, when a node of the round lost its agent, or below ``min_workers``; degraded below
    ``max_workers``; else healthy."""
    if r.finished_round and r.finished_round >= r.round:
        return Health.FINISHED, f"restart mode: round {r.finished_round} finished"
    if not r.round:
        return Health.DOWN, "restart mode: no round yet"
    if r.failed_round >= r.round:
        return Health.DOWN, f"restart mode: round {r.round} ended; the agents are restarting every worker"
    lost = [n for n in r.nodes if n not in r.agents]
    if lost:
        return Health.DOWN, f"restart mode: round {r.round} lost the agent of {', '.join(lost)}"
    if min_workers is not None and r.world_size < min_workers:
        return Health.DOWN, f"restart mode: world size {r.world_size} < min_workers {min_workers}"
    if max_workers is not None and r.world_size < max_workers:
        return Health.DEGRADED, f"restart mode: world size {r.world_size} < max_workers {max_workers}"
    return Health.HEALTHY, f"restart mode: round {r.round} runs with world size {r.world_size}"


def stall_bound(stall_after_s: float, step_times: Iterable[float | None]) -> float:
    """How long without activity makes a job stalled (pure): ``stall_after_s``, or
    ``STALL_STEP_FACTOR`` times the slowest of ``step_times`` if that is longer."""
    slowest = max((t for t in step_times if t is not None), default=0.0)
    return max(stall_after_s, STALL_STEP_FACTOR * slowest)


def last_activity(members: Iterable[str], progress: Mapping[str, Progress], published_at: float | None) -> float | None:
    """The wall-clock time of a generation's last sign of life (pure): the newest progress record of
    its members (written at each commit and when a member finished joining), else the time its
    ``generation_published`` event says; None when neither is known."""
    times = [progress[m].time for m in members if m in progress]
    if published_at is not None:
        times.append(published_at)
    return max(times, default=None)


def derived_generation(
    snap: Snapshot, progress: Mapping[str, Progress], now: float, stall_after_s: float
) -> tuple[int, tuple[str, ...]] | None:
    """When the ``generation`` record does not parse: (number, members in rank order) of the
    newest generation that live members report training in, by progress records younger than the
    stall bound (pure). None when the record parses or is absent, or no live member reports."""
    if snap.generation is not None or not snap.generation_revision:
        return None
    bound = stall_bound(stall_after_s or STALL_AFTER_S, (p.step_time_s for p in progress.values()))
    fresh = {m: p for m, p in progress.items() if m in snap.members and now - p.time <= bound}
    if not fresh:
        return None
    number = max(p.generation for p in fresh.values())
    members = sorted((m for m, p in fresh.items() if p.generation == number), key=lambda m: (fresh[m].rank, m))
    return number, tuple(members)


def save_failing(failed: SaveFailedRecord | None, checkpoint: CheckpointRecord | None) -> bool:
    """The job's latest checkpoint save failed (pure): a ``save_failed`` record exists and no good
    checkpoint was recorded after it (by the records' wall-clock times; by step when the
    ``checkpoint`` record has no time)."""
    if failed is None:
        return False
    if checkpoint is None:
        return True
    if checkpoint.time:
        return failed.time > checkpoint.time
    return failed.step >= checkpoint.step


def classify(
    snap: Snapshot, any_keys: bool, prefix: str, min_workers: int | None, max_workers: int | None, *,
    now: float = 0.0, progress: Mapping[str, Progress] | None = None, stall_after_s: float = 0.0,
    activity: float | None = None, save_failed: SaveFailedRecord | None = None,
) -> tuple[Health, str]:
    """The health of a job and a one-line reason (pure; the rules are in the module docstring).

    Args:
        now: the wall clock the records are aged against.
        progress: the members' progress records, by member id.
        stall_after_s: see ``stall_bound`` (0: stalls are not checked).
        activity: the generation's last sign of life (``last_activity``), if known.
        save_failed: the failed save, when it is newer than the last good checkpoint.
    """
    progress = progress or {}
    g = snap.generation
    if snap.finished is not None and (g is None or snap.finished.generation >= g.generation):
        return Health.FINISHED, (f"finished at step {snap.finished.step} "
                                 f"(generation {snap.finished.generation})")
    if not any_keys:
        return Health.DOWN, f"no such job: nothing under {prefix}"
    if g is None:
        derived = derived_generation(snap, progress, now, stall_after_s)
        if derived is not None:
            number, members = derived
            newest = max(progress[m].time for m in members)
            step = max(progress[m].step for m in members)
            return Health.DEGRADED, (f"the generation record is malformed (see malformed), but {len(members)} "
                                     f"live member(s) train in generation {number} by their progress records "
                                     f"(step {step}, {now - newest:.1f}s ago)")
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
    if stall_after_s > 0 and activity is not None:
        bound = stall_bound(stall_after_s, (progress[m].step_time_s for m in g.members if m in progress))
        if now - activity > bound:
            steps = [progress[m].step for m in g.members if m in progress]
            at = f"step {max(steps)}" if steps else "no step yet"
            return Health.STALLED, (f"no step committed for {now - activity:.1f}s (> {bound:g}s) by the "
                                    f"{g.world_size} live member(s) of generation {g.generation} ({at})")
    health, reason = _size_health(snap, g, max_workers)
    if save_failed is not None:
        what = f"the last checkpoint save failed (step {save_failed.step}: {save_failed.errno or save_failed.error})"
        if health is Health.HEALTHY:
            return Health.DEGRADED, what
        reason += f"; {what}"
    return health, reason


def _size_health(snap: Snapshot, g: GenerationRecord, max_workers: int | None) -> tuple[Health, str]:
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


def _parse_save_failed(keys: Keys, rows: Sequence[KeyValue]) -> tuple[SaveFailedRecord | None, tuple[str, ...]]:
    key = save_failed_key(keys.job)
    for kv in rows:
        if kv.key == key:
            try:
                return decode_save_failed(kv.value), ()
            except DECODE_ERRORS as exc:
                return None, (f"{kv.key}: {exc}",)
    return None, ()


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
        except DECODE_ERRORS as exc:
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
            except DECODE_ERRORS:
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
                "restarts": m.restarts,
                "rss_bytes": m.rss_bytes,
                "cpu_percent": m.cpu_percent,
            }
            for m in status.members
        ],
        "nodes": [
            {
                "node": n.node,
                "host": n.host,
                "agent_pid": n.agent_pid,
                "state": n.state,
                "workers_running": n.workers_running,
                "workers": n.workers,
                "restarts": n.restarts,
                "heartbeat_age_s": _round(n.heartbeat_age_s, 3),
                "drain_requested": n.drain_requested,
            }
            for n in status.nodes
        ],
        "recoveries": [
            {"time": r.time, "generation": r.generation, "cause": r.cause, "duration_s": r.duration_s}
            for r in status.recoveries
        ],
        "drains": list(status.drains),
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
        "restart": None if status.restart is None else {
            "round": status.restart.round,
            "world_size": status.restart.world_size,
            "nodes": list(status.restart.nodes),
            "nproc_per_node": status.restart.nproc_per_node,
            "master": status.restart.master,
            "restart_count": status.restart.restart_count,
            "reason": status.restart.reason,
            "agents": list(status.restart.agents),
            "failed_round": status.restart.failed_round,
            "finished_round": status.restart.finished_round,
        },
        "checkpoint": None if status.checkpoint is None else {
            "step": status.checkpoint.step,
            "path": status.checkpoint.path,
            "node": status.checkpoint.node,
            "generation": status.checkpoint.generation,
            "bytes": status.checkpoint.bytes,
            "age_s": _round(status.checkpoint_age_s, 3),
        },
        "save_failed": None if status.save_failed is None else {
            "time": status.save_failed.time,
            "step": status.save_failed.step,
            "generation": status.save_failed.generation,
            "node": status.save_failed.node,
            "directory": status.save_failed.directory,
            "errno": status.save_failed.errno,
            "error": status.save_failed.error,
            "failing": status.save_failing,
        },
        "stall_after_s": status.stall_after_s,
        "last_activity_age_s": _round(status.last_activity_age_s, 3),
    }


def render_json(status: JobStatus) -> str:
    """One JSON object on one line (so ``--watch --json`` prints JSON lines)."""
    return json.dumps(to_dict(status))


_COLUMNS = ("MEMBER", "NODE", "LOCAL", "PID", "HOST", "RANK", "STATE", "STEP", "STEP_TIME",
            "RECOVERIES", "HEARTBEAT", "RESTARTS", "RSS", "CPU")
_NODE_COLUMNS = ("NODE", "HOST", "AGENT_PID", "AGENT_STATE", "WORKERS", "RESTARTS", "HEARTBEAT", "DRAIN")


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
    if status.save_failed is not None:
        lines.append(("save error", _save_failed_line(status)))
    r = status.restart
    if r is not None:
        lines.append(("restart", f"mode restart: round {r.round} ({_clean(r.reason)}), world size {r.world_size} = "
                      f"{len(r.nodes)} node(s) x {r.nproc_per_node} [{_clean(', '.join(r.nodes))}], master "
                      f"{_clean(r.master)}, {r.restart_count} restart(s); agents alive: "
                      f"{_clean(', '.join(r.agents)) or 'none'}"))
    out = [f"{k:<11} {v}" for k, v in lines]
    out.append("")
    if status.members:
        out += _aligned([_COLUMNS] + [_row(m) for m in status.members])
    else:
        out.append("no live members")
    out.append("")
    if status.nodes:
        out += _aligned([_NODE_COLUMNS] + [_node_row(n) for n in status.nodes])
    else:
        out.append("no node agents (workers started without elasticd, or none running)")
    out.append("")
    if status.recoveries:
        out.append(f"last recoveries (newest last, at most {RECOVERIES_SHOWN}):")
        out += [f"  {_utc(r.time)}  generation {_opt(r.generation)}  {_clean(r.cause)}  "
                f"{'-' if r.duration_s is None else f'{r.duration_s:.3f}s'}" for r in status.recoveries]
    else:
        out.append("last recoveries: none recorded")
    orphan = [d for d in status.drains if d not in {n.node for n in status.nodes}]
    if orphan:
        out.append("")
        out.append("drain requested for nodes without an agent record: " + ", ".join(map(_clean, orphan)))
    if status.missing:
        out.append("")
        out.append("missing (in the generation, lease gone): " + ", ".join(map(_clean, status.missing)))
    if status.malformed:
        out.append("")
        out.append(f"malformed records ({len(status.malformed)}, ignored):")
        out += [f"  {_clean(m)}" for m in status.malformed]
    return "\n".join(out) + "\n"


def _aligned(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def _node_row(n: NodeStatus) -> tuple[str, ...]:
    return (
        _clean(n.node),
        _clean(n.host),
        str(n.agent_pid),
        _clean(n.state),
        f"{n.workers_running}/{n.workers}",
        str(n.restarts),
        f"{n.heartbeat_age_s:.1f}s ago",
        "requested" if n.drain_requested else "-",
    )


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}MiB"


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t)) if math.isfinite(t) and abs(t) < 1e11 else "?"


def _checkpoint_line(status: JobStatus) -> str:
    ck = status.checkpoint
    if ck is None:
        return "none recorded"
    age = "" if status.checkpoint_age_s is None else f", {status.checkpoint_age_s:.1f}s ago"
    return f"step {ck.step} on {_clean(ck.node)}: {_clean(ck.path)} ({ck.bytes} bytes{age})"


def _save_failed_line(status: JobStatus) -> str:
    f = status.save_failed
    assert f is not None
    when = "the latest save" if status.save_failing else "a good checkpoint was saved since"
    return (f"{when}: step {f.step} at {_utc(f.time)} on {_clean(f.node)} into {_clean(f.directory)}: "
            f"{_clean(f.error)}")


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
        _opt(m.restarts),
        _mib(m.rss_bytes),
        "-" if m.cpu_percent is None else f"{m.cpu_percent:.0f}%",
    )


def _opt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _clean(text: str) -> str:
    """Escape control characters: record fields come from etcd and must not drive the terminal."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


# ---------------------------------------------------------------------------------------------
# elasticctl events


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
    shown = events if limit is None else events[max(0, len(events) - limit):]
    return JobEvents(job_id=keys.job.rpartition("/")[2], prefix=keys.prefix, exists=bool(rows),
                     events=tuple(shown), total=len(events), malformed=bad)


def events_to_dict(ev: JobEvents) -> dict[str, object]:
    """The JSON shape of ``elasticctl events --json``: every key always present."""
    return {
        "job": ev.job_id,
        "prefix": ev.prefix,
        "total": ev.total,
        "events": [{"key": key, "time": e.time, "kind": e.kind, "source": e.source, "detail": dict(e.detail)}
                   for key, e in ev.events],
        "malformed": list(ev.malformed),
    }


def render_events_json(ev: JobEvents) -> str:
    return json.dumps(events_to_dict(ev), default=str)


def render_events_table(ev: JobEvents) -> str:
    """One line per event, oldest first: UTC time, kind, writer, details; then malformed keys."""
    out = [f"job {_clean(ev.job_id)} ({_clean(ev.prefix)}): {len(ev.events)} of {ev.total} event(s), newest last"]
    if ev.events:
        rows = [("TIME", "KIND", "SOURCE", "DETAIL")]
        for _, e in ev.events:
            ms = int(round((e.time % 1) * 1000)) % 1000 if math.isfinite(e.time) else 0
            rows.append((f"{_utc(e.time)[:-1]}.{ms:03d}Z", _clean(e.kind), _clean(e.source), _detail(e.detail)))
        out += _aligned(rows)
    if ev.malformed:
        out.append("")
        out.append(f"malformed events ({len(ev.malformed)}, ignored):")
        out += [f"  {_clean(m)}" for m in ev.malformed]
    return "\n".join(out) + "\n"


def _detail(detail: Mapping[str, object]) -> str:
    parts = []
    for k in sorted(detail):
        v = detail[k]
        plain = isinstance(v, str) and v and not any(c.isspace() or c in "\"=" for c in v)
        text = v if plain and isinstance(v, str) else json.dumps(v, default=str, separators=(",", ":"))
        parts.append(f"{k}={text}")
    return _clean(" ".join(parts))
