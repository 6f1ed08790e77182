"""The node relay's messages and the rule that serves a relayed view (``relay.node``).

Owns the frames a relay sends (``Frame``: its newest good read of the members' view and its newest
failure), the put and lease requests a worker sends, their replies and the relay's word that a
member lease ended, their codecs (a length, then JSON;
anything else is refused with ``RelayError``), and ``serve``: whether a frame answers a member's
view read. Pure: no I/O, no clock.
"""

from __future__ import annotations

import base64
import enum
import json
import math
import struct
from dataclasses import dataclass, replace

from elasticd.store.kv import KeyValue

MAX_FRAME = 1 << 24  # bytes: a frame longer than this is refused (a view is ~1 kB, a roster bucket more)
HEADER = struct.Struct(">I")  # each frame: its length, then that many bytes of JSON


class RelayError(Exception):
    """A frame that is not one a relay sends (the worker stops listening to it)."""


@dataclass(frozen=True)
class Frame:
    """What a relay sends: its newest good read and its newest failure."""

    seq: int
    read_at: float = 0.0  # CLOCK_MONOTONIC when the newest good read began (0: none yet)
    # ... and when the relay last found that read still current (read_at, or later: a heartbeat
    # with no change seen since the read, the read good and the node's lease renewed)
    current_at: float = 0.0
    view: tuple[KeyValue, ...] = ()  # that read of Keys.member_view
    extra: tuple[KeyValue, ...] = ()  # ... and the single keys read with it (this node's roster bucket)
    error: str = ""  # the newest read after it failed: why (etcd did not answer)
    error_at: float = 0.0  # ... and when that failure ended


def _kv_json(kv: KeyValue) -> list[object]:
    return [kv.key, base64.b64encode(kv.value).decode(), kv.mod_revision, kv.create_revision, kv.lease]


def _kv_of(row: object) -> KeyValue:
    if not (
        isinstance(row, list)
        and len(row) == 5
        and isinstance(row[0], str)
        and isinstance(row[1], str)
        and all(isinstance(x, int) and not isinstance(x, bool) for x in row[2:])
    ):
        raise RelayError(f"not a key-value row: {str(row)[:80]}")
    return KeyValue(row[0], base64.b64decode(row[1], validate=True), row[2], row[3], row[4])


def frame_tail(frame: Frame) -> bytes:
    """The part of ``frame``'s body after its head (``seq``, ``read_at``, ``current_at``): its read,
    the same bytes for every heartbeat that repeats that read (``encode_frame``'s ``tail``)."""
    rest = json.dumps(
        {
            "view": [_kv_json(kv) for kv in frame.view],
            "extra": [_kv_json(kv) for kv in frame.extra],
            "error": frame.error,
            "error_at": frame.error_at,
        },
        separators=(",", ":"),
    ).encode()
    return b"," + rest[1:]


def encode_frame(frame: Frame, tail: bytes | None = None) -> bytes:
    """``frame`` as sent: its length, then JSON. ``tail``: ``frame_tail(frame)``, when the sender
    kept it (a heartbeat repeats its read; encoding a large view again each time costs the relay)."""
    head = json.dumps(
        {"seq": frame.seq, "read_at": frame.read_at, "current_at": frame.current_at}, separators=(",", ":")
    ).encode()
    body = head[:-1] + (frame_tail(frame) if tail is None else tail)
    return HEADER.pack(len(body)) + body


def decode_frame(body: bytes) -> Frame:
    """The frame whose JSON is ``body`` (without its length).

    Raises:
        RelayError: ``body`` is not a frame.
    """
    return _frame_of(_object(body))


def _frame_of(d: dict[str, object]) -> Frame:
    try:
        seq, read_at, current_at, error, error_at, view, extra = (
            d["seq"],
            d["read_at"],
            d["current_at"],
            d["error"],
            d["error_at"],
            d["view"],
            d["extra"],
        )
        if not (
            _ints(seq)
            and isinstance(read_at, (int, float))
            and isinstance(current_at, (int, float))
            and isinstance(error, str)
            and isinstance(error_at, (int, float))
            and isinstance(view, list)
            and isinstance(extra, list)
        ):
            raise RelayError("a field of the wrong type")
        if not (math.isfinite(read_at) and math.isfinite(current_at) and math.isfinite(error_at)):
            raise RelayError("a time that is not finite")
        return Frame(
            seq=seq,
            read_at=float(read_at),
            current_at=float(current_at),
            view=tuple(_kv_of(r) for r in view),  # type: ignore[arg-type]
            extra=tuple(_kv_of(r) for r in extra),
            error=error,
            error_at=float(error_at),
        )
    except (ValueError, KeyError, TypeError, OverflowError) as exc:  # base64's (binascii.Error is a ValueError)
        raise RelayError(f"malformed frame: {exc}") from exc


@dataclass(frozen=True)
class PutRequest:
    """A worker's put under the lease its relay granted it, sent to its relay."""

    id: int
    key: str
    value: bytes
    lease: int
    expected: int = -1  # -1: a put; else a compare-and-put on the key's mod_revision (0: absent)


class LeaseOp(enum.Enum):
    GRANT = "grant"  # a member lease under the node's lease: Reply.revision is its id, Reply.lease the node's
    REVOKE = "revoke"  # its keys are deleted before the reply


@dataclass(frozen=True)
class LeaseRequest:
    """A worker's request about its member lease, sent to its relay."""

    id: int
    op: LeaseOp
    lease: int = 0


@dataclass(frozen=True)
class Reply:
    """The relay's answer to a ``PutRequest`` or ``LeaseRequest``: the revision written (a
    compare-and-put that failed its compare: 0; a grant: the member lease), the node's lease (a
    grant), or why not."""

    id: int
    revision: int = 0
    error: str = ""  # "" done; LEASE_LOST: the lease is gone; else etcd did not answer, and why
    lease: int = 0


LEASE_LOST = "lease_lost"


@dataclass(frozen=True)
class Ended:
    """The relay to a worker: these member leases of yours ended (``relay.leases``)."""

    leases: tuple[int, ...]


def encode_ended(e: Ended) -> bytes:
    return _framed({"ended": list(e.leases)})


def _framed(d: dict[str, object]) -> bytes:
    body = json.dumps(d, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def encode_request(r: PutRequest | LeaseRequest) -> bytes:
    if isinstance(r, LeaseRequest):
        return _framed({"lease_op": r.id, "op": r.op.value, "lease": r.lease})
    return _framed(
        {
            "put": r.id,
            "key": r.key,
            "value": base64.b64encode(r.value).decode(),
            "lease": r.lease,
            "expected": r.expected,
        }
    )


def encode_reply(r: Reply) -> bytes:
    return _framed({"reply": r.id, "revision": r.revision, "error": r.error, "lease": r.lease})


def _object(body: bytes) -> dict[str, object]:
    try:
        d = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise RelayError(f"malformed message: {exc}") from exc
    if not isinstance(d, dict):
        raise RelayError("not an object")
    return d


def _ints(*values: object) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def decode_request(body: bytes) -> PutRequest | LeaseRequest:
    """The put or lease request whose JSON is ``body``.

    Raises:
        RelayError: ``body`` is neither.
    """
    d = _object(body)
    lease = d.get("lease")
    if not (_ints(lease) and 0 <= lease < 2**63):  # type: ignore[operator]
        raise RelayError("a request without a lease")
    if "lease_op" in d:
        if not _ints(d["lease_op"]) or d.get("op") not in {op.value for op in LeaseOp}:
            raise RelayError("not a lease request")
        return LeaseRequest(d["lease_op"], LeaseOp(d["op"]), lease)  # type: ignore[arg-type]
    key, value, expected = d.get("key"), d.get("value"), d.get("expected", -1)
    if not (
        _ints(d.get("put"), expected) and isinstance(key, str) and isinstance(value, str) and -1 <= expected < 2**63  # type: ignore[operator]
    ):
        raise RelayError("not a put request")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError as exc:
        raise RelayError(f"a put request's value: {exc}") from exc
    return PutRequest(d["put"], key, raw, lease, expected)  # type: ignore[arg-type]


def decode_message(body: bytes) -> Frame | Reply | Ended:
    """What a relay sent: a frame, the reply to a request, or member leases ended.

    Raises:
        RelayError: none of them.
    """
    d = _object(body)
    if "ended" in d:
        ended = d["ended"]
        if not (isinstance(ended, list) and _ints(*ended)):
            raise RelayError("an ended message of the wrong shape")
        return Ended(tuple(ended))  # type: ignore[arg-type]
    if "reply" in d:
        if not (_ints(d["reply"], d.get("revision"), d.get("lease", 0)) and isinstance(d.get("error"), str)):
            raise RelayError("a reply of the wrong shape")
        return Reply(d["reply"], d["revision"], d["error"], d.get("lease", 0))  # type: ignore[arg-type]
    return _frame_of(d)


_VIEW_FIELD = b',"view":'  # where a frame's body leaves its head (seq, read_at, current_at) for its read (encode_frame)


class MessageReader:
    """A worker's decoding of what its relay sends, remembering the last frame: a heartbeat that
    repeats that frame's read (the same bytes from ``"view"`` on: the view, the roster bucket and
    the error fields) is decoded from its head alone (``seq``, ``read_at``, ``current_at``), so its view is not
    parsed again: a heartbeat comes every ``relay_heartbeat_s``, to every worker of the node."""

    def __init__(self) -> None:
        self._tail = b""
        self._frame: Frame | None = None

    def decode(self, body: bytes) -> Frame | Reply | Ended:
        """What a relay sent (``decode_message``).

        Raises:
            RelayError: neither a frame nor a reply.
        """
        cut = body.find(_VIEW_FIELD)
        if self._frame is not None and cut > 0 and body[cut:] == self._tail:
            head = _object(body[:cut] + b"}")
            seq, times = head.get("seq"), (head.get("read_at"), head.get("current_at"))
            if (
                set(head) == {"seq", "read_at", "current_at"}
                and _ints(seq)
                and all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in times)
            ):
                read_at, current_at = (float(t) for t in times)  # type: ignore[arg-type]
                self._frame = replace(self._frame, seq=seq, read_at=read_at, current_at=current_at)  # type: ignore[arg-type]
                return self._frame
        message = decode_message(body)
        if isinstance(message, Frame):
            self._tail, self._frame = (body[cut:], message) if cut > 0 else (b"", None)
        return message


class Serve(enum.Enum):
    VIEW = "view"  # the frame's read answers the member
    FAIL = "fail"  # the relay's read after ``since`` failed: etcd did not answer
    WAIT = "wait"  # no read after ``since`` yet: wait for the next frame


def shows(frame: Frame, key: str, value: bytes | None) -> bool:
    """``frame``'s view holds ``key`` with ``value`` (None: holds no ``key``): it shows a write of
    the member's own, whenever its read began. Pure."""
    held = [kv.value for kv in frame.view if kv.key == key]
    return not held if value is None else value in held


def serve(frame: Frame | None, since: float, written: float = 0.0) -> Serve:
    """Whether ``frame`` answers a member's view read that needs a view current at ``since`` or
    later, from a read begun at ``written`` (the member's last write to a watched key) or later. Pure."""
    if frame is None:
        return Serve.WAIT
    if frame.read_at > 0 and frame.read_at >= written and max(frame.read_at, frame.current_at) >= since:
        return Serve.VIEW
    if frame.error and frame.error_at >= max(since, written):
        return Serve.FAIL
    return Serve.WAIT
