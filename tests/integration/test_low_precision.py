"""A model with bfloat16 parameters under elasticd, in real gloo groups: its gradients are summed in
bfloat16, but the commit vote is summed in float32 (``reducer.vote_dtype``). In bfloat16 the
vote's voter count is exact only up to 256 members (257 rounds to 256: every step of a larger
generation would abort), and the global loss it carries loses all but ~3 digits. The test cannot
start 257 members; it checks the other half of the same fault, the loss, which a bfloat16 vote
rounds at any size: the ranks' own ``loss x share`` must add up to the committed global loss to
float32 precision, through a worker SIGKILL and the regroup after it."""

from __future__ import annotations

import json
import signal
from collections import defaultdict

import pytest
import torch

pytestmark = pytest.mark.timeout(120)

STEPS = 60
PROGRAM = "tests/programs/low_precision.py"


def test_a_bfloat16_model_commits_with_an_exact_vote_through_a_kill(local_job):
    job = local_job(min_workers=2, join_window_s=1.0)
    for i in range(3):
        job.spawn(
            "--dtype",
            "bfloat16",
            "--steps",
            str(STEPS),
            "--step-sleep",
            "0.03",
            "--out",
            str(job.dir / f"losses{i}.lines"),
            "--save-final",
            str(job.dir / f"final{i}.pt"),
            program=PROGRAM,
        )
    job.wait_for(lambda: job.committed() >= 15, 60, "step 15")
    job.workers[2].signal(signal.SIGKILL)
    assert job.wait_all(90) == [0, 0, -signal.SIGKILL], job.logs_tail()

    rep = job.audit(dataset_size=512)
    assert rep.ok, rep.violations
    assert rep.last_step == STEPS
    finals = [torch.load(job.dir / f"final{i}.pt", weights_only=True) for i in range(2)]
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])

    by_step: dict[tuple[int, int], list[dict[str, float]]] = defaultdict(list)
    for i in range(3):
        for line in (job.dir / f"losses{i}.lines").read_text().splitlines():
            rec = json.loads(line)
            by_step[(rec["step"], rec["world"])].append(rec)
    checked = worlds = 0
    for (step, world), recs in sorted(by_step.items()):
        if len(recs) != world:
            continue  # a member killed before it wrote the step's line
        mine = sum(r["loss"] * r["share"] for r in recs)
        (g,) = {r["global_loss"] for r in recs}  # the same sum on every member
        assert abs(mine - g) <= 1e-6 * max(1.0, abs(g)), (step, world, mine, g)
        checked += 1
        worlds |= 1 << world
    assert checked >= STEPS - 5 and worlds == (1 << 2) | (1 << 3), (checked, bin(worlds))
