"""``python -m elasticd.bench host-loss`` runs end to end (network-namespace hosts, as root) and
measures its figures, with bare workers and under agents.

Not a timed test: the figures are not asserted against their target, only that every cut was
measured in both jobs of each form, the cut hosts rejoined, and nothing was lost or repeated. The reach check
itself is in the default suite (``test_link_cut.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elasticd.chaos.netns import unusable_here
from elasticd.testing.localcluster import REPO_ROOT


@pytest.mark.soak  # benchmark runs (~30 s, ~60 s): `pytest -m soak tests/integration/test_bench_hostloss.py`
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("flags", "modes", "figures"),
    [
        ((), ("reach", "lease"), ("host_loss_recovery_s", "host_loss_recovery_lease_s")),
        (("--agents",), ("relay_off", "relay_on"), ("host_loss_recovery_s_relay_off", "host_loss_recovery_s_relay_on")),
    ],
    ids=["bare workers", "under agents"],
)
def test_bench_host_loss_measures_both_jobs(
    flags: tuple[str, ...], modes: tuple[str, ...], figures: tuple[str, ...]
) -> None:
    why = unusable_here(os.getpid())
    if why:
        pytest.skip(f"needs network-namespace hosts: {why}")
    proc = subprocess.run(
        [sys.executable, "-m", "elasticd.bench", "host-loss", *flags, "--reps", "2", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    result = json.loads(proc.stdout)
    fig = result["figures"]
    assert result["violations"] == [] and result["errors"] == [], result
    assert fig["steps_lost"] == 0, fig
    for mode in modes:
        assert len(result["runs"][mode]["recovery_s"]) == 2 and len(result["runs"][mode]["rejoin_s"]) == 2, result
    assert all(fig[name] > 0 for name in figures), fig
