"""A job on a real 3-member etcd cluster: workers take every endpoint; a follower and
then the leader are SIGKILLed during training and started again. No step is lost or repeated, the
members never regroup, and no gap between two commits is longer than lease TTL + 2 s."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.errors import EtcdUnavailable
from elasticd.store.etcd import EtcdClient
from elasticd.testing.audit import first_commit_times
from elasticd.testing.etcd import ETCD_START_TIMEOUT_S, EtcdCluster
from tests.conftest import LocalJob

pytestmark = pytest.mark.timeout(240)

SLOW = ("--step-sleep", "0.02")
LEASE_TTL_S = 2.0  # LocalJob's ELASTICD_LEASE_TTL_S


@dataclass(frozen=True)
class _Endpoints:
    endpoint: str  # what LocalJob reads: here every member, comma-separated


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    c = EtcdCluster(3).start()
    try:
        yield c
    finally:
        c.stop()


def test_follower_and_leader_loss_lose_nothing_and_stall_nothing(cluster: EtcdCluster, tmp_path: Path) -> None:
    job = LocalJob(_Endpoints(",".join(cluster.endpoints)), tmp_path / "job", min_workers=2)  # type: ignore[arg-type]
    try:
        for _ in range(2):
            job.spawn("--steps", "100000", *SLOW)
        job.wait_for(lambda: job.committed() >= 30, 60, "30 committed steps")
        for which in ("follower", "leader"):
            leader = cluster.wait_for_leader(time.monotonic() + ETCD_START_TIMEOUT_S)
            victim = leader if which == "leader" else (leader + 1) % 3
            cluster.kill(victim)
            at = job.committed()
            job.wait_for(lambda: job.committed() >= at + 100, 60, f"training without the {which}")
            cluster.start_member(victim, time.monotonic() + ETCD_START_TIMEOUT_S)
            at = job.committed()
            job.wait_for(lambda: job.committed() >= at + 100, 60, f"training after the {which} returned")
        for w in job.workers:
            w.signal(15)  # SIGTERM: drain
        codes = job.wait_all(60)
        assert codes == [0, 0], job.logs_tail()
        rep = job.audit()
        assert rep.ok, rep.violations
        assert list(rep.generations) == [1], rep.generations
        first = first_commit_times(job.dir)
        times = [first[step] for step in sorted(first)]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert max(gaps) < LEASE_TTL_S + 2.0, (max(gaps), json.dumps(sorted(gaps)[-5:]))
    finally:
        job.stop()


def test_a_new_leader_shows_as_a_higher_raft_term_and_refreshes_every_lease(cluster: EtcdCluster) -> None:
    """What an agent's node-id claim relies on (``presence.wait_began``): after an election, reads
    answer with a higher raft term, and a lease nobody renews lives a full TTL past the election,
    beyond the TTL it was granted with."""
    store = EtcdClient(EtcdConfig(endpoints=cluster.endpoints), Timeouts(), RetryPolicy())
    try:
        store.put("/t/term", b"x")
        assert store.get("/t/term") is not None
        before = store.raft_term()
        assert before >= 1
        lease = store.grant_lease(LEASE_TTL_S)
        store.put("/t/leased", b"x", lease=lease)
        granted = time.monotonic()
        time.sleep(LEASE_TTL_S / 2)
        cluster.kill(cluster.wait_for_leader(time.monotonic() + ETCD_START_TIMEOUT_S))
        deadline = time.monotonic() + ETCD_START_TIMEOUT_S
        while store.raft_term() <= before:
            assert time.monotonic() < deadline, "no higher raft term after the leader was killed"
            try:
                store.get("/t/term")
            except EtcdUnavailable:
                time.sleep(0.1)
        elected = time.monotonic()
        # unrenewed, it would have ended at granted + TTL; the new leader gave it a TTL from its election
        while time.monotonic() < max(granted + LEASE_TTL_S + 0.75, elected + 0.5):
            time.sleep(0.05)
        assert store.get("/t/leased") is not None, "the lease was not refreshed by the new leader"
    finally:
        store.close()
