"""The lease fence counts on the TTL etcd granted, not on the one asked for (issue 11, fix 1).

etcd grants whole seconds (and raises a TTL below its minimum, ~2 s at default election settings).
A fence on the configured 3.4 s would let a member frozen for 3.3 s on a 3 s lease believe its
lease alive after it died, and commit. The fake store here grants like etcd: ``round`` and a floor.
"""

from __future__ import annotations

import threading

import pytest

from elasticd.rendezvous.lease import Lease, Reachability
from tests.fakes import FakeKeyValueStore, ManualClock

pytestmark = pytest.mark.timeout(30)

KEEPALIVE_S = 0.1


class RoundingStore(FakeKeyValueStore):
    """Grants as etcd does: a whole number of seconds, at least ``floor_s``."""

    def __init__(self, clock: ManualClock, floor_s: float = 2.0) -> None:
        super().__init__(clock)
        self.floor_s = floor_s

    def grant_lease(self, ttl_s: float) -> int:
        return super().grant_lease(max(self.floor_s, float(round(ttl_s))))


@pytest.mark.parametrize(("asked_s", "granted_s"), [(3.4, 3.0), (2.5, 2.0), (1.0, 2.0), (5.0, 5.0)])
def test_the_lease_keeps_the_ttl_etcd_granted(asked_s: float, granted_s: float) -> None:
    clock = ManualClock()
    lease = Lease(RoundingStore(clock), asked_s, clock)
    lease.grant()
    assert lease.granted_ttl_s == granted_s


@pytest.mark.parametrize(("asked_s", "frozen_s", "fresh"), [
    (3.4, 2.85, True),    # 2.85 < 3 - 0.1
    (3.4, 3.3, False),    # the lease (3 s) died 0.3 s ago: a fence on 3.4 s would say fresh
    (2.5, 2.3, False),    # granted 2 s
    (1.0, 1.5, True),     # asked 1 s, etcd's minimum 2 s: still alive
])
def test_freshness_is_judged_on_the_granted_ttl(asked_s: float, frozen_s: float, fresh: bool) -> None:
    clock = ManualClock()
    lease = Lease(RoundingStore(clock), asked_s, clock)
    lease.grant()
    clock.advance(frozen_s)
    assert lease.fresh(KEEPALIVE_S) is fresh


def test_a_renewal_counts_only_for_the_lease_it_was_asked_for() -> None:
    clock = ManualClock()
    lease = Lease(RoundingStore(clock), 3.0, clock)
    lease.grant()
    clock.advance(1.0)
    renewal = lease.renew()
    lease.grant()  # a new lease replaced the old one meanwhile
    renewed_at = lease.renewed_at
    clock.advance(0.5)
    lease.keep(renewal)
    assert lease.renewed_at == renewed_at


@pytest.mark.parametrize(("held_for_s", "answered_s_ago", "lately"), [
    (0.0, 0.2, True),    # a renewal just went out, the last answer is recent
    (0.4, 0.5, True),    # out for less than its bound (0.5 s)
    (0.6, 0.7, False),   # held past its bound: a leader election holds it, the last answer is stale news
    (0.6, 3.0, False),
    (None, 3.0, False),  # nothing out, but the last answer is older than the window (1.5 s)
    (None, 1.0, True),
])  # answered_s_ago counts from the last answer, before the held renewal went out
def test_a_renewal_held_past_its_bound_means_etcd_does_not_answer(
        held_for_s: float | None, answered_s_ago: float, lately: bool) -> None:
    """Stop 26: in the chaos soak each etcd leader kill stopped training ~0.8 s: a member whose last
    answer came just before the election still counted as "answered by etcd", so every step was
    retried until the others' renewals landed. A renewal out past ``lease_renew_s`` now says etcd
    does not answer this member, at once."""
    clock = ManualClock()
    reach = Reachability(clock)
    stop, wake, asked, release = (threading.Event() for _ in range(4))
    clock.advance(10.0)
    reach.answered(True)
    clock.advance(answered_s_ago - (held_for_s or 0.0))

    def ask() -> float:
        asked.set()
        release.wait(10)
        return 1.0

    thread = threading.Thread(target=reach.background, args=(stop, wake, ask, lambda _: None, 0.01),
                              kwargs={"held_s": 0.5}, daemon=True)
    if held_for_s is not None:
        thread.start()
        assert asked.wait(10)
        clock.advance(held_for_s)
    assert reach.lately(1.5) is lately
    stop.set()
    release.set()
    if held_for_s is not None:
        thread.join(10)
        assert not thread.is_alive()
        assert reach.lately(1.5)  # answered now
