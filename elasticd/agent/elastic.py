"""The node agent: runs this node's workers, marks a dead one gone in etcd at once, restarts it, drains.

Owns the agent's state machine. ``AgentState`` is the agent's, ``SlotState`` each local rank's; the
transitions are written once, in the pure ``decide(snapshot, now, config)``, and ``Agent.run`` is
the small executor that applies its actions through a ``Supervisor`` (processes) and a
``KeyValueStore`` (etcd). What it does:

* starts ``nproc_per_node`` workers of the configured program, each with the worker environment
  (``AgentConfig.worker_environ``: job, etcd, timeouts, node id, local rank);
* when a worker ends, it revokes the lease of that worker's member record at once (found by node
  and pid under ``members/``), so the survivors re-rendezvous now instead of after the lease TTL;
* it restarts a failed worker after an exponential backoff, within the restart budget
  (``max_restarts`` per ``restart_window_s``); the restarted worker joins as a newcomer. When the
  budget is spent it stops its workers and exits 1 (``restarts_exhausted``). A worker that exits
  0 is done; when all are done the agent exits 0;
* it reads the job's keys every ``keepalive_s`` in a background thread (``progress.JobView``), so
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

import os
import select
import signal
import socket
import threading
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from enum import StrEnum
from types import FrameType

import structlog

from elasticd.agent.jobview import (
    JobView,
    ProgressMark,
    advance_mark,
    is_hung,
    observe_worker,
    read_job_view,
)
from elasticd.agent.metrics import AgentMetrics
from elasticd.agent.presence import ClaimKind, NodePresence
from elasticd.agent.sdnotify import Notifier
from elasticd.agent.supervisor import ExitKind, Supervisor, WorkerExit, WorkerStats
from elasticd.config import AgentConfig, child_environ
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.log import bind_context
from elasticd.retry import Clock
from elasticd.store.kv import KeyValue, KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.ops import DrainRecord, EventKind, NodeRecord, WorkerRecord
from elasticd.wire.records import DECODE_ERRORS, MemberRecord, decode

log = structlog.get_logger(__name__)

EXIT_OK = 0
EXIT_FATAL = 1
EXIT_CONFIG = 2  # the configuration cannot work: another live agent of the job has this node id


class AgentState(StrEnum):
    STARTING = "starting"  # no worker started yet
    RUNNING = "running"  # supervising: restarting failed workers within the budget
    DRAINING = "draining"  # asked to stop (SIGTERM): workers finish their step and leave; exit 0
    STOPPING = "stopping"  # a fatal condition (restarts exhausted): workers are stopped; exit 1


class SlotState(StrEnum):
    """One local rank's worker."""

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
    view: JobView | None = None  # the newest read of the job's keys (None: none succeeded yet)

    @classmethod
    def initial(cls, nproc: int) -> AgentSnapshot:
        return cls(AgentState.STARTING, tuple(Slot(lr) for lr in range(nproc)))


class ActionKind(StrEnum):
    SPAWN = "spawn"  # start (or restart) the worker of local_rank
    RELEASE = "release"  # a worker ended: revoke its lease, then put its slot in slot_state
    TERMINATE = "terminate"  # SIGTERM to every running worker; kill after `until`
    KILL = "kill"  # SIGKILL to every running worker (and its children); give up after `until`
    KILL_HUNG = "kill_hung"  # SIGKILL the hung worker of local_rank (and its children); its exit restarts it
    REVOKE_STOPPED = "revoke_stopped"  # revoke the lease of local_rank's stopped worker (it is not killed)
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


@dataclass(frozen=True)
class AgentOutcome:
    exit_code: int
    reason: str


def restarts_in_window(restarts: Iterable[float], now: float, window_s: float) -> int:
    """How many of the restart times lie within the last ``window_s`` seconds before ``now``."""
    return sum(1 for t in restarts if now - t < window_s)


def restart_backoff_s(recent_restarts: int, initial_s: float, max_s: float) -> float:
    """The wait before the next restart: ``initial_s * 2**recent_restarts``, at most ``max_s``."""
    return min(max_s, initial_s * 2.0 ** min(recent_restarts, 64))


def decide(snap: AgentSnapshot, now: float, config: AgentConfig) -> Action:
    """What the agent does next. Pure: no I/O, no clock reads."""
    ended = next((s for s in snap.slots if s.state is SlotState.EXITED), None)
    if ended is not None:
        return _release(snap, ended, now, config)
    running = [s for s in snap.slots if s.state is SlotState.RUNNING]
    stopping = snap.state in (AgentState.DRAINING, AgentState.STOPPING)
    if snap.stop_requests and not stopping:
        return Action(ActionKind.TERMINATE, "stop requested: the workers finish their step and leave",
                      next_state=AgentState.DRAINING, until=now + config.timeouts.shutdown_grace_s)
    if stopping:
        draining = snap.state is AgentState.DRAINING
        code = EXIT_OK if draining else EXIT_FATAL
        reason = "drained" if draining else snap.reason
        if not running:
            return Action(ActionKind.EXIT, reason, exit_code=code)
        if snap.terminate_deadline is None:
            return Action(ActionKind.TERMINATE, "stopping the other workers",
                          until=now + config.timeouts.shutdown_grace_s)
        if snap.kill_deadline is None:
            if snap.stop_requests >= 2:
                return Action(ActionKind.KILL, "a second stop request", until=now + config.kill_wait_s)
            if now >= snap.terminate_deadline:
                return Action(ActionKind.KILL, f"workers still running after shutdown_grace_s "
                              f"({config.timeouts.shutdown_grace_s:g} s)", until=now + config.kill_wait_s)
            return Action(ActionKind.WAIT, "waiting for the workers to leave", until=snap.terminate_deadline)
        if now >= snap.kill_deadline:
            pids = [s.pid for s in running]
            return Action(ActionKind.EXIT, f"workers_not_reaped: pids {pids} outlived SIGKILL by "
                          f"kill_wait_s ({config.kill_wait_s:g} s); {reason}", exit_code=EXIT_FATAL)
        return Action(ActionKind.WAIT, "waiting for killed workers to be reaped", until=snap.kill_deadline)
    hung = next((s for s in running if not s.hang_killed and is_hung(s.mark, snap.view, config.hang_timeout_s)),
                None)
    if hung is not None:
        assert hung.mark is not None and snap.view is not None
        return Action(ActionKind.KILL_HUNG, f"worker {hung.local_rank} (pid {hung.pid}) made no progress for "
                      f"{snap.view.read_at - hung.mark.at:.1f} s (hang_timeout_s {config.hang_timeout_s:g}) while "
                      f"the job's committed step grew from {hung.mark.job_step} to {snap.view.job_step}",
                      local_rank=hung.local_rank)
    frozen = next((s for s in running if stopped_past(s, now, config.stopped_worker_s)), None)
    if frozen is not None:
        assert frozen.stopped_at is not None
        return Action(ActionKind.REVOKE_STOPPED, f"worker {frozen.local_rank} (pid {frozen.pid}) stopped for "
                      f"{now - frozen.stopped_at:.2f} s (stopped_worker_s {config.stopped_worker_s:g}): its lease "
                      f"is revoked so that the others regroup without it now; it rejoins when it continues",
                      local_rank=frozen.local_rank)
    pending = next((s for s in snap.slots if s.state is SlotState.PENDING), None)
    if pending is not None:
        return Action(ActionKind.SPAWN, "start", local_rank=pending.local_rank, next_state=AgentState.RUNNING)
    due = [s for s in snap.slots if s.state is SlotState.BACKOFF]
    ready = next((s for s in due if s.restart_at <= now), None)
    if ready is not None:
        return Action(ActionKind.SPAWN, "restart", local_rank=ready.local_rank, next_state=AgentState.RUNNING)
    if all(s.state is SlotState.DONE for s in snap.slots):
        return Action(ActionKind.EXIT, "workers_finished", exit_code=EXIT_OK)
    stops = [s.stopped_at + config.stopped_worker_s for s in running
             if s.stopped_at is not None and not s.stop_revoked and config.stopped_worker_s > 0]
    return Action(ActionKind.WAIT, "supervising",
                  until=min([*(s.restart_at for s in due), *stops], default=None))


def stopped_past(slot: Slot, now: float, stopped_worker_s: float) -> bool:
    """The running worker of ``slot`` has been stopped (SIGSTOP) for ``stopped_worker_s`` or longer
    and its lease is not revoked yet (0: never)."""
    return (stopped_worker_s > 0 and slot.state is SlotState.RUNNING and slot.stopped_at is not None
            and not slot.stop_revoked and now - slot.stopped_at >= stopped_worker_s)


def _release(snap: AgentSnapshot, slot: Slot, now: float, config: AgentConfig) -> Action:
    e = slot.exit
    assert e is not None, "an EXITED slot carries its exit"
    what = f"worker {slot.local_rank} (pid {e.pid}) {e.describe()}"
    if slot.hang_killed:
        what += " as hung"
    if snap.state in (AgentState.DRAINING, AgentState.STOPPING) or snap.stop_requests:
        return Action(ActionKind.RELEASE, f"{what}; the agent is stopping", local_rank=slot.local_rank,
                      slot_state=SlotState.DONE if e.ok else SlotState.STOPPED)
    if e.ok:
        return Action(ActionKind.RELEASE, f"{what}: done", local_rank=slot.local_rank, slot_state=SlotState.DONE)
    recent = restarts_in_window(snap.restarts, now, config.restart_window_s)
    if recent >= config.max_restarts:
        return Action(
            ActionKind.RELEASE,
            f"restarts_exhausted: {what}; {recent} restarts in the last {config.restart_window_s:g} s "
            f"(max_restarts {config.max_restarts})",
            local_rank=slot.local_rank, slot_state=SlotState.STOPPED, next_state=AgentState.STOPPING,
        )
    delay = restart_backoff_s(recent, config.restart_backoff_initial_s, config.restart_backoff_max_s)
    return Action(ActionKind.RELEASE, f"{what}: restart in {delay:g} s", local_rank=slot.local_rank,
                  slot_state=SlotState.BACKOFF, restart_at=now + delay)


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


class _Waker:
    """Bounded sleeps that a signal or ``poke`` cuts short.

    With ``install`` (main thread only), SIGTERM and SIGINT count as stop requests, and every signal,
    SIGCHLD included, wakes ``wait`` at once through ``signal.set_wakeup_fd``.
    """

    def __init__(self, install: bool) -> None:
        self._install = install
        self.stop_requests = 0
        self._r, self._w = socket.socketpair()
        self._r.setblocking(False)
        self._w.setblocking(False)
        self._old_fd = -1
        self._old: dict[int, object] = {}

    def __enter__(self) -> _Waker:
        if self._install:
            self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
            for sig, handler in ((signal.SIGTERM, self._on_stop), (signal.SIGINT, self._on_stop),
                                 (signal.SIGCHLD, self._on_wake)):
                self._old[sig] = signal.signal(sig, handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._install:
            for sig, handler in self._old.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            signal.set_wakeup_fd(self._old_fd)
        self._r.close()
        self._w.close()

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requests += 1  # only an int: a handler must not take locks

    def _on_wake(self, signum: int, frame: FrameType | None) -> None:
        pass  # the wakeup fd already woke the loop

    def poke(self) -> None:
        try:
            self._w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already awake (buffer full) or closed

    def wait(self, timeout_s: float) -> None:
        ready, _, _ = select.select([self._r], [], [], max(0.0, timeout_s))
        if ready:
            try:
                while self._r.recv(4096):
                    pass
            except BlockingIOError:
                pass


Waker = _Waker  # the public name: restart mode (group_restart.py) sleeps the same way

HANG_READS_PER_TIMEOUT = 10  # reads of the job per hang_timeout_s when only hang detection needs them


def job_read_interval_s(config: AgentConfig, live_consumers: bool) -> float:
    """How often the agent reads the job's keys: every ``keepalive_s`` for metrics and systemd
    STATUS (``live_consumers``); for hang detection alone, ``HANG_READS_PER_TIMEOUT`` times per
    ``hang_timeout_s`` but never more often than every ``keepalive_s`` (each read holds every
    member's records, so many nodes reading a large job often would load etcd)."""
    k = config.timeouts.keepalive_s
    if live_consumers or config.hang_timeout_s <= 0:
        return k
    return max(k, config.hang_timeout_s / HANG_READS_PER_TIMEOUT)


class _JobReader:
    """A thread that reads the job's keys every ``interval_s`` and keeps the newest ``JobView``.

    It keeps etcd off the agent's loop: a slow or absent etcd delays only the next view (each
    read is bounded by the store's own request timeout and retries), and a failed read leaves the
    previous view in place, so nothing is decided on evidence that was not read.
    """

    def __init__(self, store: KeyValueStore, keys: Keys, clock: Clock, interval_s: float) -> None:
        self._store, self._keys, self._clock, self._interval_s = store, keys, clock, interval_s
        self._latest: JobView | None = None
        self._stop = threading.Event()
        self._failing = False
        self._thread = threading.Thread(target=self._run, name="elasticd-job-reader", daemon=True)
        self._thread.start()

    def latest(self) -> JobView | None:
        return self._latest

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self._interval_s + 1.0)  # a read under way may outlast this; it is a daemon

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                rows = self._store.get_prefixes((*self._keys.rendezvous, self._keys.progress("")))
            except EtcdUnavailable as exc:
                if not self._failing:
                    log.warning("job_read_failed", error=str(exc)[:300])
                self._failing = True
            else:
                if self._failing:
                    log.info("job_read_recovered")
                self._failing = False
                self._latest = read_job_view(self._keys, rows, self._clock())
            self._stop.wait(self._interval_s)


class Agent:
    """The executor: applies ``decide``'s actions until it says exit."""

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
        """
        Args:
            notifier: where READY/WATCHDOG/STATUS/STOPPING go (systemd); None: nowhere.
            watchdog_s: ping the watchdog this often (half of systemd's WatchdogSec); None: never.
            metrics: the Prometheus metrics to keep up to date (the caller serves them); None: none.
        """
        self._config = config
        self._metrics = metrics
        self._reader: _JobReader | None = None
        self._store = store
        self._notifier = notifier or Notifier(None)
        self._watchdog_s = watchdog_s
        self._last_ping = float("-inf")
        self._next_status = float("-inf")
        self._ready_sent = False
        self._stopping_sent = False
        self._last_status = ""
        self._clock = clock
        self._supervisor = supervisor or Supervisor(clock)
        self._keys = Keys(config.etcd.prefix, config.world.job_id)
        self.snapshot = AgentSnapshot.initial(config.nproc_per_node)
        self._waker: _Waker | None = None
        self._pending_stop = 0
        self._presence: NodePresence | None = None
        self._drain_request: DrainRecord | None = None
        self._drain_requested = False  # set by the presence thread; acted on by the loop
        self._drain_acted = False
        self._last_exit: dict[int, str] = {}
        self._since: float | None = None  # wall clock of the node id claim

    @property
    def stats(self) -> dict[int, WorkerStats]:
        """The latest memory and CPU sample of each running worker (local rank -> sample)."""
        return self._supervisor.stats()

    def request_stop(self) -> None:
        """Ask the agent to drain, as SIGTERM does (for callers that are not signals)."""
        self._pending_stop += 1
        if self._waker is not None:
            self._waker.poke()

    def run(self, install_signals: bool = True) -> AgentOutcome:
        """Run until the workers are done, drained, or the agent must give up.

        Args:
            install_signals: handle SIGTERM/SIGINT/SIGCHLD (only possible in the main thread).

        Returns:
            The exit code (0 done or drained, 1 fatal, 2 the node id is another live agent's) and
            the reason.
        """
        c = self._config
        bind_context(node=c.node_id)
        log.info("agent_started", job=c.world.job_id, node=c.node_id, program=list(c.program),
                 nproc_per_node=c.nproc_per_node, min_workers=c.world.min_workers,
                 max_workers=c.world.max_workers, etcd=list(c.etcd.endpoints), max_restarts=c.max_restarts,
                 restart_window_s=c.restart_window_s, hang_timeout_s=c.hang_timeout_s,
                 etcd_tls=c.etcd.tls, etcd_user=c.etcd.user or None)
        with _Waker(install_signals) as waker:
            self._waker = waker
            try:
                outcome = self._run(waker)
            finally:
                self._waker = None
                if self._reader is not None:
                    self._reader.stop()
                    self._reader = None
        level = log.info if outcome.exit_code == EXIT_OK else log.error
        level("agent_stopped", exit_code=outcome.exit_code, reason=outcome.reason)
        return outcome

    def _run(self, waker: _Waker) -> AgentOutcome:
        c = self._config
        presence = NodePresence(self._store, self._keys, c.node_id, c.timeouts, c.stats_interval_s,
                                c.events_keep, self._on_drain_request, self._clock)
        self._since = time.time()

        def claim_wait(seconds: float) -> None:
            self._notify(self._clock())  # the systemd watchdog, while lease_ttl_s passes
            waker.wait(seconds)

        def stopping() -> bool:
            return bool(waker.stop_requests or self._pending_stop)

        # An agent started during an etcd outage (a replacement node, a restart) waits for etcd,
        # up to etcd_outage_s, rather than exiting into systemd's restart loop.
        outage_ends = self._clock() + c.timeouts.etcd_outage_s
        while True:
            try:
                self._store.get(self._keys.generation)
                claim = presence.claim(self._node_record(), claim_wait, stopping, c.world.job_id)
                break
            except EtcdUnavailable as exc:
                if self._clock() >= outage_ends:
                    return AgentOutcome(EXIT_FATAL, f"etcd_unreachable for etcd_outage_s "
                                        f"({c.timeouts.etcd_outage_s:g} s): {exc}")
                if stopping():
                    return AgentOutcome(EXIT_OK, "stopped while waiting for etcd")
                log.warning("agent_waiting_for_etcd", error=str(exc)[:200],
                            bound_s=round(outage_ends - self._clock(), 1))
                claim_wait(c.timeouts.keepalive_s)
        if claim.kind is ClaimKind.REFUSE:
            return AgentOutcome(EXIT_CONFIG, claim.reason)
        if claim.kind is not ClaimKind.CLAIMED:
            return AgentOutcome(EXIT_OK, f"stopped while waiting for the node id: {claim.reason}")
        self._presence = presence
        self._presence.start()
        if c.hang_timeout_s > 0 or self._metrics is not None or self._notifier.enabled:
            self._reader = _JobReader(self._store, self._keys, self._clock, job_read_interval_s(
                c, live_consumers=self._metrics is not None or self._notifier.enabled))
        try:
            try:
                outcome = self._loop(waker)
            except Exception as exc:  # the top-level loop: any surprise becomes a fatal stop
                log.error("agent_failed", error=repr(exc), exc_info=True)
                self._supervisor.terminate_all(c.timeouts.shutdown_grace_s, c.kill_wait_s)
                outcome = AgentOutcome(EXIT_FATAL, f"agent_failed: {exc!r}")
            if outcome.exit_code == EXIT_OK and outcome.reason == "drained":
                self._presence.event(EventKind.NODE_DRAINED, node=c.node_id)
            return outcome
        finally:
            # Bounded: the last events, the drain request and the node record (its lease) go now.
            self._presence.close(2 * c.timeouts.etcd_request_s)
            self._presence = None

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
            workers.append(WorkerRecord(
                local_rank=slot.local_rank, pid=slot.pid, state=str(slot.state), starts=slot.starts,
                restarts=max(0, slot.starts - 1), last_exit=self._last_exit.get(slot.local_rank),
                rss_bytes=st.rss_bytes if fresh and st is not None else None,
                cpu_percent=st.cpu_percent if fresh and st is not None else None,
            ))
        return NodeRecord(node=c.node_id, host=c.advertise_addr, agent_pid=os.getpid(),
                          state=str(self.snapshot.state), time=time.time(), workers=tuple(workers),
                          since=self._since)

    def _loop(self, waker: _Waker) -> AgentOutcome:
        c = self._config
        next_sample = self._clock() + c.stats_interval_s
        while True:
            now = self._clock()
            self._observe(waker, now)
            self._notify(now)
            if now >= next_sample:
                stats = self._supervisor.sample()
                if self._metrics is not None:
                    self._metrics.set_workers(self._config.nproc_per_node, self._supervisor.running(), stats)
                next_sample = now + c.stats_interval_s
            self._publish_node()
            action = decide(self.snapshot, now, c)
            if action.kind is ActionKind.WAIT:
                timeout = min(c.poll_interval_s, next_sample - now)
                if self._watchdog_s is not None:
                    timeout = min(timeout, max(0.0, self._last_ping + self._watchdog_s - now))
                if action.until is not None:
                    timeout = min(timeout, action.until - now)
                waker.wait(timeout)
                continue
            if action.kind is ActionKind.EXIT:
                return AgentOutcome(action.exit_code, action.reason)
            self._apply(action, now)

    def _notify(self, now: float) -> None:
        """systemd: WATCHDOG from this loop (before READY too), READY once this node's workers are
        in a generation, STATUS when it changes, STOPPING when a drain starts."""
        if self._watchdog_s is not None and now - self._last_ping >= self._watchdog_s:
            self._notifier.watchdog()
            self._last_ping = now
        if self.snapshot.stop_requests and not self._stopping_sent:
            self._notifier.stopping()
            self._stopping_sent = True
        if not self._notifier.enabled or now < self._next_status:
            return
        self._next_status = now + self._config.timeouts.keepalive_s
        v = self.snapshot.view  # read by the job reader thread; None until a read succeeded
        if v is None:
            return
        mine = [m for m in v.in_generation if m in v.members and v.members[m].node == self._config.node_id]
        if v.generation and mine and not self._ready_sent:
            self._notifier.ready()
            self._ready_sent = True
            log.info("agent_ready", generation=v.generation, workers_in_generation=len(mine))
        text = (f"generation {v.generation}, world {v.world_size} "
                f"[{self._config.world.min_workers}..{self._config.world.max_workers}], "
                f"this node {len(mine)}/{self._config.nproc_per_node} in it, step >= {v.job_step}"
                if v.generation else "waiting for the first generation")
        if text != self._last_status:
            self._notifier.status(text)
            self._last_status = text

    def _observe(self, waker: _Waker, now: float) -> None:
        if self._drain_requested and not self._drain_acted:
            self._drain_acted = True
            if not self.snapshot.stop_requests:  # already stopping: a drain request is no second SIGTERM
                self._pending_stop += 1
        requests = waker.stop_requests + self._pending_stop
        if requests != self.snapshot.stop_requests:
            log.info("stop_signal_received", count=requests, state=str(self.snapshot.state))
            self.snapshot = replace(self.snapshot, stop_requests=requests)
        for e in self._supervisor.poll():
            self._log_exit(e)
            self._set_slot(e.local_rank, state=SlotState.EXITED, exit=e)
        if self._config.stopped_worker_s > 0:
            self._observe_stopped(now)
        view = self._reader.latest() if self._reader is not None else None
        if view is not None and view is not self.snapshot.view:
            self._take_view(view)

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
                    log.info("worker_continued", local_rank=s.local_rank, pid=s.pid,
                             stopped_s=round(now - s.stopped_at, 3))
                self._set_slot(s.local_rank, stopped_at=None, stop_revoked=False)

    def _take_view(self, view: JobView) -> None:
        """A new read of the job: move each running worker's progress mark; update the metrics."""
        node = self._config.node_id
        slots = []
        observed = {}
        for s in self.snapshot.slots:
            if s.state is SlotState.RUNNING and s.pid:
                obs = observe_worker(view, node, self._supervisor.pids(s.local_rank) or {s.pid})
                observed[s.local_rank] = obs
                s = replace(s, mark=advance_mark(s.mark, obs, view))
            slots.append(s)
        self.snapshot = replace(self.snapshot, slots=tuple(slots), view=view)
        if self._metrics is not None:
            self._metrics.set_view(view, observed)

    def _log_exit(self, e: WorkerExit) -> None:
        stats = e.last_stats
        level = log.info if e.ok else log.warning
        level("worker_exited", local_rank=e.local_rank, pid=e.pid, kind=str(e.kind), code=e.code,
              signal=e.signal, runtime_s=e.runtime_s, how=e.describe(),
              rss_mb=round(stats.rss_bytes / 2**20, 1) if stats else None,
              cpu_percent=stats.cpu_percent if stats else None)
        self._last_exit[e.local_rank] = e.describe()
        self._event(EventKind.WORKER_EXITED, local_rank=e.local_rank, pid=e.pid, exit_kind=str(e.kind), code=e.code,
                    signal=e.signal, how=e.describe(), runtime_s=e.runtime_s)

    def _set_slot(self, local_rank: int, **changes: object) -> Slot:
        slots = list(self.snapshot.slots)
        slots[local_rank] = replace(slots[local_rank], **changes)  # type: ignore[arg-type]
        self.snapshot = replace(self.snapshot, slots=tuple(slots))
        return slots[local_rank]

    def _apply(self, action: Action, now: float) -> None:
        c = self._config
        if action.kind is ActionKind.SPAWN:
            self._spawn(action.local_rank, now)
        elif action.kind is ActionKind.RELEASE:
            slot = self.snapshot.slots[action.local_rank]
            assert slot.exit is not None and action.slot_state is not None
            if slot.exit.kind is not ExitKind.SPAWN_FAILED:
                self._revoke(slot.exit)
            self._set_slot(action.local_rank, state=action.slot_state, restart_at=action.restart_at, pid=0)
            if action.slot_state is SlotState.BACKOFF:
                kept = tuple(t for t in self.snapshot.restarts if now - t < c.restart_window_s)  # bounded
                self.snapshot = replace(self.snapshot, restarts=(*kept, now))
                recent = len(kept) + 1
                log.info("worker_restart_scheduled", local_rank=action.local_rank,
                         in_s=round(action.restart_at - now, 3), restarts_in_window=recent,
                         max_restarts=c.max_restarts, reason=action.reason)
                if self._metrics is not None:
                    self._metrics.worker_restarted(action.local_rank)
            if action.next_state is AgentState.STOPPING:
                log.error("restarts_exhausted", local_rank=action.local_rank, reason=action.reason)
                self._event(EventKind.RESTARTS_EXHAUSTED, local_rank=action.local_rank, reason=action.reason)
                self.snapshot = replace(self.snapshot, reason=action.reason)
        elif action.kind is ActionKind.TERMINATE:
            pids = self._supervisor.send_signal(signal.SIGTERM)
            log.info("workers_signalled", signal="SIGTERM", pids=pids, grace_s=c.timeouts.shutdown_grace_s,
                     reason=action.reason)
            if action.next_state is AgentState.DRAINING:
                req = self._drain_request
                cause = ("elasticctl drain" + (f" by {req.requested_by}" if req else "")
                         if self._drain_acted else "stop signal (SIGTERM/SIGINT)")
                self._event(EventKind.NODE_DRAINING, cause=cause, workers=pids)
            self.snapshot = replace(self.snapshot, terminate_deadline=action.until)
        elif action.kind is ActionKind.KILL:
            pids = self._supervisor.kill()
            log.warning("workers_killed", pids=pids, reason=action.reason)
            self.snapshot = replace(self.snapshot, kill_deadline=action.until)
        elif action.kind is ActionKind.KILL_HUNG:
            slot = self.snapshot.slots[action.local_rank]
            pids = self._supervisor.kill([action.local_rank])
            v, m = self.snapshot.view, slot.mark
            log.warning("worker_hung", local_rank=action.local_rank, pid=slot.pid, killed=pids,
                        stalled_s=round(v.read_at - m.at, 2) if v and m else None,
                        last_progress=list(m.key) if m else None, job_step_then=m.job_step if m else None,
                        job_step_now=v.job_step if v else None, hang_timeout_s=c.hang_timeout_s,
                        reason=action.reason)
            self._set_slot(action.local_rank, hang_killed=True)
            if self._metrics is not None:
                self._metrics.worker_hung(action.local_rank)
        elif action.kind is ActionKind.REVOKE_STOPPED:
            slot = self._set_slot(action.local_rank, stop_revoked=True)
            log.warning("worker_stopped", local_rank=action.local_rank, pid=slot.pid,
                        stopped_worker_s=c.stopped_worker_s, reason=action.reason)
            self._event(EventKind.WORKER_STOPPED, local_rank=action.local_rank, pid=slot.pid)
            self._revoke_leases(action.local_rank, slot.pid, self._supervisor.pids(action.local_rank))
        if action.next_state is not None:
            self.snapshot = replace(self.snapshot, state=action.next_state)

    def _spawn(self, local_rank: int, now: float) -> None:
        c = self._config
        slot = self.snapshot.slots[local_rank]
        env = child_environ(c.worker_environ(local_rank))
        try:
            pid = self._supervisor.spawn(local_rank, c.program, env)
        except OSError as exc:
            e = WorkerExit(local_rank, 0, ExitKind.SPAWN_FAILED, detail=f"{c.program[0]}: {exc}")
            self._log_exit(e)
            self._set_slot(local_rank, state=SlotState.EXITED, exit=e, starts=slot.starts + 1)
            return
        self._set_slot(local_rank, state=SlotState.RUNNING, pid=pid, exit=None, starts=slot.starts + 1, mark=None,
                       hang_killed=False, stopped_at=None, stop_revoked=False)
        log.info("worker_started", local_rank=local_rank, pid=pid, start=slot.starts + 1,
                 restart=slot.starts > 0)
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
        for member, lease in found:
            try:
                self._store.revoke_lease(lease)
            except LeaseLost:
                log.info("worker_lease_vanished", local_rank=local_rank, pid=pid, member=member)
                continue
            except EtcdUnavailable as exc:
                log.warning("worker_lease_revoke_failed", local_rank=local_rank, pid=pid, member=member,
                            error=str(exc))
                continue
            log.info("worker_lease_revoked", local_rank=local_rank, pid=pid, member=member, lease=lease,
                     took_s=round(self._clock() - started, 4))
