"""A step whose sum one member holds while stopped, applied by its peers that are then lost, is
committed once, by the stopped member once continued (it applies what it received and rejoins as
the holder of the newest state), never done again; here with the model and its gradients on a GPU
(the group gloo, so the sums cross through staging copies): run on a GPU machine, skipped without
one. The same scenario on the CPU, with the recipe and against a fault-free run, is in
``test_recipe.py``. Real gloo workers, a real etcd, a real SIGSTOP (at the exact point, by the
worker's own ``ELASTICD_STOP_AFTER_SUM``), real SIGKILLs and a real lease expiry
(``tests.jobs.stop_one_and_lose_the_others``)."""

from __future__ import annotations

import pytest
import torch

from tests.jobs import assert_committed_once, stop_one_and_lose_the_others

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (tests/programs/gpu_check.sh)"),
]

STEP, STEPS, SAMPLES = 25, 60, 1024


def test_a_step_applied_after_a_stop_is_committed_once_on_the_gpu(local_job) -> None:
    # members sharing one GPU: gloo groups (NCCL takes one rank of a communicator per device)
    job = local_job(min_workers=3, max_workers=3, backend="gloo")

    def spawn(**extra: object):
        return job.spawn(
            "--steps",
            str(STEPS),
            "--samples",
            str(SAMPLES),
            "--device",
            "cuda",
            "--fp16",
            "--step-sleep",
            "0.01",
            **extra,
        )

    stop_one_and_lose_the_others(job, spawn, STEP)
    codes = job.wait_all(120)
    assert codes[1:2] + codes[3:] == [0, 0, 0], job.logs_tail()
    rep = job.audit(SAMPLES)
    assert rep.ok, rep.violations
    assert rep.last_step == STEPS and len(set(rep.final_checksums)) == 1
    assert_committed_once(job, STEP)
