"""A node's relay: one etcd watch and one read per change for all the workers of a node.

Without it every worker watches the job's generation keys and reads its view of the job itself, so
a change of membership costs etcd one watch event and one read per worker. With it (the agent's
``relay`` setting), the agent runs a ``NodeRelay``: it watches ``Keys.member_watch`` once, reads
``Keys.member_view`` (and, for a large generation, this node's roster bucket) once per change and
at least every ``relay_heartbeat_s``, and sends each read to its workers over a Unix socket. A
worker's ``RelayedStore`` answers the membership's view reads and watches from those frames and
sends everything else (its lease, its member and ready records, the coordinator's full reads, every
write) straight to etcd, so each worker keeps its own lease: a crashed worker is still seen at once.

The rules that keep a relayed view as good as a read of its own (``serve``, pure):

* a view is served only from a read that *began* after the member's last write to a watched key
  (read-your-writes: that write's watch event makes the relay read at once) and less than
  ``2 * relay_heartbeat_s`` ago; the clock is ``CLOCK_MONOTONIC``, one clock for every process of a
  host;
* a read the relay could not make (etcd did not answer within its retries) fails the member's view
  read with ``EtcdUnavailable``, as its own read would have;
* a relay that sends nothing for ``relay_stale_s`` (a stopped or dead agent), a broken socket or a
  malformed frame: the worker reads and watches etcd itself from then on (``relay_lost``).

Never decides anything of the rendezvous; never imports etcd3 or torch.
"""

from __future__ import annotations

import base64
import enum
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from elasticd.config import RetryPolicy, Timeouts
from elasticd.errors import EtcdUnavailable
from elasticd.retry import Clock
from elasticd.store.kv import KeyValue, KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import DECODE_ERRORS
from elasticd.wire.roster import bucket_of, buckets_for, is_sparse
from elasticd.wire.snapshot import parse_snapshot

log = structlog.get_logger(__name__)

MAX_FRAME = 1 << 24  # bytes: a frame longer than this is refused (a view is ~1 kB, a roster bucket more)
_HEADER = struct.Struct(">I")  # each frame: its length, then that many bytes of JSON
LISTEN_BACKLOG = 256  # a node's workers connect at once when the agent starts them


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
    return _HEADER.pack(len(body)) + body


def decode_frame(body: bytes) -> Frame:
    """The frame whose JSON is ``body`` (without its length).

    Raises:
        RelayError: ``body`` is not a frame.
    """
    try:
        d = json.loads(body)
        if not isinstance(d, dict):
            raise RelayError("not an object")
        seq, read_at, error, error_at = d["seq"], d["read_at"], d["error"], d["error_at"]
        if not (isinstance(seq, int) and isinstance(read_at, (int, float)) and isinstance(error, str)
                and isinstance(error_at, (int, float)) and isinstance(d["view"], list)
                and isinstance(d["extra"], list)):
            raise RelayError("a field of the wrong type")
        return Frame(seq=seq, read_at=float(read_at), view=tuple(_kv_of(r) for r in d["view"]),
                     extra=tuple(_kv_of(r) for r in d["extra"]), error=error, error_at=float(error_at))
    except (ValueError, KeyError, TypeError) as exc:  # json's, base64's (binascii.Error is a ValueError)
        raise RelayError(f"malformed frame: {exc}") from exc


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


class NodeRelay:
    """The relay of one node (run by its agent): reads the members' view on each change and sends it."""

    def __init__(self, store: KeyValueStore, keys: Keys, node: str, path: str, timeouts: Timeouts,
                 clock: Clock = time.monotonic) -> None:
        self._store, self._keys, self._node, self.path = store, keys, node, path
        self._timeouts, self._clock = timeouts, clock
        self._lock = threading.Lock()
        self._frame = Frame(seq=0)
        self._clients: list[socket.socket] = []
        self._changed = threading.Event()  # a watched key changed: read now
        self._send = threading.Event()  # a new read or failure: send now
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
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
        self._sock = sock
        self._cancel = [self._store.watch_prefix(p, self._changed.set) for p in self._keys.member_watch]
        self._changed.set()
        for name, target in (("read", self._read_loop), ("send", self._send_loop), ("accept", self._accept_loop)):
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
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        for t in self._threads:
            t.join(timeout=self._timeouts.etcd_request_s * 2)
        with self._lock:
            for c in self._clients:
                c.close()
            self._clients = []
        try:
            os.unlink(self.path)
        except OSError:
            pass

    def clients(self) -> int:
        with self._lock:
            return len(self._clients)

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
            dropped = [c for c in clients if not _send_all_now(c, data)]
            if dropped:
                with self._lock:
                    self._clients = [c for c in self._clients if c not in dropped]
                for c in dropped:
                    c.close()
                log.warning("relay_clients_dropped", node=self._node, dropped=len(dropped))

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.setblocking(False)
            with self._lock:
                self._clients.append(conn)
            self._send.set()  # the newcomer gets the newest frame now


def _send_all_now(conn: socket.socket, data: bytes) -> bool:
    """Send ``data`` whole without waiting; False (drop the client) when its buffer is full (a
    stopped worker) or it went away: a frame half sent would corrupt its stream."""
    try:
        return conn.send(data) == len(data)
    except OSError:  # BlockingIOError (full), BrokenPipeError, ConnectionResetError
        return False


# -- the worker's side --------------------------------------------------------------------------


class RelayedStore:
    """A ``KeyValueStore``: a member's view reads and watches from its node's relay (``NodeRelay``),
    everything else straight to etcd (``inner``). Thread-safe."""

    def __init__(self, inner: KeyValueStore, keys: Keys, path: str, timeouts: Timeouts, retry: RetryPolicy,
                 clock: Clock = time.monotonic) -> None:
        self._inner, self._timeouts, self._clock = inner, timeouts, clock
        self._view_prefixes = tuple(keys.member_view)
        self._watched = frozenset(keys.member_watch)
        # a view read waits for the relay at most as long as its own read could take
        self._wait_s = timeouts.relay_stale_s + retry.etcd_attempts * timeouts.etcd_request_s
        self._cond = threading.Condition()
        self._frame: Frame | None = None
        self._dirty_since = 0.0  # when my last write to a watched key returned
        self._direct = False
        self._subs: dict[int, tuple[str, Callable[[], None]]] = {}
        self._direct_cancel: dict[int, Callable[[], None]] = {}
        self._next_sub = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeouts.relay_stale_s)
        try:
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            self._direct = True
            log.warning("relay_unreachable", path=path, error=str(exc)[:200])
            return
        log.info("relay_connected", path=path)
        threading.Thread(target=self._receive_loop, name="elasticd-relay-receive", daemon=True).start()

    @property
    def relayed(self) -> bool:
        """The relay answers this member's view reads (False once it fell back to etcd)."""
        return not self._direct

    # -- frames ---------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        try:
            while True:
                (length,) = _HEADER.unpack(self._recv_exactly(_HEADER.size))
                if length > MAX_FRAME:
                    raise RelayError(f"a frame of {length} bytes (at most {MAX_FRAME})")
                self._on_frame(decode_frame(self._recv_exactly(length)))
        except TimeoutError:
            self._fall_back(f"nothing from the relay for {self._timeouts.relay_stale_s:g} s (relay_stale_s)")
        except (OSError, RelayError, EOFError) as exc:
            self._fall_back(f"{type(exc).__name__}: {exc}"[:200])
        finally:
            self._sock.close()

    def _recv_exactly(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise EOFError("the relay closed the socket")
            buf += chunk
        return bytes(buf)

    def _on_frame(self, frame: Frame) -> None:
        with self._cond:
            old = self._frame
            self._frame = frame
            self._cond.notify_all()
            subs = [cb for _, cb in self._subs.values()]
        if old is None or old.view != frame.view or old.extra != frame.extra:
            for cb in subs:
                cb()

    def _fall_back(self, why: str) -> None:
        with self._cond:
            if self._direct:
                return
            self._direct = True
            self._cond.notify_all()
            subs = dict(self._subs)
        log.warning("relay_lost", reason=why, then="reading and watching etcd directly")
        for sub, (prefix, cb) in subs.items():
            try:
                self._direct_cancel[sub] = self._inner.watch_prefix(prefix, cb)
            except EtcdUnavailable as exc:
                log.warning("relay_fallback_watch_failed", prefix=prefix, error=str(exc)[:200])
        for _, cb in subs.values():
            cb()  # read again, directly

    # -- reads ----------------------------------------------------------------------------------

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        if tuple(prefixes) != self._view_prefixes:
            return self._inner.get_prefixes(prefixes)
        now = self._clock()
        since = max(self._dirty_since, now - 2 * self._timeouts.relay_heartbeat_s)
        deadline = now + self._wait_s
        with self._cond:
            while not self._direct:
                verdict = serve(self._frame, since)
                if verdict is Serve.VIEW:
                    assert self._frame is not None
                    return list(self._frame.view)
                if verdict is Serve.FAIL:
                    assert self._frame is not None
                    raise EtcdUnavailable(f"etcd did not answer this node's relay: {self._frame.error}")
                left = deadline - self._clock()
                if left <= 0:
                    raise EtcdUnavailable(f"this node's relay sent no view within {self._wait_s:g} s")
                self._cond.wait(left)
        return self._inner.get_prefixes(prefixes)

    def get(self, key: str) -> KeyValue | None:
        frame = self._frame
        if frame is not None and not self._direct:
            for kv in frame.extra:  # a roster bucket: its key names its generation, it never changes
                if kv.key == key:
                    return kv
        return self._inner.get(key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return self._inner.get_prefix(prefix)

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        with self._cond:
            if prefix not in self._watched or self._direct:
                direct = True
            else:
                direct = False
                sub = self._next_sub
                self._next_sub += 1
                self._subs[sub] = (prefix, callback)
        if direct:
            return self._inner.watch_prefix(prefix, callback)

        def cancel() -> None:
            with self._cond:
                self._subs.pop(sub, None)
                direct_cancel = self._direct_cancel.pop(sub, None)
            if direct_cancel is not None:
                direct_cancel()

        return cancel

    # -- writes: straight to etcd, noting when a watched key was written --------------------------

    def _wrote(self, key: str) -> None:
        if key in self._watched:
            self._dirty_since = self._clock()

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        try:
            return self._inner.put(key, value, lease)
        finally:
            self._wrote(key)

    def delete(self, key: str) -> None:
        try:
            self._inner.delete(key)
        finally:
            self._wrote(key)

    def compare_and_put(self, key: str, expected_mod_revision: int, value: bytes, delete_keys: Iterable[str] = (),
                        put_keys: Mapping[str, bytes] | None = None, lease: int = 0,
                        delete_ranges: Iterable[tuple[str, str]] = ()) -> bool:
        try:
            return self._inner.compare_and_put(key, expected_mod_revision, value, delete_keys, put_keys, lease,
                                               delete_ranges)
        finally:
            self._wrote(key)

    def grant_lease(self, ttl_s: float) -> int:
        return self._inner.grant_lease(ttl_s)

    def refresh_lease(self, lease: int) -> float:
        return self._inner.refresh_lease(lease)

    def revoke_lease(self, lease: int) -> None:
        self._inner.revoke_lease(lease)

    def close(self) -> None:
        """Stop listening to the relay (the inner store stays open)."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
