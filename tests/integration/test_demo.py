"""The README's main command, ``python -m elasticd.demo``, run as a user runs it (small settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.testing.localcluster import REPO_ROOT

pytestmark = pytest.mark.timeout(200)


def test_demo_runs_agents_kills_a_worker_drains_a_node_adds_one_and_passes_its_audit(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "elasticd.demo",
        "--steps",
        "200",
        "--step-sleep",
        "0.1",
        "--timeout",
        "150",
        "--workdir",
        str(workdir),
    ]
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
    assert "steps committed   200/200" in out, tail
    assert "killed node-2's worker" in out, tail
    assert "elasticctl --etcd" in out and "drain node-1 --job demo   (exit 0)" in out, tail
    assert "agent node-1 exited 0 (drained)" in out, tail
    assert "node_drained" in out, tail  # elasticctl events at the end
    assert "node-3's worker joined as a newcomer" in out, tail
    assert "agents            node-0: exit 0, node-1: exit 0, node-2: exit 0, node-3: exit 0" in out, tail
    # elasticctl status, printed while the new node trains and at the end
    assert "health      HEALTHY: world size 3 = max_workers 3" in out, tail
    assert "health      FINISHED: finished at step 200" in out, tail
    # what the demo printed is what its files say
    assert sorted(p.name for p in (workdir / "audit").glob("*.jsonl")) == [f"node-{i}.jsonl" for i in range(4)]
    assert sorted(p.name for p in workdir.glob("agent-*.log")) == [f"agent-node-{i}.log" for i in range(4)]
