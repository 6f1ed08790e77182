"""The supervisor on real, tiny processes: exit classification, signals, bounded termination, stats."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from elasticd.agent.supervisor import (
    ExitKind,
    Supervisor,
    WorkerExit,
    classify_exit,
    signal_name,
)

pytestmark = pytest.mark.timeout(60)

SLEEPER = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "sys.stdout.write('up\\n'); sys.stdout.flush(); time.sleep(60)",
]


@pytest.mark.parametrize(
    ("returncode", "kind", "code", "sig", "described"),
    [
        (0, ExitKind.SUCCEEDED, 0, None, "exited with code 0"),
        (1, ExitKind.FAILED, 1, None, "exited with code 1"),
        (137, ExitKind.FAILED, 137, None, "exited with code 137"),
        (-9, ExitKind.SIGNALED, None, 9, "was killed by SIGKILL"),
        (-15, ExitKind.SIGNALED, None, 15, "was killed by SIGTERM"),
    ],
)
def test_classify_exit(returncode: int, kind: ExitKind, code: int | None, sig: int | None, described: str) -> None:
    assert classify_exit(returncode) == (kind, code, sig)
    assert WorkerExit(0, 1, kind, code, sig).describe() == described


def test_signal_name_of_an_unnamed_number() -> None:
    assert signal_name(9) == "SIGKILL" and signal_name(200) == "signal 200"


def _wait_exits(sup: Supervisor, n: int, timeout: float = 10.0) -> list[WorkerExit]:
    deadline = time.monotonic() + timeout
    exits: list[WorkerExit] = []
    while len(exits) < n and time.monotonic() < deadline:
        exits += sup.poll()
        time.sleep(0.01)
    assert len(exits) == n, exits
    return sorted(exits, key=lambda e: e.local_rank)


def test_exits_are_reaped_and_classified() -> None:
    sup = Supervisor()
    sup.spawn(0, [sys.executable, "-c", "pass"], {})
    sup.spawn(1, [sys.executable, "-c", "import sys; sys.exit(4)"], {})
    pid = sup.spawn(2, SLEEPER, {})
    assert set(sup.running()) == {0, 1, 2}
    sup.send_signal(signal.SIGKILL, [2])
    exits = _wait_exits(sup, 3)
    assert [(e.local_rank, e.kind, e.code, e.signal) for e in exits] == [
        (0, ExitKind.SUCCEEDED, 0, None),
        (1, ExitKind.FAILED, 4, None),
        (2, ExitKind.SIGNALED, None, 9),
    ]
    assert exits[2].pid == pid and sup.running() == {} and sup.poll() == []


def test_the_environment_is_exactly_the_one_given() -> None:
    sup = Supervisor()
    sup.spawn(
        0,
        [
            sys.executable,
            "-c",
            "import os, sys; sys.exit(0 if os.environ.get('A') == '1' and 'HOME' not in os.environ else 1)",
        ],
        {"A": "1"},
    )
    (e,) = _wait_exits(sup, 1)
    assert e.ok, e


def test_a_program_that_does_not_exist_raises_oserror() -> None:
    with pytest.raises(OSError):
        Supervisor().spawn(0, ["/nonexistent/worker"], {})


def test_terminate_all_is_bounded_and_kills_what_ignores_sigterm() -> None:
    sup = Supervisor()
    sup.spawn(0, SLEEPER, {})
    sup.spawn(1, STUBBORN, {})
    time.sleep(0.5)  # let the stubborn one install its handler (a bound, not a synchronisation)
    started = time.monotonic()
    exits = sorted(sup.terminate_all(grace_s=0.5, kill_wait_s=5.0), key=lambda e: e.local_rank)
    assert time.monotonic() - started < 5.0
    assert [(e.kind, e.signal) for e in exits] == [(ExitKind.SIGNALED, 15), (ExitKind.SIGNALED, 9)]
    assert sup.running() == {}


def test_kill_takes_the_workers_children_too() -> None:
    sup = Supervisor()
    sup.spawn(
        0,
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']); time.sleep(60)",
        ],
        {},
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sup.sample()
        if sup.running() and _descendants(sup):
            break
        time.sleep(0.05)
    child = _descendants(sup)
    assert child, "the worker's child did not show up"
    killed = sup.kill()
    (e,) = _wait_exits(sup, 1)
    assert e.signal == 9 and set(child) <= set(killed) and set(child) <= set(e.descendants)


def _descendants(sup: Supervisor) -> list[int]:
    return sorted(p for w in sup._workers.values() for p in w.descendants)


def test_sample_records_memory_and_cpu() -> None:
    sup = Supervisor()
    sup.spawn(0, [sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"], {})
    time.sleep(0.3)
    stats = sup.sample()
    assert stats[0].rss_bytes > 1_000_000 and stats[0].cpu_percent > 10.0, stats
    sup.terminate_all(grace_s=1.0, kill_wait_s=5.0)
