"""Restart mode: run unmodified torchrun scripts, and restart every worker of the job on any failure.

Owns the executor of restart mode (``AgentConfig.mode = "restart"``), ``GroupRestartAgent``: it
applies the actions of the pure ``restart_decide.decide(local, view, now, config)`` (where
``Phase`` and its transitions live) to etcd and the workers, inside the daemon skeleton it shares
with elastic mode (``daemon.AgentDaemon``); it never decides itself. The workers are ordinary
torchrun scripts: they read ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT`` and
``TORCHELASTIC_RUN_ID`` (``restart_decide.worker_environ``), build their own process group and load
their own checkpoint. What it does, as torchrun's elastic agent does:

* the agents of a job meet under ``<prefix>/<job>/restart/`` in etcd (``Keys.restart_*``). Each
  one holds a lease, keeps ``agents/<node>`` under it, and writes ``waiting/<node>`` (its ``nproc_per_node``, address and a
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

import os
import random
import signal
import socket
import time
from dataclasses import replace

import structlog

from elasticd.agent.daemon import AgentDaemon, AgentOutcome, Waker
from elasticd.agent.restart_decide import (
    Action,
    ActionKind,
    Local,
    Phase,
    decide,
    worker_environ,
)
from elasticd.agent.sdnotify import Notifier
from elasticd.agent.supervisor import Supervisor, WorkerExit
from elasticd.config import AgentConfig
from elasticd.errors import EtcdUnavailable, LeaseLost, PermissionDenied
from elasticd.log import bind_context
from elasticd.retry import Clock
from elasticd.settings import child_environ
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import encode
from elasticd.wire.restart import (
    AgentRecord,
    DoneRecord,
    FailedRecord,
    FinishedRecord,
    RoundRecord,
    RoundView,
    WaitingRecord,
    parse_view,
)

log = structlog.get_logger(__name__)


PORT_PICK_ATTEMPTS = 50  # random ports tried below the ephemeral range before taking the kernel's
PORT_PICK_LOW = 10000  # the lowest port tried


def pick_free_port(ephemeral_low: int | None = None) -> int:
    """A TCP port free on every interface now (the master's store binds it when the round starts).

    Taken below the kernel's ephemeral range (``ip_local_port_range``) where one is free: a port
    the kernel hands out (bind to 0) may be given to an outgoing connection before the worker
    binds it, which failed a round now and then (``EADDRINUSE``). The kernel's pick is the fallback.
    """
    low = ephemeral_low if ephemeral_low is not None else _ephemeral_low()
    rng = random.Random()
    for _ in range(PORT_PICK_ATTEMPTS if low > PORT_PICK_LOW else 0):
        port = rng.randrange(PORT_PICK_LOW, low)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


class GroupRestartAgent(AgentDaemon):
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
        """The arguments are ``AgentDaemon``'s."""
        super().__init__(config, store, supervisor, clock, notifier, watchdog_s)
        self._keys = Keys(config.etcd.prefix, config.world.job_id)
        self.local = Local(node=config.node_id, phase_since=clock())
        self._lease = 0
        self._next_refresh = float("-inf")
        self._last_candidates: frozenset[str] = frozenset()
        self._last_shape: tuple[int, int, frozenset[str]] = (0, 0, frozenset())
        self._warned: set[str] = set()
        self._failed_at: float | None = None  # when this agent saw its last round end (for recovery_s)

    def _started_fields(self) -> dict[str, object]:
        return {"mode": "restart", **super()._started_fields()}

    def _serve(self, waker: Waker) -> AgentOutcome:
        c = self._config
        outcome = self._until_etcd_answers(waker, self._register_agent)
        if isinstance(outcome, AgentOutcome):
            return outcome
        try:
            return self._guarded_loop(waker, stop_workers=False)
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
                waker.wait(self._sleep_s(now, action.until, self._next_refresh))
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
        requests = self._stop_requests(waker)
        if requests != self.local.stop_requests:
            log.info("stop_signal_received", count=requests, phase=str(self.local.phase))
            self.local = replace(self.local, stop_requests=requests)
            self._notify_stopping()
        for e in self._supervisor.poll():
            self._on_exit(e)

    def _on_exit(self, e: WorkerExit) -> None:
        loc = self.local
        expected = loc.phase is not Phase.RUNNING
        level = log.info if e.ok or expected else log.warning
        level(
            "worker_exited",
            local_rank=e.local_rank,
            pid=e.pid,
            kind=str(e.kind),
            code=e.code,
            signal=e.signal,
            runtime_s=e.runtime_s,
            how=e.describe(),
            round=loc.round,
        )
        failure = loc.failure
        if not e.ok and not expected and not failure:
            failure = f"worker {e.local_rank} (pid {e.pid}) {e.describe()}"
        self.local = replace(
            loc, running=max(0, loc.running - 1), succeeded=loc.succeeded + (1 if e.ok else 0), failure=failure
        )

    def _read_view(self, now: float) -> RoundView:
        view = parse_view(self._keys, self._store.get_prefix(self._keys.restart_prefix))
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
        record = AgentRecord(c.node_id, os.getpid(), c.advertise_addr)
        self._store.put(self._keys.restart_agent(c.node_id), encode(record), lease=self._lease)
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
        except (EtcdUnavailable, LeaseLost, PermissionDenied) as exc:
            log.warning("lease_revoke_failed", error=str(exc))

    # -- acting -------------------------------------------------------------------------------

    def _apply(self, action: Action, view: RoundView, now: float) -> None:
        c = self._config
        loc = self.local
        kind = action.kind
        if kind is ActionKind.REGISTER:
            rec = WaitingRecord(c.node_id, c.nproc_per_node, c.advertise_addr, pick_free_port(), loc.round)
            self._store.put(self._keys.restart_waiting(c.node_id), encode(rec), lease=self._lease)
            if loc.phase is not Phase.JOINING:
                self.local = replace(loc, phase=Phase.JOINING, phase_since=now)
            log.info("round_wanted", port=rec.port, last_round=loc.round, reason=action.reason)
        elif kind is ActionKind.PUBLISH:
            assert action.record is not None
            won = self._store.compare_and_put(
                self._keys.restart_round,
                action.expected_revision,
                encode(action.record),
                delete_keys=[self._keys.restart_waiting(n) for n in action.consumed],
            )
            if won:
                r = action.record
                log.info(
                    "round_published",
                    round=r.round,
                    nodes=list(r.nodes),
                    world_size=r.world_size,
                    master=f"{r.master_addr}:{r.master_port}",
                    restart_count=r.restart_count,
                    cause=r.reason,
                )
        elif kind is ActionKind.START:
            assert action.record is not None
            self._start(action.record, now)
        elif kind is ActionKind.MARK_FAILED:
            failed = FailedRecord(action.round, c.node_id, action.cause, action.reason[:300])
            won = self._store.compare_and_put(self._keys.restart_failed, action.expected_revision, encode(failed))
            if won:
                log.warning("round_failed", round=action.round, cause=action.cause, detail=action.reason)
        elif kind is ActionKind.MARK_DONE:
            self._store.put(self._keys.restart_done(c.node_id), encode(DoneRecord(c.node_id, action.round)))
            self.local = replace(loc, phase=Phase.FINISHING, phase_since=now)
            log.info("node_done", round=action.round)
        elif kind is ActionKind.MARK_FINISHED:
            self._store.put(self._keys.restart_finished, encode(FinishedRecord(action.round)))
            log.info("job_finished", round=action.round)
        elif kind is ActionKind.TERMINATE:
            pids = self._supervisor.send_signal(signal.SIGTERM)
            log.info(
                "workers_stopping",
                round=loc.round,
                cause=action.cause,
                pids=pids,
                grace_s=c.timeouts.shutdown_grace_s,
                reason=action.reason,
            )
            if self._failed_at is None:
                self._failed_at = now
            self.local = replace(
                loc,
                phase=Phase.STOPPING,
                phase_since=now,
                cause=action.cause,
                terminate_deadline=action.until,
                kill_deadline=None,
            )
        elif kind is ActionKind.KILL:
            self._kill_workers(action.reason)
            self.local = replace(loc, kill_deadline=action.until)
        elif kind is ActionKind.RESTART:
            restarts = loc.restarts
            if action.counted:
                restarts = (*(t for t in restarts if now - t < c.restart_window_s), now)  # bounded
            log.info(
                "round_left",
                round=loc.round,
                cause=loc.cause,
                counted=action.counted,
                restarts_in_window=len(restarts) if action.counted else None,
                max_restarts=c.max_restarts,
                reason=action.reason,
            )
            self.local = replace(
                loc,
                phase=Phase.REJOIN,
                phase_since=now,
                restart_at=action.until or now,
                restarts=restarts,
                terminate_deadline=None,
                kill_deadline=None,
            )

    def _start(self, record: RoundRecord, now: float) -> None:
        c = self._config
        group_rank = record.nodes.index(c.node_id)
        bind_context(round=record.round)
        self.local = replace(
            self.local,
            phase=Phase.RUNNING,
            phase_since=now,
            round=record.round,
            nodes=record.nodes,
            running=0,
            succeeded=0,
            failure="",
            cause="",
        )
        run_id = c.world.job_id
        for lr in range(c.nproc_per_node):
            env = child_environ(worker_environ(record, c.node_id, lr, run_id, c.max_restarts))
            pid = self._spawn_worker(lr, env)
            self.local = replace(self.local, running=self.local.running + 1)
            if isinstance(pid, WorkerExit):
                self._on_exit(pid)  # counted as started, then as ended at once
                continue
            log.info(
                "worker_started",
                local_rank=lr,
                pid=pid,
                rank=group_rank * record.nproc_per_node + lr,
                round=record.round,
            )
        recovery = None if self._failed_at is None else round(now - self._failed_at, 3)
        self._failed_at = None
        log.info(
            "round_started",
            round=record.round,
            node_rank=group_rank,
            world_size=record.world_size,
            nodes=list(record.nodes),
            master=f"{record.master_addr}:{record.master_port}",
            restart_count=record.restart_count,
            since_round_ended_s=recovery,
        )
        self._notify_ready()
        self._notifier.status(
            f"round {record.round}, world {record.world_size} "
            f"[{c.world.min_workers}..{c.world.max_workers}], node rank {group_rank}, "
            f"restarts {record.restart_count}"
        )
