"""A member stopped and continued after its vote confirms its lease and applies the step with its
peers (``commit.commit_outcome``: the continued refusal is confirmable), so no step is applied by
only some members of its generation. Real gloo workers, a real etcd, real SIGSTOP/SIGCONT."""

from __future__ import annotations

import json
import random
import signal
import time
from collections import defaultdict

import pytest

pytestmark = pytest.mark.timeout(180)

STOPS = 8
STEPS = 190  # ~15 s at the slow workers' 0.08 s: the stops (~9 s from step 20) end well before the job
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


def test_a_member_continued_after_its_vote_confirms_its_lease_and_applies_the_step_with_its_peers(local_job):
    # Worker 1 computes fast and then waits in the gradient all_reduce for the two slow ones, so a
    # SIGSTOP lands after its vote most of the time. When it continues, the sum completes on all
    # three; its fence says "continued". It used to refuse the step while the two others applied
    # it (a split commit: worker 1 was behind and got rank 0's state at the regroup; had both
    # others died then, the step would have been done twice). Now etcd grants its lease a renewal
    # (no agent revoked it: a revoked lease never comes back), and it applies the step with them.
    job = local_job(min_workers=3)
    for sleep in ("0.08", "0", "0.08"):
        job.spawn("--steps", str(STEPS), "--step-sleep", sleep)
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
    assert rep.last_step == STEPS and len(set(rep.final_checksums)) == 1
    split = {step: sorted(ranks) for step, (world, ranks) in ranks_per_step(job).items() if len(ranks) != world}
    assert not split, f"steps applied by only some members of their generation: {split}"
    log = job.workers[1].log_text()
    confirmed = log.count('"after": "this process was stopped and continued')
    assert confirmed >= 3, (confirmed, job.logs_tail())  # the case under test happened (lease_confirmed)
    assert "not committed: this process was stopped and continued" not in log
