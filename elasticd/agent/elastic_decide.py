"""Elastic mode's node agent, its pure half: the states, the snapshot, the actions and ``decide``.

Owns ``AgentState`` (the agent's) and ``SlotState`` (each local rank's worker), with their allowed
transitions written on the enums; the ``AgentSnapshot`` that ``decide(snapshot, now, config)``
reads; the ``Action`` it returns (one at a time, with its reason); ``stopped_past`` (the stopped
worker rule) and ``member_leases`` (which member records in etcd belong to a local worker). The
restart budget and the stop ladder it applies are the daemon skeleton's (``daemon``).

Never does I/O, never reads a clock (``now`` is passed in), never imports torch: ``elastic.Agent``
is the executor that applies the actions.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass
from enum import StrEnum

from elasticd.agent.daemon import (
    EXIT_FATAL,
    EXIT_JOB_FAILED,
    EXIT_OK,
    Rung,
    restart_backoff_s,
    restarts_in_window,
    stop_ladder,
)
from elasticd.agent.health import SHOWN_OUTPUT_CHARS, HealthResult
from elasticd.agent.jobview import JobView, ProgressMark, is_hung
from elasticd.agent.supervisor import ExitKind, WorkerExit
from elasticd.config import AgentConfig
from elasticd.errors import EXIT_NO_RESTART, EXIT_REJOIN
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import DECODE_ERRORS, MemberRecord, decode


class AgentState(StrEnum):
    """The agent's state. The transitions (``decide`` takes no other edge):

    * STARTING -> RUNNING: the first worker is started.
    * STARTING, RUNNING -> DRAINING: a stop request (SIGTERM/SIGINT, ``request_stop``, ``drain/<node>``).
    * STARTING, RUNNING -> UNHEALTHY: the health check failed (its workers are stopped; an exit
      puts its slot back to PENDING); UNHEALTHY -> RUNNING: a check passed and a worker starts;
      UNHEALTHY -> DRAINING: a stop request.
    * RUNNING -> STOPPING: a worker failed with the restart budget spent (``restarts_exhausted``),
      exited ``EXIT_NO_RESTART`` (``worker_fatal``), or the job's failure records show a bug
      (``job_failed``: the same exception at the same step in two or more workers).
    * DRAINING, STOPPING -> exit: once no worker runs (0 drained; stopping: 1, or 3 for a bug), or 1 when killed
      workers are not reaped within ``kill_wait_s``. RUNNING -> exit 0 when every worker is DONE.
    """

    STARTING = "starting"  # no worker started yet
    RUNNING = "running"  # supervising: restarting failed workers within the budget
    DRAINING = "draining"  # asked to stop (SIGTERM): workers finish their step and leave; exit 0
    STOPPING = "stopping"  # a fatal condition (restarts exhausted): workers are stopped; exit 1
    UNHEALTHY = "unhealthy"  # cordoned, or the health check failed: workers stopped, none started until back


class SlotState(StrEnum):
    """One local rank's worker. The transitions:

    * PENDING -> RUNNING: started; PENDING, BACKOFF -> EXITED: it could not be started.
    * RUNNING -> EXITED: its process ended (seen by the executor, not yet acted on).
    * EXITED -> DONE: it exited 0 and the job finished, or the agent is stopping (never restarted);
      an exit 0 before the job finished is a failure (-> BACKOFF or STOPPED). Until a read of the
      job after the exit says which, the slot stays EXITED (``awaits_finish``).
    * EXITED -> BACKOFF: it failed and the budget allows a restart; BACKOFF -> RUNNING after the backoff.
    * EXITED -> STOPPED: it failed while the agent stops, or with the budget spent.
    * DONE and STOPPED are final; PENDING and BACKOFF slots stay so while the agent drains.
    """

    PENDING = "pending"  # not started yet
    RUNNING = "running"
    EXITED = "exited"  # its process ended; the agent has not acted on that yet
    BACKOFF = "backoff"  # waiting to be restarted
    DONE = "done"  # exited 0: finished, never restarted
    STOPPED = "stopped"  # ended and will not be restarted (the agent is stopping)


@dataclass(frozen=True)
class Slot:
    local_rank: int
    state: SlotState = SlotState.PENDING
    pid: int = 0
    exit: WorkerExit | None = None
    restart_at: float = 0.0  # BACKOFF: when to restart (monotonic)
    starts: int = 0
    mark: ProgressMark | None = None  # RUNNING: when its progress in etcd last advanced (hang test)
    hang_killed: bool = False  # RUNNING: SIGKILLed as hung; its exit is on the way
    stopped_at: float | None = None  # RUNNING: first seen stopped (state T) at (monotonic); None: not stopped
    stop_revoked: bool = False  # RUNNING: stopped past stopped_worker_s, and its lease was revoked
    exited_at: float | None = None  # EXITED: when the executor saw its process end (monotonic)
    score: float | None = None  # RUNNING: its straggler score at the last read (None: none)
    slow_since: float | None = None  # RUNNING: when its slow episode began (``wire.stragglers``)
    straggler_acted: bool = False  # RUNNING: this slow episode was reported (and acted on)
    replica_killed: bool = False  # RUNNING: SIGKILLed because its replica lost another worker


@dataclass(frozen=True)
class AgentSnapshot:
    """Everything ``decide`` looks at."""

    state: AgentState
    slots: tuple[Slot, ...]
    restarts: tuple[float, ...] = ()  # when each restart was decided (monotonic)
    stop_requests: int = 0  # SIGTERM/SIGINT received
    terminate_deadline: float | None = None  # SIGTERM forwarded: kill after this
    kill_deadline: float | None = None  # SIGKILL sent: stop waiting after this
    reason: str = ""  # why the agent is stopping (STOPPING)
    exit_code: int = EXIT_FATAL  # STOPPING: the exit code once no worker runs
    view: JobView | None = None  # the newest read of the job's keys (None: none succeeded yet)
    health: HealthResult | None = None  # the newest health check (None: none ended yet, or no check)
    health_after: float = float("-inf")  # a (re)start waits for a check that ended after this (monotonic)

    @classmethod
    def initial(cls, nproc: int) -> AgentSnapshot:
        return cls(AgentState.STARTING, tuple(Slot(lr) for lr in range(nproc)))


class ActionKind(StrEnum):
    SPAWN = "spawn"  # start (or restart) the worker of local_rank
    RELEASE = "release"  # a worker ended: revoke its lease, then put its slot in slot_state
    TERMINATE = "terminate"  # SIGTERM to every running worker; kill after `until`
    KILL = "kill"  # SIGKILL to every running worker (and its children); give up after `until`
    STRAGGLER = "straggler"  # local_rank's worker is a straggler: report it (and replace its node, by policy)
    KILL_HUNG = "kill_hung"  # SIGKILL the hung worker of local_rank (and its children); its exit restarts it
    REVOKE_STOPPED = "revoke_stopped"  # revoke the lease of local_rank's stopped worker (it is not killed)
    KILL_REPLICA = "kill_replica"  # SIGKILL local_ranks (a replica that lost a worker, or a stopped one's)
    JOB_FAILED = "job_failed"  # a bug stops the job (``JobView.bug``): record it, stop (STOPPING, exit 3)
    WAIT = "wait"  # nothing to do until `until` (None: until something happens)
    EXIT = "exit"  # the agent is done: exit with exit_code


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    reason: str
    local_rank: int = -1
    slot_state: SlotState | None = None
    restart_at: float = 0.0
    next_state: AgentState | None = None
    until: float | None = None
    exit_code: int = EXIT_OK
    budgeted: bool = True  # a RELEASE to BACKOFF counts against max_restarts
    # SPAWN: every local rank of the replica it starts; KILL_REPLICA: the ranks it kills (``local_rank``:
    # the one whose fault it is, -1: none of them). Empty: ``local_rank`` alone.
    local_ranks: tuple[int, ...] = ()


def decide(snap: AgentSnapshot, now: float, config: AgentConfig) -> Action:
    """What the agent does next. Pure: no I/O, no clock reads."""
    bug = snap.view.bug if snap.view is not None else None
    if bug is not None and snap.state not in (AgentState.DRAINING, AgentState.STOPPING):
        return Action(
            ActionKind.JOB_FAILED,
            f"job_failed: {bug.describe()}",
            next_state=AgentState.STOPPING,
            exit_code=EXIT_JOB_FAILED,
        )
    ended = next(
        (s for s in snap.slots if s.state is SlotState.EXITED and not awaits_finish(s, snap, now, config)), None
    )
    if ended is not None:
        return _release(snap, ended, now, config)
    running = [s for s in snap.slots if s.state is SlotState.RUNNING]
    stopping = snap.state in (AgentState.DRAINING, AgentState.STOPPING)
    if snap.stop_requests and not stopping:
        return Action(
            ActionKind.TERMINATE,
            "stop requested: the workers finish their step and leave",
            next_state=AgentState.DRAINING,
            until=now + config.timeouts.shutdown_grace_s,
        )
    if stopping:
        return _stopping(snap, running, now, config)
    unhealthy = _health(snap, running, now, config)
    if unhealthy is not None:
        return unhealthy
    fault = _running_fault(snap, running, now, config)
    if fault is not None:
        return fault
    if config.replica_size > 1:
        return _replicas(snap, now, config)
    pending = next((s for s in snap.slots if s.state is SlotState.PENDING), None)
    if pending is not None:
        return Action(ActionKind.SPAWN, "start", local_rank=pending.local_rank, next_state=AgentState.RUNNING)
    due = [s for s in snap.slots if s.state is SlotState.BACKOFF]
    ready = next((s for s in due if s.restart_at <= now), None)
    if ready is not None:
        return Action(ActionKind.SPAWN, "restart", local_rank=ready.local_rank, next_state=AgentState.RUNNING)
    if all(s.state is SlotState.DONE for s in snap.slots):
        return Action(ActionKind.EXIT, "workers_finished", exit_code=EXIT_OK)
    return Action(ActionKind.WAIT, "supervising", until=_next_deadline(snap, running, config))


def out_of_service(snap: AgentSnapshot, config: AgentConfig) -> str | None:
    """Why the node must run no worker now: cordoned (``cordon/<node>``), or its last health check
    failed. None: it may run workers."""
    cordon = snap.view.cordoned.get(config.node_id) if snap.view is not None else None
    if cordon is not None:
        return f"cordoned: {cordon} (elasticctl uncordon {config.node_id})"
    h = snap.health
    if config.health_check and h is not None and not h.passed:
        return f"health_check_failed: {h.output[-SHOWN_OUTPUT_CHARS:]}"
    return None


def _health(snap: AgentSnapshot, running: list[Slot], now: float, config: AgentConfig) -> Action | None:
    """What the node's service asks for, if anything (None: nothing holds its workers). Out of
    service (``out_of_service``: cordoned, or a failed health check), the workers are stopped
    (SIGTERM, then the stop ladder) and the node stays UNHEALTHY; with a check, a (re)start waits
    for a passing one that ended after ``health_after`` (the last exit); back in service, an
    UNHEALTHY node's slots start."""
    out = out_of_service(snap, config)
    if out is not None:
        if snap.state is not AgentState.UNHEALTHY:
            return Action(
                ActionKind.TERMINATE,
                out,
                next_state=AgentState.UNHEALTHY,
                until=now + config.timeouts.shutdown_grace_s,
            )
        if not running:
            if snap.view is not None and snap.view.finished:  # nothing left to come back for
                return Action(ActionKind.EXIT, "workers_finished: the job finished while the node was out of service")
            return Action(ActionKind.WAIT, f"out of service: {out}")
        return _ladder(snap, running, now, config, "the node is out of service")
    if not config.health_check:
        return None
    h = snap.health
    starting = any(
        s.state is SlotState.PENDING or (s.state is SlotState.BACKOFF and s.restart_at <= now) for s in snap.slots
    )
    if starting and (h is None or h.at < snap.health_after):
        return Action(ActionKind.WAIT, "waiting for a health check before a worker starts")
    return None


def _stopping(snap: AgentSnapshot, running: list[Slot], now: float, config: AgentConfig) -> Action:
    """DRAINING or STOPPING: stop the workers (the stop ladder), then exit (0 drained, else the
    snapshot's code)."""
    draining = snap.state is AgentState.DRAINING
    code = EXIT_OK if draining else snap.exit_code
    reason = "drained" if draining else snap.reason
    if not running:
        return Action(ActionKind.EXIT, reason, exit_code=code)
    if snap.terminate_deadline is None:
        return Action(ActionKind.TERMINATE, "stopping the other workers", until=now + config.timeouts.shutdown_grace_s)
    return _ladder(snap, running, now, config, reason)


def _ladder(snap: AgentSnapshot, running: list[Slot], now: float, config: AgentConfig, why: str) -> Action:
    """The next rung of stopping the ``running`` workers that were sent SIGTERM (``stop_ladder``):
    wait, SIGKILL, or exit 1 once they outlived SIGKILL (``why``: what the agent was stopping for)."""
    assert snap.terminate_deadline is not None
    step = stop_ladder(
        now,
        terminate_deadline=snap.terminate_deadline,
        kill_deadline=snap.kill_deadline,
        stop_requests=snap.stop_requests,
        grace_s=config.timeouts.shutdown_grace_s,
        kill_wait_s=config.kill_wait_s,
        workers=f"pids {[s.pid for s in running]}",
    )
    if step.rung is Rung.GIVE_UP:
        return Action(ActionKind.EXIT, f"{step.reason}; {why}", exit_code=EXIT_FATAL)
    kind = ActionKind.KILL if step.rung is Rung.KILL else ActionKind.WAIT
    return Action(kind, step.reason, until=step.until)


def _next_deadline(snap: AgentSnapshot, running: list[Slot], config: AgentConfig) -> float | None:
    """When ``decide`` has something to do next with nothing else happening: a restart due, a
    stopped worker past ``stopped_worker_s``, an exit 0 whose wait for a read of the job ends."""
    stops = [
        s.stopped_at + config.stopped_worker_s
        for s in running
        if s.stopped_at is not None and not s.stop_revoked and config.stopped_worker_s > 0
    ]
    if config.replica_size > 1:  # a replica restarts when its last worker's backoff ends
        due = [
            max(s.restart_at for s in rep if s.state is SlotState.BACKOFF)
            for rep in _replica_slots(snap, config)
            if all(s.state in (SlotState.PENDING, SlotState.BACKOFF) for s in rep)
            and any(s.state is SlotState.BACKOFF for s in rep)
        ]
    else:
        due = [s.restart_at for s in snap.slots if s.state is SlotState.BACKOFF]
    unsure = [
        s.exited_at + config.timeouts.etcd_outage_s
        for s in snap.slots
        if s.exited_at is not None and s.state is SlotState.EXITED
    ]
    return min([*due, *stops, *unsure], default=None)


def awaits_finish(slot: Slot, snap: AgentSnapshot, now: float, config: AgentConfig) -> bool:
    """``slot``'s worker exited 0 while the agent is not stopping, and no read of the job taken
    since says whether the job finished: the agent waits for one (at most ``etcd_outage_s`` after
    the exit) before it takes the exit as done or as a failure (``_release``)."""
    e, v = slot.exit, snap.view
    if slot.state is not SlotState.EXITED or e is None or not e.ok or slot.exited_at is None:
        return False
    if snap.state in (AgentState.DRAINING, AgentState.STOPPING, AgentState.UNHEALTHY) or snap.stop_requests:
        return False
    if v is not None and (v.finished or v.read_at >= slot.exited_at):
        return False
    return now < slot.exited_at + config.timeouts.etcd_outage_s


def _running_fault(snap: AgentSnapshot, running: list[Slot], now: float, config: AgentConfig) -> Action | None:
    """A running worker to act on: hung (killed), stopped past ``stopped_worker_s`` (its lease
    revoked), or a straggler (reported; replaced by policy). None: none."""
    hung = next((s for s in running if not s.hang_killed and is_hung(s.mark, snap.view, config.hang_timeout_s)), None)
    if hung is not None:
        assert hung.mark is not None and snap.view is not None
        return Action(
            ActionKind.KILL_HUNG,
            f"worker {hung.local_rank} (pid {hung.pid}) made no progress for "
            f"{snap.view.read_at - hung.mark.at:.1f} s (hang_timeout_s {config.hang_timeout_s:g}) while "
            f"the job's committed step grew from {hung.mark.job_step} to {snap.view.job_step}",
            local_rank=hung.local_rank,
        )
    frozen = next((s for s in running if stopped_past(s, now, config.stopped_worker_s)), None)
    if frozen is not None and config.replica_size > 1:
        assert frozen.stopped_at is not None
        return Action(
            ActionKind.KILL_REPLICA,
            f"worker {frozen.local_rank} (pid {frozen.pid}) stopped for {now - frozen.stopped_at:.2f} s "
            f"(stopped_worker_s {config.stopped_worker_s:g}): its replica is ended and starts again whole",
            local_rank=frozen.local_rank,
            local_ranks=_alive_in_replica(snap, frozen.local_rank, config),
        )
    if frozen is not None:
        assert frozen.stopped_at is not None
        return Action(
            ActionKind.REVOKE_STOPPED,
            f"worker {frozen.local_rank} (pid {frozen.pid}) stopped for "
            f"{now - frozen.stopped_at:.2f} s (stopped_worker_s {config.stopped_worker_s:g}): its lease "
            f"is revoked so that the others regroup without it now; it rejoins when it continues",
            local_rank=frozen.local_rank,
        )
    slow = next((s for s in running if is_straggler(s, now, config)), None)
    if slow is not None:
        assert slow.slow_since is not None and slow.score is not None
        return Action(
            ActionKind.STRAGGLER,
            f"worker {slow.local_rank} (pid {slow.pid}) scored {slow.score:.2f} (straggler_score "
            f"{config.straggler_score:g}) for {now - slow.slow_since:.1f} s (straggler_s {config.straggler_s:g})",
            local_rank=slow.local_rank,
        )
    return None


def _alive_in_replica(snap: AgentSnapshot, local_rank: int, config: AgentConfig) -> tuple[int, ...]:
    """The running workers of ``local_rank``'s replica not yet killed with it."""
    return tuple(
        lr
        for lr in config.replica_ranks(local_rank)
        if snap.slots[lr].state is SlotState.RUNNING and not snap.slots[lr].replica_killed
    )


def _replica_slots(snap: AgentSnapshot, config: AgentConfig) -> list[tuple[Slot, ...]]:
    """The slots of each replica, in local rank order (``replica_size`` consecutive ranks each)."""
    k = config.replica_size
    return [snap.slots[first : first + k] for first in range(0, config.nproc_per_node, k)]


def _replicas(snap: AgentSnapshot, now: float, config: AgentConfig) -> Action:
    """With ``replica_size`` > 1, after the faults: a replica that lost a worker (one waiting for
    its restart) while others of it run has those ended (KILL_REPLICA); a replica whose every
    worker waits (to start, or for its restart, all due) starts whole (one SPAWN of all its ranks);
    then as ``decide``: exit once every worker is done, else wait."""
    replicas = _replica_slots(snap, config)
    for rep in replicas:
        down = next((s for s in rep if s.state in (SlotState.BACKOFF, SlotState.STOPPED)), None)
        alive = _alive_in_replica(snap, rep[0].local_rank, config)
        if down is not None and alive:
            return Action(
                ActionKind.KILL_REPLICA,
                f"worker {down.local_rank} of the replica of local ranks {rep[0].local_rank}.."
                f"{rep[-1].local_rank} ended: the others end with it and all start again together",
                local_ranks=alive,
            )
    for rep in replicas:
        if not all(s.state in (SlotState.PENDING, SlotState.BACKOFF) for s in rep):
            continue
        if max(s.restart_at if s.state is SlotState.BACKOFF else now for s in rep) <= now:
            fresh = all(s.state is SlotState.PENDING for s in rep)
            return Action(
                ActionKind.SPAWN,
                "start" if fresh else "restart",
                local_rank=rep[0].local_rank,
                local_ranks=tuple(s.local_rank for s in rep),
                next_state=AgentState.RUNNING,
            )
    if all(s.state is SlotState.DONE for s in snap.slots):
        return Action(ActionKind.EXIT, "workers_finished", exit_code=EXIT_OK)
    running = [s for s in snap.slots if s.state is SlotState.RUNNING]
    return Action(ActionKind.WAIT, "supervising", until=_next_deadline(snap, running, config))


def is_straggler(slot: Slot, now: float, config: AgentConfig) -> bool:
    """``slot``'s running worker has been slow (``wire.stragglers``) for ``straggler_s`` or longer,
    and this episode was not acted on yet."""
    return (
        slot.state is SlotState.RUNNING
        and slot.slow_since is not None
        and not slot.straggler_acted
        and now - slot.slow_since >= config.straggler_s
    )


def stopped_past(slot: Slot, now: float, stopped_worker_s: float) -> bool:
    """The running worker of ``slot`` has been stopped (SIGSTOP) for ``stopped_worker_s`` or longer
    and its lease is not revoked yet (0: never)."""
    return (
        stopped_worker_s > 0
        and slot.state is SlotState.RUNNING
        and slot.stopped_at is not None
        and not slot.stop_revoked
        and now - slot.stopped_at >= stopped_worker_s
    )


def _release(snap: AgentSnapshot, slot: Slot, now: float, config: AgentConfig) -> Action:
    e = slot.exit
    assert e is not None, "an EXITED slot carries its exit"
    what = f"worker {slot.local_rank} (pid {e.pid}) {e.describe()}"
    if slot.hang_killed:
        what += " as hung"
    held = _release_out_of_service(snap, slot, what)
    if held is not None:
        return held
    if e.ok:
        done = _exit_0(snap, slot, what, config)
        if done is not None:
            return done
        # A worker leaves with 0 at the job's end (a ``finished`` record), or when drained (the
        # agent is stopping then): any other exit 0 is a script that ended before the job did.
        what += " before the job finished (no finished record in etcd): a failure"
    # no fault of its own: its replica lost another worker, or it asked for it (it missed steps)
    if slot.replica_killed or (e.kind is ExitKind.FAILED and e.code == EXIT_REJOIN):
        why = (
            " with its replica: it starts again with the others"
            if slot.replica_killed
            else ": it missed steps of the job and starts again as a newcomer now"
        )
        return Action(
            ActionKind.RELEASE,
            what + why,
            local_rank=slot.local_rank,
            slot_state=SlotState.BACKOFF,
            restart_at=now,
            budgeted=False,
        )
    if e.kind is ExitKind.FAILED and e.code == EXIT_NO_RESTART:  # the worker says a restart cannot help
        return Action(
            ActionKind.RELEASE,
            f"worker_fatal: {what} (EXIT_NO_RESTART: fatal, not restarted; its log says why)",
            local_rank=slot.local_rank,
            slot_state=SlotState.STOPPED,
            next_state=AgentState.STOPPING,
            exit_code=EXIT_JOB_FAILED,
        )
    recent = restarts_in_window(snap.restarts, now, config.restart_window_s)
    if recent >= config.max_restarts:
        return Action(
            ActionKind.RELEASE,
            f"restarts_exhausted: {what}; {recent} restarts in the last {config.restart_window_s:g} s "
            f"(max_restarts {config.max_restarts})",
            local_rank=slot.local_rank,
            slot_state=SlotState.STOPPED,
            next_state=AgentState.STOPPING,
            exit_code=EXIT_FATAL,
        )
    delay = restart_backoff_s(recent, config.restart_backoff_initial_s, config.restart_backoff_max_s)
    return Action(
        ActionKind.RELEASE,
        f"{what}: restart in {delay:g} s",
        local_rank=slot.local_rank,
        slot_state=SlotState.BACKOFF,
        restart_at=now + delay,
    )


def _release_out_of_service(snap: AgentSnapshot, slot: Slot, what: str) -> Action | None:
    """The RELEASE of a worker that ended while the agent stops (DONE on 0, else STOPPED) or while
    the node is unhealthy (PENDING: it starts again once a check passes). None: neither."""
    if snap.state in (AgentState.DRAINING, AgentState.STOPPING) or snap.stop_requests:
        return Action(
            ActionKind.RELEASE,
            f"{what}; the agent is stopping",
            local_rank=slot.local_rank,
            slot_state=SlotState.DONE if slot.exit is not None and slot.exit.ok else SlotState.STOPPED,
        )
    if snap.state is AgentState.UNHEALTHY:  # stopped for the node's sake: started again once healthy
        return Action(
            ActionKind.RELEASE,
            f"{what}; the node is unhealthy: it starts again once a health check passes",
            local_rank=slot.local_rank,
            slot_state=SlotState.PENDING,
            budgeted=False,
        )
    return None


def _exit_0(snap: AgentSnapshot, slot: Slot, what: str, config: AgentConfig) -> Action | None:
    """The RELEASE of a worker that exited 0 as done: the job finished, or no read of the job since
    its exit said otherwise within ``etcd_outage_s``. None: the job did not finish (a failure)."""
    v = snap.view
    if v is not None and v.finished:
        return Action(
            ActionKind.RELEASE,
            f"{what}: done (the job finished)",
            local_rank=slot.local_rank,
            slot_state=SlotState.DONE,
        )
    if v is None or slot.exited_at is None or v.read_at < slot.exited_at:
        return Action(
            ActionKind.RELEASE,
            f"{what}: taken as done (no read of the job from etcd since, within etcd_outage_s "
            f"{config.timeouts.etcd_outage_s:g} s, says whether the job finished)",
            local_rank=slot.local_rank,
            slot_state=SlotState.DONE,
        )
    return None


def member_leases(kvs: Iterable[KeyValue], keys: Keys, node: str, pids: Collection[int]) -> list[tuple[str, int]]:
    """(member id, lease) of each leased member record of ``node`` whose pid is in ``pids``.

    Pure; a record that does not parse is skipped (it is not ours to judge).
    """
    found: list[tuple[str, int]] = []
    for kv in kvs:
        if not kv.key.startswith(keys.member("")) or not kv.lease:
            continue
        try:
            rec = decode(MemberRecord, kv.value)
        except DECODE_ERRORS:
            continue
        if rec.node == node and rec.pid in pids:
            found.append((rec.member_id, kv.lease))
    return found
