"""Restart mode's node agent, its pure half: the phases, what the agent knows, the actions and ``decide``.

Owns ``Phase`` (with its allowed transitions written on the enum), ``Local`` (what this agent
knows of itself), the ``Action`` that ``decide(local, view, now, config)`` returns from a
``RoundView`` of the restart keys, and the pure rules it is built from: the node bounds of a round
(``node_bounds``), whether a round must end (``round_broken``), which newcomers fit
(``newcomers_that_fit``) and the torchrun environment of a worker (``worker_environ``). The restart
budget and the stop ladder are the daemon skeleton's (``daemon``).

Never does I/O, never reads a clock (``now`` is passed in), never imports torch:
``restart.GroupRestartAgent`` is the executor that applies the actions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

from elasticd.agent.daemon import (
    EXIT_FATAL,
    EXIT_OK,
    Rung,
    restart_backoff_s,
    restarts_in_window,
    stop_ladder,
)
from elasticd.config import AgentConfig
from elasticd.wire.restart import COUNTED_CAUSES, Cause, RoundRecord, RoundView


class Phase(StrEnum):
    """This agent's phase. The transitions (``decide`` and its executor take no other edge):

    * REJOIN -> JOINING: the backoff is over; the waiting record is written (REGISTER).
    * JOINING -> RUNNING: a round that includes this node is published (START).
    * RUNNING -> FINISHING: every worker of this node exited 0 (MARK_DONE).
    * RUNNING, FINISHING -> STOPPING: the round ended (failed, superseded, a node lost or left, a
      newcomer fits): the workers get SIGTERM (TERMINATE).
    * STOPPING -> REJOIN: the workers are gone (RESTART; after a backoff when the cause counts).
    * exit: on a stop request, from any phase but RUNNING (whose workers are stopped first); from
      STOPPING when the restarts are exhausted or killed workers are not reaped; from FINISHING
      when the job finished, or the others did not report done within join_s; from JOINING when
      the job had finished, too few nodes came within join_s, or the nproc differs.
    """

    REJOIN = "rejoin"  # no workers; after restart_at, write the waiting record
    JOINING = "joining"  # waiting record written; waiting for (or publishing) a round with this node
    RUNNING = "running"  # this node's workers run in `round`
    STOPPING = "stopping"  # stopping this node's workers; then rejoin, or exit
    FINISHING = "finishing"  # this node's workers all exited 0; waiting for the other nodes'


@dataclass(frozen=True)
class Local:
    """What this agent knows of itself; ``decide`` reads it with the ``RoundView``."""

    node: str
    phase: Phase = Phase.REJOIN
    round: int = 0  # the round this node's workers run (or last ran) in
    nodes: tuple[str, ...] = ()  # the nodes of that round
    running: int = 0  # workers started and not yet reaped
    succeeded: int = 0  # workers of `round` that exited 0
    failure: str = ""  # the first worker failure of `round` ("" none)
    cause: str = ""  # STOPPING: why the round ended (a Cause)
    restart_at: float = 0.0  # REJOIN: when to write the waiting record
    phase_since: float = 0.0  # when the current phase began (monotonic)
    candidates_changed_at: float = 0.0  # when the set of live waiting nodes last changed
    view_changed_at: float = 0.0  # when the round, the failed round or the set of live agents last changed
    restarts: tuple[float, ...] = ()  # when each counted restart was decided (monotonic)
    stop_requests: int = 0  # SIGTERM/SIGINT received
    terminate_deadline: float | None = None  # SIGTERM sent to the workers: kill after this
    kill_deadline: float | None = None  # SIGKILL sent: stop waiting after this


class ActionKind(StrEnum):
    REGISTER = "register"  # write this node's waiting record (a fresh free port with it); -> JOINING
    PUBLISH = "publish"  # compare-and-set `record` as the next round, consuming its waiting records
    START = "start"  # start this node's workers in `record`; -> RUNNING
    MARK_FAILED = "mark_failed"  # compare-and-set the failed record for `round` (cause, detail)
    MARK_DONE = "mark_done"  # write done/<node> for `round`; -> FINISHING
    MARK_FINISHED = "mark_finished"  # write finished for `round`
    TERMINATE = "terminate"  # SIGTERM to this node's workers, kill after `until`; -> STOPPING (`cause`)
    KILL = "kill"  # SIGKILL to this node's workers and their children; give up after `until`
    RESTART = "restart"  # the round is over here: -> REJOIN at `until` (counted: a counted restart)
    WAIT = "wait"  # nothing to do until `until` (None: until something happens)
    EXIT = "exit"  # the agent is done: exit with exit_code


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    reason: str
    until: float | None = None
    record: RoundRecord | None = None
    expected_revision: int = 0
    consumed: tuple[str, ...] = ()
    round: int = 0
    cause: str = ""
    counted: bool = False
    exit_code: int = EXIT_OK


def node_bounds(config: AgentConfig) -> tuple[int, int]:
    """(min, max) nodes per round: the world bounds in workers divided by ``nproc_per_node``."""
    nproc = config.nproc_per_node
    return math.ceil(config.world.min_workers / nproc), max(1, config.world.max_workers // nproc)


def worker_environ(record: RoundRecord, node: str, local_rank: int, run_id: str, max_restarts: int) -> dict[str, str]:
    """The variables torchrun sets for a worker, for ``local_rank`` of ``node`` in ``record``."""
    nproc = record.nproc_per_node
    group_rank = record.nodes.index(node)
    rank = group_rank * nproc + local_rank
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(record.world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(len(record.nodes)),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(record.world_size),
        "MASTER_ADDR": record.master_addr,
        "MASTER_PORT": str(record.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(record.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        # Tells torch that no agent-hosted store exists: rank 0's worker hosts it on MASTER_PORT.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def _cause(text: str) -> Cause:
    """A recorded cause; one this version does not know counts as a failure (the safe side)."""
    return Cause(text) if text in {c.value for c in Cause} else Cause.WORKER_FAILED


def round_broken(view: RoundView, r: int, nodes: tuple[str, ...]) -> tuple[Cause | None, str]:
    """Whether round ``r`` of ``nodes`` must end, as seen in ``view`` (a cause and a detail; None:
    it is fine). A failed record or a newer round ends it with the recorded cause; a member node
    whose agent is gone (and that was not done) ends it as ``node_lost``. Pure."""
    if view.failed is not None and view.failed.round >= r:
        return _cause(view.failed.cause), (
            f"round {view.failed.round} marked failed by {view.failed.node}: {view.failed.detail}"
        )
    if view.round is not None and view.round.round > r:
        return _cause(view.round.reason), f"round {view.round.round} superseded round {r}"
    lost = [n for n in nodes if n not in view.agents and view.done.get(n) != r]
    if lost:
        return Cause.NODE_LOST, f"the agent of {', '.join(lost)} is gone (lease expired or revoked)"
    return None, ""


def newcomers_that_fit(view: RoundView, nodes: tuple[str, ...], config: AgentConfig) -> list[str]:
    """Waiting nodes, alive and with this node's nproc, that a restart of ``nodes`` would take in
    (in arrival order, as many as max_workers leaves room for). Pure."""
    _, max_nodes = node_bounds(config)
    room = max_nodes - len(nodes)
    fit = [
        n
        for n in sorted(view.waiting, key=lambda n: (view.waiting_order.get(n, 0), n))
        if n not in nodes and n in view.agents and view.waiting[n].nproc == config.nproc_per_node
    ]
    return fit[: max(0, room)]


def decide(local: Local, view: RoundView, now: float, config: AgentConfig) -> Action:
    """What the agent does next. Pure: no I/O, no clock reads."""
    phase = local.phase
    if phase is Phase.STOPPING:
        return _stopping(local, view, now, config)
    if phase is Phase.RUNNING:
        return _running(local, view, now, config)
    if local.stop_requests:
        rnd = view.round
        if (
            phase is Phase.JOINING
            and rnd is not None
            and local.node in rnd.nodes
            and rnd.round > local.round
            and round_broken(view, rnd.round, rnd.nodes)[0] is None
        ):
            # A round that includes this node was published just now: end it as a leave, so that
            # the others do not take the departure for a lost node (which would use their budget).
            return Action(
                ActionKind.MARK_FAILED,
                f"the agent of {local.node} was asked to stop",
                round=rnd.round,
                cause=str(Cause.NODE_LEFT),
                expected_revision=view.failed_revision,
            )
        return Action(ActionKind.EXIT, "left the job (stop requested)", exit_code=EXIT_OK)
    if phase is Phase.REJOIN:
        if now < local.restart_at:
            return Action(ActionKind.WAIT, "restart backoff", until=local.restart_at)
        return Action(ActionKind.REGISTER, "ready for the next round")
    if phase is Phase.FINISHING:
        return _finishing(local, view, now, config)
    return _joining(local, view, now, config)


def _running(local: Local, view: RoundView, now: float, config: AgentConfig) -> Action:
    r = local.round
    cause: Cause | None
    if local.failure:
        cause, detail = Cause.WORKER_FAILED, f"{local.node}: {local.failure}"
    elif local.stop_requests:
        cause, detail = Cause.NODE_LEFT, f"the agent of {local.node} was asked to stop"
    else:
        # (a round record that does not parse is garbage written by hand: not a reason to stop)
        cause, detail = round_broken(view, r, local.nodes)
        if cause is None:
            fit = newcomers_that_fit(view, local.nodes, config)
            if fit:
                cause, detail = Cause.JOIN, f"{', '.join(fit)} waiting to join"
    if cause is not None:
        return _end_round(view, r, cause, detail, until=now + config.timeouts.shutdown_grace_s)
    if local.running == 0 and local.succeeded >= config.nproc_per_node:
        return Action(ActionKind.MARK_DONE, f"every worker of {local.node} exited 0", round=r)
    return Action(ActionKind.WAIT, "supervising")


def _end_round(view: RoundView, r: int, cause: Cause, detail: str, until: float) -> Action:
    """Round ``r`` must end: mark it failed first (unless a failed mark or a newer round already
    ended it), then stop this node's workers, the SIGKILL due at ``until``, with the recorded cause."""
    superseded = view.round is not None and view.round.round > r
    if view.failed_round < r and not superseded:
        return Action(ActionKind.MARK_FAILED, detail, round=r, cause=str(cause), expected_revision=view.failed_revision)
    recorded = view.failed.cause if view.failed is not None and view.failed.round == r else str(cause)
    return Action(ActionKind.TERMINATE, detail, cause=recorded, until=until)


def _stopping(local: Local, view: RoundView, now: float, config: AgentConfig) -> Action:
    if local.running > 0:
        deadline = local.terminate_deadline if local.terminate_deadline is not None else now
        step = stop_ladder(
            now,
            terminate_deadline=deadline,
            kill_deadline=local.kill_deadline,
            stop_requests=local.stop_requests,
            grace_s=config.timeouts.shutdown_grace_s,
            kill_wait_s=config.kill_wait_s,
        )
        if step.rung is Rung.GIVE_UP:
            return Action(ActionKind.EXIT, step.reason, exit_code=EXIT_FATAL)
        kind = ActionKind.KILL if step.rung is Rung.KILL else ActionKind.WAIT
        return Action(kind, step.reason, until=step.until)
    if local.stop_requests:
        return Action(ActionKind.EXIT, "left the job (stop requested)", exit_code=EXIT_OK)
    if local.cause not in COUNTED_CAUSES:
        return Action(ActionKind.RESTART, f"round {local.round} ended ({local.cause}): rejoin", until=now)
    recent = restarts_in_window(local.restarts, now, config.restart_window_s)
    if recent >= config.max_restarts:
        return Action(
            ActionKind.EXIT,
            f"restarts_exhausted: round {local.round} ended ({local.cause}); "
            f"{recent} restarts in the last {config.restart_window_s:g} s "
            f"(max_restarts {config.max_restarts})",
            exit_code=EXIT_FATAL,
        )
    delay = restart_backoff_s(recent, config.restart_backoff_initial_s, config.restart_backoff_max_s)
    return Action(
        ActionKind.RESTART,
        f"round {local.round} ended ({local.cause}): restart in {delay:g} s",
        until=now + delay,
        counted=True,
    )


def _finishing(local: Local, view: RoundView, now: float, config: AgentConfig) -> Action:
    r = local.round
    if view.finished >= r:
        return Action(ActionKind.EXIT, "workers_finished", exit_code=EXIT_OK)
    cause, detail = round_broken(view, r, local.nodes)
    if cause is not None:
        # The round ended after this node finished: every worker runs again (torchrun does the
        # same); they load their checkpoint and finish at once.
        return _end_round(view, r, cause, detail, until=now)
    if all(view.done.get(n) == r for n in local.nodes):
        return Action(ActionKind.MARK_FINISHED, f"every node of round {r} is done", round=r)
    until = local.phase_since + config.timeouts.join_s
    if now >= until:
        return Action(
            ActionKind.EXIT,
            f"workers_finished (the other nodes did not report done within join_s, {config.timeouts.join_s:g} s)",
            exit_code=EXIT_OK,
        )
    return Action(ActionKind.WAIT, "waiting for the other nodes to finish", until=until)


def _joining(local: Local, view: RoundView, now: float, config: AgentConfig) -> Action:
    me = local.node
    rnd = view.round
    if view.finished and (rnd is None or view.finished >= rnd.round):
        return Action(ActionKind.EXIT, f"job_already_finished: round {view.finished} finished", exit_code=EXIT_OK)
    if rnd is not None and me in rnd.nodes and rnd.round > local.round:
        if round_broken(view, rnd.round, rnd.nodes)[0] is None:  # (one that failed at once: skip it)
            return Action(ActionKind.START, f"round {rnd.round} includes {me}", record=rnd)
    if me not in view.waiting or me not in view.agents:
        return Action(ActionKind.REGISTER, "my waiting record is gone")
    order = sorted(view.waiting, key=lambda n: (view.waiting_order.get(n, 0), n))
    alive = [n for n in order if n in view.agents]
    job_nproc = rnd.nproc_per_node if rnd is not None else view.waiting[alive[0]].nproc
    if view.waiting[me].nproc != job_nproc:
        return Action(
            ActionKind.EXIT,
            f"nproc_mismatch: this node runs {view.waiting[me].nproc} workers per node, the job {job_nproc}",
            exit_code=EXIT_FATAL,
        )
    cands = [n for n in alive if view.waiting[n].nproc == job_nproc]
    min_nodes, max_nodes = node_bounds(config)
    old = rnd.nodes if rnd is not None else ()
    if rnd is not None:
        cause, _ = round_broken(view, rnd.round, rnd.nodes)
        if cause is None:
            return Action(
                ActionKind.WAIT,
                f"round {rnd.round} is running; its agents restart it to take in newcomers while it has room",
            )
        # The live nodes of the ended round come once their workers are stopped, which takes at
        # most shutdown_grace_s + kill_wait_s after they saw the round end.
        missing = [n for n in old if n in view.agents and n not in cands]
        last_call = (
            max(local.phase_since, local.view_changed_at) + config.timeouts.shutdown_grace_s + config.kill_wait_s
        )
        if missing and now < last_call:
            return Action(ActionKind.WAIT, f"last call for {missing} (stopping their workers)", until=last_call)
    if len(cands) < min_nodes:
        closes = local.phase_since + config.timeouts.join_s
        if now >= closes:
            return Action(
                ActionKind.EXIT,
                f"rendezvous_closed: {len(cands)} node(s) waiting < {min_nodes} "
                f"(min_workers {config.world.min_workers}) for join_s ({config.timeouts.join_s:g} s)",
                exit_code=EXIT_FATAL,
            )
        return Action(ActionKind.WAIT, f"{len(cands)} node(s) waiting < {min_nodes}", until=closes)
    newcomers = [n for n in cands if n not in old]
    settle = local.candidates_changed_at + config.timeouts.join_window_s
    if newcomers and len(cands) < max_nodes and now < settle:
        return Action(ActionKind.WAIT, "join window open", until=settle)
    chosen = ([n for n in old if n in cands] + newcomers)[:max_nodes]
    if rnd is None:
        reason = "start"
    else:
        cause, _ = round_broken(view, rnd.round, rnd.nodes)
        reason = str(cause)
    counted = (
        rnd is not None
        and view.failed is not None
        and view.failed.round == rnd.round
        and (view.failed.cause in COUNTED_CAUSES)
    )
    head = view.waiting[chosen[0]]
    record = RoundRecord(
        round=view.highest_round + 1,
        nodes=tuple(chosen),
        nproc_per_node=job_nproc,
        master_addr=head.host,
        master_port=head.port,
        restart_count=(rnd.restart_count if rnd is not None else 0) + (1 if counted else 0),
        reason=reason,
    )
    return Action(
        ActionKind.PUBLISH, reason, record=record, expected_revision=view.round_revision, consumed=tuple(chosen)
    )
