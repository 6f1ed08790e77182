"""The node's health check: an operator's command, run before workers start and every interval.

Owns ``HealthResult`` (one run: passed or not, the output's tail, when), ``run_check`` (the command
under ``sh -c`` in a session of its own, killed whole at ``health_check_timeout_s``), and
``HealthChecker``, the thread that runs it at once, every ``health_check_interval_s`` and whenever
``request`` asks (a worker exited: a restart waits for a newer result), keeping the newest
result and waking the agent's loop after each run. What a result means for the workers is
``elastic_decide``'s (a failed check keeps the node out: workers stopped, none started until a
check passes). Never imports torch.

A check passes when the command exits 0 within its timeout. Examples (docs/agent.md): on a GPU
node, ``nvidia-smi --query-gpu=ecc.errors.uncorrected.volatile.total --format=csv,noheader`` that
must print only zeros; on a CPU host, a free-disk and free-memory check.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from elasticd.retry import Clock

log = structlog.get_logger(__name__)

OUTPUT_CHARS = 2000  # the output's tail kept in a result
SHOWN_OUTPUT_CHARS = 300  # the tail shown in the node record, a stop reason and elasticctl status


@dataclass(frozen=True)
class HealthResult:
    passed: bool
    output: str  # stdout and stderr together, their tail; or why the command did not finish
    at: float  # monotonic time the run ended
    duration_s: float


def run_check(command: str, timeout_s: float, clock: Clock) -> HealthResult:
    """Run ``command`` with ``sh -c``; it passes when it exits 0 within ``timeout_s`` (then the whole
    session it started is SIGKILLed, and it fails)."""
    started = clock()
    try:
        proc = subprocess.Popen(
            ["sh", "-c", command],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as exc:
        return HealthResult(False, f"could not run the check: {exc}", clock(), clock() - started)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        text = out.decode(errors="replace")[-OUTPUT_CHARS:]
        passed = proc.returncode == 0
        if not passed:
            text = f"exit code {proc.returncode}: {text}"
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        passed = False
        text = (
            f"no answer within health_check_timeout_s ({timeout_s:g} s): {out.decode(errors='replace')[-OUTPUT_CHARS:]}"
        )
    return HealthResult(passed, text.strip(), clock(), clock() - started)


class HealthChecker:
    """A thread that runs the node's health check at once, every ``interval_s`` (0: only when asked)
    and at each ``request``; ``latest`` is the newest result (None before the first one)."""

    def __init__(
        self, command: str, timeout_s: float, interval_s: float, clock: Clock, on_result: Callable[[], None]
    ) -> None:
        self._command, self._timeout_s, self._interval_s = command, timeout_s, interval_s
        self._clock, self._on_result = clock, on_result
        self._latest: HealthResult | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elasticd-health", daemon=True)
        self._thread.start()

    def latest(self) -> HealthResult | None:
        return self._latest

    def request(self) -> None:
        """Run the check again now (after the run under way, if one is)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(self._timeout_s + 1.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # a request from now on asks for a run after this one
            result = run_check(self._command, self._timeout_s, self._clock)
            previous, self._latest = self._latest, result
            if previous is None or previous.passed != result.passed:
                level = log.info if result.passed else log.error
                level(
                    "health_check_passed" if result.passed else "health_check_failed",
                    output=result.output[-500:],
                    duration_s=round(result.duration_s, 3),
                )
            self._on_result()
            self._wake.wait(self._interval_s if self._interval_s > 0 else None)
