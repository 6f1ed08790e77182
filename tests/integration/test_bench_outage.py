"""``python -m elasticd.bench outage`` runs end to end with a short outage and measures its figures.

Not a timed test: the rates are not asserted against the target, only that the outage happened,
training went on through it, and nothing was lost, repeated or regrouped.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from elasticd.bench.outage import rate
from elasticd.testing.localcluster import REPO_ROOT


def test_rate_counts_steps_in_the_window() -> None:
    times = {1: 10.0, 2: 10.5, 3: 11.0, 4: 12.5}
    assert rate(times, 10.0, 12.0) == 1.5
    with pytest.raises(ValueError):
        rate(times, 5.0, 5.0)


@pytest.mark.soak  # a benchmark run (~20 s): `pytest -m soak tests/integration/test_bench_outage.py`; the
@pytest.mark.timeout(150)  # behaviour it measures is in the default suite (test_faults.py's etcd outage test)
def test_bench_outage_trains_through_an_etcd_outage() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "elasticd.bench",
            "outage",
            "--workers",
            "2",
            "--outage-s",
            "6",
            "--window-s",
            "3",
            "--step-sleep",
            "0.01",
            "--json",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    result = json.loads(proc.stdout)
    fig = result["figures"]
    assert result["violations"] == [], result
    assert (fig["steps_lost"], fig["regroups"], fig["worker_failures"]) == (0, 0, 0), fig
    assert fig["rate_during_steps_s"] > 0 and fig["outage_rate_ratio"] > 0, fig
