"""Restart mode: run unmodified torchrun scripts, and restart every worker of the job on any failure.

Owns the agents' own rendezvous of restart mode (``AgentConfig.mode = "restart"``), its pure
decision ``decide(local, view, now, config)`` and the executor ``GroupRestartAgent``. The workers
are ordinary torchrun scripts: they read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_RUN_ID`` (``worker_environ``), build their own
process group and load their own checkpoint. What it does, as torchrun's elastic agent does:

* the agents of a job meet under ``<prefix>/<job>/restart/`` in etcd. Each one holds a lease, keeps
  ``agents/<node>`` under it, and writes ``waiting/<node>`` (its ``nproc_per_node``, address and a
  free port it picked) when it wants into the next *round*. A round (``round``: the nodes in node
  rank order, the master address and port from node rank 0's waiting record) is published by
  compare-and-set on its ``mod_revision``, consuming the waiting records it takes. A round needs at
  least ``min_workers`` workers and takes at most ``max_workers`` (whole nodes); newcomers get a
  ``join_window_s`` to arrive together;
* each agent starts its ``nproc_per_node`` workers of the round. When one of them fails (exits
  non-zero, is killed, cannot start), a node's agent disappears (lease gone), a node leaves
  (SIGTERM) or a new node waits to join and fits, an agent of the round marks it failed
  (``failed``, compare-and-set: the first cause stays). Every agent of the round then stops its
  workers (SIGTERM, SIGKILL after ``shutdown_grace_s``) and rejoins; a new round starts every worker
  again. Restarts caused by a failure (``worker_failed``, ``node_lost``) count against
  ``max_restarts`` per ``restart_window_s`` with the same backoff as elastic mode; when the budget
  is spent the agent exits 1 (``restarts_exhausted``). Joins and leaves do not count;
* when every worker of a node exits 0 its agent writes ``done/<node>``; when every node of the
  round is done, ``finished`` is written and the agents exit 0;
* SIGTERM: the agent marks the round failed (``node_left``), stops its workers, revokes its lease
  and exits 0; the others form a smaller round if it has at least ``min_workers``.

The loop reads the restart prefix every ``poll_interval_s`` (a worker's exit and a signal wake it
at once), so every sleep is bounded; the phases are bounded by ``join_s`` (too few nodes, or the
others not reporting done), ``shutdown_grace_s`` + ``kill_wait_s`` (stopping), and the backoff. A
spare node (the job is at ``max_workers``) waits for room without a deadline, as under torchrun.
Never imports torch.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import time
from dataclasses import dataclass, replace
from enum import StrEnum

import structlog

from elasticd.agent.elastic import (
    EXIT_FATAL,
    EXIT_OK,
    AgentOutcome,
    Waker,
    restart_backoff_s,
    restarts_in_window,
)
from elasticd.agent.sdnotify import Notifier
from elasticd.agent.supervisor import ExitKind, Supervisor, WorkerExit
from elasticd.config import AgentConfig, child_environ
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.log import bind_context
from elasticd.retry import Clock
from elasticd.store.kv import KeyValueStore
from elasticd.wire.records import encode
from elasticd.wire.restart import (
    COUNTED_CAUSES,
    AgentRecord,
    Cause,
    DoneRecord,
    FailedRecord,
    FinishedRecord,
    RestartKeys,
    RoundRecord,
    RoundView,
    WaitingRecord,
    parse_view,
)

log = structlog.get_logger(__name__)


# ---------------------------------------------------------------------------------------------
# The pure decision


class Phase(StrEnum):
    """This agent's phase."""

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
            f"round {view.failed.round} marked failed by {view.failed.node}: {view.failed.detail}")
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
    fit = [n for n in sorted(view.waiting, key=lambda n: (view.waiting_order.get(n, 0), n))
           if n not in nodes and n in view.agents and view.waiting[n].nproc == config.nproc_per_node]
    return fit[:max(0, room)]


def decide(local: Local, view: RoundView, now: float, config: AgentConfig) -> Action:
    """What the agent does next. Pure: no I/O, no clock reads."""
    phase = local.phase
    if phase is Phase.STOPPING:
        return _stopping(local, view, now, config)
    if phase is Phase.RUNNING:
        return _running(local, view, now, config)
    if local.stop_requests:
        rnd = view.round
        if (phase is Phase.JOINING and rnd is not None and local.node in rnd.nodes and rnd.round > local.round
                and round_broken(view, rnd.round, rnd.nodes)[0] is None):
            # A round that includes this node was published just now: end it as a leave, so that
            # the others do not take the departure for a lost node (which would use their budget).
            return Action(ActionKind.MARK_FAILED, f"the agent of {local.node} was asked to stop", round=rnd.round,
                          cause=str(Cause.NODE_LEFT), expected_revision=view.failed_revision)
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
        superseded = view.round is not None and view.round.round > r
        if view.failed_round < r and not superseded:
            return Action(ActionKind.MARK_FAILED, detail, round=r, cause=str(cause),
                          expected_revision=view.failed_revision)
        recorded = view.failed.cause if view.failed is not None and view.failed.round == r else str(cause)
        return Action(ActionKind.TERMINATE, detail, cause=recorded,
                      until=now + config.timeouts.shutdown_grace_s)
    if local.running == 0 and local.succeeded >= config.nproc_per_node:
        return Action(ActionKind.MARK_DONE, f"every worker of {local.node} exited 0", round=r)
    return Action(ActionKind.WAIT, "supervising")


def _stopping(local: Local, view: RoundView, now: float, config: AgentConfig) -> Action:
    if local.running > 0:
        if local.kill_deadline is not None:
            if now >= local.kill_deadline:
                return Action(ActionKind.EXIT, f"workers_not_reaped: workers outlived SIGKILL by kill_wait_s "
                              f"({config.kill_wait_s:g} s)", exit_code=EXIT_FATAL)
            return Action(ActionKind.WAIT, "waiting for killed workers to be reaped", until=local.kill_deadline)
        if local.stop_requests >= 2:
            return Action(ActionKind.KILL, "a second stop request", until=now + config.kill_wait_s)
        deadline = local.terminate_deadline if local.terminate_deadline is not None else now
        if now >= deadline:
            return Action(ActionKind.KILL, f"workers still running after shutdown_grace_s "
                          f"({config.timeouts.shutdown_grace_s:g} s)", until=now + config.kill_wait_s)
        return Action(ActionKind.WAIT, "waiting for the workers to stop", until=deadline)
    if local.stop_requests:
        return Action(ActionKind.EXIT, "left the job (stop requested)", exit_code=EXIT_OK)
    if local.cause not in COUNTED_CAUSES:
        return Action(ActionKind.RESTART, f"round {local.round} ended ({local.cause}): rejoin", until=now)
    recent = restarts_in_window(local.restarts, now, config.restart_window_s)
    if recent >= config.max_restarts:
        return Action(ActionKind.EXIT, f"restarts_exhausted: round {local.round} ended ({local.cause}); "
                      f"{recent} restarts in the last {config.restart_window_s:g} s "
                      f"(max_restarts {config.max_restarts})", exit_code=EXIT_FATAL)
    delay = restart_backoff_s(recent, config.restart_backoff_initial_s, config.restart_backoff_max_s)
    return Action(ActionKind.RESTART, f"round {local.round} ended ({local.cause}): restart in {delay:g} s",
                  until=now + delay, counted=True)


def _finishing(local: Local, view: RoundView, now: float, config: AgentConfig) -> Action:
    r = local.round
    if view.finished >= r:
        return Action(ActionKind.EXIT, "workers_finished", exit_code=EXIT_OK)
    cause, detail = round_broken(view, r, local.nodes)
    if cause is not None:
        superseded = view.round is not None and view.round.round > r
        if view.failed_round < r and not superseded:
            return Action(ActionKind.MARK_FAILED, detail, round=r, cause=str(cause),
                          expected_revision=view.failed_revision)
        # The round ended after this node finished: every worker runs again (torchrun does the
        # same); they load their checkpoint and finish at once.
        recorded = view.failed.cause if view.failed is not None and view.failed.round == r else str(cause)
        return Action(ActionKind.TERMINATE, detail, cause=recorded, until=now)
    if all(view.done.get(n) == r for n in local.nodes):
        return Action(ActionKind.MARK_FINISHED, f"every node of round {r} is done", round=r)
    until = local.phase_since + config.timeouts.join_s
    if now >= until:
        return Action(ActionKind.EXIT, f"workers_finished (the other nodes did not report done within join_s, "
                      f"{config.timeouts.join_s:g} s)", exit_code=EXIT_OK)
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
        return Action(ActionKind.EXIT, f"nproc_mismatch: this node runs {view.waiting[me].nproc} workers per node, "
                      f"the job {job_nproc}", exit_code=EXIT_FATAL)
    cands = [n for n in alive if view.waiting[n].nproc == job_nproc]
    min_nodes, max_nodes = node_bounds(config)
    old = rnd.nodes if rnd is not None else ()
    if rnd is not None:
        cause, _ = round_broken(view, rnd.round, rnd.nodes)
        if cause is None:
            return Action(ActionKind.WAIT, f"round {rnd.round} is running; its agents restart it to take in "
                          f"newcomers while it has room")
        # The live nodes of the ended round come once their workers are stopped, which takes at
        # most shutdown_grace_s + kill_wait_s after they saw the round end.
        missing = [n for n in old if n in view.agents and n not in cands]
        last_call = (max(local.phase_since, local.view_changed_at) + config.timeouts.shutdown_grace_s
                     + config.kill_wait_s)
        if missing and now < last_call:
            return Action(ActionKind.WAIT, f"last call for {missing} (stopping their workers)", until=last_call)
    if len(cands) < min_nodes:
        closes = local.phase_since + config.timeouts.join_s
        if now >= closes:
            return Action(ActionKind.EXIT, f"rendezvous_closed: {len(cands)} node(s) waiting < {min_nodes} "
                          f"(min_workers {config.world.min_workers}) for join_s ({config.timeouts.join_s:g} s)",
                          exit_code=EXIT_FATAL)
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
    counted = rnd is not None and view.failed is not None and view.failed.round == rnd.round and (
        view.failed.cause in COUNTED_CAUSES)
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
    return Action(ActionKind.PUBLISH, reason, record=record, expected_revision=view.round_revision,
                  consumed=tuple(chosen))


# ---------------------------------------------------------------------------------------------
# The executor


def pick_free_port() -> int:
    """A TCP port free on every interface now (the master's store binds it when the round starts)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class GroupRestartAgent:
    """The executor of restart mode: applies ``decide``'s actions until it says exit."""

    def __init__(
        self,
        config: AgentConfig,
        store: KeyValueStore,
        supervisor: Supervisor | None = None,
        clock: Clock = time.monotonic,
        notifier: Notifier | None = None,
        watchdog_s: float | None = None,
    ) -> None:
        """
        Args:
            notifier: where READY/WATCHDOG/STATUS/STOPPING go (systemd); None: nowhere.
            watchdog_s: ping the watchdog this often (half of systemd's WatchdogSec); None: never.
        """
        self._config = config
        self._store = store
        self._clock = clock
        self._supervisor = supervisor or Supervisor(clock)
        self._notifier = notifier or Notifier(None)
        self._watchdog_s = watchdog_s
        self._keys = RestartKeys(config.etcd.prefix, config.world.job_id)
        self.local = Local(node=config.node_id, phase_since=clock())
        self._lease = 0
        self._next_refresh = float("-inf")
        self._last_ping = float("-inf")
        self._ready_sent = False
        self._stopping_sent = False
        self._last_candidates: frozenset[str] = frozenset()
        self._last_shape: tuple[int, int, frozenset[str]] = (0, 0, frozenset())
        self._warned: set[str] = set()
        self._failed_at: float | None = None  # when this agent saw its last round end (for recovery_s)
        self._waker: Waker | None = None
        self._pending_stop = 0

    def request_stop(self) -> None:
        """Ask the agent to leave, as SIGTERM does (for callers that are not signals)."""
        self._pending_stop += 1
        if self._waker is not None:
            self._waker.poke()

    def run(self, install_signals: bool = True) -> AgentOutcome:
        """Run until the job is done, this node leaves, or the agent must give up.

        Args:
            install_signals: handle SIGTERM/SIGINT/SIGCHLD (only possible in the main thread).

        Returns:
            The exit code (0 done or left, 1 fatal) and the reason.
        """
        c = self._config
        bind_context(node=c.node_id)
        log.info("agent_started", mode="restart", job=c.world.job_id, node=c.node_id, program=list(c.program),
                 nproc_per_node=c.nproc_per_node, min_workers=c.world.min_workers,
                 max_workers=c.world.max_workers, etcd=list(c.etcd.endpoints), max_restarts=c.max_restarts,
                 restart_window_s=c.restart_window_s)
        with Waker(install_signals) as waker:
            self._waker = waker
            try:
                outcome = self._run(waker)
            finally:
                self._waker = None
        level = log.info if outcome.exit_code == EXIT_OK else log.error
        level("agent_stopped", exit_code=outcome.exit_code, reason=outcome.reason)
        return outcome

    def _run(self, waker: Waker) -> AgentOutcome:
        c = self._config
        try:
            self._register_agent()
        except EtcdUnavailable as exc:
            return AgentOutcome(EXIT_FATAL, f"etcd_unreachable: {exc}")
        try:
            return self._loop(waker)
        except Exception as exc:  # the top-level loop: any surprise becomes a fatal stop
            log.error("agent_failed", error=repr(exc), exc_info=True)
            return AgentOutcome(EXIT_FATAL, f"agent_failed: {exc!r}")
        finally:
            self._supervisor.terminate_all(c.timeouts.shutdown_grace_s, c.kill_wait_s)
            self._leave()

    def _loop(self, waker: Waker) -> AgentOutcome:
        c = self._config
        while True:
            now = self._clock()
            self._observe(waker, now)
            self._keepalive(now)
            self._ping(now)
            try:
                view = self._read_view(now)
            except EtcdUnavailable as exc:
                log.warning("etcd_read_failed", error=str(exc))
                waker.wait(c.poll_interval_s)
                continue
            action = decide(self.local, view, now, c)
            if action.kind is ActionKind.WAIT:
                timeout = min(c.poll_interval_s, max(0.0, self._next_refresh - now))
                if self._watchdog_s is not None:
                    timeout = min(timeout, max(0.0, self._last_ping + self._watchdog_s - now))
                if action.until is not None:
                    timeout = min(timeout, max(0.0, action.until - now))
                waker.wait(timeout)
                continue
            if action.kind is ActionKind.EXIT:
                return AgentOutcome(action.exit_code, action.reason)
            try:
                self._apply(action, view, now)
            except LeaseLost:
                # The others may already have ended this node's round (node_lost); decide sees that.
                log.warning("lease_expired", lease=self._lease)
                self._reregister()
            except EtcdUnavailable as exc:
                log.warning("etcd_write_failed", action=str(action.kind), error=str(exc))
                waker.wait(c.poll_interval_s)

    # -- observing ----------------------------------------------------------------------------

    def _observe(self, waker: Waker, now: float) -> None:
        requests = waker.stop_requests + self._pending_stop
        if requests != self.local.stop_requests:
            log.info("stop_signal_received", count=requests, phase=str(self.local.phase))
            self.local = replace(self.local, stop_requests=requests)
            if not self._stopping_sent:
                self._notifier.stopping()
                self._stopping_sent = True
        for e in self._supervisor.poll():
            self._on_exit(e)

    def _on_exit(self, e: WorkerExit) -> None:
        loc = self.local
        expected = loc.phase is not Phase.RUNNING
        level = log.info if e.ok or expected else log.warning
        level("worker_exited", local_rank=e.local_rank, pid=e.pid, kind=str(e.kind), code=e.code,
              signal=e.signal, runtime_s=e.runtime_s, how=e.describe(), round=loc.round)
        failure = loc.failure
        if not e.ok and not expected and not failure:
            failure = f"worker {e.local_rank} (pid {e.pid}) {e.describe()}"
        self.local = replace(loc, running=max(0, loc.running - 1), succeeded=loc.succeeded + (1 if e.ok else 0),
                             failure=failure)

    def _read_view(self, now: float) -> RoundView:
        view = parse_view(self._keys, self._store.get_prefix(self._keys.prefix))
        for bad in view.malformed:
            if bad not in self._warned:
                self._warned.add(bad)
                log.error("malformed_record_ignored", record=bad)
        cands = frozenset(n for n in view.waiting if n in view.agents)
        if cands != self._last_candidates:
            self._last_candidates = cands
            self.local = replace(self.local, candidates_changed_at=now)
        shape = (view.round.round if view.round else 0, view.failed_round, frozenset(view.agents))
        if shape != self._last_shape:
            self._last_shape = shape
            self.local = replace(self.local, view_changed_at=now)
        return view

    # -- the lease ----------------------------------------------------------------------------

    def _register_agent(self) -> None:
        c = self._config
        self._lease = self._store.grant_lease(c.timeouts.lease_ttl_s)
        self._store.put(self._keys.agent(c.node_id), encode(AgentRecord(c.node_id, os.getpid(), c.advertise_addr)),
                        lease=self._lease)
        self._next_refresh = self._clock() + c.timeouts.keepalive_s
        log.info("agent_registered", lease=self._lease)

    def _keepalive(self, now: float) -> None:
        if now < self._next_refresh:
            return
        self._next_refresh = now + self._config.timeouts.keepalive_s
        try:
            ttl = self._store.refresh_lease(self._lease)
        except LeaseLost:
            ttl = 0.0
        except EtcdUnavailable as exc:
            log.warning("lease_refresh_failed", error=str(exc))
            return
        if ttl <= 0:
            # The others may already have ended this node's round (node_lost); decide sees that.
            log.warning("lease_expired", lease=self._lease)
            self._reregister()

    def _reregister(self) -> None:
        """A new lease and agent record (the waiting record, if wanted, is rewritten by decide)."""
        try:
            self._register_agent()
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("agent_register_failed", error=str(exc))  # the next keepalive tries again

    def _leave(self) -> None:
        try:
            self._store.revoke_lease(self._lease)
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("lease_revoke_failed", error=str(exc))

    def _ping(self, now: float) -> None:
        if self._watchdog_s is not None and now - self._last_ping >= self._watchdog_s:
            self._notifier.watchdog()
            self._last_ping = now

    # -- acting -------------------------------------------------------------------------------

    def _apply(self, action: Action, view: RoundView, now: float) -> None:
        c = self._config
        loc = self.local
        kind = action.kind
        if kind is ActionKind.REGISTER:
            rec = WaitingRecord(c.node_id, c.nproc_per_node, c.advertise_addr, pick_free_port(), loc.round)
            self._store.put(self._keys.waiting(c.node_id), encode(rec), lease=self._lease)
            if loc.phase is not Phase.JOINING:
                self.local = replace(loc, phase=Phase.JOINING, phase_since=now)
            log.info("round_wanted", port=rec.port, last_round=loc.round, reason=action.reason)
        elif kind is ActionKind.PUBLISH:
            assert action.record is not None
            won = self._store.compare_and_put(self._keys.round, action.expected_revision, encode(action.record),
                                              delete_keys=[self._keys.waiting(n) for n in action.consumed])
            if won:
                r = action.record
                log.info("round_published", round=r.round, nodes=list(r.nodes), world_size=r.world_size,
                         master=f"{r.master_addr}:{r.master_port}", restart_count=r.restart_count, cause=r.reason)
        elif kind is ActionKind.START:
            assert action.record is not None
            self._start(action.record, now)
        elif kind is ActionKind.MARK_FAILED:
            failed = FailedRecord(action.round, c.node_id, action.cause, action.reason[:300])
            won = self._store.compare_and_put(self._keys.failed, action.expected_revision, encode(failed))
            if won:
                log.warning("round_failed", round=action.round, cause=action.cause, detail=action.reason)
        elif kind is ActionKind.MARK_DONE:
            self._store.put(self._keys.done(c.node_id), encode(DoneRecord(c.node_id, action.round)))
            self.local = replace(loc, phase=Phase.FINISHING, phase_since=now)
            log.info("node_done", round=action.round)
        elif kind is ActionKind.MARK_FINISHED:
            self._store.put(self._keys.finished, encode(FinishedRecord(action.round)))
            log.info("job_finished", round=action.round)
        elif kind is ActionKind.TERMINATE:
            pids = self._supervisor.send_signal(signal.SIGTERM)
            log.info("workers_stopping", round=loc.round, cause=action.cause, pids=pids,
                     grace_s=c.timeouts.shutdown_grace_s, reason=action.reason)
            if self._failed_at is None:
                self._failed_at = now
            self.local = replace(loc, phase=Phase.STOPPING, phase_since=now, cause=action.cause,
                                 terminate_deadline=action.until, kill_deadline=None)
        elif kind is ActionKind.KILL:
            pids = self._supervisor.kill()
            log.warning("workers_killed", pids=pids, reason=action.reason)
            self.local = replace(loc, kill_deadline=action.until)
        elif kind is ActionKind.RESTART:
            restarts = loc.restarts
            if action.counted:
                restarts = (*(t for t in restarts if now - t < c.restart_window_s), now)  # bounded
            log.info("round_left", round=loc.round, cause=loc.cause, counted=action.counted,
                     restarts_in_window=len(restarts) if action.counted else None,
                     max_restarts=c.max_restarts, reason=action.reason)
            self.local = replace(loc, phase=Phase.REJOIN, phase_since=now, restart_at=action.until or now,
                                 restarts=restarts, terminate_deadline=None, kill_deadline=None)

    def _start(self, record: RoundRecord, now: float) -> None:
        c = self._config
        group_rank = record.nodes.index(c.node_id)
        bind_context(round=record.round)
        self.local = replace(self.local, phase=Phase.RUNNING, phase_since=now, round=record.round,
                             nodes=record.nodes, running=0, succeeded=0, failure="", cause="")
        run_id = c.world.job_id
        for lr in range(c.nproc_per_node):
            env = child_environ(worker_environ(record, c.node_id, lr, run_id, c.max_restarts))
            try:
                pid = self._supervisor.spawn(lr, c.program, env)
            except OSError as exc:
                e = WorkerExit(lr, 0, ExitKind.SPAWN_FAILED, detail=f"{c.program[0]}: {exc}")
                self.local = replace(self.local, running=self.local.running + 1)
                self._on_exit(e)
                continue
            self.local = replace(self.local, running=self.local.running + 1)
            log.info("worker_started", local_rank=lr, pid=pid, rank=group_rank * record.nproc_per_node + lr,
                     round=record.round)
        recovery = None if self._failed_at is None else round(now - self._failed_at, 3)
        self._failed_at = None
        log.info("round_started", round=record.round, node_rank=group_rank, world_size=record.world_size,
                 nodes=list(record.nodes), master=f"{record.master_addr}:{record.master_port}",
                 restart_count=record.restart_count, since_round_ended_s=recovery)
        if not self._ready_sent:
            self._notifier.ready()
            self._ready_sent = True
        self._notifier.status(f"round {record.round}, world {record.world_size} "
                              f"[{c.world.min_workers}..{c.world.max_workers}], node rank {group_rank}, "
                              f"restarts {record.restart_count}")

