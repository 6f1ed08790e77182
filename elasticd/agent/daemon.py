"""The daemon skeleton of both node agents: elastic mode's ``Agent`` and restart mode's ``GroupRestartAgent``.

Owns what the two share as daemons: the exit codes and ``AgentOutcome``; the ``Waker`` (bounded
sleeps that a signal, a worker's exit or ``request_stop`` cut short); the restart budget
(``restarts_in_window``, ``restart_backoff_s``); the stop ladder (``stop_ladder``: SIGTERM, SIGKILL
after ``shutdown_grace_s`` or at a second stop request, then give up after ``kill_wait_s``), pure;
and ``AgentDaemon``, the frame that both executors fill in: ``run`` (the start and end lines, the
signals, the top-level catch), stop requests, systemd's watchdog pacing and READY/STOPPING notices,
how long the loop may sleep, starting one worker and killing them all.

Never decides what an agent does next (``elastic_decide`` and ``restart_decide`` do), never reads
or writes etcd itself (each executor does, through the store it is given), never imports torch.
"""

from __future__ import annotations

import select
import signal
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import FrameType
from typing import TypeVar

import structlog

from elasticd.agent.sdnotify import Notifier
from elasticd.agent.supervisor import ExitKind, Supervisor, WorkerExit
from elasticd.config import AgentConfig
from elasticd.errors import EtcdUnavailable, PermissionDenied
from elasticd.log import bind_context
from elasticd.retry import Clock
from elasticd.store.kv import KeyValueStore

log = structlog.get_logger(__name__)

T = TypeVar("T")

EXIT_OK = 0
EXIT_FATAL = 1
# the configuration cannot work: another live agent of the job has this node id, the etcd user's
# role does not cover the job (``PermissionDenied``), or etcd never answered since the start
EXIT_CONFIG = 2
# the job stopped on a bug, not a fault: the same exception at the same step in two or more workers
# (``wire.failures``), or a worker that exited ``EXIT_NO_RESTART``; restarting cannot get past it
EXIT_JOB_FAILED = 3


@dataclass(frozen=True)
class AgentOutcome:
    exit_code: int
    reason: str


# ---------------------------------------------------------------------------------------------
# The restart budget and the stop ladder (pure)


def restarts_in_window(restarts: Iterable[float], now: float, window_s: float) -> int:
    """How many of the restart times lie within the last ``window_s`` seconds before ``now``."""
    return sum(1 for t in restarts if now - t < window_s)


def restart_backoff_s(recent_restarts: int, initial_s: float, max_s: float) -> float:
    """The wait before the next restart: ``initial_s * 2**recent_restarts``, at most ``max_s``."""
    return min(max_s, initial_s * 2.0 ** min(recent_restarts, 64))


class Rung(StrEnum):
    """Where the stop ladder stands: WAIT (for the workers) -> KILL -> WAIT (for the reaping) -> GIVE_UP."""

    WAIT = "wait"  # the workers were signalled: wait until `until`
    KILL = "kill"  # SIGKILL the workers (and their children) now; give up on them after `until`
    GIVE_UP = "give_up"  # they outlived SIGKILL by kill_wait_s: the agent exits 1 (workers_not_reaped)


@dataclass(frozen=True)
class LadderStep:
    rung: Rung
    reason: str
    until: float | None = None


def stop_ladder(
    now: float,
    *,
    terminate_deadline: float,
    kill_deadline: float | None,
    stop_requests: int,
    grace_s: float,
    kill_wait_s: float,
    workers: str = "workers",
) -> LadderStep:
    """The next step in stopping workers that were sent SIGTERM. Pure.

    Args:
        terminate_deadline: when shutdown_grace_s ends (SIGKILL then).
        kill_deadline: when kill_wait_s after the SIGKILL ends; None: no SIGKILL sent yet.
        stop_requests: SIGTERM/SIGINT received; a second one kills at once.
        workers: who outlived SIGKILL, for the ``workers_not_reaped`` reason.
    """
    if kill_deadline is not None:
        if now >= kill_deadline:
            return LadderStep(
                Rung.GIVE_UP, f"workers_not_reaped: {workers} outlived SIGKILL by kill_wait_s ({kill_wait_s:g} s)"
            )
        return LadderStep(Rung.WAIT, "waiting for killed workers to be reaped", until=kill_deadline)
    if stop_requests >= 2:
        return LadderStep(Rung.KILL, "a second stop request", until=now + kill_wait_s)
    if now >= terminate_deadline:
        return LadderStep(
            Rung.KILL, f"workers still running after shutdown_grace_s ({grace_s:g} s)", until=now + kill_wait_s
        )
    return LadderStep(Rung.WAIT, "waiting for the workers to stop", until=terminate_deadline)


# ---------------------------------------------------------------------------------------------
# The skeleton


class Waker:
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

    def __enter__(self) -> Waker:
        if self._install:
            self._old_fd = signal.set_wakeup_fd(self._w.fileno(), warn_on_full_buffer=False)
            for sig, handler in (
                (signal.SIGTERM, self._on_stop),
                (signal.SIGINT, self._on_stop),
                (signal.SIGCHLD, self._on_wake),
            ):
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


class AgentDaemon(ABC):
    """One node agent as a daemon; a mode fills in ``_serve`` (its claim, its loop, its cleanup)."""

    def __init__(
        self,
        config: AgentConfig,
        store: KeyValueStore,
        supervisor: Supervisor | None,
        clock: Clock,
        notifier: Notifier | None,
        watchdog_s: float | None,
    ) -> None:
        """
        Args:
            config: the agent's configuration (the mode's executor reads what it needs).
            store: etcd (or a fake); the mode's executor does the reads and writes.
            supervisor: the worker processes; None: a new ``Supervisor`` on ``clock``.
            clock: the monotonic clock every deadline is measured on.
            notifier: where READY/WATCHDOG/STATUS/STOPPING go (systemd); None: nowhere.
            watchdog_s: ping the watchdog this often (half of systemd's WatchdogSec); None: never.
        """
        self._config = config
        self._store = store
        self._clock = clock
        self._supervisor = supervisor or Supervisor(clock)
        self._notifier = notifier or Notifier(None)
        self._watchdog_s = watchdog_s
        self._last_ping = float("-inf")
        self._ready_sent = False
        self._stopping_sent = False
        self._waker: Waker | None = None
        self._pending_stop = 0

    def request_stop(self) -> None:
        """Ask the agent to stop, as SIGTERM does (for callers that are not signals)."""
        self._pending_stop += 1
        if self._waker is not None:
            self._waker.poke()

    def run(self, install_signals: bool = True) -> AgentOutcome:
        """Run until the mode's decision says exit: the workers are done, the node drained or
        left, or the agent must give up.

        Args:
            install_signals: handle SIGTERM/SIGINT/SIGCHLD (only possible in the main thread).

        Returns:
            The exit code (0 done, drained or left; 1 fatal; 2 the node id is another live agent's,
            elastic mode) and the reason.
        """
        bind_context(node=self._config.node_id)
        log.info("agent_started", **self._started_fields())
        with Waker(install_signals) as waker:
            self._waker = waker
            try:
                outcome = self._serve(waker)
            finally:
                self._waker = None
                self._closed()
        level = log.info if outcome.exit_code == EXIT_OK else log.error
        level("agent_stopped", exit_code=outcome.exit_code, reason=outcome.reason)
        return outcome

    @abstractmethod
    def _serve(self, waker: Waker) -> AgentOutcome:
        """Everything between the start and the end: the mode's claim, its loop and its cleanup."""

    @abstractmethod
    def _loop(self, waker: Waker) -> AgentOutcome:
        """The mode's executor loop: observe, decide, apply, until the decision says exit."""

    def _closed(self) -> None:
        """After ``_serve``, however it ended (a mode's threads stop here)."""

    def _started_fields(self) -> dict[str, object]:
        c = self._config
        return dict(
            job=c.world.job_id,
            node=c.node_id,
            program=list(c.program),
            nproc_per_node=c.nproc_per_node,
            spares_per_node=c.spares_per_node,
            standby_node=c.standby_node,
            min_workers=c.world.min_workers,
            max_workers=c.world.max_workers,
            etcd=list(c.etcd.endpoints),
            max_restarts=c.max_restarts,
            restart_window_s=c.restart_window_s,
        )

    def _guarded_loop(self, waker: Waker, *, stop_workers: bool = True) -> AgentOutcome:
        """``_loop``, where any surprise becomes a fatal stop (``agent_failed``), and etcd's
        permission denied (never retried: the etcd user's role does not cover the job) exit 2.

        Args:
            stop_workers: on a surprise, stop the workers here (False: the caller always does).
        """
        try:
            return self._loop(waker)
        except PermissionDenied as exc:
            log.error("agent_permission_denied", error=str(exc))
            if stop_workers:
                self._supervisor.terminate_all(self._config.timeouts.shutdown_grace_s, self._config.kill_wait_s)
            return AgentOutcome(EXIT_CONFIG, str(exc))
        except Exception as exc:  # the top-level loop: any surprise becomes a fatal stop
            log.error("agent_failed", error=repr(exc), exc_info=True)
            if stop_workers:
                self._supervisor.terminate_all(self._config.timeouts.shutdown_grace_s, self._config.kill_wait_s)
            return AgentOutcome(EXIT_FATAL, f"agent_failed: {exc!r}")

    def _until_etcd_answers(self, waker: Waker, call: Callable[[], T]) -> T | AgentOutcome:
        """The agent's first use of etcd, ``call``, tried again every ``keepalive_s`` while etcd
        does not answer (an agent started during an outage waits rather than exit into systemd's
        restart loop), logging ``agent_waiting_for_etcd`` with the endpoints. Gives up after
        ``etcd_outage_s`` with exit 2: an etcd that never answered this agent is most often a wrong
        ``--etcd`` (systemd does not restart it; ``RestartPreventExitStatus=2``). Returns ``call``'s
        result, or the outcome to exit with (also a permission denied: exit 2, or a stop: 0)."""
        c = self._config
        ends = self._clock() + c.timeouts.etcd_outage_s
        while True:
            try:
                return call()
            except PermissionDenied as exc:  # the user's role does not cover the job: waiting cannot help
                log.error("agent_permission_denied", error=str(exc))
                return AgentOutcome(EXIT_CONFIG, str(exc))
            except EtcdUnavailable as exc:
                now = self._clock()
                if now >= ends:
                    return AgentOutcome(
                        EXIT_CONFIG,
                        f"etcd_unreachable: no etcd at {','.join(c.etcd.endpoints)} answered since the agent "
                        f"started, for etcd_outage_s ({c.timeouts.etcd_outage_s:g} s); check --etcd (or "
                        f"ELASTICD_ETCD, etcd in the config file) and that etcd runs: {exc}",
                    )
                if self._stop_requests(waker) > 0:
                    return AgentOutcome(EXIT_OK, "stopped while waiting for etcd")
                log.warning(
                    "agent_waiting_for_etcd",
                    endpoints=list(c.etcd.endpoints),
                    error=str(exc)[:200],
                    gives_up_in_s=round(ends - now, 1),
                )
                self._ping(now)  # the systemd watchdog, while the agent waits
                waker.wait(min(c.timeouts.keepalive_s, ends - now))

    def _stop_requests(self, waker: Waker) -> int:
        """SIGTERM/SIGINT received plus ``request_stop`` calls."""
        return waker.stop_requests + self._pending_stop

    def _ping(self, now: float) -> None:
        """systemd's watchdog, when its interval has passed (from the loop, so a stuck loop misses it)."""
        if self._watchdog_s is not None and now - self._last_ping >= self._watchdog_s:
            self._notifier.watchdog()
            self._last_ping = now

    def _notify_ready(self) -> bool:
        """READY to systemd, once. Returns whether it was sent now."""
        if self._ready_sent:
            return False
        self._notifier.ready()
        self._ready_sent = True
        return True

    def _notify_stopping(self) -> None:
        """STOPPING to systemd, once."""
        if not self._stopping_sent:
            self._notifier.stopping()
            self._stopping_sent = True

    def _sleep_s(self, now: float, until: float | None, *deadlines: float) -> float:
        """How long the loop may sleep: at most ``poll_interval_s``, and not past ``until``, any of
        ``deadlines`` (monotonic) or the next watchdog ping."""
        ends = list(deadlines)
        if until is not None:
            ends.append(until)
        if self._watchdog_s is not None:
            ends.append(self._last_ping + self._watchdog_s)
        return max(0.0, min([self._config.poll_interval_s, *(t - now for t in ends)]))

    def _spawn_worker(self, local_rank: int, env: Mapping[str, str]) -> int | WorkerExit:
        """Start the configured program as worker ``local_rank``. Returns its pid, or, when it cannot
        be started, its exit (``SPAWN_FAILED``), which the mode handles as any other exit."""
        c = self._config
        try:
            return self._supervisor.spawn(local_rank, c.program, env)
        except OSError as exc:
            return WorkerExit(local_rank, 0, ExitKind.SPAWN_FAILED, detail=f"{c.program[0]}: {exc}")

    def _kill_workers(self, reason: str) -> None:
        """SIGKILL every running worker and its children."""
        pids = self._supervisor.kill()
        log.warning("workers_killed", pids=pids, reason=reason)
