"""The drop-in form: a plain inline DDP script (``agents/inline_ddp.py``) and its port
(``agents/inline_elastic.py``), which keeps every loop and changes at most ten lines.

Two kinds of reference. The port's fault-free run takes the same global batch at every step as
the plain script under torchrun (the same seeded order per epoch, the same samples per step), split
into other micro-batches: under bf16 autocast a different split rounds differently (the recipe's
tests measured 3.6e-4 in the parameters for a split in 3 instead of 1), so the two end within
1.5e-3. Under faults the global batch follows the world size (DDP's semantics), so the reference is
the job's own record: ``tests/dropin_replay.py`` recomputes, in one process, every committed
step from its world size and its ranks' stream blocks; a step lost, repeated, applied from a
partial sum or mis-weighted makes the replay differ (the agents' test shows it does), and where the
sums have the same order (worlds of 1 and 2) the replay is bitwise equal to the job.
"""

from __future__ import annotations

import difflib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.errors import EXIT_REJOIN
from elasticd.store.etcd import EtcdClient
from elasticd.testing.audit import check, read_lines
from elasticd.testing.localcluster import REPO_ROOT
from elasticd.wire.keys import Keys
from tests.dropin_replay import replay, steps_of, worst
from tests.integration.test_agent_faults import _kill_node
from tests.integration.test_node_agent import _worker_pid, agent_job  # noqa: F401 (fixture)
from tests.integration.test_recipe import _body

pytestmark = pytest.mark.timeout(300)

PLAIN, PORT = REPO_ROOT / "agents/inline_ddp.py", REPO_ROOT / "agents/inline_elastic.py"
SAMPLES = 384  # 6 steps per epoch at world 2 (2 ranks x 2 micro-batches x 16)
ARGS = ("--samples", str(SAMPLES), "--warmup", "8")
TOL = 1.5e-3  # bf16 rounding of other micro-batch splits (module docstring)
EXACT = 1e-6  # the replay against the job: the same operations, sums in another order at world 3+


def test_the_port_changes_at_most_ten_lines_and_restructures_nothing() -> None:
    diff = list(difflib.unified_diff(_body(PLAIN), _body(PORT), lineterm="", n=0))
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    print("\n".join(diff))
    assert len(added) <= 10 and len(removed) <= 10, (added, removed)
    indent = {line.strip(): len(line) - len(line.lstrip()) for line in removed}
    assert not [a for a in added if a.strip() in indent and indent[a.strip()] != len(a) - len(a.lstrip())]
    loops = ("for ", "while ", "with ", "if step", "break", "continue", "next(it)", "loss.backward()")
    touched = [line for line in added + removed if line.strip().startswith(loops)]
    assert not touched, touched  # the loops, the micro-batches and the break stay the script's


def _audit(directory: Path) -> list[dict[str, Any]]:
    return read_lines(sorted(directory.rglob("*.jsonl")))


def _assert_replays(records: list[dict[str, Any]], final: Path, argv: tuple[str, ...]) -> None:
    got = torch.load(final, weights_only=True)
    ref = replay(records, list(argv))
    print(f"replay: max |param diff| {worst(got['model'], ref['model']):.1e}, EMA {worst(got['ema'], ref['ema']):.1e}")
    for part in ("model", "ema"):
        for k, v in ref[part].items():
            torch.testing.assert_close(got[part][k], v, rtol=0, atol=EXACT)
    assert got["lr"] == ref["lr"]  # the scheduler stepped once per committed step
    assert got["step"] == len(steps_of(records))


def test_the_plain_script_under_torchrun_and_the_port_end_alike(local_job, tmp_path: Path) -> None:
    argv = (*ARGS, "--steps", "24")
    plain = tmp_path / "plain.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(PLAIN), *argv]
        + ["--save-final", str(plain), "--checkpoint", str(tmp_path / "ck.pt"), "--checkpoint-every", "10"],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(tmp_path / "ck.pt", weights_only=True)["step"] == 20  # its own rank-0 checkpoints
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn(*argv, "--save-final", str(job.dir / "port.pt"), program=str(PORT), audit=False, audit_dir=job.dir)
    assert job.wait_all(120) == [0, 0], job.logs_tail()
    records = _audit(job.dir / job.job_id)
    rep = check(records, SAMPLES)
    assert rep.ok, rep.violations
    assert rep.last_step == 24 and rep.epochs_complete == 4 and len(set(rep.final_checksums)) == 1
    got, ref = torch.load(job.dir / "port.pt", weights_only=True), torch.load(plain, weights_only=True)
    print(f"port vs torchrun: max |param diff| {worst(got['model'], ref['model']):.1e}")
    assert worst(got["model"], ref["model"]) < TOL and worst(got["ema"], ref["ema"]) < TOL
    assert got["lr"] == pytest.approx(ref["lr"], rel=1e-12)


def test_a_worker_killed_mid_step_and_a_newcomer_mid_epoch(local_job) -> None:
    # long enough that the newcomer (a fresh Python importing torch, seconds on a loaded machine)
    # joins mid-run: one admitted at the last step meets its peer's goodbye (docs/limits.md)
    argv = (*ARGS, "--steps", "150", "--step-sleep", "0.05")
    job = local_job(min_workers=1)
    final = job.dir / "final.pt"
    for _ in range(2):
        job.spawn(*argv, "--save-final", str(final), program=str(PORT), audit=False, audit_dir=job.dir)
    audits = job.dir / job.job_id
    # one worker may start the job alone (one suffices): the kill waits until both train together,
    # so that the survivor holds the state whichever of them was first
    job.wait_for(lambda: _world_steps(audits, 2) >= 2 * 5 and _steps(audits) >= 15, 60, "both at step 15")
    job.workers[1].signal(signal.SIGKILL)
    job.wait_for(lambda: _steps(audits) >= 20, 60, "step 20 alone")
    job.spawn(*argv, "--save-final", str(final), program=str(PORT), audit=False, audit_dir=job.dir)
    codes = job.wait_all(120)
    assert codes[0] == 0 and codes[2] == 0, job.logs_tail()
    records = _audit(audits)
    rep = check(records, SAMPLES)
    assert rep.ok, rep.violations  # every step once, every sample of each epoch once, equal finals
    assert rep.last_step == 150 and sorted(set(rep.step_world.values())) == [1, 2], rep.step_world
    assert "recovered" in job.workers[0].log_text()  # the survivor finished the step in place
    _assert_replays(records, final, argv)


def test_a_newcomer_admitted_at_the_last_step_ends_with_the_job(local_job, tmp_path: Path) -> None:
    """Two members hold before their last step until a newcomer waits to join, so that step's vote
    regroups the job and the newcomer is admitted holding the last step. Its own loop, whose counter
    starts at 0, takes one more step, whose gradient all_reduce meets the others' goodbye: the
    goodbye has the step's shape and votes "finished", so the newcomer applies nothing and every
    member exits 0 with the job at its last step, committed once."""
    go = tmp_path / "go"
    args = ("--steps", "20", "--hold-before", "20", "--hold-file", str(go))
    job = local_job(min_workers=2, max_workers=3)
    for _ in range(2):
        job.spawn(*args, program="tests/programs/dropin_hold.py")
    # they hold before step 20: step 19 waits for its confirmation (step 20's all_reduce)
    job.wait_for(lambda: job.committed() >= 18, 90, "step 18")
    newcomer = job.spawn(*args, program="tests/programs/dropin_hold.py")
    store = EtcdClient(EtcdConfig(endpoints=(job.etcd.endpoint,)), Timeouts(), RetryPolicy())
    try:
        ready = Keys("/elasticd", job.job_id).ready("")
        job.wait_for(
            lambda: any(f".{newcomer.pid}" in kv.key for kv in store.get_prefix(ready)), 90, "the newcomer's join"
        )
    finally:
        store.close()
    go.touch()  # each of them then waits until its own view has the newcomer waiting
    assert job.wait_all(90) == [0, 0, 0], job.logs_tail(40)
    rep = job.audit(512)
    assert rep.ok, rep.violations
    assert rep.last_step == 20, rep.last_step  # nothing past the job's end
    assert "job_finished_at_a_peers_goodbye" in newcomer.log_text(), newcomer.log_text()[-3000:]


def _steps(directory: Path) -> int:
    return max((len(p.read_text().splitlines()) for p in directory.glob("*.jsonl")), default=0)


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_under_agents_a_worker_killed_a_node_lost_and_a_node_joining_mid_epoch(agent_job) -> None:
    # long enough that the new node (a fresh Python importing torch, ~3 s on a loaded machine) joins
    argv = (*ARGS, "--samples", "1024", "--steps", "200", "--step-sleep", "0.04")
    job = agent_job(lease_ttl_s=2, keepalive_s=0.5)
    final = job.dir / "final.pt"
    program = [sys.executable, str(PORT), *argv, "--save-final", str(final)]
    flags = ("--nnodes", "1:3", "--audit-dir", str(job.dir))
    a, b = job.start("a", *flags, program=program), job.start("b", *flags, program=program)
    audits = job.dir / job.job_id
    job.wait_for(lambda: _world_steps(audits, 2) >= 10, 90, "two nodes training together")
    killed = _worker_pid(a)
    os.kill(killed, signal.SIGKILL)  # its agent starts a newcomer; b goes on alone meanwhile
    job.wait_for(lambda: len(a.events("worker_started")) == 2, 30, "the killed worker's restart")
    job.wait_for(lambda: _after_world_one(audits), 90, "the restarted worker back in the job")
    at_world_two = _world_steps(audits, 2)
    job.wait_for(lambda: _world_steps(audits, 2) >= at_world_two + 5, 60, "training at world 2 again")
    _kill_node(b.pid, [_worker_pid(b)])
    lost_at = _world_steps(audits, 1)
    job.wait_for(lambda: _world_steps(audits, 1) >= lost_at + 5, 30, "the job going on at world 1")
    at_world_two = _world_steps(audits, 2)
    c = job.start("c", *flags, program=program)
    job.wait_for(lambda: _world_steps(audits, 2) > at_world_two, 90, "the new node joining")
    assert a.wait(120) == 0 and c.wait(60) == 0, job.logs_tail()
    records = _audit(audits)
    rep = check(records, 1024)
    assert rep.ok, rep.violations
    assert rep.last_step == 200 and len(set(rep.final_checksums)) == 1
    assert [e["signal"] for e in a.events("worker_exited") if e["pid"] == killed] == [signal.SIGKILL]
    # the reference is sharp: the record with one step's blocks swapped for another's ends elsewhere
    six = next(r["blocks"] for r in records if r["event"] == "commit" and r["step"] == 6)
    tampered = [{**r, "blocks": six} if r["event"] == "commit" and r["step"] == 5 else r for r in records]
    with pytest.raises(AssertionError):
        _assert_replays(tampered, final, (*argv, "--save-final", str(final)))
    _assert_replays(records, final, (*argv, "--save-final", str(final)))


def _world_steps(directory: Path, world: int) -> int:
    return sum(1 for r in _audit(directory) if r.get("event") == "commit" and r["world_size"] == world)


def _after_world_one(directory: Path) -> bool:
    """A commit at world 2 after the job went on alone."""
    seen_one = False
    for r in sorted((r for r in _audit(directory) if r.get("event") == "commit"), key=lambda r: r["step"]):
        seen_one = seen_one or r["world_size"] == 1
        if seen_one and r["world_size"] == 2:
            return True
    return False


def test_a_full_job_resume_continues_the_same_curve(local_job, tmp_path: Path) -> None:
    argv = (*ARGS, "--steps", "40", "--step-sleep", "0.02")
    ckpt = tmp_path / "ckpt"
    first = local_job(min_workers=2, checkpoint_dir=ckpt, checkpoint_every_steps=10)
    for _ in range(2):
        first.spawn(*argv, program=str(PORT), audit=False, audit_dir=first.dir)
    first.wait_for(lambda: _steps(first.dir / first.job_id) >= 24, 120, "step 24")
    for w in first.workers:
        w.signal(signal.SIGKILL)
    first.wait_all(30)
    second = local_job(min_workers=2, checkpoint_dir=ckpt, checkpoint_every_steps=10)
    second.job_id = first.job_id
    final = second.dir / "final.pt"
    for _ in range(2):
        second.spawn(*argv, "--save-final", str(final), program=str(PORT), audit=False, audit_dir=second.dir)
    assert second.wait_all(120) == [0, 0], second.logs_tail()
    rec2 = _audit(second.dir / second.job_id)
    resumed = min(int(r["step"]) for r in rec2 if r["event"] == "commit") - 1
    assert resumed in (10, 20), resumed
    rec1 = [r for r in _audit(first.dir / first.job_id) if r["event"] != "commit" or int(r["step"]) <= resumed]
    rep = check(rec1 + rec2, SAMPLES)
    assert rep.ok, rep.violations  # the history to the checkpoint and the resumed run: one clean run
    assert rep.steps == list(range(1, 41))
    _assert_replays(rec1 + rec2, final, argv)


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_a_stopped_worker_that_missed_steps_starts_again_as_a_newcomer(agent_job) -> None:
    # SIGSTOP past the lease: the other goes on alone; continued, the stopped one finds the job's
    # steps beyond its own mid-step, exits EXIT_REJOIN, and its agent starts it again at once.
    argv = (*ARGS, "--samples", "1024", "--steps", "120", "--step-sleep", "0.03")
    job = agent_job(lease_ttl_s=2, keepalive_s=0.5)
    final = job.dir / "final.pt"
    program = [sys.executable, str(PORT), *argv, "--save-final", str(final)]
    flags = ("--nnodes", "1:2", "--audit-dir", str(job.dir), "--max-restarts", "0")
    a, b = job.start("a", *flags, program=program), job.start("b", *flags, program=program)
    audits = job.dir / job.job_id
    job.wait_for(lambda: _world_steps(audits, 2) >= 10, 90, "two nodes training together")
    victim = _worker_pid(b)
    os.kill(victim, signal.SIGSTOP)
    try:
        job.wait_for(lambda: _world_steps(audits, 1) >= 10, 30, "the job going on without the stopped worker")
    finally:
        os.kill(victim, signal.SIGCONT)
    job.wait_for(lambda: _after_world_one(audits), 90, "the restarted worker joining")
    assert a.wait(120) == 0 and b.wait(60) == 0, job.logs_tail()
    exits = [e for e in b.events("worker_exited") if e["pid"] == victim]
    assert exits and exits[0]["code"] == EXIT_REJOIN, b.log_text()[-3000:]
    records = _audit(audits)
    rep = check(records, 1024)
    assert rep.ok, rep.violations
    assert rep.last_step == 120 and len(rep.finals_by_step[120]) == 1  # the replaced one left a final line too
    _assert_replays(records, final, (*argv, "--save-final", str(final)))
