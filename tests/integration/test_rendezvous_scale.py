"""The rendezvous at sizes past etcd's default limits, against a real etcd with default settings.

A generation used to be published in one transaction that also deleted each member's ready record:
N + 2 operations, and etcd refuses more than 128 by default (``--max-txn-ops``), so no generation
of 127 or more members could form on a stock etcd. Now the ready records a generation consumed are
told apart by revision (``wire.snapshot.consumed``), and the transaction holds the small generation
record, at most 100 roster buckets (``wire.roster``), one range delete and the event at any N.
"""

from __future__ import annotations

import time

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts, WorldConfig
from elasticd.rendezvous.membership import Membership
from elasticd.retry import Deadline
from elasticd.store.etcd import EtcdClient
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord, ReadyRecord, encode
from elasticd.wire.roster import buckets_for, is_sparse
from elasticd.wire.snapshot import parse_snapshot

pytestmark = pytest.mark.timeout(120)

SIG = "s" * 64


def test_a_generation_of_200_members_is_published_on_a_stock_etcd(etcd_server) -> None:
    timeouts = Timeouts(lease_ttl_s=5, keepalive_s=1, join_window_s=0.05, join_s=60)
    store = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), timeouts, RetryPolicy())
    keys = Keys("/elasticd", f"scale{time.monotonic_ns()}")
    lease = store.grant_lease(60)
    others = [f"node{i}.0.{i}" for i in range(199)]  # registered and ready, as 199 members would be
    for i, m in enumerate(others):
        rec = MemberRecord(
            member_id=m,
            node=f"node{i}",
            local_rank=0,
            pid=1000 + i,
            host="127.0.0.1",
            store_port=20000 + i,
            signature=SIG,
        )
        store.put(keys.member(m), encode(rec), lease=lease)
        store.put(
            keys.ready(m),
            encode(ReadyRecord(member_id=m, committed_step=-1, prev_generation=0, prev_rank=0, signature=SIG)),
            lease=lease,
        )
    me = MemberRecord(
        member_id="me.0.1", node="me", local_rank=0, pid=1, host="127.0.0.1", store_port=30000, signature=SIG
    )
    membership = Membership(store, keys, me, WorldConfig(job_id=keys.job.rsplit("/", 1)[1], min_workers=200), timeouts)
    membership.start()
    try:
        joined = membership.join(-1, Deadline.after(60))
        assert joined.world_size == 200 and joined.generation == 1
        assert membership.is_coordinator()  # the only live member elected itself and published
        # the member read the small record and its node's roster bucket, not the 200 names
        assert is_sparse(joined.record) and joined.record.members[joined.rank] == "me.0.1"
        assert sum(1 for m in joined.record.members if m) < 200
        snap = parse_snapshot(keys, store.get_prefixes(keys.rendezvous))
        assert snap.generation is not None and len(snap.generation.members) == 200 and not snap.malformed
        assert len(store.get_prefix(keys.roster_prefix)) == buckets_for(200)
        assert snap.ready == {}  # every ready record was consumed by the generation
    finally:
        membership.close()
        store.revoke_lease(lease)
        store.close()
