"""``python -m elasticd.bench agent`` runs end to end (one repetition) and measures every figure.

Not a timed test: the figures' values are not asserted against targets, only that each fault was
injected, observed and survived with no committed step lost.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.testing.localcluster import REPO_ROOT


@pytest.mark.soak  # a benchmark run (~25 s): `pytest -m soak tests/integration/test_bench_agent.py`; what it
@pytest.mark.timeout(180)  # measures is in the default suite (test_node_agent.py, test_agent_faults.py)
def test_bench_agent_measures_crash_stop_hang_drain_and_node_loss_both_ways_with_no_step_lost(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticd.bench",
            "agent",
            "--reps",
            "1",
            "--spare-reps",
            "0",
            "--relay",
            "both",
            "--json",
            "--workdir",
            str(tmp_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    fig = result["figures"]
    assert result["errors"] == [] and result["violations"] == [], result
    assert fig["steps_lost"] == 0 and fig["steps_lost_relay"] == 0
    for mode in ("", "_relay"):
        for name in (
            "crash_detect_s",
            "stop_detect_s",
            "hang_detect_s",
            "node_loss_recovery_s",
            "drain_s",
            "drain_step_time_s",
        ):
            assert isinstance(fig[name + mode], float) and fig[name + mode] > 0, (name + mode, fig)
    assert isinstance(fig["stop_detect_s_relay_ratio"], float)
    # each fault happened: the drained agent exited 0 and the victim's worker started three times
    # (restarted after the crash and after its hang; the stopped one was continued, not restarted)
    for rep in ("rep0", "rep0-relay"):
        agent_logs = {p.name: p.read_text() for p in (tmp_path / rep).glob("agent-*.log")}
        assert '"reason": "drained"' in agent_logs["agent-node-1.log"]
        assert agent_logs["agent-node-2.log"].count('"event": "worker_started"') == 3
        assert agent_logs["agent-node-2.log"].count('"event": "worker_hung"') == 1
        assert ('"event": "relay_started"' in agent_logs["agent-node-2.log"]) == (rep == "rep0-relay")


@pytest.mark.soak  # two agent jobs of four nodes each (~2 minutes): `pytest -m soak tests/integration/test_bench_agent.py`
@pytest.mark.timeout(400)
def test_bench_agent_measures_the_warm_spare_figures_with_no_step_lost(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticd.bench",
            "agent",
            "--reps",
            "0",
            "--spare-reps",
            "1",
            "--json",
            "--workdir",
            str(tmp_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=390,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    fig = result["figures"]
    assert result["errors"] == [] and result["violations"] == [], result
    assert fig["spare_steps_lost"] == 0
    for name in (
        "full_size_s",
        "full_size_s_no_spares",
        "node_replace_s",
        "node_replace_s_no_spares",
        "overhead_ratio",
    ):
        assert isinstance(fig[name], float) and fig[name] > 0, (name, fig)
