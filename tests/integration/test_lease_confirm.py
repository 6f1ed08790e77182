"""``Membership.confirm_lease`` against a real etcd: what lets a member whose lease expired by its
own clock still apply a step (the commit rule's ``confirmable`` refusal, ``commit.py``).

A granted renewal after the sum proves the lease never expired; a revoked lease, or an etcd that
does not answer within ``lease_confirm_s``, leaves the refusal standing.
"""

from __future__ import annotations

import signal
import time

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts, WorldConfig
from elasticd.rendezvous.membership import Membership
from elasticd.retry import Deadline
from elasticd.store.etcd import EtcdClient
from elasticd.testing.etcd import EtcdServer
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord

pytestmark = pytest.mark.timeout(90)

CONFIRM_S = 1.5
SLACK_S = 1.0  # the keepalive thread's own request may run out its bound first


def _member(etcd: EtcdServer) -> tuple[Membership, EtcdClient, Keys]:
    timeouts = Timeouts(lease_ttl_s=3, keepalive_s=0.75, join_window_s=0.05, join_s=30,
                        lease_confirm_s=CONFIRM_S, etcd_request_s=0.5)
    store = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,)), timeouts, RetryPolicy(etcd_attempts=2))
    keys = Keys("/elasticd", f"confirm{time.monotonic_ns()}")
    me = MemberRecord(member_id="me.0.1", node="me", local_rank=0, pid=1, host="127.0.0.1", store_port=30000,
                      signature="s" * 64)
    membership = Membership(store, keys, me, WorldConfig(job_id=keys.job.rsplit("/", 1)[1], min_workers=1),
                            timeouts)
    membership.start()
    membership.join(-1, Deadline.after(30))
    return membership, store, keys


def test_a_live_lease_is_confirmed_and_a_revoked_one_is_not(etcd_server: EtcdServer) -> None:
    membership, store, _ = _member(etcd_server)
    try:
        standing = membership.standing()
        assert membership.confirm_lease(standing)  # etcd answers: the lease is alive
        store.revoke_lease(standing.lease)  # an expiry, as the coordinator would see it
        began = time.monotonic()
        assert not membership.confirm_lease(membership.standing())
        assert time.monotonic() - began <= CONFIRM_S + SLACK_S
    finally:
        membership.close()
        store.close()


def test_an_etcd_that_does_not_answer_leaves_the_refusal_within_its_bound() -> None:
    with EtcdServer() as etcd:
        membership, store, _ = _member(etcd)
        try:
            etcd.signal(signal.SIGSTOP)  # etcd holds every request, as a leader election does
            try:
                time.sleep(0.2)  # an answer already on its way is counted before the standing
                standing = membership.standing()
                began = time.monotonic()
                assert not membership.confirm_lease(standing)
                assert CONFIRM_S - 0.1 <= time.monotonic() - began <= CONFIRM_S + SLACK_S
            finally:
                etcd.signal(signal.SIGCONT)
            # etcd answers again and the lease was never lost: confirmed
            assert membership.confirm_lease(standing)
        finally:
            membership.close()
            store.close()
