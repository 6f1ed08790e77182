"""A worker's side of its node's relay (``RelayedStore``; the relay and its rules: ``relay.node``).

A ``KeyValueStore`` that answers the membership's view reads and watches from the frames its node's
relay sends, holds a member lease of the relay instead of an etcd lease of its own (granted and
revoked over the socket; it needs no renewal, and the relay says when it ended: ``relay.leases``),
sends its writes under that lease to the relay, which batches them under the node's one etcd
lease, and everything else straight to etcd.
Once the relay is lost, its member lease is gone with it: its renewal answers 0 and its puts fail
with ``LeaseLost``, so the member registers again, under an etcd lease of its own. When the relay goes quiet for ``relay_stale_s``, breaks
or sends something malformed, it reads, watches and writes etcd itself from then on. Never imports
etcd3 or torch.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

import structlog

from elasticd.config import RetryPolicy, Timeouts
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.relay.messages import (
    HEADER,
    LEASE_LOST,
    MAX_FRAME,
    Ended,
    Frame,
    LeaseOp,
    LeaseRequest,
    MessageReader,
    PutRequest,
    RelayError,
    Reply,
    Serve,
    encode_request,
    serve,
    shows,
)
from elasticd.retry import Clock
from elasticd.store.kv import KeyValue, KeyValueStore, RangeQuery, RangeResult
from elasticd.wire.keys import Keys

log = structlog.get_logger(__name__)

# After a write of its own to a watched key, how long a member waits for a relayed view that shows
# it before it reads etcd itself (once): a few relay round trips. Own writes are rare (a publish, a
# verdict, an abort), so the direct reads they cost do not grow with the job.
OWN_WRITE_WAIT_S = 0.05


class RelayedStore:
    """A ``KeyValueStore``: a member's view reads and watches from its node's relay (``NodeRelay``),
    everything else straight to etcd (``inner``). Thread-safe."""

    def __init__(
        self,
        inner: KeyValueStore,
        keys: Keys,
        path: str,
        timeouts: Timeouts,
        retry: RetryPolicy,
        clock: Clock = time.monotonic,
    ) -> None:
        self._inner, self._timeouts, self._retry, self._clock = inner, timeouts, retry, clock
        self._view_prefixes = tuple(keys.member_view)
        self._watched = frozenset(keys.member_watch)
        # a view read waits for the relay at most as long as its own read could take
        self._wait_s = timeouts.relay_stale_s + retry.etcd_attempts * timeouts.etcd_request_s
        self._cond = threading.Condition()
        self._frame: Frame | None = None
        self._dirty_since = 0.0  # when my last write to a watched key returned
        self._own_write: tuple[str, bytes | None] | None = None  # ... that write: (key, value; None: deleted)
        self._direct = False
        self._subs: dict[int, tuple[str, Callable[[], None]]] = {}
        self._direct_cancel: dict[int, Callable[[], None]] = {}
        self._next_sub = 0
        self._ready_prefix = keys.ready("")
        self._virtual: set[int] = set()  # the member leases the relay granted this member
        # what this member holds under each live member lease: key -> (value, a seat taken by compare)
        self._held: dict[int, dict[str, tuple[bytes, bool]]] = {}
        self._moving = threading.Lock()  # held while the records move to an etcd lease of my own
        self._moved: dict[int, int] = {}  # member lease -> the etcd lease its records moved to
        self._ended: set[int] = set()  # member leases the relay said ended
        self._ids = itertools.count(1)
        self._pending: dict[int, list[Reply | None]] = {}  # put id -> [its reply], when it came
        self._send_lock = threading.Lock()
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
        reader = MessageReader()
        try:
            while True:
                (length,) = HEADER.unpack(self._recv_exactly(HEADER.size))
                if length > MAX_FRAME:
                    raise RelayError(f"a frame of {length} bytes (at most {MAX_FRAME})")
                message = reader.decode(self._recv_exactly(length))
                if isinstance(message, Reply):
                    self._on_reply(message)
                elif isinstance(message, Ended):
                    self._on_ended(message)
                else:
                    self._on_frame(message)
        except TimeoutError:
            self._fall_back(f"nothing from the relay for {self._timeouts.relay_stale_s:g} s (relay_stale_s)")
        except Exception as exc:  # noqa: BLE001 (a broken or hostile relay: whatever it is, leave it)
            self._fall_back(f"{type(exc).__name__}: {exc}"[:200])
        finally:
            with self._send_lock:  # not while a put is being sent on it
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

    def _on_reply(self, reply: Reply) -> None:
        with self._cond:
            slot = self._pending.get(reply.id)
            if slot is not None:
                slot[0] = reply
                self._cond.notify_all()

    def _on_ended(self, message: Ended) -> None:
        with self._cond:
            self._ended.update(message.leases)
            for lease in message.leases:
                self._held.pop(lease, None)

    def _fall_back(self, why: str) -> None:
        with self._moving:
            with self._cond:
                if self._direct:
                    return
                self._direct = True
                # Shut the socket before any write of this member goes to etcd directly: the relay
                # drops what it queued for a worker that shut its end (a stopped agent, continued).
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                self._cond.notify_all()
                subs = dict(self._subs)
            log.warning("relay_lost", reason=why, then="reading and watching etcd directly")
            self._move_leases()
        for sub, (prefix, cb) in subs.items():
            self._watch_directly(sub, prefix, cb)
        for _, cb in subs.values():
            cb()  # read again, directly

    def _move_leases(self) -> None:
        """The relay is lost: write what this member holds under its member lease again, under an
        etcd lease of its own, before the node's lease can end (``relay_stale_s`` <
        ``lease_ttl_s``), so that its records never vanish and it need not register again; the
        coordinator's seat only while it still names this member. Not its ready record: written
        again, it would read as a new request to join (its mod_revision past the generation's);
        one still waiting ends with the node's lease, and the join writes it again. Best effort: a
        member lease not moved answers 0 at its next renewal, and the member registers again."""
        with self._cond:
            held = {lease: dict(keys) for lease, keys in self._held.items()}
        if not held:
            return
        try:
            own = self._inner.grant_lease(self._timeouts.lease_ttl_s)
            for lease, keys in held.items():
                for key, (value, seat) in keys.items():
                    if key.startswith(self._ready_prefix):
                        continue
                    if not seat:
                        self._inner.put(key, value, own)
                        continue
                    kv = self._inner.get(key)
                    if kv is not None and kv.value == value:
                        self._inner.compare_and_put(key, kv.mod_revision, value, lease=own)
                self._moved[lease] = own
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("member_lease_not_moved", error=str(exc)[:200], then="registering again")
            return
        log.info("member_lease_moved", leases=sorted(held), lease=own, keys=sum(len(k) for k in held.values()))

    def _own(self, lease: int) -> int | None:
        """The etcd lease member lease ``lease`` moved to once the relay was lost (None: it did
        not); waits for a move in progress."""
        with self._moving:
            return self._moved.get(lease)

    def _forget(self, lease: int) -> None:
        """Member lease ``lease`` ended: nothing of it to move, and its renewal answers 0."""
        with self._cond:
            self._held.pop(lease, None)
            self._ended.add(lease)

    def _watch_directly(self, sub: int, prefix: str, cb: Callable[[], None]) -> None:
        """Arm ``sub``'s watch on etcd itself; while etcd does not answer (an outage), again on a
        thread every ``etcd_reconnect_max_s``, for at most ``etcd_outage_s``."""
        deadline = self._clock() + self._timeouts.etcd_outage_s

        def arm() -> bool:
            try:
                cancel = self._inner.watch_prefix(prefix, cb)
            except EtcdUnavailable:
                return False
            with self._cond:
                kept = sub in self._subs
                if kept:
                    self._direct_cancel[sub] = cancel
            if not kept:  # cancelled meanwhile
                cancel()
            return True

        def rearm() -> None:
            while self._clock() < deadline:
                with self._cond:
                    if sub not in self._subs:
                        return
                time.sleep(self._retry.etcd_reconnect_max_s)
                if arm():
                    cb()  # what it missed meanwhile
                    return
            log.warning("relay_fallback_watch_failed", prefix=prefix, bound_s=self._timeouts.etcd_outage_s)

        if not arm():
            threading.Thread(target=rearm, name="elasticd-relay-rewatch", daemon=True).start()

    # -- reads ----------------------------------------------------------------------------------

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        if tuple(prefixes) != self._view_prefixes:
            return self._inner.get_prefixes(prefixes)
        now = self._clock()
        since, written = now - 2 * self._timeouts.relay_heartbeat_s, self._dirty_since
        deadline = now + self._wait_s
        # After my own write to a watched key (a generation I published, a verdict, an abort) the
        # relay's next view shows it within milliseconds; if none does within OWN_WRITE_WAIT_S (its
        # read began before my write returned and the key changed again since, or its agent is
        # stopped), I read etcd myself once rather than wait for its next heartbeat or relay_stale_s.
        own_wait_s = min(OWN_WRITE_WAIT_S, self._timeouts.relay_heartbeat_s)
        own_write_by = now + own_wait_s if written >= since else None
        with self._cond:
            while not self._direct:
                verdict = serve(self._frame, since, written)
                if verdict is Serve.WAIT and self._shows_own_write(now):
                    verdict = Serve.VIEW  # a fresh read that began before my write returned, and holds it
                if verdict is Serve.VIEW:
                    assert self._frame is not None
                    return list(self._frame.view)
                if verdict is Serve.FAIL:
                    assert self._frame is not None
                    raise EtcdUnavailable(f"etcd did not answer this node's relay: {self._frame.error}")
                left = deadline - self._clock()
                if left <= 0:
                    raise EtcdUnavailable(f"this node's relay sent no view within {self._wait_s:g} s")
                if own_write_by is not None:
                    own_left = own_write_by - self._clock()
                    if own_left <= 0:
                        break  # read etcd myself, below
                    left = min(left, own_left)
                self._cond.wait(left)
        return self._inner.get_prefixes(prefixes)

    def _shows_own_write(self, now: float) -> bool:
        """The newest frame is fresh (current less than ``2 * relay_heartbeat_s`` ago) and
        holds my last write to a watched key: its read began before the write returned to me, but
        after etcd applied it. Called holding the condition."""
        frame, own = self._frame, self._own_write
        if frame is None or own is None or not frame.read_at:
            return False
        return max(frame.read_at, frame.current_at) >= now - 2 * self._timeouts.relay_heartbeat_s and shows(frame, *own)

    def get(self, key: str) -> KeyValue | None:
        frame = self._frame
        if frame is not None and not self._direct:
            for kv in frame.extra:  # a roster bucket: its key names its generation, it never changes
                if kv.key == key:
                    return kv
        return self._inner.get(key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return self._inner.get_prefix(prefix)

    def read_ranges(self, queries: Sequence[RangeQuery]) -> tuple[int, list[RangeResult]]:
        return self._inner.read_ranges(queries)

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

    def _wrote(self, key: str, value: bytes | None) -> None:
        """A write of mine to ``key`` (``value``; None: a delete) returned: my next view must show it."""
        if key in self._watched:
            self._dirty_since = self._clock()
            self._own_write = (key, value)

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """A put under a member lease of the relay goes through the relay, which writes its workers'
        puts together under the node's lease; the rest directly.

        Raises:
            LeaseLost: ``lease`` is gone (a member lease also when the relay is lost).
            EtcdUnavailable: etcd did not answer (the relay's attempts or this member's own).
        """
        if lease in self._virtual:
            if not self._direct:
                reply = self._ask(PutRequest(next(self._ids), key, value, lease))
                if reply is not None:
                    revision = self._answer(reply, lease, f"put {key}").revision
                    with self._cond:
                        self._held.setdefault(lease, {})[key] = (value, False)
                    return revision
            lease = self._moved_or_lost(lease, f"put {key}")
        try:
            return self._inner.put(key, value, lease)
        finally:
            self._wrote(key, value)

    def _ask(self, request: PutRequest | LeaseRequest) -> Reply | None:
        """The relay's reply to ``request``; None: the relay is lost, or did not answer within the
        bound of this member's own request (then it is left: ``relay_lost``)."""
        if self._direct:
            return None
        slot: list[Reply | None] = [None]
        with self._cond:
            self._pending[request.id] = slot
        try:
            try:
                with self._send_lock:
                    self._sock.sendall(encode_request(request))
            except OSError as exc:
                self._fall_back(f"{type(exc).__name__}: {exc}"[:200])
                return None
            deadline = self._clock() + self._wait_s
            with self._cond:
                while slot[0] is None and not self._direct:
                    left = deadline - self._clock()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            reply = slot[0]
            if reply is None:  # leave the relay first: what it still holds for me is then dropped
                self._fall_back(f"the relay did not answer within {self._wait_s:g} s")
        finally:
            with self._cond:
                self._pending.pop(request.id, None)
        return reply

    def _answer(self, reply: Reply, lease: int, what: str) -> Reply:
        """``reply`` to a request under member lease ``lease``, unless it failed.

        Raises:
            LeaseLost: the member lease ended.
            EtcdUnavailable: etcd did not answer the relay.
        """
        if reply.error == LEASE_LOST:
            self._forget(lease)
            raise LeaseLost(f"{what}: the relay's member lease {lease} no longer exists")
        if reply.error:
            raise EtcdUnavailable(f"etcd did not answer this node's relay: {reply.error}")
        return reply

    def _moved_or_lost(self, lease: int, what: str) -> int:
        """The etcd lease member lease ``lease`` moved to when the relay was lost.

        Raises:
            LeaseLost: it did not move (its records are deleted when the relay sees this member's
                connection close, or end with the node's lease).
        """
        own = self._own(lease)
        if own is None:
            raise LeaseLost(f"{what}: the relay is lost, and the member lease {lease} with it")
        return own

    def put_many(self, items: Sequence[tuple[str, bytes, int]]) -> int:
        if any(lease in self._virtual for _, _, lease in items):
            raise ValueError("put_many under a relay's member lease: put each key")
        try:
            return self._inner.put_many(items)
        finally:
            for key, value, _ in items:
                self._wrote(key, value)

    def delete(self, key: str) -> None:
        with self._cond:  # no longer held: a move after the relay is lost must not write it again
            for keys in self._held.values():
                keys.pop(key, None)
        try:
            self._inner.delete(key)
        finally:
            self._wrote(key, None)

    def delete_held(self, items: Sequence[tuple[str, bytes | None]], lease: int) -> int:
        return self._inner.delete_held(items, lease)

    def compare_and_put(
        self,
        key: str,
        expected_mod_revision: int,
        value: bytes,
        delete_keys: Iterable[str] = (),
        put_keys: Mapping[str, bytes] | None = None,
        lease: int = 0,
        delete_ranges: Iterable[tuple[str, str]] = (),
    ) -> bool:
        """As ``KeyValueStore.compare_and_put``; one under a member lease goes through the relay.
        Only a compare that held (or one whose outcome is unknown: an error) is an own write the
        next view must show: one that failed wrote nothing, and its member reads on from the relay
        (at a job's start every member campaigns for the coordinator's seat and all but one lose)."""
        won: bool | None = None  # None: unknown (raised)
        try:
            if lease in self._virtual:
                if delete_keys or put_keys or delete_ranges:
                    raise ValueError("a compare-and-put under a relay's member lease writes its one key")
                if not self._direct:
                    reply = self._ask(PutRequest(next(self._ids), key, value, lease, expected_mod_revision))
                    if reply is not None:
                        won = self._answer(reply, lease, f"compare-and-put {key}").revision > 0
                        if won:
                            with self._cond:
                                self._held.setdefault(lease, {})[key] = (value, True)
                        return won
                lease = self._moved_or_lost(lease, f"compare-and-put {key}")
            won = self._inner.compare_and_put(
                key, expected_mod_revision, value, delete_keys, put_keys, lease, delete_ranges
            )
            return won
        finally:
            if won is not False:
                self._wrote(key, value)

    def grant_lease(self, ttl_s: float) -> int:
        """A member lease of the relay, under the node's one etcd lease (``relay.leases``); an etcd
        lease of this member's own once the relay is lost.

        Raises:
            EtcdUnavailable: etcd did not answer (the relay holds no node lease now).
        """
        reply = self._ask(LeaseRequest(next(self._ids), LeaseOp.GRANT))
        if reply is None:
            return self._inner.grant_lease(ttl_s)
        if reply.error:
            raise EtcdUnavailable(f"etcd did not answer this node's relay: {reply.error}")
        with self._cond:
            self._virtual.add(reply.revision)
        return reply.revision

    def refresh_lease(self, lease: int) -> float:
        """A member lease needs no renewal: the relay sees its worker's process (``relay.leases``),
        and says when it ended. Its TTL is ``lease_ttl_s`` until then (0 after); once the relay is
        lost, the etcd lease it moved to is renewed (0: it did not move)."""
        if lease not in self._virtual:
            return self._inner.refresh_lease(lease)
        if lease in self._ended:
            return 0.0
        if not self._direct:
            return self._timeouts.lease_ttl_s
        own = self._own(lease)
        return 0.0 if own is None else self._inner.refresh_lease(own)

    def revoke_lease(self, lease: int) -> None:
        if lease not in self._virtual:
            self._inner.revoke_lease(lease)
            return
        self._forget(lease)
        if not self._direct:
            reply = self._ask(LeaseRequest(next(self._ids), LeaseOp.REVOKE, lease))
            if reply is not None:
                if reply.error not in ("", LEASE_LOST):
                    raise EtcdUnavailable(f"etcd did not answer this node's relay: {reply.error}")
                return
        own = self._own(lease)
        if own is not None:  # else: a lost relay ends it when it sees this member's connection close
            self._inner.revoke_lease(own)

    def raft_term(self) -> int:
        return self._inner.raft_term()

    def close(self) -> None:
        """Stop listening to the relay (the inner store stays open; reads and writes go to it)."""
        with self._cond:
            self._direct = True  # closed on purpose: nothing to fall back from, nothing to log
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
