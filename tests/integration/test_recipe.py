"""The training recipe (agents/recipe.py): a real script's whole state through faults and a restart.

The recipe has a warmup + cosine LR schedule, clipping at a norm that clips, accumulation over 2
micro-batches, bf16 autocast on CPU, a registered EMA of the weights and a DataLoader with 2 worker
processes. Two failures and one join end with the same parameters, EMA, scheduler state and loss
curve as a fault-free run; a full-job restart from a durable checkpoint continues the same curve;
and the script differs from its plain torchrun + DDP version (agents/recipe_ddp.py) by at most ten
lines.

Tolerance: every step averages the same global batch in both runs, but over a different number
of ranks and micro-batch splits. Under bf16 autocast each rank's matmul outputs, its partial weight
gradients included, are rounded to bf16 (8 bits of mantissa), so a different split rounds
differently: one process training the same 40 steps with each micro-batch split in 3 instead of 1
ends 3.6e-4 away in the parameters and 2.9e-4 in the EMA; the run with two kills and a join here
ended 1.4e-4 / 1.0e-4 away, its losses 2.6e-4. We allow 1.5e-3 (absolute; ~4x the worst split
noise, ~10x this run's). What no rounding explains is checked exactly: the audit (every step
committed once, every sample of an epoch used once, identical final state on every rank), the
scheduler's step count and learning rate, the EMA's update count. One skipped step in the middle
of the run moves the parameters by 2.6e-3, beyond the tolerance (test_a_skipped_step_would_be_caught);
a late one (the LR decayed to 1 %) moves them less, and only the exact counts catch it.
"""

from __future__ import annotations

import difflib
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from elasticd.testing.audit import check, read_lines
from elasticd.testing.localcluster import REPO_ROOT
from tests.jobs import assert_committed_once, stop_one_and_lose_the_others

pytestmark = pytest.mark.timeout(400)

STEPS = 40
SAMPLES = 384
ARGS = ("--steps", str(STEPS), "--samples", str(SAMPLES), "--warmup", "8", "--step-sleep", "0.01")
TOL = 1.5e-3
STOPPED_STEP = 20  # the step whose sum one member holds while stopped (test_a_step_applied_after_a_stop_...)


def _body(path: Path) -> list[str]:
    """The script without its module docstring (which says which version it is)."""
    text = path.read_text()
    m = re.match(r'\s*""".*?"""\n', text, re.S)
    assert m is not None
    return text[m.end() :].splitlines()


def test_the_elastic_recipe_differs_from_the_ddp_one_by_at_most_ten_lines() -> None:
    ddp, elastic = _body(REPO_ROOT / "agents/recipe_ddp.py"), _body(REPO_ROOT / "agents/recipe.py")
    diff = list(difflib.unified_diff(ddp, elastic, lineterm="", n=0))
    added = [line for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    print("\n".join(diff))
    assert len(added) <= 10, added  # what a user writes or changes
    # what a user deletes: the process group, DDP, the sampler, the no_sync block and their own
    # checkpoint code (elasticd's durable checkpoints keep the registered state instead)
    assert len(removed) <= 25, removed
    reindented = [line for line in added if line.strip() and line.lstrip() in {r[1:].lstrip() for r in removed}]
    assert not reindented, reindented  # nothing re-indented


def _final(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def _finals(job) -> list[dict[str, torch.Tensor]]:
    """The final state written by the last generation's rank 0 (one file)."""
    found = [_final(p) for p in sorted(job.dir.glob("final*.pt"))]
    assert len(found) == 1, [p.name for p in job.dir.glob("final*.pt")]
    return found


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _compare(got: dict[str, object], ref: dict[str, object]) -> None:
    print(
        f"max |param diff| {_worst(got['model'], ref['model']):.2e}, "
        f"max |EMA diff| {_worst(got['ema'], ref['ema']):.2e}, "
        f"lr {got['lr'].tolist()} vs {ref['lr'].tolist()}, last_epoch {int(got['last_epoch'])}"
    )
    for part in ("model", "ema"):
        for k, v in ref[part].items():
            torch.testing.assert_close(got[part][k], v, rtol=0, atol=TOL)
    assert int(got["last_epoch"]) == int(ref["last_epoch"]) == STEPS  # the scheduler stepped once per step
    assert got["ema_updates"] == ref["ema_updates"] == STEPS
    torch.testing.assert_close(got["lr"], ref["lr"], rtol=1e-9, atol=0)


def _losses(rep) -> torch.Tensor:
    return torch.tensor([rep.losses[s] for s in range(1, STEPS + 1)])


@pytest.fixture(scope="module")
def fault_free(etcd_server, tmp_path_factory):
    """The fault-free run both comparisons use: (its final state, its audit), run once."""
    from tests.conftest import LocalJob

    job = LocalJob(etcd_server, tmp_path_factory.mktemp("fault_free"), min_workers=3, join_window_s=3)
    job.job_id = f"recipe-fault-free-{os.getpid()}"  # this module's import of conftest counts job ids anew
    try:
        for i in range(3):
            job.spawn(*ARGS, "--save-final", str(job.dir / f"final{i}.pt"), program="agents/recipe.py")
        assert job.wait_all(150) == [0, 0, 0], job.logs_tail()
        rep = job.audit(SAMPLES)
        assert rep.ok, rep.violations
        (final,) = _finals(job)
        return final, rep
    finally:
        job.stop()


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_two_failures_and_a_join_end_like_a_fault_free_run(local_job, fault_free) -> None:
    ref_final, ref = fault_free

    # The starters land in one generation (a 1.5 s join window). Slower steps than the reference
    # (the sleep changes no number): the members train on through the newcomer's join window, and
    # the newcomer (a fresh Python importing torch, ~2-3 s here) must be in before the last step.
    job = local_job(min_workers=1, join_window_s=1.5)
    args = (*ARGS[:-1], "0.15")
    for i in range(3):
        job.spawn(*args, "--save-final", str(job.dir / f"final{i}.pt"), program="agents/recipe.py")
    job.wait_for(lambda: job.committed() >= 8, 120, "step 8")
    job.workers[0].signal(signal.SIGKILL)
    job.spawn(*args, "--save-final", str(job.dir / "final3.pt"), program="agents/recipe.py")
    job.wait_for(lambda: job.committed(worker=3) > 0 and job.committed() >= 20, 120, "the join and step 20")
    job.workers[1].signal(signal.SIGKILL)
    codes = job.wait_all(180)
    assert codes[2:] == [0, 0], job.logs_tail()
    rep = job.audit(SAMPLES)
    assert rep.ok, rep.violations  # every step once, every sample of an epoch once, identical finals
    # start, the first kill and the join (one generation when the newcomer is up in time), the second kill
    assert rep.last_step == STEPS and len(rep.generations) >= 3 and job.committed(worker=3) == STEPS, rep.generations
    (final,) = _finals(job)
    print(f"max |loss diff| {float((_losses(rep) - _losses(ref)).abs().max()):.2e}")
    _compare(final, ref_final)
    torch.testing.assert_close(_losses(rep), _losses(ref), rtol=0, atol=TOL)


def test_a_step_applied_after_a_stop_by_the_survivor_of_its_appliers_is_committed_once(local_job, fault_free) -> None:
    # The survivor applies the sum it holds once continued (the script's clipping, scheduler and EMA
    # around it), rejoins as the holder of the newest state, and its sync confirms the step: never
    # done again (audit: "repeated" would say so), and the run ends like the fault-free one.
    ref_final, ref = fault_free
    job = local_job(min_workers=3, max_workers=3)

    def spawn(**extra: object):
        return job.spawn(
            *ARGS, "--save-final", str(job.dir / f"final{len(job.workers)}.pt"), program="agents/recipe.py", **extra
        )

    stop_one_and_lose_the_others(job, spawn, STOPPED_STEP)
    codes = job.wait_all(150)
    assert codes[1:2] + codes[3:] == [0, 0, 0], job.logs_tail()
    rep = job.audit(SAMPLES)
    assert rep.ok, rep.violations
    assert rep.last_step == STEPS
    assert_committed_once(job, STOPPED_STEP)
    (final,) = _finals(job)
    _compare(final, ref_final)
    torch.testing.assert_close(_losses(rep), _losses(ref), rtol=0, atol=TOL)


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_a_full_restart_from_a_durable_checkpoint_continues_the_curve(local_job, fault_free, tmp_path: Path) -> None:
    ref_final, ref = fault_free
    ckpt = tmp_path / "ckpt"
    first = local_job(min_workers=3, join_window_s=3, checkpoint_dir=ckpt, checkpoint_every_steps=10)
    for i in range(3):
        first.spawn(*ARGS, program="agents/recipe.py")
    first.wait_for(lambda: first.committed() >= 24, 150, "step 24")
    for w in first.workers:
        w.signal(signal.SIGKILL)
    first.wait_all(30)
    second = local_job(min_workers=3, join_window_s=3, checkpoint_dir=ckpt, checkpoint_every_steps=10)
    second.job_id = first.job_id
    for i in range(3):
        second.spawn(*ARGS, "--save-final", str(second.dir / f"final{i}.pt"), program="agents/recipe.py")
    assert second.wait_all(150) == [0, 0, 0], second.logs_tail()
    rec2 = read_lines(sorted(second.dir.glob("audit*.jsonl")))
    resumed = min(int(r["step"]) for r in rec2 if r["event"] == "commit") - 1  # type: ignore[call-overload]
    assert resumed in (10, 20), resumed  # it went on from the checkpoint, not from step 1
    # the history up to the checkpoint plus the second run is one clean run: the recomputed steps
    # took the same global batches, every sample of an epoch once
    rec1 = [
        r
        for r in read_lines(sorted(first.dir.glob("audit*.jsonl")))
        if r["event"] != "commit" or int(r["step"]) <= resumed
    ]  # type: ignore[call-overload]
    rep = check(rec1 + rec2, SAMPLES)
    assert rep.ok, rep.violations
    assert rep.steps == list(range(1, STEPS + 1))
    (final,) = _finals(second)
    _compare(final, ref_final)
    got = torch.tensor([rep.losses[s] for s in range(resumed + 1, STEPS + 1)])
    want = torch.tensor([ref.losses[s] for s in range(resumed + 1, STEPS + 1)])
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_the_ddp_recipe_runs_under_torchrun(tmp_path: Path) -> None:
    import subprocess

    out = tmp_path / "final.pt"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO_ROOT / "agents/recipe_ddp.py"),
            "--steps",
            "6",
            "--samples",
            "128",
            "--save-final",
            str(out),
            "--checkpoint",
            str(tmp_path / "ck.pt"),
            "--checkpoint-every",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = _final(out)
    assert int(final["last_epoch"]) == 6
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert ck["step"] == 6 and set(ck) == {"step", "model", "optimizer", "scheduler", "ema"}


def test_a_skipped_step_would_be_caught() -> None:
    """The tolerance above sees one skipped step in the middle of the recipe (single process)."""
    sys.path.insert(0, str(REPO_ROOT / "agents"))
    from recipe_parts import EMA, Clusters, collate, make_model, parse_args, warmup_cosine

    args = parse_args(["--samples", str(SAMPLES), "--warmup", "8", "--steps", str(STEPS)])
    data = Clusters(args.samples, args.features, args.classes, args.seed)

    def train(skip: int | None) -> dict[str, torch.Tensor]:
        model = make_model(args)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        sched, ema = warmup_cosine(opt, args.warmup, args.steps), EMA(model, args.ema_decay)
        for step in range(1, STEPS + 1):
            x, y = collate([data[(step * 96 + j) % SAMPLES] for j in range(96)])
            if step == skip:
                continue
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            sched.step()
            ema.update(model)
        return model.state_dict()

    full, skipped = train(None), train(STEPS // 2)
    assert max(float((full[k] - skipped[k]).abs().max()) for k in full) > TOL
