"""``python -m elasticd.chaos`` run as a user runs it: a short run that injects every fault kind
possible (a 3-member etcd cluster included; where network namespaces work, as root, every node a
namespace host on a bridge the run creates and ``link_down`` among the kinds, else loopback; half
the agents with the node relay on) and must pass every invariant and delete every namespace and
link it made (and, as root, its checkpoint filesystem); and, marked soak, the bug scenario (whose
agents must all stop with exit 3 and whose status must name the step and the exception) and the
30-minute run. The checker's own detection of violations is tested in
``tests/unit/test_chaos_logic.py`` on hand-made records."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.chaos.ckptfs import unusable_here as no_mount_here
from elasticd.chaos.netns import unusable_here
from elasticd.chaos.schedule import Place, kinds_possible
from elasticd.testing.localcluster import REPO_ROOT


def _why_not_netns() -> str:
    return unusable_here(os.getpid())


def _left_behind(prefix: str) -> list[str]:
    """Namespaces and links whose names start with ``prefix`` (the run's own)."""
    out = []
    for args in (["netns", "list"], ["-o", "link", "show"]):
        done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=False)
        out += [line for line in done.stdout.splitlines() if prefix in line]
    return out


def _run_chaos(workdir: Path, timeout_s: float, *args: str) -> tuple[int, dict[str, object], str]:
    """Run the suite with ``--json``; (exit code, the JSON object, what it printed on stderr).
    A netns run must leave no namespace or link of its own behind."""
    cmd = [sys.executable, "-m", "elasticd.chaos", "--json", "--workdir", str(workdir), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:  # it stops every process it started on SIGTERM too
            proc.terminate()
            proc.communicate(timeout=30)
    if shutil.which("ip") is not None and os.geteuid() == 0:
        assert _left_behind(f"ecd{proc.pid}") == [], err[-6000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    assert lines, f"no JSON object printed (exit {proc.returncode})\n{err[-6000:]}"
    return proc.returncode, json.loads(lines[-1]), err


def _failed(report: dict[str, object]) -> list[str]:
    invariants = report["invariants"]
    assert isinstance(invariants, list)
    return [f"{i['name']}: {i['detail']}" for i in invariants if not i["ok"]]


@pytest.mark.timeout(240)
def test_a_short_run_with_every_fault_kind_keeps_every_invariant(tmp_path: Path) -> None:
    netns = not _why_not_netns()  # the reason is printed by the run when it falls back
    place = Place(3, "" if netns else "--no-netns", no_mount_here())
    code, report, err = _run_chaos(
        tmp_path / "chaos",
        230,
        "--minutes",
        "1",
        "--mean-interval-s",
        "2.2",
        "--warmup-s",
        "2",
        "--etcd-members",
        "3",
        "--min-nodes",
        "1",
        "--seed",
        "3",
        "--netns" if netns else "--no-netns",
        "--relay",
        "mixed",  # both ways of following the job (relay.node) under the same faults
        # A little more than the job commits in the warm-up and the 60 s of faults (~950 at ~13
        # steps/s; ~27 faults, so every kind at least once): the faults must end on time, not near
        # the last step, and the default (a fault-free rate) left ~25 s of steps to finish after
        # the faults ended.
        "--steps",
        "1150",
    )
    tail = err[-5000:]
    assert not _failed(report), f"{_failed(report)}\nstalls {report['stalls']}\n{tail}"
    assert code == 0 and report["ok"] is True, tail
    injected = report["injected"]
    assert isinstance(injected, dict)
    assert set(injected) == {k.value for k in kinds_possible(3, place=place)}, injected
    missed = [k for k, n in injected.items() if n < 1]
    assert not missed, f"kinds never injected: {missed}\n{tail}"
    if netns:  # the cut-off host was dropped for longer than the lease, the others went on, it rejoined
        ttl = report["settings"]["lease_ttl_s"]  # type: ignore[index]
        assert report["link_down"] and all(d["length_s"] > ttl for d in report["link_down"]), report["link_down"]  # type: ignore[union-attr, index]
        assert "link down: dropped, rejoined" in {i["name"] for i in report["invariants"]}  # type: ignore[union-attr, index]
    assert report["steps"] == report["target_steps"]
    assert report["status_samples"], tail
    assert isinstance(report["ettr"], float) and 0 < report["ettr"] <= 1.2
    assert (tmp_path / "chaos" / "audit").is_dir()
    assert not os.path.ismount(tmp_path / "chaos" / "checkpoints")  # unmounted on the way out


@pytest.mark.soak  # test_bugs.py holds the behaviour in the default suite (docs/testing.md)
@pytest.mark.timeout(120)
def test_the_bug_scenario_stops_every_agent_with_exit_3_and_status_names_the_bug(tmp_path: Path) -> None:
    code, report, err = _run_chaos(tmp_path / "bug", 110, "--scenario", "bug", "--raise-at-step", "20")
    assert code == 0 and report["ok"] is True, f"{_failed(report)}\n{err[-5000:]}"
    names = {i["name"] for i in report["invariants"]}  # type: ignore[union-attr, index]
    assert names == {
        "every agent exits 3",
        "stopped within 2 x TTL + 3 s = 7 s",
        "status: failed at step 20, naming ScriptBug",
        "no step at or past 20 committed",
    }, names


@pytest.mark.soak
@pytest.mark.timeout(30 * 60 + 900)
def test_soak_thirty_minutes_of_faults(tmp_path: Path) -> None:
    code, report, err = _run_chaos(
        tmp_path / "chaos",
        30 * 60 + 840,
        "--minutes",
        "30",
        "--mean-interval-s",
        "10",
        "--etcd-members",
        "3",
        "--seed",
        "30",
    )
    assert not _failed(report), f"{_failed(report)}\nstalls {report['stalls']}\n{err[-5000:]}"
    assert code == 0
    injected = report["injected"]
    assert isinstance(injected, dict)
    assert set(injected) >= {k.value for k in kinds_possible(3)}  # link_down too where netns works
    assert all(n >= 1 for n in injected.values()), injected


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_a_sharded_run_keeps_every_invariant(tmp_path: Path) -> None:
    """``--replica-size 2``: each node a replica of two FSDP2 workers, every kind possible for it
    (no ``nan_grads``) injected, sharded checkpoints under the checkpoint faults where root can mount."""
    netns = not _why_not_netns()
    place = Place(3, "" if netns else "--no-netns", no_mount_here(), "--replica-size 2", "--replica-size 2")
    code, report, err = _run_chaos(
        tmp_path / "sharded",
        560,
        "--replica-size",
        "2",
        "--minutes",
        "3",
        "--mean-interval-s",
        "4",
        "--etcd-members",
        "3",
        "--min-nodes",
        "1",
        "--seed",
        "5",
        "--netns" if netns else "--no-netns",
    )
    assert not _failed(report), f"{_failed(report)}\nstalls {report['stalls']}\n{err[-5000:]}"
    assert code == 0 and report["ok"] is True
    injected = report["injected"]
    assert isinstance(injected, dict) and "nan_grads" not in injected
    assert set(injected) == {k.value for k in kinds_possible(3, place=place)}, injected
    assert report["steps"] == report["target_steps"]
