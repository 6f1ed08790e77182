"""The ack round: a step is applied by every member of its generation or by none, also when one
member refuses it after the vote (``commit.needs_ack``/``ack_outcome``). Real gloo workers, a real
etcd, real SIGSTOP/SIGCONT."""

from __future__ import annotations

import json
import random
import signal
import time
from collections import defaultdict

import pytest

pytestmark = pytest.mark.timeout(180)

STOPS = 8
STOP_S = 0.3  # well inside the 2 s lease: nobody's lease expires, nobody leaves


def ranks_per_step(job) -> dict[int, tuple[int, set[int]]]:
    out: dict[int, tuple[int, set[int]]] = {}
    seen: dict[int, set[int]] = defaultdict(set)
    for p in job.dir.glob("audit*.jsonl"):
        for line in p.read_text().splitlines():
            r = json.loads(line)
            if r["event"] == "commit":
                seen[r["step"]].add(r["rank"])
                out[r["step"]] = (r["world_size"], seen[r["step"]])
    return out


def test_a_member_continued_after_its_vote_makes_every_member_refuse_the_step(local_job):
    # Worker 1 computes fast and then waits in the gradient all_reduce for the two slow ones, so a
    # SIGSTOP lands after its vote most of the time. When it continues, the sum completes on all
    # three; its fence says "continued" and it refuses the step. Before the ack round the two
    # others applied it (a split commit: worker 1 was behind and got rank 0's state at the
    # regroup; if both others had died then, the step would have been done twice). Now nobody
    # applies it, and it is done once, by all three, after the regroup.
    job = local_job(min_workers=3)
    for sleep in ("0.08", "0", "0.08"):
        job.spawn("--steps", "260", "--step-sleep", sleep)
    job.wait_for(lambda: job.committed() >= 20, 60, "20 committed steps")
    stopped = job.workers[1]
    rng = random.Random(7)
    for _ in range(STOPS):
        time.sleep(rng.uniform(0.6, 1.0))
        stopped.signal(signal.SIGSTOP)
        time.sleep(STOP_S)
        stopped.signal(signal.SIGCONT)
    codes = job.wait_all(120)
    assert codes == [0, 0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == 260 and len(set(rep.final_checksums)) == 1
    split = {step: sorted(ranks) for step, (world, ranks) in ranks_per_step(job).items() if len(ranks) != world}
    assert not split, f"steps applied by only some members of their generation: {split}"
    refused = job.workers[1].log_text().count("this process was stopped and continued")
    ack_refusals = sum(w.log_text().count("refused the step after the vote") for w in job.workers)
    assert refused and ack_refusals, (refused, ack_refusals, job.logs_tail())  # the case under test happened
