"""The node agent: runs this node's workers, marks a dead one gone in etcd at once, restarts it, drains.

Owns the executor of elastic mode, ``Agent``: it applies the actions of the pure
``elastic_decide.decide(snapshot, now, config)`` (where ``AgentState``, ``SlotState`` and their
transitions live) through a ``Supervisor`` (processes) and a ``KeyValueStore`` (etcd), inside the
daemon skeleton it shares with restart mode (``daemon.AgentDaemon``). It never decides (the
snapshot goes to ``decide``) and never reads etcd on its loop. What it does:

* starts ``nproc_per_node`` workers of the configured program, and ``spares_per_node`` warm spares
  (all of them spares on a standby node: ``AgentConfig.starts_spare``), each with the worker
  environment (``settings.worker_env_to_environ``: job, etcd, timeouts, node id, local rank, spare);
* when a worker ends, it revokes the lease of that worker's member record at once (found by node
  and pid under ``members/``), so the survivors re-rendezvous now instead of after the lease TTL;
* it restarts a failed worker after an exponential backoff, within the restart budget
  (``max_restarts`` per ``restart_window_s``); the restarted worker joins as a newcomer (as a spare
  when the node keeps spares: one of them took the crashed one's place). When the
  budget is spent it stops its workers and exits 1 (``restarts_exhausted``). A worker that exits
  0 is done when the job finished (a ``finished`` record, read once more right after the exit);
  an exit 0 before that is a failure like any other. When all are done the agent exits 0;
* it reads the job's keys every ``keepalive_s`` in a background thread (``jobview.JobReader``), so
  the loop never waits on etcd; a local worker whose progress has not advanced for
  ``hang_timeout_s`` while the job's committed step grew is SIGKILLed (with its children) and then
  released and restarted like a crashed one (``worker_hung``); the same reads feed the metrics
  (``metrics.AgentMetrics``) and systemd's STATUS line;
* SIGTERM (or SIGINT) drains: it is forwarded to the workers, which finish their step and leave;
  after ``shutdown_grace_s`` they are killed; the agent exits 0. A second SIGTERM kills at once.

Every wait is bounded (``poll_interval_s``; a worker's exit and a signal wake the loop at once).

Before it starts a worker the agent claims its node id: it creates ``nodes/<node>`` under its own
lease by compare-and-set on absence (``NodePresence.claim``). While another agent's lease holds that
record it waits, at most ``lease_ttl_s`` plus a margin (a crashed agent's record expires by then);
if the record is still there, another live agent has this node id, and the agent exits 2
(``node_id_taken``, naming the other agent's host, pid and since when) without touching the job.

For operators (``presence.NodePresence``, on its own thread so that etcd never stalls this loop):
the agent keeps ``nodes/<node>`` (its state and each worker's pid, restarts, last exit, memory and
CPU) under its own lease, records ``worker_exited``, ``worker_restarted``, ``restarts_exhausted``,
``node_draining`` and ``node_drained`` in the job's events, and drains, as on SIGTERM, when
``drain/<node>`` appears (``elasticctl drain``). Never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import tempfile
import time
from collections.abc import Collection
from dataclasses import replace

import structlog

from elasticd.agent.daemon import (
    EXIT_CONFIG,
    EXIT_OK,
    AgentDaemon,
    AgentOutcome,
    Waker,
)
from elasticd.agent.elastic_decide import (
    Action,
    ActionKind,
    AgentSnapshot,
    AgentState,
    Slot,
    SlotState,
    decide,
    member_leases,
    out_of_service,
)
from elasticd.agent.health import SHOWN_OUTPUT_CHARS, HealthChecker
from elasticd.agent.jobview import (
    JobReader,
    JobView,
    WorkerPhase,
    advance_mark,
    job_read_interval_s,
    observe_worker,
)
from elasticd.agent.metrics import AgentMetrics
from elasticd.agent.presence import ClaimDecision, ClaimKind, NodePresence
from elasticd.agent.sdnotify import Notifier
from elasticd.agent.supervisor import ExitKind, Supervisor, WorkerExit, WorkerStats
from elasticd.config import AgentConfig
from elasticd.errors import EXIT_REJOIN, EtcdUnavailable, LeaseLost
from elasticd.relay.node import NodeRelay
from elasticd.retry import Clock
from elasticd.settings import child_environ, nccl_environ, worker_env_to_environ
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.nodefaults import CordonRecord, crash_times, encode_cordon, should_cordon
from elasticd.wire.ops import DrainRecord, EventKind, NodeRecord, WorkerRecord, decode_event
from elasticd.wire.stragglers import StragglerRecord, encode_straggler, slow_since

log = structlog.get_logger(__name__)


class Agent(AgentDaemon):
    """The executor of elastic mode: applies ``decide``'s actions until it says exit."""

    def __init__(
        self,
        config: AgentConfig,
        store: KeyValueStore,
        supervisor: Supervisor | None = None,
        clock: Clock = time.monotonic,
        notifier: Notifier | None = None,
        watchdog_s: float | None = None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        """The arguments are ``AgentDaemon``'s, and:

        Args:
            metrics: the Prometheus metrics to keep up to date (the caller serves them); None: none.
        """
        super().__init__(config, store, supervisor, clock, notifier, watchdog_s)
        self._metrics = metrics
        self._reader: JobReader | None = None
        self._next_status = float("-inf")
        self._last_status = ""
        self._keys = Keys(config.etcd.prefix, config.world.job_id)
        self.snapshot = AgentSnapshot.initial(config.slots)
        self._presence: NodePresence | None = None
        self._drain_request: DrainRecord | None = None
        self._drain_requested = False  # set by the presence thread; acted on by the loop
        self._drain_acted = False
        self._last_exit: dict[int, str] = {}
        self._since: float | None = None  # wall clock of the node id claim
        self._relay: NodeRelay | None = None  # this node's relay, while it runs
        self._health: HealthChecker | None = None  # the node's health check, when one is set
        self._stop_cause = ""  # why the agent drains itself (a straggler), when it does
        self._crashes: list[float] = []  # wall-clock times of this node's crashes within cordon_window_s
        self._replica_starts = 0  # replicas started so far (sharded training: each start's id is new)

    @property
    def stats(self) -> dict[int, WorkerStats]:
        """The latest memory and CPU sample of each running worker (local rank -> sample)."""
        return self._supervisor.stats()

    def _started_fields(self) -> dict[str, object]:
        c = self._config
        return {
            **super()._started_fields(),
            "hang_timeout_s": c.hang_timeout_s,
            "etcd_tls": c.etcd.tls,
            "etcd_user": c.etcd.user or None,
        }

    def _closed(self) -> None:
        if self._reader is not None:
            self._reader.stop()
            self._reader = None
        if self._health is not None:
            self._health.stop()
            self._health = None

    def _serve(self, waker: Waker) -> AgentOutcome:
        c = self._config
        presence = NodePresence(
            self._store,
            self._keys,
            c.node_id,
            c.timeouts,
            c.stats_interval_s,
            c.events_keep,
            self._on_drain_request,
            self._clock,
        )
        self._since = time.time()

        def claim_wait(seconds: float) -> None:
            self._notify(self._clock())  # the systemd watchdog, while lease_ttl_s passes
            waker.wait(seconds)

        def stopping() -> bool:
            return self._stop_requests(waker) > 0

        def first_contact() -> ClaimDecision:
            self._store.get(self._keys.generation)
            return presence.claim(self._node_record(), claim_wait, stopping, c.world.job_id)

        claim = self._until_etcd_answers(waker, first_contact)
        if isinstance(claim, AgentOutcome):
            return claim
        if claim.kind is ClaimKind.REFUSE:
            return AgentOutcome(EXIT_CONFIG, claim.reason)
        if claim.kind is not ClaimKind.CLAIMED:
            return AgentOutcome(EXIT_OK, f"stopped while waiting for the node id: {claim.reason}")
        self._presence = presence
        self._presence.start()
        self._before_the_workers(waker)
        self._relay = self._start_relay() if c.relay else None
        # Always read: a worker's exit 0 is done only when the job finished (``awaits_finish``).
        self._reader = JobReader(
            self._store,
            self._keys,
            self._clock,
            job_read_interval_s(c, live_consumers=self._metrics is not None or self._notifier.enabled),
            waker.poke,
            node=c.node_id,
        )
        try:
            outcome = self._guarded_loop(waker)
            if outcome.exit_code == EXIT_OK and outcome.reason == "drained":
                self._presence.event(EventKind.NODE_DRAINED, node=c.node_id)
            return outcome
        finally:
            if self._relay is not None:
                _close_relay(self._relay)
                self._relay = None
            # Bounded: the last events, the drain request and the node record (its lease) go now.
            self._presence.close(2 * c.timeouts.etcd_request_s)
            self._presence = None

    def _before_the_workers(self, waker: Waker) -> None:
        """Once the node id is claimed: the last run's failure records cleared (if it is a new run),
        this node's crash history read, and its health check started (when one is set)."""
        c = self._config
        self._clear_failures_of_a_past_run()
        self._read_fault_history()
        if c.health_check:
            self._health = HealthChecker(
                c.health_check, c.health_check_timeout_s, c.health_check_interval_s, self._clock, waker.poke
            )

    def _clear_failures_of_a_past_run(self) -> None:
        """A job with no live member is started anew (after a fix): the failure records of its last
        run go, so that the bug they show stops it no more. With a live member the job runs on,
        and its records stay (best effort: etcd down, they stay)."""
        members, failures = self._keys.member(""), self._keys.failure("")
        try:
            rows = self._store.get_prefixes((members, failures))
            if any(kv.key.startswith(members) and kv.lease for kv in rows):
                return
            old = [kv.key for kv in rows if kv.key.startswith(failures)]
            for key in old:
                self._store.delete(key)
        except EtcdUnavailable as exc:
            log.warning("failures_not_cleared", error=str(exc)[:200])
            return
        if old:
            log.info("failures_of_a_past_run_cleared", count=len(old))

    def _start_relay(self) -> NodeRelay | None:
        """This node's relay (``relay.node``), on a socket in a directory of its own (0700);
        None when it cannot start: the workers then read etcd themselves."""
        c = self._config
        relay = NodeRelay(
            self._store,
            self._keys,
            c.node_id,
            os.path.join(tempfile.mkdtemp(prefix="elasticd-relay-"), "relay.sock"),
            c.timeouts,
            node_lease=self._presence.lease_now if self._presence is not None else None,
        )
        try:
            relay.start()
        except (OSError, EtcdUnavailable) as exc:
            log.warning("relay_not_started", error=str(exc)[:200])
            _close_relay(relay)
            return None
        return relay

    def _on_drain_request(self, request: DrainRecord | None) -> None:
        """From the presence thread: ``drain/<node>`` appeared. The loop acts on it."""
        self._drain_request = request
        self._drain_requested = True
        if self._waker is not None:
            self._waker.poke()

    def _event(self, kind: EventKind, /, **detail: object) -> None:
        if self._presence is not None:
            self._presence.event(kind, node=self._config.node_id, **detail)

    def _publish_node(self) -> None:
        """Hand the node record as it is now to the presence thread (it writes it when it changed)."""
        if self._presence is not None:
            self._presence.update(self._node_record())

    def _node_record(self) -> NodeRecord:
        """The node record as it is now."""
        c = self._config
        stats = self._supervisor.stats()
        workers = []
        for slot in self.snapshot.slots:
            st = stats.get(slot.local_rank)
            fresh = st is not None and st.pid == slot.pid
            workers.append(
                WorkerRecord(
                    local_rank=slot.local_rank,
                    pid=slot.pid,
                    state=str(slot.state),
                    starts=slot.starts,
                    restarts=max(0, slot.starts - 1),
                    last_exit=self._last_exit.get(slot.local_rank),
                    rss_bytes=st.rss_bytes if fresh and st is not None else None,
                    cpu_percent=st.cpu_percent if fresh and st is not None else None,
                )
            )
        return NodeRecord(
            node=c.node_id,
            host=c.advertise_addr,
            agent_pid=os.getpid(),
            state=str(self.snapshot.state),
            time=time.time(),
            workers=tuple(workers),
            since=self._since,
            health=_health_text(self.snapshot, c),
        )

    def _loop(self, waker: Waker) -> AgentOutcome:
        c = self._config
        next_sample = self._clock() + c.stats_interval_s
        while True:
            now = self._clock()
            self._observe(waker, now)
            self._notify(now)
            if now >= next_sample:
                stats = self._supervisor.sample()
                if self._metrics is not None:
                    self._metrics.set_workers(self._config.slots, self._supervisor.running(), stats)
                next_sample = now + c.stats_interval_s
            self._publish_node()
            action = decide(self.snapshot, now, c)
            if action.kind is ActionKind.WAIT:
                waker.wait(self._sleep_s(now, action.until, next_sample))
                continue
            if action.kind is ActionKind.EXIT:
                return AgentOutcome(action.exit_code, action.reason)
            self._apply(action, now)

    def _notify(self, now: float) -> None:
        """systemd: WATCHDOG from this loop (before READY too), READY once this node's workers are
        in a generation, STATUS when it changes, STOPPING when a drain starts."""
        self._ping(now)
        if self.snapshot.stop_requests:
            self._notify_stopping()
        if not self._notifier.enabled or now < self._next_status:
            return
        self._next_status = now + self._config.timeouts.keepalive_s
        v = self.snapshot.view  # read by the job reader thread; None until a read succeeded
        if v is None:
            return
        mine = [m for m in v.in_generation if m in v.members and v.members[m].node == self._config.node_id]
        if v.generation and mine and self._notify_ready():
            log.info("agent_ready", generation=v.generation, workers_in_generation=len(mine))
        text = (
            f"generation {v.generation}, world {v.world_size} "
            f"[{self._config.world.min_workers}..{self._config.world.max_workers}], "
            f"this node {len(mine)}/{self._config.nproc_per_node} in it, step >= {v.job_step}"
            if v.generation
            else "waiting for the first generation"
        )
        if text != self._last_status:
            self._notifier.status(text)
            self._last_status = text

    def _observe(self, waker: Waker, now: float) -> None:
        if self._drain_requested and not self._drain_acted:
            self._drain_acted = True
            if not self.snapshot.stop_requests:  # already stopping: a drain request is no second SIGTERM
                self._pending_stop += 1
        requests = self._stop_requests(waker)
        if requests != self.snapshot.stop_requests:
            log.info("stop_signal_received", count=requests, state=str(self.snapshot.state))
            self.snapshot = replace(self.snapshot, stop_requests=requests)
        for e in self._supervisor.poll():
            self._log_exit(e)
            if not self.snapshot.slots[e.local_rank].replica_killed:  # ended with its replica: no crash of its own
                self._note_crash(e)
            self._set_slot(e.local_rank, state=SlotState.EXITED, exit=e, exited_at=now)
            if self._reader is not None:  # did the job finish (``awaits_finish``), or show a bug?
                self._reader.refresh()
            if self._health is not None:  # a restart waits for a check run after this exit
                self.snapshot = replace(self.snapshot, health_after=now)
                self._health.request()
        self._observe_health()
        if self._config.stopped_worker_s > 0:
            self._observe_stopped(now)
        for thread in (self._presence, self._reader):  # their etcd refused them: stop (_guarded_loop)
            if thread is not None and thread.denied is not None:
                raise thread.denied
        view = self._reader.latest() if self._reader is not None else None
        if view is not None and view is not self.snapshot.view:
            self._take_view(view)

    def _observe_health(self) -> None:
        """Take the newest health check; a change from passing to failing (or back) is an event."""
        h = self._health.latest() if self._health is not None else None
        old = self.snapshot.health
        if h is None or h is old:
            return
        self.snapshot = replace(self.snapshot, health=h)
        if old is None or old.passed != h.passed:
            kind = EventKind.HEALTH_CHECK_PASSED if h.passed else EventKind.HEALTH_CHECK_FAILED
            self._event(kind, output=h.output[-500:], duration_s=round(h.duration_s, 3))

    def _observe_stopped(self, now: float) -> None:
        """Note when each running worker was first seen stopped (state T), and when it continued."""
        stopped = self._supervisor.stopped()
        for s in self.snapshot.slots:
            if s.state is not SlotState.RUNNING:
                continue
            if s.local_rank in stopped and s.stopped_at is None:
                self._set_slot(s.local_rank, stopped_at=now)
            elif s.local_rank not in stopped and s.stopped_at is not None:
                if s.stop_revoked:
                    log.info(
                        "worker_continued", local_rank=s.local_rank, pid=s.pid, stopped_s=round(now - s.stopped_at, 3)
                    )
                self._set_slot(s.local_rank, stopped_at=None, stop_revoked=False)

    def _take_view(self, view: JobView) -> None:
        """A new read of the job: move each running worker's progress mark; update the metrics."""
        node, bound = self._config.node_id, self._config.straggler_score
        slots = []
        observed = {}
        scores = view.scores
        for s in self.snapshot.slots:
            if s.state is SlotState.RUNNING and s.pid:
                obs = observe_worker(view, node, self._supervisor.pids(s.local_rank) or {s.pid})
                observed[s.local_rank] = obs
                score = scores.get(obs.member_id) if obs.phase is WorkerPhase.TRAINING else None
                since = slow_since(s.slow_since, score, view.read_at, bound)
                acted = s.straggler_acted and since is not None  # a new episode is reported again
                s = replace(
                    s, mark=advance_mark(s.mark, obs, view), score=score, slow_since=since, straggler_acted=acted
                )
            slots.append(s)
        self.snapshot = replace(self.snapshot, slots=tuple(slots), view=view)
        if self._metrics is not None:
            self._metrics.set_view(view, observed, scores)

    def _log_exit(self, e: WorkerExit) -> None:
        stats = e.last_stats
        level = log.info if e.ok else log.warning
        level(
            "worker_exited",
            local_rank=e.local_rank,
            pid=e.pid,
            kind=str(e.kind),
            code=e.code,
            signal=e.signal,
            runtime_s=e.runtime_s,
            how=e.describe(),
            rss_mb=round(stats.rss_bytes / 2**20, 1) if stats else None,
            cpu_percent=stats.cpu_percent if stats else None,
        )
        self._last_exit[e.local_rank] = e.describe()
        self._event(
            EventKind.WORKER_EXITED,
            local_rank=e.local_rank,
            pid=e.pid,
            exit_kind=str(e.kind),
            code=e.code,
            signal=e.signal,
            how=e.describe(),
            runtime_s=e.runtime_s,
        )

    def _set_slot(self, local_rank: int, **changes: object) -> Slot:
        slots = list(self.snapshot.slots)
        slots[local_rank] = replace(slots[local_rank], **changes)  # type: ignore[arg-type]
        self.snapshot = replace(self.snapshot, slots=tuple(slots))
        return slots[local_rank]

    def _release(self, action: Action, now: float) -> None:
        """A worker ended: revoke its lease, put its slot in the state ``decide`` chose (a restart
        counts against the budget when ``action.budgeted``)."""
        c = self._config
        slot = self.snapshot.slots[action.local_rank]
        assert slot.exit is not None and action.slot_state is not None
        if slot.exit.kind is not ExitKind.SPAWN_FAILED:
            self._revoke(slot.exit)
        self._set_slot(action.local_rank, state=action.slot_state, restart_at=action.restart_at, pid=0, exited_at=None)
        if action.slot_state is SlotState.BACKOFF:
            kept = tuple(t for t in self.snapshot.restarts if now - t < c.restart_window_s)  # bounded
            self.snapshot = replace(self.snapshot, restarts=(*kept, now) if action.budgeted else kept)
            recent = len(self.snapshot.restarts)
            log.info(
                "worker_restart_scheduled",
                local_rank=action.local_rank,
                in_s=round(action.restart_at - now, 3),
                restarts_in_window=recent,
                max_restarts=c.max_restarts,
                reason=action.reason,
            )
            if self._metrics is not None:
                self._metrics.worker_restarted(action.local_rank)
        if action.next_state is AgentState.STOPPING:
            name = action.reason.split(":", 1)[0]  # restarts_exhausted, worker_fatal
            log.error(name, local_rank=action.local_rank, reason=action.reason)
            kind = EventKind.RESTARTS_EXHAUSTED if name == "restarts_exhausted" else EventKind.WORKER_FATAL
            self._event(kind, local_rank=action.local_rank, reason=action.reason)
            self.snapshot = replace(self.snapshot, reason=action.reason, exit_code=action.exit_code)

    def _terminate(self, action: Action) -> None:
        """SIGTERM to every worker (they finish their step and leave); a drain is recorded."""
        pids = self._supervisor.send_signal(signal.SIGTERM)
        grace_s = self._config.timeouts.shutdown_grace_s
        log.info("workers_signalled", signal="SIGTERM", pids=pids, grace_s=grace_s, reason=action.reason)
        if action.next_state is AgentState.DRAINING:
            req = self._drain_request
            cause = self._stop_cause or (
                "elasticctl drain" + (f" by {req.requested_by}" if req else "")
                if self._drain_acted
                else "stop signal (SIGTERM/SIGINT)"
            )
            self._event(EventKind.NODE_DRAINING, cause=cause, workers=pids)
        self.snapshot = replace(self.snapshot, terminate_deadline=action.until)

    def _kill_hung(self, action: Action) -> None:
        """SIGKILL a hung worker (and its children): its exit restarts it; recorded as an event."""
        c = self._config
        slot = self.snapshot.slots[action.local_rank]
        pids = self._supervisor.kill([action.local_rank])
        v, m = self.snapshot.view, slot.mark
        log.warning(
            "worker_hung",
            local_rank=action.local_rank,
            pid=slot.pid,
            killed=pids,
            stalled_s=round(v.read_at - m.at, 2) if v and m else None,
            last_progress=list(m.key) if m else None,
            job_step_then=m.job_step if m else None,
            job_step_now=v.job_step if v else None,
            hang_timeout_s=c.hang_timeout_s,
            reason=action.reason,
        )
        self._event(EventKind.WORKER_HUNG, local_rank=action.local_rank, pid=slot.pid, reason=action.reason)
        self._set_slot(action.local_rank, hang_killed=True)
        if self._metrics is not None:
            self._metrics.worker_hung(action.local_rank)

    def _note_crash(self, e: WorkerExit) -> None:
        """A worker crashed (or was killed as hung): more than ``cordon_crashes`` within
        ``cordon_window_s`` (this agent's and, from the job's events, its predecessors') cordon the
        node: ``cordon/<node>`` is written, and the node runs no worker until uncordoned."""
        c, now = self._config, time.time()
        if e.ok or e.code == EXIT_REJOIN or self.snapshot.state is not AgentState.RUNNING:
            return
        self._crashes = [t for t in self._crashes if now - t <= c.cordon_window_s] + [now]
        if not should_cordon(self._crashes, now, c.cordon_crashes, c.cordon_window_s):
            return
        reason = (
            f"{len(self._crashes)} crashes within cordon_window_s ({c.cordon_window_s:g} s) > "
            f"cordon_crashes ({c.cordon_crashes})"
        )
        try:
            self._store.put(self._keys.cordon(c.node_id), encode_cordon(CordonRecord(c.node_id, "agent", reason, now)))
        except EtcdUnavailable as exc:
            log.warning("cordon_not_written", reason=reason, error=str(exc)[:200])
            return
        log.error("node_cordoned", reason=reason)
        self._event(EventKind.NODE_CORDONED, reason=reason)
        if self._reader is not None:
            self._reader.refresh()

    def _read_fault_history(self) -> None:
        """This node's crashes in the job's events (an agent restarted by systemd counts its
        predecessors' too); best effort."""
        try:
            rows = self._store.get_prefix(self._keys.events)
        except EtcdUnavailable as exc:
            log.warning("fault_history_not_read", error=str(exc)[:200])
            return
        events = []
        for kv in rows:
            with contextlib.suppress(ValueError, TypeError, UnicodeDecodeError, RecursionError):
                events.append(decode_event(kv.value))
        now, window = time.time(), self._config.cordon_window_s
        self._crashes = [t for t in crash_times(events, self._config.node_id) if now - t <= window]

    def _straggler(self, action: Action) -> None:
        """A local worker is a straggler: report it (a log line, an event); with ``straggler_policy``
        replace, drain this node when a spare waits on another node and no other replacement holds
        the job's ``straggler`` lease (compare-and-set on absence: never two at once)."""
        c, v = self._config, self.snapshot.view
        slot = self._set_slot(action.local_rank, straggler_acted=True)
        obs = observe_worker(v, c.node_id, self._supervisor.pids(slot.local_rank) or {slot.pid}) if v else None
        member = obs.member_id if obs is not None else ""
        compute = obs.progress.compute_s if obs is not None and obs.progress is not None else None
        detail = dict(local_rank=slot.local_rank, member=member, score=round(slot.score or 0.0, 3), compute_s=compute)
        log.warning("straggler_detected", **detail, reason=action.reason)
        self._event(EventKind.STRAGGLER_DETECTED, **detail)
        if self._metrics is not None:
            self._metrics.straggler_detected(slot.local_rank)
        if c.straggler_policy != "replace" or v is None or self.snapshot.stop_requests:
            return
        if not v.spares_waiting(other_than=c.node_id):
            log.info("straggler_not_replaced", member=member, reason="no warm spare waits on another node")
            return
        record = StragglerRecord(c.node_id, member, round(slot.score or 0.0, 3), time.time())
        try:
            lease = self._store.grant_lease(c.straggler_cooldown_s)
            won = self._store.compare_and_put(self._keys.straggler, 0, encode_straggler(record), lease=lease)
        except EtcdUnavailable as exc:
            log.warning("straggler_not_replaced", member=member, reason=f"etcd: {str(exc)[:200]}")
            return
        if not won:
            with contextlib.suppress(EtcdUnavailable, LeaseLost):
                self._store.revoke_lease(lease)  # unused: another node holds the straggler lease
            log.info("straggler_not_replaced", member=member, reason="another node is being replaced (straggler lease)")
            return
        log.warning("straggler_replaced", **detail, cooldown_s=c.straggler_cooldown_s)
        self._event(EventKind.STRAGGLER_REPLACED, **detail)
        self._stop_cause = f"straggler (score {slot.score or 0.0:.2f}): a waiting spare takes its place"
        self._pending_stop += 1

    def _job_failed(self, action: Action) -> None:
        """A bug stops the job (``JobView.bug``): log it with its traceback's tail, record the event,
        and stop (``decide`` terminates the workers; the exit code is 3)."""
        bug = self.snapshot.view.bug if self.snapshot.view is not None else None
        assert bug is not None
        fields = dict(
            step=bug.step, exception=f"{bug.exc_type}: {bug.message}", members=list(bug.members), nodes=list(bug.nodes)
        )
        log.error("job_failed", **fields, reason=action.reason, detail=bug.detail)
        self._event(EventKind.JOB_FAILED, **fields)
        self.snapshot = replace(self.snapshot, reason=action.reason, exit_code=action.exit_code)

    def _apply(self, action: Action, now: float) -> None:
        c = self._config
        if action.kind is ActionKind.SPAWN and action.local_ranks:
            self._spawn_replica(action.local_ranks, now)
        elif action.kind is ActionKind.SPAWN:
            self._spawn(action.local_rank, now)
        elif action.kind is ActionKind.KILL_REPLICA:
            self._kill_replica(action)
        elif action.kind is ActionKind.RELEASE:
            self._release(action, now)
        elif action.kind is ActionKind.TERMINATE:
            self._terminate(action)
        elif action.kind is ActionKind.JOB_FAILED:
            self._job_failed(action)
        elif action.kind is ActionKind.KILL:
            self._kill_workers(action.reason)
            self.snapshot = replace(self.snapshot, kill_deadline=action.until)
        elif action.kind is ActionKind.STRAGGLER:
            self._straggler(action)
        elif action.kind is ActionKind.KILL_HUNG:
            self._kill_hung(action)
        elif action.kind is ActionKind.REVOKE_STOPPED:
            slot = self._set_slot(action.local_rank, stop_revoked=True)
            log.warning(
                "worker_stopped",
                local_rank=action.local_rank,
                pid=slot.pid,
                stopped_worker_s=c.stopped_worker_s,
                reason=action.reason,
            )
            self._event(EventKind.WORKER_STOPPED, local_rank=action.local_rank, pid=slot.pid)
            self._revoke_leases(action.local_rank, slot.pid, self._supervisor.pids(action.local_rank))
        if action.next_state is not None:
            self.snapshot = replace(self.snapshot, state=action.next_state)
        if action.next_state is AgentState.RUNNING:  # back from UNHEALTHY: its stop is over
            self.snapshot = replace(self.snapshot, terminate_deadline=None, kill_deadline=None)

    def _spawn_replica(self, local_ranks: tuple[int, ...], now: float) -> None:
        """Start every worker of a replica, under a replica id new to this start, with the address
        its shard 0 serves the replica's store on (a free port of the advertised address)."""
        c = self._config
        self._replica_starts += 1
        replica = f"{c.node_id}.r{local_ranks[0] // c.replica_size}.{os.getpid()}.{self._replica_starts}"
        store = f"{c.advertise_addr}:{free_port(c.advertise_addr)}"
        log.info("replica_starting", replica=replica, local_ranks=list(local_ranks), store=store)
        for lr in local_ranks:
            self._spawn(lr, now, replica, store)

    def _kill_replica(self, action: Action) -> None:
        """SIGKILL the given workers of a replica and revoke their leases now (the others regroup
        without the replica at once); each one's exit puts it in line to start with its replica."""
        for lr in action.local_ranks:
            slot = self.snapshot.slots[lr]
            pids = self._supervisor.pids(lr)
            killed = self._supervisor.kill([lr])
            log.warning("replica_worker_killed", local_rank=lr, pid=slot.pid, killed=killed, reason=action.reason)
            self._set_slot(lr, replica_killed=lr != action.local_rank)
            self._revoke_leases(lr, slot.pid, pids)
        self._event(EventKind.REPLICA_ENDED, local_ranks=list(action.local_ranks), reason=action.reason)

    def _spawn(self, local_rank: int, now: float, replica: str = "", replica_store: str = "") -> None:
        c = self._config
        slot = self.snapshot.slots[local_rank]
        if slot.starts and self._reader is not None:
            self._reader.refresh()  # a restart: the other workers' failure records may be in by now
        spare = c.starts_spare(local_rank, slot.starts)
        env = c.worker_env(
            local_rank, spare, self._relay.path if self._relay is not None else "", replica, replica_store
        )  # NCCL's watchdog settings are defaults: the agent's own environment wins
        pid = self._spawn_worker(local_rank, child_environ(worker_env_to_environ(env), nccl_environ(env.timeouts)))
        if isinstance(pid, WorkerExit):
            e = pid
            self._log_exit(e)
            self._set_slot(local_rank, state=SlotState.EXITED, exit=e, starts=slot.starts + 1)
            return
        self._set_slot(
            local_rank,
            state=SlotState.RUNNING,
            pid=pid,
            exit=None,
            starts=slot.starts + 1,
            mark=None,
            hang_killed=False,
            stopped_at=None,
            stop_revoked=False,
            replica_killed=False,
        )
        log.info(
            "worker_started",
            local_rank=local_rank,
            pid=pid,
            start=slot.starts + 1,
            restart=slot.starts > 0,
            spare=spare,
        )
        if slot.starts > 0:
            self._event(EventKind.WORKER_RESTARTED, local_rank=local_rank, pid=pid, start=slot.starts + 1)

    def _revoke(self, e: WorkerExit) -> None:
        """Mark the ended worker gone in etcd now."""
        self._revoke_leases(e.local_rank, e.pid, {e.pid, *e.descendants})

    def _revoke_leases(self, local_rank: int, pid: int, pids: Collection[int]) -> None:
        """Revoke the lease of each member record of ``pids`` (a worker and its children), which also
        drops its ready record. Best effort: if etcd does not answer, the lease TTL does it later."""
        started = self._clock()
        node = self._config.node_id
        try:
            found = member_leases(self._store.get_prefix(self._keys.member("")), self._keys, node, pids)
        except EtcdUnavailable as exc:
            log.warning("worker_lease_revoke_failed", local_rank=local_rank, pid=pid, error=str(exc))
            return
        if not found:
            # Normal after a clean exit (the worker revoked its own lease) or a death before joining.
            log.info("worker_record_not_found", local_rank=local_rank, pid=pid)
            return
        node_lease = self._relay.node_lease if self._relay is not None else 0
        for member, lease in found:
            if node_lease and lease == node_lease:  # a member lease of this node's relay (relay.leases)
                assert self._relay is not None
                done = self._relay.release_members([member], self._config.timeouts.etcd_request_s)
                log.info("worker_released", local_rank=local_rank, pid=pid, member=member, deleted=done)
                continue
            try:
                self._store.revoke_lease(lease)
            except LeaseLost:
                log.info("worker_lease_vanished", local_rank=local_rank, pid=pid, member=member)
                continue
            except EtcdUnavailable as exc:
                log.warning("worker_lease_revoke_failed", local_rank=local_rank, pid=pid, member=member, error=str(exc))
                continue
            log.info(
                "worker_lease_revoked",
                local_rank=local_rank,
                pid=pid,
                member=member,
                lease=lease,
                took_s=round(self._clock() - started, 4),
            )


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the kernel's pick; another process may take it before it is used)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _close_relay(relay: NodeRelay) -> None:
    """Stop ``relay`` and remove the directory of its socket (``Agent._start_relay`` made it)."""
    relay.close()
    os.rmdir(os.path.dirname(relay.path))


def _health_text(snap: AgentSnapshot, config: AgentConfig) -> str | None:
    """The node record's ``health``: ``cordoned: <why>``, ``failing: <the check's output>``,
    ``passing``, or None (no check, or no result yet)."""
    out, h = out_of_service(snap, config), snap.health
    if out is not None and out.startswith("cordoned: "):
        return out
    if h is None or not config.health_check:
        return None
    return "passing" if h.passed else f"failing: {h.output[-SHOWN_OUTPUT_CHARS:]}"
