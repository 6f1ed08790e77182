"""The node relay's pure parts (``relay.messages``): the frame codec, its refusal of anything a
relay does not send, and the rule that says whether a frame answers a member's view read."""

from __future__ import annotations

import json

import pytest

from elasticd.config import ConfigError, Timeouts
from elasticd.relay.node import current
from elasticd.relay.messages import (
    LEASE_LOST,
    Frame,
    MessageReader,
    PutRequest,
    RelayError,
    Reply,
    Serve,
    decode_frame,
    decode_message,
    decode_request,
    encode_frame,
    encode_reply,
    encode_request,
    frame_tail,
    serve,
)
from elasticd.store.kv import KeyValue

KV = KeyValue("/elasticd/j/generation", b"\x00\xffbinary", 7, 3, 0)
ROSTER = KeyValue("/elasticd/j/roster/9/2", b"{}", 9, 9, 0)


def body(frame: Frame) -> bytes:
    return encode_frame(frame)[4:]


def test_a_frame_round_trips_with_binary_values_and_its_length_prefix() -> None:
    f = Frame(seq=4, read_at=12.5, view=(KV,), extra=(ROSTER,), error="", error_at=0.0)
    data = encode_frame(f)
    assert int.from_bytes(data[:4], "big") == len(data) - 4
    assert decode_frame(data[4:]) == f
    failed = Frame(seq=5, read_at=12.5, view=(KV,), error="etcd down", error_at=13.0)
    assert decode_frame(body(failed)) == failed


def test_a_heartbeat_repeating_the_last_read_is_decoded_from_its_head_and_any_other_in_full() -> None:
    reader = MessageReader()
    first = Frame(seq=4, read_at=12.5, view=(KV,), extra=(ROSTER,))
    got = reader.decode(body(first))
    assert got == first
    beat = reader.decode(body(Frame(seq=5, read_at=13.0, current_at=13.5, view=(KV,), extra=(ROSTER,))))
    assert beat == Frame(seq=5, read_at=13.0, current_at=13.5, view=(KV,), extra=(ROSTER,))
    assert isinstance(beat, Frame) and beat.view is got.view  # not parsed again
    for changed in (
        Frame(seq=6, read_at=14.0, view=(KV, ROSTER), extra=(ROSTER,)),  # a new read
        Frame(seq=7, read_at=14.0, view=(KV, ROSTER), extra=(ROSTER,), error="etcd down", error_at=15.0),
    ):  # a failed read after it
        assert reader.decode(body(changed)) == changed
    assert reader.decode(encode_reply(Reply(3, 9))[4:]) == Reply(3, 9)  # replies pass through
    assert (
        reader.decode(
            body(Frame(seq=8, read_at=16.0, view=(KV, ROSTER), extra=(ROSTER,), error="etcd down", error_at=15.0))
        ).read_at
        == 16.0
    )  # type: ignore[union-attr]
    # a head that is not a frame's is refused as in full, even with the last frame's tail
    tail = body(first)[body(first).find(b',"view":') :]
    reader.decode(body(first))
    for bad in (
        b'{"seq":"9","read_at":1.0,"current_at":1.0' + tail,
        b'{"seq":9,"read_at":1e999,"current_at":1.0' + tail,
        b'{"seq":9,"read_at":1.0,"current_at":1e999' + tail,
        b'{"seq":9,"read_at":1.0' + tail,
    ):
        with pytest.raises(RelayError):
            reader.decode(bad)
    extra_field = b'{"seq":9,"read_at":1.0,"current_at":1.0,"x":1' + tail  # decoded in full, as decode_message does
    assert reader.decode(extra_field) == decode_message(extra_field)


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        b"{}",
        json.dumps({"seq": "1", "read_at": 0, "view": [], "extra": [], "error": "", "error_at": 0}).encode(),
        json.dumps(
            {"seq": 1, "read_at": 0, "view": [["k", "!!notbase64", 1, 1, 0]], "extra": [], "error": "", "error_at": 0}
        ).encode(),
        json.dumps(
            {"seq": 1, "read_at": 0, "view": [["k", "", 1, 1]], "extra": [], "error": "", "error_at": 0}
        ).encode(),
        json.dumps(
            {"seq": 1, "read_at": 0, "view": [["k", "", True, 1, 0]], "extra": [], "error": "", "error_at": 0}
        ).encode(),
        json.dumps({"seq": 1, "read_at": 0, "view": {}, "extra": [], "error": "", "error_at": 0}).encode(),
        b'{"seq": 1, "read_at": Infinity, "view": [], "extra": [], "error": "", "error_at": 0}',
        b"[" * 100000 + b"]" * 100000,
    ],
    ids=[
        "garbage",
        "a list",
        "no fields",
        "seq a string",
        "value not base64",
        "short row",
        "bool revision",
        "view not a list",
        "a time not finite",
        "nested too deep",
    ],
)
def test_anything_but_a_frame_is_refused(raw: bytes) -> None:
    with pytest.raises(RelayError):
        decode_frame(raw)


@pytest.mark.parametrize(
    ("frame", "since", "expected"),
    [
        (None, 0.0, Serve.WAIT),  # nothing heard yet
        (Frame(seq=0), 0.0, Serve.WAIT),  # connected, no read yet
        (Frame(seq=1, read_at=10.0, view=(KV,)), 9.0, Serve.VIEW),  # read after what is needed
        (Frame(seq=1, read_at=10.0, view=(KV,)), 10.0, Serve.VIEW),  # ... at that very moment
        (Frame(seq=1, read_at=10.0, view=(KV,)), 10.5, Serve.WAIT),  # too old, or before my write
        (Frame(seq=2, read_at=10.0, error="down", error_at=11.0), 10.5, Serve.FAIL),  # the read after failed
        (Frame(seq=2, read_at=10.0, error="down", error_at=11.0), 11.5, Serve.WAIT),  # a failure before: wait
        (Frame(seq=2, read_at=12.0, error="down", error_at=11.0), 11.5, Serve.VIEW),  # a good read after it
        (Frame(seq=3, read_at=10.0, current_at=11.0, view=(KV,)), 10.5, Serve.VIEW),  # read before, current since
        (Frame(seq=3, read_at=10.0, current_at=11.0, view=(KV,)), 11.5, Serve.WAIT),  # ... not current since
    ],
)
def test_serve(frame: Frame | None, since: float, expected: Serve) -> None:
    assert serve(frame, since) is expected


@pytest.mark.parametrize(
    ("frame", "since", "written", "expected"),
    [
        (Frame(seq=1, read_at=10.0, current_at=12.0, view=(KV,)), 11.0, 9.0, Serve.VIEW),  # read after my write
        (Frame(seq=1, read_at=10.0, current_at=12.0, view=(KV,)), 11.0, 10.5, Serve.WAIT),  # read before it: wait
        (Frame(seq=2, read_at=10.0, error="down", error_at=11.0), 9.0, 10.5, Serve.FAIL),  # the read after it failed
        (Frame(seq=2, read_at=10.0, error="down", error_at=11.0), 9.0, 11.5, Serve.WAIT),  # ... failed before it
    ],
)
def test_serve_after_a_write_of_my_own_needs_a_read_begun_after_it(
    frame: Frame, since: float, written: float, expected: Serve
) -> None:
    assert serve(frame, since, written) is expected


@pytest.mark.parametrize(
    ("frame", "changing", "node_ok", "expected"),
    [
        (Frame(seq=1, read_at=10.0, view=(KV,)), False, True, True),  # a good read, nothing since
        (Frame(seq=0), False, True, False),  # no read yet
        (Frame(seq=2, read_at=10.0, error="down", error_at=11.0), False, True, False),  # the newest read failed
        (Frame(seq=1, read_at=10.0, view=(KV,)), True, True, False),  # a change seen, or a read under way
        (Frame(seq=1, read_at=10.0, view=(KV,)), False, False, False),  # etcd did not answer the node's renewal
    ],
)
def test_a_heartbeat_says_current_only_with_nothing_changed_and_etcd_answering(
    frame: Frame, changing: bool, node_ok: bool, expected: bool
) -> None:
    assert current(frame, changing, node_ok) is expected


def test_relay_stale_s_must_exceed_two_heartbeats() -> None:
    Timeouts(relay_heartbeat_s=0.5, relay_stale_s=1.5)
    with pytest.raises(ConfigError, match="relay_stale_s"):
        Timeouts(relay_heartbeat_s=0.5, relay_stale_s=1.0)


def test_put_requests_and_replies_round_trip_and_are_told_apart_from_frames() -> None:
    req = PutRequest(7, "/elasticd/j/ready/n.0.1", b"\x00{json}", 123)
    assert decode_request(encode_request(req)[4:]) == req
    for reply in (Reply(7, revision=42), Reply(8, error=LEASE_LOST), Reply(9, error="etcd down")):
        assert decode_message(encode_reply(reply)[4:]) == reply
    frame = Frame(seq=3, read_at=1.0, view=(KV,))
    assert decode_message(body(frame)) == frame


@pytest.mark.parametrize(
    "raw",
    [
        b"[]",
        json.dumps({"put": 1, "key": "k", "value": "!!", "lease": 1}).encode(),
        json.dumps({"put": "1", "key": "k", "value": "", "lease": 1}).encode(),
        json.dumps({"put": 1, "key": 5, "value": "", "lease": 1}).encode(),
        json.dumps({"put": 1, "key": "k", "value": "", "lease": True}).encode(),
        json.dumps({"put": 1, "key": "k", "value": "", "lease": 2**63}).encode(),
        json.dumps({"put": 1, "key": "k", "value": "", "lease": -1}).encode(),
    ],
    ids=[
        "a list",
        "value not base64",
        "id a string",
        "key a number",
        "bool lease",
        "lease too large",
        "lease negative",
    ],
)
def test_anything_but_a_put_request_is_refused(raw: bytes) -> None:
    with pytest.raises(RelayError):
        decode_request(raw)


def test_a_reply_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(RelayError):
        decode_message(json.dumps({"reply": 1, "revision": "2", "error": ""}).encode())


@pytest.mark.parametrize(
    ("view", "value", "expected"),
    [
        ((("/j/generation", b"g2"),), b"g2", True),  # my write is in the read
        ((("/j/generation", b"g1"),), b"g2", False),  # an older read: wait for the next one
        ((), b"g2", False),
        ((("/j/abort", b"a"),), None, True),  # my delete: the key is gone in the read
        ((("/j/generation", b"g1"),), None, False),
    ],
)
def test_a_frame_shows_a_members_own_write_whatever_its_read_time(
    view: tuple[tuple[str, bytes], ...], value: bytes | None, expected: bool
) -> None:
    from elasticd.relay.messages import shows

    frame = Frame(seq=1, read_at=5.0, view=tuple(KeyValue(k, v, 10, 1) for k, v in view))
    assert shows(frame, "/j/generation", value) is expected


def test_a_frame_encoded_with_its_kept_tail_is_the_same_bytes_and_a_heartbeat_decodes_from_its_head() -> None:
    f = Frame(seq=4, read_at=12.5, view=(KV,), extra=(ROSTER,), error="", error_at=0.0)
    tail = frame_tail(f)
    assert encode_frame(f, tail) == encode_frame(f)
    beat = Frame(seq=5, read_at=12.5, current_at=13.0, view=f.view, extra=f.extra)
    assert encode_frame(beat, tail) == encode_frame(beat)
    reader = MessageReader()
    assert reader.decode(body(f)) == f
    assert reader.decode(encode_frame(beat, tail)[4:]) == beat
