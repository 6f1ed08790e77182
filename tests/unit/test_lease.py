"""A member's lease keeps the TTL etcd granted, not the one asked for, and counts a renewal only
for the lease it was asked for.

etcd grants whole seconds (and raises a TTL below its minimum, ~2 s at default election settings).
The fake store here grants like etcd: ``round`` and a floor.
"""

from __future__ import annotations

import pytest

from elasticd.rendezvous.lease import Lease
from tests.fakes import FakeKeyValueStore, ManualClock

pytestmark = pytest.mark.timeout(30)

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
