"""A node's relay: one etcd watch and one read per change for all the workers of a node.

Without it every worker watches the job's generation keys and reads its view of the job itself, so
a change of membership costs etcd one watch event and one read per worker. With it (the agent's
``relay`` setting), the agent runs a ``NodeRelay``: it watches ``Keys.member_watch`` once, reads
``Keys.member_view`` (and, for a large generation, this node's roster bucket) once per change and
at least every ``relay_heartbeat_s``, and sends each read to its workers over a Unix socket. A
worker's ``RelayedStore`` answers the membership's view reads and watches from those frames and
sends its leased records (member, ready, progress) to the relay, which writes what its workers
sent meanwhile in one transaction (``put_many``: a node's registrations and ready records are one
request, not one per worker); everything else (its lease and renewals, the coordinator's full reads,
the unleased writes) goes straight to etcd. Each worker keeps its own lease, so a crashed worker is
still seen at once (its agent revokes it).

The rules that keep a relayed view as good as a read of its own (``serve``, pure):

* a view is served only from a read that *began* after the member's last write to a watched key
  (read-your-writes: that write's watch event makes the relay read at once) and less than
  ``2 * relay_heartbeat_s`` ago; the clock is ``CLOCK_MONOTONIC``, one clock for every process of a
  host;
* a read the relay could not make (etcd did not answer within its retries) fails the member's view
  read with ``EtcdUnavailable``, as its own read would have;
* a relay that sends nothing for ``relay_stale_s`` (a stopped or dead agent), a broken socket or a
  malformed frame: the worker reads and watches etcd itself from then on (``relay_lost``); a put
  the relay did not answer within the bound of a put of the worker's own is made directly (a put is
  idempotent).

This module holds the messages, the rule and the agent's side (``NodeRelay``); the worker's side is
``rendezvous.relayed_store``. Never decides anything of the rendezvous; never imports etcd3 or torch.
"""

from __future__ import annotations

import base64
import enum
import json
import os
import queue
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.retry import Clock
from elasticd.store.kv import KeyValue, KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import DECODE_ERRORS
from elasticd.wire.roster import bucket_of, buckets_for, is_sparse
from elasticd.wire.snapshot import parse_snapshot

log = structlog.get_logger(__name__)

MAX_FRAME = 1 << 24  # bytes: a frame longer than this is refused (a view is ~1 kB, a roster bucket more)
HEADER = struct.Struct(">I")  # each frame: its length, then that many bytes of JSON
LISTEN_BACKLOG = 256  # a node's workers connect at once when the agent starts them
MAX_BATCH = 100  # puts in one transaction (etcd's default --max-txn-ops is 128)
RECV_CHUNK = 65536


class RelayError(Exception):
    """A frame that is not one a relay sends (the worker stops listening to it)."""


@dataclass(frozen=True)
class Frame:
    """What a relay sends: its newest good read and its newest failure."""

    seq: int
    read_at: float = 0.0  # CLOCK_MONOTONIC when the newest good read began (0: none yet)
    view: tuple[KeyValue, ...] = ()  # that read of Keys.member_view
    extra: tuple[KeyValue, ...] = ()  # ... and the single keys read with it (this node's roster bucket)
    error: str = ""  # the newest read after it failed: why (etcd did not answer)
    error_at: float = 0.0  # ... and when that failure ended


def _kv_json(kv: KeyValue) -> list[object]:
    return [kv.key, base64.b64encode(kv.value).decode(), kv.mod_revision, kv.create_revision, kv.lease]


def _kv_of(row: object) -> KeyValue:
    if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str) and isinstance(row[1], str)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in row[2:])):
        raise RelayError(f"not a key-value row: {str(row)[:80]}")
    return KeyValue(row[0], base64.b64decode(row[1], validate=True), row[2], row[3], row[4])


def encode_frame(frame: Frame) -> bytes:
    """``frame`` as sent: its length, then JSON."""
    body = json.dumps({"seq": frame.seq, "read_at": frame.read_at, "view": [_kv_json(kv) for kv in frame.view],
                       "extra": [_kv_json(kv) for kv in frame.extra], "error": frame.error,
                       "error_at": frame.error_at}, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def decode_frame(body: bytes) -> Frame:
    """The frame whose JSON is ``body`` (without its length).

    Raises:
        RelayError: ``body`` is not a frame.
    """
    return _frame_of(_object(body))


def _frame_of(d: dict[str, object]) -> Frame:
    try:
        seq, read_at, error, error_at, view, extra = d["seq"], d["read_at"], d["error"], d["error_at"], d["view"], d["extra"]
        if not (_ints(seq) and isinstance(read_at, (int, float)) and isinstance(error, str)
                and isinstance(error_at, (int, float)) and isinstance(view, list) and isinstance(extra, list)):
            raise RelayError("a field of the wrong type")
        return Frame(seq=seq, read_at=float(read_at), view=tuple(_kv_of(r) for r in view),  # type: ignore[arg-type]
                     extra=tuple(_kv_of(r) for r in extra), error=error, error_at=float(error_at))
    except (ValueError, KeyError, TypeError) as exc:  # base64's (binascii.Error is a ValueError)
        raise RelayError(f"malformed frame: {exc}") from exc


@dataclass(frozen=True)
class PutRequest:
    """A worker's leased put, sent to its relay."""

    id: int
    key: str
    value: bytes
    lease: int


@dataclass(frozen=True)
class Reply:
    """The relay's answer to a ``PutRequest``: the revision written, or why not."""

    id: int
    revision: int = 0
    error: str = ""  # "" written; LEASE_LOST: the lease is gone; else etcd did not answer, and why


LEASE_LOST = "lease_lost"


def _framed(d: dict[str, object]) -> bytes:
    body = json.dumps(d, separators=(",", ":")).encode()
    return HEADER.pack(len(body)) + body


def encode_request(r: PutRequest) -> bytes:
    return _framed({"put": r.id, "key": r.key, "value": base64.b64encode(r.value).decode(), "lease": r.lease})


def encode_reply(r: Reply) -> bytes:
    return _framed({"reply": r.id, "revision": r.revision, "error": r.error})


def _object(body: bytes) -> dict[str, object]:
    try:
        d = json.loads(body)
    except ValueError as exc:
        raise RelayError(f"malformed message: {exc}") from exc
    if not isinstance(d, dict):
        raise RelayError("not an object")
    return d


def _ints(*values: object) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def decode_request(body: bytes) -> PutRequest:
    """The put request whose JSON is ``body``.

    Raises:
        RelayError: ``body`` is not one.
    """
    d = _object(body)
    key, value = d.get("key"), d.get("value")
    if not (_ints(d.get("put"), d.get("lease")) and isinstance(key, str) and isinstance(value, str)):
        raise RelayError("not a put request")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError as exc:
        raise RelayError(f"a put request's value: {exc}") from exc
    return PutRequest(d["put"], key, raw, d["lease"])  # type: ignore[arg-type]


def decode_message(body: bytes) -> Frame | Reply:
    """What a relay sent: a frame, or the reply to a put.

    Raises:
        RelayError: neither.
    """
    d = _object(body)
    if "reply" in d:
        if not (_ints(d["reply"], d.get("revision")) and isinstance(d.get("error"), str)):
            raise RelayError("a reply of the wrong shape")
        return Reply(d["reply"], d["revision"], d["error"])  # type: ignore[arg-type]
    return _frame_of(d)


class Serve(enum.Enum):
    VIEW = "view"  # the frame's read answers the member
    FAIL = "fail"  # the relay's read after ``since`` failed: etcd did not answer
    WAIT = "wait"  # no read after ``since`` yet: wait for the next frame


def serve(frame: Frame | None, since: float) -> Serve:
    """Whether ``frame`` answers a member's view read that needs a read begun at ``since`` or later. Pure."""
    if frame is None:
        return Serve.WAIT
    if frame.read_at >= since and frame.read_at > 0:
        return Serve.VIEW
    if frame.error and frame.error_at >= since:
        return Serve.FAIL
    return Serve.WAIT


# -- the agent's side ---------------------------------------------------------------------------


class _Client:
    """One worker's connection: what it sent that is not yet a whole message, and a lock that keeps
    frames and replies whole on its stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.lock = threading.Lock()

    def connected(self) -> bool:
        """The worker has not shut its end (it does so before it writes etcd itself)."""
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except BlockingIOError:
            return True  # nothing to read: still there
        except OSError:
            return False

    def send_now(self, data: bytes) -> bool:
        """Send ``data`` whole without waiting; False (drop the client) when its buffer is full (a
        stopped worker) or it went away: a message half sent would corrupt its stream."""
        with self.lock:
            try:
                return self.sock.send(data) == len(data)
            except OSError:  # BlockingIOError (full), BrokenPipeError, ConnectionResetError
                return False


class NodeRelay:
    """The relay of one node (run by its agent): reads the members' view on each change and sends
    it; writes the leased puts its workers send, batched."""

    def __init__(self, store: KeyValueStore, keys: Keys, node: str, path: str, timeouts: Timeouts,
                 clock: Clock = time.monotonic) -> None:
        self._store, self._keys, self._node, self.path = store, keys, node, path
        self._timeouts, self._clock = timeouts, clock
        self._lock = threading.Lock()
        self._frame = Frame(seq=0)
        self._clients: list[_Client] = []
        self._puts: queue.Queue[tuple[_Client, PutRequest]] = queue.Queue()
        self._changed = threading.Event()  # a watched key changed: read now
        self._send = threading.Event()  # a new read or failure: send now
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._cancel: list[Callable[[], None]] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Listen on ``path`` (a stale socket file there is replaced), watch, and begin reading.

        Raises:
            OSError: the socket could not be made.
            EtcdUnavailable: the watches could not be set up.
        """
        if os.path.exists(self.path):
            os.unlink(self.path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o600)  # the agent's workers run as the agent's user
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
        self._sock = sock
        self._selector.register(sock, selectors.EVENT_READ, None)
        self._cancel = [self._store.watch_prefix(p, self._changed.set) for p in self._keys.member_watch]
        self._changed.set()
        for name, target in (("read", self._read_loop), ("send", self._send_loop), ("serve", self._serve_loop),
                             ("write", self._write_loop)):
            t = threading.Thread(target=target, name=f"elasticd-relay-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("relay_started", node=self._node, path=self.path)

    def close(self) -> None:
        self._stop.set()
        self._changed.set()
        self._send.set()
        for cancel in self._cancel:
            try:
                cancel()
            except EtcdUnavailable:
                pass
        for t in self._threads:
            t.join(timeout=self._timeouts.etcd_request_s * 2)
        with self._lock:
            for c in self._clients:
                c.sock.close()
            self._clients = []
        if self._sock is not None:
            self._sock.close()
        self._selector.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def clients(self) -> int:
        with self._lock:
            return len(self._clients)

    # -- the view -------------------------------------------------------------------------------

    def _read(self) -> tuple[list[KeyValue], list[KeyValue]]:
        view = self._store.get_prefixes(self._keys.member_view)
        g = parse_snapshot(self._keys, view).generation
        extra: list[KeyValue] = []
        if g is not None and is_sparse(g):
            kv = self._store.get(self._keys.roster(g.generation, bucket_of(self._node, buckets_for(g.world_size))))
            extra = [kv] if kv is not None else []
        return view, extra

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            self._changed.wait(self._timeouts.relay_heartbeat_s)
            self._changed.clear()
            if self._stop.is_set():
                return
            began = self._clock()
            try:
                view, extra = self._read()
            except EtcdUnavailable as exc:
                with self._lock:
                    f = self._frame
                    self._frame = Frame(f.seq + 1, f.read_at, f.view, f.extra, str(exc)[:300] or "etcd unavailable",
                                        self._clock())
            except DECODE_ERRORS as exc:  # a garbage generation record: the members' own parse reports it
                log.warning("relay_read_failed", error=str(exc)[:200])
                continue
            else:
                with self._lock:
                    self._frame = Frame(self._frame.seq + 1, began, tuple(view), tuple(extra))
            self._send.set()

    def _send_loop(self) -> None:
        while not self._stop.is_set():
            self._send.wait(self._timeouts.relay_heartbeat_s)
            self._send.clear()
            with self._lock:
                data, clients = encode_frame(self._frame), list(self._clients)
            self._drop([c for c in clients if not c.send_now(data)])

    def _drop(self, dropped: list[_Client]) -> None:
        if not dropped:
            return
        with self._lock:
            self._clients = [c for c in self._clients if c not in dropped]
        for c in dropped:
            try:
                self._selector.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            c.sock.close()
        # a worker that exited, or one stopped long enough to fill its socket's buffer (it reads
        # etcd itself once it runs again): not an error of the relay
        log.info("relay_clients_dropped", node=self._node, dropped=len(dropped))

    # -- the workers' puts ----------------------------------------------------------------------

    def _serve_loop(self) -> None:
        """Accept workers and read their put requests (one thread: a selector is not shared)."""
        while not self._stop.is_set():
            try:
                ready = self._selector.select(self._timeouts.relay_heartbeat_s)
            except (OSError, ValueError):
                return  # closed
            for key, _ in ready:
                if key.data is None:
                    self._accept()
                else:
                    self._receive(key.data)

    def _accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        conn.setblocking(False)
        client = _Client(conn)
        with self._lock:
            self._clients.append(client)
        self._selector.register(conn, selectors.EVENT_READ, client)
        self._send.set()  # the newcomer gets the newest frame now

    def _receive(self, client: _Client) -> None:
        try:
            chunk = client.sock.recv(RECV_CHUNK)
            if not chunk:
                raise EOFError("closed")
            client.buf += chunk
            while len(client.buf) >= HEADER.size:
                (length,) = HEADER.unpack_from(client.buf)
                if length > MAX_FRAME:
                    raise RelayError(f"a request of {length} bytes")
                if len(client.buf) < HEADER.size + length:
                    break
                body = bytes(client.buf[HEADER.size:HEADER.size + length])
                del client.buf[:HEADER.size + length]
                self._puts.put((client, decode_request(body)))
        except BlockingIOError:
            return
        except RelayError as exc:  # not what a worker sends: refused
            log.warning("relay_client_refused", node=self._node, error=str(exc)[:200])
            self._drop([client])
        except (OSError, EOFError):  # the worker went away (exited, killed)
            self._drop([client])

    def _write_loop(self) -> None:
        """Write what the workers sent meanwhile in one transaction (at most ``MAX_BATCH`` puts)."""
        while not self._stop.is_set():
            try:
                batch = [self._puts.get(timeout=self._timeouts.relay_heartbeat_s)]
            except queue.Empty:
                continue
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._puts.get_nowait())
                except queue.Empty:
                    break
            # A worker that left this relay (it heard nothing for relay_stale_s: this agent was
            # stopped) writes its records itself: one queued here must not land after its own.
            batch = [(c, r) for c, r in batch if c.connected()]
            if not batch:
                continue
            for client, reply in self._write(batch):
                if not client.send_now(encode_reply(reply)):
                    self._drop([client])

    def _write(self, batch: list[tuple[_Client, PutRequest]]) -> list[tuple[_Client, Reply]]:
        try:
            revision = self._store.put_many([(r.key, r.value, r.lease) for _, r in batch])
            return [(c, Reply(r.id, revision)) for c, r in batch]
        except EtcdUnavailable as exc:
            return [(c, Reply(r.id, error=str(exc)[:300] or "etcd unavailable")) for c, r in batch]
        except LeaseLost:
            pass  # one of them: each alone, so the others are written
        out = []
        for c, r in batch:
            try:
                out.append((c, Reply(r.id, self._store.put(r.key, r.value, r.lease))))
            except LeaseLost:
                out.append((c, Reply(r.id, error=LEASE_LOST)))
            except EtcdUnavailable as exc:
                out.append((c, Reply(r.id, error=str(exc)[:300] or "etcd unavailable")))
        return out
