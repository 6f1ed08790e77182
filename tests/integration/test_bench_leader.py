"""``python -m elasticd.bench leader`` runs end to end and measures its figures.

Not a timed test: the rates are not asserted against the target, only that the leader was killed,
training went on, and nothing was lost, repeated or regrouped.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elasticd.bench.leader import gaps_within
from elasticd.testing.localcluster import REPO_ROOT


def test_gaps_are_between_consecutive_commits_inside_the_window() -> None:
    times = {1: 9.0, 2: 10.0, 3: 10.5, 4: 12.0, 5: 13.0}
    assert gaps_within(times, 10.0, 12.5) == [0.5, 1.5]
    assert gaps_within(times, 20.0, 30.0) == []


@pytest.mark.soak  # a benchmark run (~40 s): `pytest -m soak tests/integration/test_bench_leader.py`; the
@pytest.mark.timeout(200)  # behaviour it measures is in the default suite (test_etcd_cluster.py)
def test_bench_leader_trains_through_leader_kills() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticd.bench",
            "leader",
            "--workers",
            "2",
            "--reps",
            "2",
            "--window-s",
            "3",
            "--step-sleep",
            "0.02",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=190,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    result = json.loads(proc.stdout)
    fig = result["figures"]
    assert result["violations"] == [], result
    assert (fig["steps_lost"], fig["regroups"], fig["worker_failures"]) == (0, 0, 0), fig
    assert fig["rate_after_kill_steps_s"] > 0 and fig["leader_rate_ratio"] > 0, fig
