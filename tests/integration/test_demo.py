"""The README's main command, ``python -m elasticd.demo``, run as a user runs it (small settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.localcluster import REPO_ROOT

pytestmark = pytest.mark.timeout(180)


def test_demo_kills_a_worker_adds_one_and_passes_its_audit(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    # 150 steps leave the newcomer about 10 s to start and join on a 2-core machine.
    cmd = [sys.executable, "-m", "elasticd.demo", "--steps", "150", "--step-sleep", "0.1",
           "--timeout", "150", "--workdir", str(workdir)]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=170)
    finally:
        if proc.poll() is None:  # the demo stops its own processes when it ends, even on SIGTERM
            proc.terminate()
            proc.communicate(timeout=10)
    tail = out[-6000:]
    assert proc.returncode == 0, tail
    assert "invariants        OK" in out, tail
    assert "result            PASS" in out, tail
    assert "steps committed   150/150" in out, tail
    assert "killed worker 2" in out, tail
    assert "worker 3 joined" in out, tail
    # what the demo printed is what its files say
    assert sorted(p.name for p in (workdir / "audit").glob("*.jsonl")) == [f"worker{i}.jsonl" for i in range(4)]
    assert (workdir / "worker3.log").exists()
