"""A member that stops after the coordinator took it into a generation, and before that
generation's group is built, holds the others in the build no longer than the reach check's
bounds: they ask its host while they wait there (``rendezvous.reach``, ``Waiting.build``), its
Python does not answer, and the generation is aborted without it; its lease (15 s here) would have
held them until it ended. Real gloo workers, a real etcd, a real SIGSTOP; every step once, the
final parameters identical on every rank that ends the job."""

from __future__ import annotations

import json
import signal
import time

import pytest
import torch

from elasticd.config import EtcdConfig
from elasticd.wire.keys import Keys
from elasticd.wire.records import decode_generation

pytestmark = pytest.mark.timeout(180)

STEPS = 260
TTL_S = 15.0  # the stopped member's lease: the wait it would cost without the reach check
# The reach check's path: reach_check_s 0.5 + probe_s 0.25 + unresponsive_s 2, a regroup; what the
# lease would cost is TTL_S less the join window at most (12 s)
BOUND_S = 8.0


def _commits(job, worker: int) -> list[dict[str, object]]:
    path = job.dir / f"audit{worker}.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except ValueError:  # a line being written
            continue
        if r["event"] == "commit":
            out.append(r)
    return out


def test_a_member_stopped_before_its_generations_build_holds_the_others_within_the_reach_bounds(
    local_job, client, tmp_path
):
    job = local_job(min_workers=1, lease_ttl_s=TTL_S, keepalive_s=1.0, join_window_s=3.0, reach_hold_s=3.0)
    for i in range(2):
        job.spawn("--steps", str(STEPS), "--step-sleep", "0.05", "--save-final", str(tmp_path / f"final{i}.pt"))
    job.wait_for(lambda: len(_commits(job, 0)) >= 20, 90, "two workers training")
    newcomer = job.spawn("--steps", str(STEPS), "--step-sleep", "0.05", "--save-final", str(tmp_path / "final2.pt"))
    keys = Keys(EtcdConfig().prefix, job.job_id)
    # its ready record is written: the coordinator takes it into the next generation after the
    # join window (3 s); it stops before that generation is published
    job.wait_for(
        lambda: any(kv.key.endswith(f".{newcomer.pid}") for kv in client.get_prefix(keys.ready(""))),
        90,
        "the newcomer's ready record",
    )
    newcomer.signal(signal.SIGSTOP)
    stopped_at = time.time()
    taken: list[int] = []

    def has_newcomer() -> bool:
        number, members = _generation(client, keys)
        if any(m.endswith(f".{newcomer.pid}") for m in members):
            taken.append(number)
        return bool(taken)

    try:
        job.wait_for(has_newcomer, 10, "a generation with the stopped newcomer")
        job.wait_for(
            lambda: any(int(c["generation"]) > taken[0] for c in _commits(job, 0)), 60, "a commit after that generation"
        )
    finally:
        newcomer.signal(signal.SIGCONT)
    before = [c for c in _commits(job, 0) if float(c["t"]) <= stopped_at]
    after = [c for c in _commits(job, 0) if int(c["generation"]) > taken[0]]
    stall = float(after[0]["t"]) - float(before[-1]["t"])
    # the stall covers the join window (up to 3 s before the publish) and the build's wait
    assert stall < BOUND_S + 3.0, f"no commit for {stall:.2f} s: the build waited for the lease"
    assert after[0]["world_size"] == 2, after[0]
    logs = job.workers[0].log_text() + job.workers[1].log_text()
    assert "members unresponsive" in logs, job.logs_tail()
    codes = job.wait_all(150)
    assert codes == [0, 0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == STEPS
    # the continued member rejoins, held out for reach_hold_s, or the job ends first (a loaded host)
    finals = [torch.load(p, weights_only=True) for p in sorted(tmp_path.glob("final*.pt"))]
    assert len(finals) >= 2
    for f in finals[1:]:
        assert all(torch.equal(f[k], finals[0][k]) for k in f)


def _generation(client, keys: Keys) -> tuple[int, list[str]]:
    """The generation record's number and members (0 and none before the first)."""
    kv = client.get(keys.generation)
    if kv is None:
        return 0, []
    g = decode_generation(kv.value)
    return g.generation, list(g.members)
