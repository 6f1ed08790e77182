"""``python -m elasticd.chaos --netns``: every node a network-namespace host on a bridge the run
creates, and the ``link_down`` fault (a host's veth taken down for longer than the lease, then up)
among a couple of others. Needs root and a working ``ip netns``; skipped otherwise, with the reason.
The run must keep every invariant (the cut-off host is dropped, the others go on within the stall
bound, the host rejoins) and delete every namespace and link it made."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.chaos.netns import netns_unusable, probe_netns
from elasticd.testing.localcluster import REPO_ROOT

pytestmark = pytest.mark.timeout(180)


def _why_not() -> str:
    ip = shutil.which("ip")
    euid = os.geteuid()
    probed = probe_netns(ip, os.getpid()) if euid == 0 and ip is not None else ""
    return netns_unusable(euid, ip, probed)


def _left_behind(prefix: str) -> list[str]:
    """Namespaces and links whose names start with ``prefix`` (the run's own)."""
    out = []
    for args in (["netns", "list"], ["-o", "link", "show"]):
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
        out += [line for line in done.stdout.splitlines() if prefix in line]
    return out


def test_a_short_netns_run_with_link_down_keeps_every_invariant_and_cleans_up(tmp_path: Path) -> None:
    why = _why_not()
    if why:
        pytest.skip(f"network-namespace hosts unavailable: {why}")
    cmd = [sys.executable, "-m", "elasticd.chaos", "--json", "--workdir", str(tmp_path / "chaos"), "--netns",
           "--faults", "link_down,worker_kill,agent_stop", "--minutes", "0.75", "--mean-interval-s", "4",
           "--warmup-s", "3", "--nodes", "3", "--min-nodes", "1", "--seed", "11"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=170)
    finally:
        if proc.poll() is None:  # it stops every process and deletes its network on SIGTERM too
            proc.terminate()
            proc.communicate(timeout=30)
    tail = err[-6000:]
    assert _left_behind(f"ecd{proc.pid}") == [], tail
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON object printed (exit {proc.returncode})\n{tail}"
    report = json.loads(lines[-1])
    failed = [f"{i['name']}: {i['detail']}" for i in report["invariants"] if not i["ok"]]
    assert not failed, f"{failed}\nstalls {report['stalls']}\n{tail}"
    assert proc.returncode == 0 and report["ok"] is True, tail
    assert report["settings"]["netns"] is True
    assert report["injected"]["link_down"] >= 1, f"{report['injected']}\n{tail}"
    ttl = report["settings"]["lease_ttl_s"]
    assert report["link_down"] and all(d["length_s"] > ttl for d in report["link_down"]), report["link_down"]
    assert "link down: dropped, rejoined" in {i["name"] for i in report["invariants"]}
    assert report["steps"] == report["target_steps"]
