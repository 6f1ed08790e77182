"""The relay's member leases (``relay.leases``): when one ends, what its end deletes, and who may
renew or write under it; and the relay's lease messages round trip."""

from __future__ import annotations

import pytest

from elasticd.relay.leases import MemberLease, MemberLeases, expired, next_expiry
from elasticd.relay.messages import (
    LeaseOp,
    LeaseRequest,
    PutRequest,
    RelayError,
    Reply,
    decode_message,
    decode_request,
    encode_reply,
    encode_request,
)

TTL = 3.0


@pytest.mark.parametrize(
    ("renewed_at", "ended", "now", "is_expired"),
    [
        (10.0, False, 12.9, False),  # within the TTL
        (10.0, False, 13.0, True),  # a TTL without renewal: ended, as etcd ends a lease
        (10.0, False, 100.0, True),
        (10.0, True, 100.0, False),  # ended already: not again
        (10.0, False, 10.0, False),
    ],
)
def test_a_member_lease_expires_a_ttl_after_its_last_renewal(
    renewed_at: float, ended: bool, now: float, is_expired: bool
) -> None:
    lease = MemberLease(7, "w", renewed_at, ended=ended)
    assert expired([lease], now, TTL) == ([7] if is_expired else [])


def test_next_expiry_is_the_earliest_live_lease_end() -> None:
    leases = [MemberLease(1, "a", 5.0), MemberLease(2, "b", 4.0, ended=True), MemberLease(3, "c", 6.0)]
    assert next_expiry(leases, TTL) == 8.0
    assert next_expiry([], TTL) is None


def test_renewal_and_writes_only_by_the_owner_while_the_lease_lives() -> None:
    leases = MemberLeases(TTL)
    a = leases.grant("wa", now=0.0)
    b = leases.grant("wb", now=0.0)
    assert a != b
    assert leases.renew(a, "wa", now=2.0) == TTL
    assert leases.renew(a, "wb", now=2.0) == 0.0  # not theirs
    assert not leases.note(a, "wb", "/k", None)
    assert leases.note(a, "wa", "/members/a", None)
    assert leases.note(a, "wa", "/coordinator", b"seat of a")
    assert leases.expired(now=4.9) == [b]  # b was never renewed; a was, at 2.0
    assert leases.end([b]) == [b]
    assert leases.end([b]) == []  # once
    assert leases.renew(b, "wb", now=5.0) == 0.0
    assert not leases.note(b, "wb", "/members/b", None)
    assert leases.take([b]) == []


def test_an_ended_lease_gives_every_key_noted_under_it_once() -> None:
    leases = MemberLeases(TTL)
    a = leases.grant("wa", now=0.0)
    leases.note(a, "wa", "/members/a", None)
    leases.note(a, "wa", "/ready/a", None)
    leases.note(a, "wa", "/coordinator", b"seat of a")
    assert leases.take([a]) == []  # not ended: nothing to delete yet
    assert leases.holding(["/members/a"]) == [a]
    assert leases.of_owner("wa") == [a]
    leases.end([a])
    assert leases.holding(["/members/a"]) == [] and leases.of_owner("wa") == []
    assert sorted(leases.take([a]), key=lambda kv: kv[0]) == [
        ("/coordinator", b"seat of a"),
        ("/members/a", None),
        ("/ready/a", None),
    ]
    assert leases.take([a]) == [] and len(leases) == 0


def test_the_node_lease_lost_forgets_every_member_lease() -> None:
    leases = MemberLeases(TTL)
    ids = [leases.grant(f"w{i}", now=0.0) for i in range(3)]
    assert leases.forget_all() == 3
    assert all(leases.renew(i, f"w{n}", now=1.0) == 0.0 for n, i in enumerate(ids))
    assert leases.grant("w0", now=1.0) not in ids  # ids are never reused


@pytest.mark.parametrize(
    "request_",
    [
        PutRequest(1, "/elasticd/j/ready/n0.0.1", b"\x00v", 5),
        PutRequest(2, "/elasticd/j/coordinator", b"seat", 5, expected=0),
        PutRequest(3, "/elasticd/j/coordinator", b"seat", 5, expected=1234),
        LeaseRequest(4, LeaseOp.GRANT),
        LeaseRequest(5, LeaseOp.RENEW, 9),
        LeaseRequest(6, LeaseOp.REVOKE, 9),
    ],
)
def test_requests_round_trip(request_: PutRequest | LeaseRequest) -> None:
    data = encode_request(request_)
    assert decode_request(data[4:]) == request_


@pytest.mark.parametrize(
    "body",
    [
        b'{"lease_op": 1, "op": "steal", "lease": 1}',
        b'{"lease_op": "1", "op": "grant", "lease": 0}',
        b'{"lease_op": 1, "op": "grant"}',
        b'{"put": 1, "key": "/k", "value": "", "lease": 1, "expected": -2}',
        b'{"put": 1, "key": "/k", "value": "", "lease": -1}',
    ],
)
def test_malformed_requests_are_refused(body: bytes) -> None:
    with pytest.raises(RelayError):
        decode_request(body)


def test_replies_carry_the_lease_granted_and_the_ttl_left() -> None:
    reply = Reply(3, revision=17, ttl_s=2.5, lease=0x694D7F1E6E7A4C05)
    assert decode_message(encode_reply(reply)[4:]) == reply
    with pytest.raises(RelayError):
        decode_message(b'{"reply": 1, "revision": 0, "error": "", "ttl_s": "x", "lease": 0}')
