"""``python -m elasticd.chaos`` run as a user runs it: a short run that injects every fault kind
possible on loopback (a 3-member etcd cluster included) and must pass every invariant, and the
30-minute soak (``-m soak``; with ``link_down`` where network namespaces work). The netns run with
``link_down`` is in ``test_chaos_netns.py``. The checker's own detection of violations is tested in
``tests/unit/test_chaos_logic.py`` on hand-made records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.chaos.schedule import kinds_possible
from elasticd.testing.localcluster import REPO_ROOT


def _run_chaos(workdir: Path, timeout_s: float, *args: str) -> tuple[int, dict[str, object], str]:
    """Run the suite with ``--json``; (exit code, the JSON object, what it printed on stderr)."""
    cmd = [sys.executable, "-m", "elasticd.chaos", "--json", "--workdir", str(workdir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:  # it stops every process it started on SIGTERM too
            proc.terminate()
            proc.communicate(timeout=30)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON object printed (exit {proc.returncode})\n{err[-6000:]}"
    return proc.returncode, json.loads(lines[-1]), err


def _failed(report: dict[str, object]) -> list[str]:
    invariants = report["invariants"]
    assert isinstance(invariants, list)
    return [f"{i['name']}: {i['detail']}" for i in invariants if not i["ok"]]


@pytest.mark.timeout(180)
def test_a_short_run_with_every_fault_kind_keeps_every_invariant(tmp_path: Path) -> None:
    code, report, err = _run_chaos(
        tmp_path / "chaos", 170,
        "--minutes", "1", "--mean-interval-s", "2.5", "--warmup-s", "3", "--etcd-members", "3",
        "--min-nodes", "1", "--seed", "3", "--no-netns",  # loopback; link_down: test_chaos_netns.py
    )
    tail = err[-5000:]
    assert not _failed(report), f"{_failed(report)}\nstalls {report['stalls']}\n{tail}"
    assert code == 0 and report["ok"] is True, tail
    injected = report["injected"]
    assert isinstance(injected, dict)
    assert set(injected) == {k.value for k in kinds_possible(3)}
    missed = [k for k, n in injected.items() if n < 1]
    assert not missed, f"kinds never injected: {missed}\n{tail}"
    assert report["steps"] == report["target_steps"]
    assert report["status_samples"], tail
    assert isinstance(report["ettr"], float) and 0 < report["ettr"] <= 1.2
    assert (tmp_path / "chaos" / "audit").is_dir()


@pytest.mark.soak
@pytest.mark.timeout(30 * 60 + 900)
def test_soak_thirty_minutes_of_faults(tmp_path: Path) -> None:
    code, report, err = _run_chaos(
        tmp_path / "chaos", 30 * 60 + 840,
        "--minutes", "30", "--mean-interval-s", "10", "--etcd-members", "3", "--seed", "30",
    )
    assert not _failed(report), f"{_failed(report)}\nstalls {report['stalls']}\n{err[-5000:]}"
    assert code == 0
    injected = report["injected"]
    assert isinstance(injected, dict)
    assert set(injected) >= {k.value for k in kinds_possible(3)}  # link_down too where netns works
    assert all(n >= 1 for n in injected.values()), injected
