"""A step refused by one member after the sum, and applied by its peers that are then lost, is
rolled forward by the next generation instead of being done again (``worker.rollforward``), with
the script's own code around it (the recipe: accumulation, clipping, a scheduler, an EMA).
Real gloo workers, a real etcd, a real SIGSTOP (at the exact point, by the worker's own
``ELASTICD_STOP_AFTER_SUM`` fault injection), real SIGKILLs and a real lease expiry."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.timeout(180)

STEP = 25  # the step worker 1 refuses
STEPS = 60
SAMPLES = 1024


def stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def commits_of(job, worker: int) -> list[dict]:
    p = job.dir / f"audit{worker}.jsonl"
    if not p.exists():
        return []
    return [r for r in map(json.loads, p.read_text().splitlines()) if r["event"] == "commit"]


RECIPE = ("agents/recipe.py", "--samples", str(SAMPLES), "--warmup", "8", "--workers", "0", "--step-sleep", "0.01")
# the model, its gradients and the kept sum on the GPU, the group gloo (staging copies): a GPU machine only
CUDA = ("agents/mlp.py", "--samples", str(SAMPLES), "--device", "cuda", "--fp16", "--step-sleep", "0.01")


@pytest.mark.parametrize("workload", [
    pytest.param(RECIPE, id="recipe"),
    pytest.param(CUDA, id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")),
])
def test_a_step_refused_after_the_sum_by_the_only_survivor_is_rolled_forward_not_done_again(local_job, workload):
    # Worker 1 stops right after the sum of STEP arrives, before it reads its fence. Workers 0 and 2
    # apply STEP and are SIGKILLed before any regroup. Worker 1's lease runs out while it is
    # stopped; continued, it learns that its lease is gone and refuses STEP (it cannot know its
    # peers applied it). Two newcomers join it. Before the roll-forward, the new generation did
    # STEP again (its commit lines in two generations); now worker 1's kept sum is applied, once.
    # members sharing one GPU: gloo groups (NCCL takes one rank of a communicator per device)
    job = local_job(min_workers=3, max_workers=3, backend="gloo")

    def spawn(**extra: object):
        program, *args = workload
        return job.spawn("--steps", str(STEPS), *args, "--save-final", str(job.dir / f"final{len(job.workers)}.pt"),
                         program=program, **extra)

    spawn()
    victim = spawn(stop_after_sum=STEP)
    spawn()
    job.wait_for(lambda: stopped(victim.pid), 90, f"worker 1 stopped after the sum of step {STEP}")
    job.wait_for(lambda: all(any(r["step"] == STEP for r in commits_of(job, w)) for w in (0, 2)), 10,
                 f"workers 0 and 2 applied step {STEP}")
    for w in (0, 2):
        job.workers[w].signal(signal.SIGKILL)
    assert not any(r["step"] >= STEP for r in commits_of(job, 1))
    time.sleep(4.0)  # past worker 1's 2 s lease: etcd ends it, so it cannot confirm it
    victim.signal(signal.SIGCONT)
    spawn()
    spawn()
    codes = job.wait_all(120)
    assert codes[1:2] + codes[3:] == [0, 0, 0], job.logs_tail()
    rep = job.audit(SAMPLES)
    assert rep.ok, rep.violations  # among them: "step 25 committed in several generations" (repeated)
    assert rep.last_step == STEPS and len(set(rep.final_checksums)) == 1
    rows = [r for w in range(5) for r in commits_of(job, w) if r["step"] == STEP]
    first = {r["generation"] for r in rows if "sum_generation" not in r}
    rolled = [r for r in rows if "sum_generation" in r]
    assert len(first) == 1 and len(rolled) == 3, rows  # applied by 0 and 2, then by the new generation's three
    assert {r["sum_generation"] for r in rolled} == first and {r["generation"] for r in rolled} != first
    if workload is RECIPE:  # the script's code after commit() ran once for every step, the rolled one too
        final = torch.load(next(job.dir.glob("final*.pt")), weights_only=True)
        assert (int(final["last_epoch"]), int(final["ema_updates"])) == (STEPS, STEPS)
    log = victim.log_text()
    assert "step_sum_kept" in log and "step_rolled_forward" in log, job.logs_tail()
