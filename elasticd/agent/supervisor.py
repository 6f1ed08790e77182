"""Local worker processes: spawn, watch, terminate (grace, then kill) and classify their exits.

Owns the worker processes of one agent, keyed by local rank: starting a program with a given
environment, reaping the ones that ended (``poll``), signalling them, killing them with their
children, and sampling each one's memory and CPU use for status. It is the only module that imports
psutil. It knows nothing about membership, etcd or the restart policy: the agent decides, the
supervisor does. Nothing here blocks without a bound.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import psutil
import structlog

from elasticd.retry import Clock

log = structlog.get_logger(__name__)


class ExitKind(StrEnum):
    """How a worker process ended."""

    SUCCEEDED = "succeeded"  # exit code 0: its work is done
    FAILED = "failed"  # a non-zero exit code
    SIGNALED = "signaled"  # killed by a signal (SIGKILL, SIGSEGV, the OOM killer, ...)
    SPAWN_FAILED = "spawn_failed"  # it never ran: the program could not be started


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9; ``signal 64`` for a number without a name."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def classify_exit(returncode: int) -> tuple[ExitKind, int | None, int | None]:
    """Turn a ``Popen.returncode`` into (kind, exit code, signal number). Pure."""
    if returncode == 0:
        return ExitKind.SUCCEEDED, 0, None
    if returncode < 0:
        return ExitKind.SIGNALED, None, -returncode
    return ExitKind.FAILED, returncode, None


@dataclass(frozen=True)
class WorkerStats:
    """One sample of a worker's resource use."""

    local_rank: int
    pid: int
    rss_bytes: int
    cpu_percent: float  # since the previous sample; 100 is one full core
    sampled_at: float  # monotonic


@dataclass(frozen=True)
class WorkerExit:
    """A worker that ended, as the supervisor reaped it."""

    local_rank: int
    pid: int
    kind: ExitKind
    code: int | None = None
    signal: int | None = None
    runtime_s: float = 0.0
    detail: str = ""  # why it could not be started (SPAWN_FAILED)
    descendants: tuple[int, ...] = ()  # its child processes last seen (a wrapper's real worker)
    last_stats: WorkerStats | None = None

    @property
    def ok(self) -> bool:
        return self.kind is ExitKind.SUCCEEDED

    def describe(self) -> str:
        """``exited with code 1``, ``was killed by SIGKILL``, ``could not be started: ...``."""
        if self.kind is ExitKind.SIGNALED:
            return f"was killed by {signal_name(self.signal or 0)}"
        if self.kind is ExitKind.SPAWN_FAILED:
            return f"could not be started: {self.detail}"
        return f"exited with code {self.code}"


@dataclass
class _Worker:
    local_rank: int
    proc: psutil.Popen
    started_at: float
    descendants: set[int] = field(default_factory=set)
    stats: WorkerStats | None = None


class Supervisor:
    """The running worker processes of one agent, at most one per local rank.

    Not thread-safe: one thread (the agent's loop) calls it.
    """

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._workers: dict[int, _Worker] = {}

    def spawn(self, local_rank: int, argv: Sequence[str], env: Mapping[str, str]) -> int:
        """Start ``argv`` as worker ``local_rank`` with exactly the environment ``env``.

        Its stdout and stderr are the agent's (so journald or the caller's log gets them).

        Returns:
            The worker's pid.

        Raises:
            OSError: the program could not be started (not found, not executable, ...).
        """
        assert local_rank not in self._workers, f"local rank {local_rank} is already running"
        proc = psutil.Popen(list(argv), env=dict(env))
        try:
            proc.cpu_percent(interval=None)  # the first reading is a baseline; later ones are since it
        except psutil.Error:
            pass  # it ended at once: the next poll() reports it
        self._workers[local_rank] = _Worker(local_rank, proc, self._clock())
        return int(proc.pid)

    def running(self) -> dict[int, int]:
        """Local rank -> pid of every worker not yet reaped."""
        return {lr: int(w.proc.pid) for lr, w in self._workers.items()}

    def poll(self) -> list[WorkerExit]:
        """Reap the workers that ended since the last call (never blocks)."""
        exits: list[WorkerExit] = []
        for lr, w in list(self._workers.items()):
            rc = w.proc.poll()
            if rc is None:
                continue
            del self._workers[lr]
            kind, code, sig = classify_exit(int(rc))
            exits.append(
                WorkerExit(
                    local_rank=lr,
                    pid=int(w.proc.pid),
                    kind=kind,
                    code=code,
                    signal=sig,
                    runtime_s=round(self._clock() - w.started_at, 3),
                    descendants=tuple(sorted(w.descendants)),
                    last_stats=w.stats,
                )
            )
        return exits

    def send_signal(self, signum: int, local_ranks: Iterable[int] | None = None) -> list[int]:
        """Send ``signum`` to the given workers (default: all); return the pids signalled."""
        ranks = list(self._workers) if local_ranks is None else [lr for lr in local_ranks if lr in self._workers]
        sent: list[int] = []
        for lr in ranks:
            w = self._workers[lr]
            try:
                w.proc.send_signal(signum)
                sent.append(int(w.proc.pid))
            except psutil.Error:
                pass  # it ended meanwhile: the next poll() reports it
        return sent

    def stopped(self) -> frozenset[int]:
        """The local ranks whose worker process is stopped now (SIGSTOP, SIGTSTP: state T). A tracing
        stop (a debugger, py-spy) is not counted; a worker that ended meanwhile is skipped."""
        found = set()
        for lr, w in self._workers.items():
            try:
                if w.proc.status() == psutil.STATUS_STOPPED:
                    found.add(lr)
            except psutil.Error:
                continue
        return frozenset(found)

    def pids(self, local_rank: int) -> frozenset[int]:
        """The pid of worker ``local_rank`` and of its children last seen (empty: not running)."""
        w = self._workers.get(local_rank)
        return frozenset({int(w.proc.pid), *w.descendants}) if w is not None else frozenset()

    def kill(self, local_ranks: Iterable[int] | None = None) -> list[int]:
        """SIGKILL the given workers (default: all) and each one's child processes; return the pids killed."""
        killed: list[int] = []
        ranks = list(self._workers) if local_ranks is None else [lr for lr in local_ranks if lr in self._workers]
        for w in (self._workers[lr] for lr in ranks):
            try:
                tree = [w.proc, *w.proc.children(recursive=True)]
            except psutil.Error:
                tree = [w.proc]
            for p in tree:
                try:
                    p.kill()
                    killed.append(int(p.pid))
                except psutil.Error:
                    pass
        return killed

    def sample(self) -> dict[int, WorkerStats]:
        """Measure each worker's RSS and CPU use now (and note its children's pids)."""
        now = self._clock()
        for w in self._workers.values():
            try:
                with w.proc.oneshot():
                    rss = int(w.proc.memory_info().rss)
                    cpu = float(w.proc.cpu_percent(interval=None))
                w.descendants.update(int(c.pid) for c in w.proc.children(recursive=True))
            except psutil.Error:
                continue  # it ended meanwhile: the next poll() reports it
            w.stats = WorkerStats(w.local_rank, int(w.proc.pid), rss, round(cpu, 1), now)
        return self.stats()

    def stats(self) -> dict[int, WorkerStats]:
        """The last sample of each running worker."""
        return {lr: w.stats for lr, w in self._workers.items() if w.stats is not None}

    def terminate_all(self, grace_s: float, kill_wait_s: float) -> list[WorkerExit]:
        """Stop every worker: SIGTERM, up to ``grace_s`` to exit, then SIGKILL and up to
        ``kill_wait_s`` to be reaped. Blocks at most ``grace_s + kill_wait_s``.

        Returns:
            The exits reaped (a worker that outlives both bounds is left running and not listed).
        """
        procs = [w.proc for w in self._workers.values()]
        if not procs:
            return []
        self.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs(procs, timeout=grace_s)
        if alive:
            self.kill()
            psutil.wait_procs(alive, timeout=kill_wait_s)
        return self.poll()
