"""The relay's member leases (``relay.leases``): when one ends, what its end deletes, and who may
write under it; and the relay's lease messages round trip."""

from __future__ import annotations

import pytest

from elasticd.relay.leases import MemberLease, MemberLeases, expired
from elasticd.relay.messages import (
    Ended,
    LeaseOp,
    LeaseRequest,
    PutRequest,
    RelayError,
    Reply,
    decode_message,
    decode_request,
    encode_ended,
    encode_reply,
    encode_request,
)

TTL = 3.0


@pytest.mark.parametrize(
    ("stopped_since", "ended", "now", "is_expired"),
    [
        (None, False, 100.0, False),  # running: a member lease needs no renewal
        (10.0, False, 12.9, False),  # stopped, within the TTL
        (10.0, False, 13.0, True),  # stopped for a TTL: ended, as etcd ends a lease not renewed
        (10.0, False, 100.0, True),
        (10.0, True, 100.0, False),  # ended already: not again
        (10.0, False, 10.0, False),
    ],
)
def test_a_member_lease_expires_once_its_process_is_stopped_for_the_ttl(
    stopped_since: float | None, ended: bool, now: float, is_expired: bool
) -> None:
    lease = MemberLease(7, "w", 1234, stopped_since, ended=ended)
    assert expired([lease], now, TTL) == ([7] if is_expired else [])


def test_a_stop_counts_from_when_it_is_first_seen_and_a_continue_clears_it() -> None:
    leases = MemberLeases(TTL)
    a = leases.grant("wa", pid=11)
    b = leases.grant("wb", pid=12)
    c = leases.grant("wc")  # pid unknown: no stop is ever seen
    assert leases.pids() == {a: 11, b: 12}
    leases.observe({a: True, b: True}, now=1.0)
    leases.observe({a: True, b: False}, now=2.0)  # b continued
    assert leases.expired(now=3.9) == []
    assert leases.expired(now=4.0) == [a]  # stopped since 1.0, not since 2.0
    leases.observe({b: True}, now=5.0)
    assert leases.expired(now=7.9) == [a] and leases.expired(now=8.0) == [a, b]
    assert c not in leases.expired(now=1000.0)


def test_writes_only_by_the_owner_while_the_lease_lives() -> None:
    leases = MemberLeases(TTL)
    a = leases.grant("wa")
    b = leases.grant("wb")
    assert a != b
    assert not leases.note(a, "wb", "/k", None)  # not theirs
    assert leases.note(a, "wa", "/members/a", None)
    assert leases.note(a, "wa", "/coordinator", b"seat of a")
    assert leases.end([b]) == [b]
    assert leases.end([b]) == []  # once
    assert not leases.note(b, "wb", "/members/b", None)
    assert leases.owner_of(b) == "wb"
    assert leases.take([b]) == []


def test_an_ended_lease_gives_every_key_noted_under_it_once() -> None:
    leases = MemberLeases(TTL)
    a = leases.grant("wa")
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


def test_the_node_lease_lost_forgets_every_member_lease_and_names_their_owners() -> None:
    leases = MemberLeases(TTL)
    ids = [leases.grant(f"w{i}") for i in range(3)]
    assert leases.forget_all() == {ids[0]: "w0", ids[1]: "w1", ids[2]: "w2"}
    assert not any(leases.holds(i, f"w{n}") for n, i in enumerate(ids))
    assert leases.grant("w0") not in ids  # ids are never reused


@pytest.mark.parametrize(
    "request_",
    [
        PutRequest(1, "/elasticd/j/ready/n0.0.1", b"\x00v", 5),
        PutRequest(2, "/elasticd/j/coordinator", b"seat", 5, expected=0),
        PutRequest(3, "/elasticd/j/coordinator", b"seat", 5, expected=1234),
        LeaseRequest(4, LeaseOp.GRANT),
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


def test_replies_carry_the_lease_granted_and_the_relay_says_which_leases_ended() -> None:
    reply = Reply(3, revision=17, lease=0x694D7F1E6E7A4C05)
    assert decode_message(encode_reply(reply)[4:]) == reply
    assert decode_message(encode_ended(Ended((4, 9)))[4:]) == Ended((4, 9))
    with pytest.raises(RelayError):
        decode_message(b'{"reply": 1, "revision": 0, "error": "", "lease": "x"}')
    with pytest.raises(RelayError):
        decode_message(b'{"ended": [1, "2"]}')
