"""A node's relay: one etcd watch and one read per change for all the workers of a node.

Without it every worker watches the job's generation keys and reads its view of the job itself, so
a change of membership costs etcd one watch event and one read per worker. With it (the agent's
``relay`` setting), the agent runs a ``NodeRelay``: it watches ``Keys.member_watch`` once, reads
``Keys.member_view`` once per change and every ``view_poll_s`` (and, for a large generation, this
node's roster bucket once per generation), and sends each read to its workers over a Unix socket,
and every ``relay_heartbeat_s`` a heartbeat (saying the read is still current: ``current``). A
worker's ``RelayedStore`` answers the membership's view reads and watches from those frames and
sends its member and ready records to the relay, which writes what its workers
sent meanwhile in one transaction (``put_many``: a node's registrations and ready records are one
request, not one per worker); everything else (the coordinator's full reads, the unleased writes)
goes straight to etcd.

One etcd lease per node: the relay grants each worker a member lease of its own (``relay.leases``)
under the node's lease (its agent's, or one of the relay's), writes its leased records (member,
ready, progress, the coordinator's seat) under the node's lease, and deletes them when the member
lease ends: the worker's socket closes (at once), its process stays stopped for ``lease_ttl_s``
(read from ``/proc`` every ``STOP_POLL_S``), a revoke by the worker, or a release by the agent
(``release_members``); it then tells the worker (``Ended``). Each delete is conditional on the
key's lease (and the seat's value), and runs on the writer thread after the puts queued before it.

The rules that keep a relayed view as good as a read of its own (``serve``, pure):

* a view is served only from a read that *began* after the member's last write to a watched key
  (read-your-writes: that write's watch event makes the relay read at once) and that the relay
  found current less than ``2 * relay_heartbeat_s`` ago (its read began then, or a heartbeat since
  said so: no change seen, the read good, etcd answering the node's lease renewals); the clock is
  ``CLOCK_MONOTONIC``, one clock for every process of a host;
* a read the relay could not make (etcd did not answer within its retries) fails the member's view
  read with ``EtcdUnavailable``, as its own read would have;
* a relay that sends nothing for ``relay_stale_s`` (a stopped or dead agent), a broken socket or a
  malformed frame: the worker reads and watches etcd itself from then on (``relay_lost``); a put
  the relay did not answer within the bound of a put of the worker's own is made directly (a put is
  idempotent).

This module is the agent's side (``NodeRelay``); the messages and the rule are
``relay.messages``, the worker's side ``relay.store``. Never decides anything of the rendezvous;
never imports etcd3 or torch.
"""

from __future__ import annotations

import os
import queue
import select
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

import structlog

from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.relay.leases import MemberLeases
from elasticd.relay.messages import (
    HEADER,
    LEASE_LOST,
    MAX_FRAME,
    Ended,
    Frame,
    LeaseOp,
    LeaseRequest,
    PutRequest,
    RelayError,
    Reply,
    decode_request,
    encode_ended,
    encode_frame,
    frame_tail,
    encode_reply,
)
from elasticd.retry import Clock
from elasticd.store.kv import KeyValue, KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.roster import bucket_of, buckets_for, is_sparse
from elasticd.wire.snapshot import parse_snapshot

log = structlog.get_logger(__name__)

LISTEN_BACKLOG = 256  # a node's workers connect at once when the agent starts them
MAX_BATCH = 100  # puts in one transaction (etcd's default --max-txn-ops is 128)
RECV_CHUNK = 65536
STOP_POLL_S = 0.25  # how often the relay reads its workers' process states (a stop is seen this late at most)


def current(frame: Frame, changing: bool, node_ok: bool) -> bool:
    """Whether a heartbeat may say ``frame``'s read is still current: it was good (the newest read
    did not fail), no change was seen since it began (``changing``: a watch event, or a read under
    way) and etcd answered the node's last lease renewal (a watch on a cut link goes silent, it
    does not fail). Pure."""
    return frame.read_at > 0 and not frame.error and not changing and node_ok


def peer_pid(sock: socket.socket) -> int:
    """The pid of the process at the other end of a Unix socket (SO_PEERCRED; 0: unknown)."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, AttributeError, struct.error):
        return 0
    return int(pid)


def process_stopped(pid: int) -> bool:
    """Process ``pid`` is stopped (SIGSTOP, SIGTSTP: state T in ``/proc/<pid>/stat``; a debugger's
    tracing stop, t, is not counted); False when it cannot be read (gone: its socket closes)."""
    try:  # os.open, not open(): the relay reads each worker's state four times a second
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return False
    try:
        raw = os.read(fd, 4096)
    except OSError:
        return False
    finally:
        os.close(fd)
    return raw[raw.rfind(b")") + 2 : raw.rfind(b")") + 3] == b"T"


class _End:
    """Ended member leases whose keys the write loop deletes, in order with the puts (``done``:
    set once they are deleted, or the node's lease that held them ended)."""

    def __init__(self, leases: list[int], node: int) -> None:
        self.leases = leases
        self.node = node  # the node's lease the keys were written under
        self.keys: list[tuple[str, bytes | None]] = []
        self.done = threading.Event()


# -- the agent's side ---------------------------------------------------------------------------


class _Client:
    """One worker's connection: what it sent that is not yet a whole message, and a lock that keeps
    frames and replies whole on its stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = peer_pid(sock)  # the worker's process (0: unknown)
        self.buf = bytearray()
        self.lock = threading.Lock()
        self.gone = False  # dropped: shut down; the serve thread closes it (it owns the fds)

    def connected(self) -> bool:
        """The worker has not shut its end (it does so before it writes etcd itself), whatever it
        sent before that is still unread."""
        if self.gone:
            return False
        p = select.poll()
        try:
            p.register(self.sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
            return not p.poll(0)
        except (OSError, ValueError):  # closed
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

    def __init__(
        self,
        store: KeyValueStore,
        keys: Keys,
        node: str,
        path: str,
        timeouts: Timeouts,
        clock: Clock = time.monotonic,
        node_lease: Callable[[], tuple[int, bool]] | None = None,
    ) -> None:
        """``node_lease``: the node's lease as its agent holds it (its node record's: the id, and
        whether its last renewal was answered), which this relay then neither renews nor revokes;
        None: the relay holds a lease of its own."""
        self._store, self._keys, self._node, self.path = store, keys, node, path
        self._timeouts, self._clock = timeouts, clock
        self._lock = threading.Lock()
        self._frame = Frame(seq=0)
        self._tail = frame_tail(self._frame)  # the encoded read of _frame (a heartbeat sends it again)
        self._reading = False  # a read is under way (or due: a change was seen): no heartbeat says current
        self._bucket: tuple[tuple[str, int], KeyValue] | None = None  # ((key, generation revision), this node's bucket)
        self._clients: list[_Client] = []
        self._closing: list[_Client] = []  # dropped, to be closed by the serve thread
        self._puts: queue.Queue[tuple[_Client | None, PutRequest | LeaseRequest | _End]] = queue.Queue()
        self._carry: tuple[_Client | None, PutRequest | LeaseRequest | _End] | None = None  # the write loop's next item
        self._progress_prefix = keys.progress("")
        self._held: list[tuple[_Client, PutRequest]] = []  # progress records to write together (``_hold``)
        self._flush_at = 0.0  # ... at this time
        self._leases = MemberLeases(timeouts.lease_ttl_s)
        self.node_lease = 0  # the node's etcd lease (0: none: etcd did not grant one)
        self._node_ok = False  # its last renewal was answered: etcd holds it
        self._unreleased: list[_End] = []  # ended leases whose keys etcd did not delete yet: retried
        self._retry_at = 0.0  # ... every keepalive_s
        self._lease_wake = threading.Event()
        self._borrowed = node_lease
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
        if self._borrowed is not None:
            self.node_lease, self._node_ok = self._borrowed()
            if not self.node_lease:
                raise EtcdUnavailable("the agent holds no node lease yet")
        else:
            self.node_lease, self._node_ok = self._store.grant_lease(self._timeouts.lease_ttl_s), True
        self._changed.set()
        for name, target in (
            ("read", self._read_loop),
            ("send", self._send_loop),
            ("serve", self._serve_loop),
            ("write", self._write_loop),
            ("lease", self._lease_loop),
        ):
            t = threading.Thread(target=target, name=f"elasticd-relay-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        log.info("relay_started", node=self._node, path=self.path)

    def close(self) -> None:
        """Stop, and revoke the node's lease: whatever its workers still hold goes at once."""
        self._stop.set()
        self._changed.set()
        self._send.set()
        self._lease_wake.set()
        for cancel in self._cancel:
            try:
                cancel()
            except EtcdUnavailable:
                pass
        for t in self._threads:
            t.join(timeout=self._timeouts.etcd_request_s * 2)
        self._close_dropped()  # the serve thread has stopped: those it had still to close
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
        if self.node_lease and self._borrowed is None:
            try:
                self._store.revoke_lease(self.node_lease)
            except (EtcdUnavailable, LeaseLost) as exc:  # it ends by its TTL
                log.info("node_lease_revoke_failed", node=self._node, error=str(exc)[:200])

    # -- the view -------------------------------------------------------------------------------

    def _read(self) -> tuple[list[KeyValue], list[KeyValue]]:
        """The members' view and, for a large generation, this node's roster bucket: read once per
        generation record (it is written with the record, in its transaction, and never after)."""
        view = self._store.get_prefixes(self._keys.member_view)
        snap = parse_snapshot(self._keys, view)
        g, written = snap.generation, snap.generation_revision
        if g is None or not is_sparse(g):
            return view, []
        key = self._keys.roster(g.generation, bucket_of(self._node, buckets_for(g.world_size)))
        if self._bucket is not None and self._bucket[0] == (key, written):
            return view, [self._bucket[1]]
        kv = self._store.get(key)
        if kv is None:
            return view, []
        self._bucket = ((key, written), kv)
        return view, [kv]

    def _read_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:  # etcd answering: a change (its watch event) or the safety net; else retry soon
                healthy = not self._frame.error and self._node_ok
            self._changed.wait(self._timeouts.view_poll_s if healthy else self._timeouts.relay_heartbeat_s)
            with self._lock:
                self._changed.clear()
                self._reading = True
            if self._stop.is_set():
                return
            began = self._clock()
            try:
                view, extra = self._read()
            except EtcdUnavailable as exc:
                error = str(exc)[:300] or "etcd unavailable"
                self._set_frame(lambda f: replace(f, error=error, error_at=self._clock()))
            except Exception as exc:
                log.exception("relay_read_failed", node=self._node)
                error = f"the relay's read failed: {type(exc).__name__}: {exc}"[:300]
                self._set_frame(lambda f: replace(f, error=error, error_at=self._clock()))
            else:
                self._set_frame(lambda f: Frame(f.seq, began, began, tuple(view), tuple(extra)))
            with self._lock:
                self._reading = False
            self._send.set()

    def _set_frame(self, new: Callable[[Frame], Frame]) -> None:
        """The next frame, ``new`` of the current one with the next ``seq``, and its encoded read."""
        with self._lock:
            f = new(self._frame)
        tail = frame_tail(f)  # encoded once per read, off the lock
        with self._lock:
            self._frame, self._tail = replace(f, seq=self._frame.seq + 1), tail

    def _send_loop(self) -> None:
        """Send the newest frame on each read, and every ``relay_heartbeat_s``: then, if nothing
        changed since its read, as current now (``current``)."""
        while not self._stop.is_set():
            beat = not self._send.wait(self._timeouts.relay_heartbeat_s)
            self._send.clear()
            with self._lock:
                if beat and current(self._frame, self._reading or self._changed.is_set(), self._node_ok):
                    self._frame = replace(self._frame, seq=self._frame.seq + 1, current_at=self._clock())
                data, clients = encode_frame(self._frame, self._tail), list(self._clients)
            self._drop([c for c in clients if not c.send_now(data)])

    def _drop(self, dropped: list[_Client]) -> None:
        """Shut these clients down; the serve thread unregisters and closes them (a socket closed
        here could have its fd reused by an accept while another thread still holds it)."""
        dropped = [c for c in dropped if not c.gone]
        if not dropped:
            return
        with self._lock:
            self._clients = [c for c in self._clients if c not in dropped]
            for c in dropped:
                c.gone = True
                self._closing.append(c)
            leases = [lease for c in dropped for lease in self._leases.of_owner(c)]
        self._end(leases, "its worker's connection closed")
        for c in dropped:
            with c.lock:
                try:
                    c.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        # a worker that exited, or one stopped long enough to fill its socket's buffer (it reads
        # etcd itself once it runs again): not an error of the relay
        log.info("relay_clients_dropped", node=self._node, dropped=len(dropped))

    def _close_dropped(self) -> None:
        with self._lock:
            closing, self._closing = self._closing, []
        for c in closing:
            try:
                self._selector.unregister(c.sock)
            except (KeyError, ValueError):
                pass
            c.sock.close()

    # -- the workers' puts ----------------------------------------------------------------------

    def _serve_loop(self) -> None:
        """Accept workers and read their put requests (one thread: a selector is not shared)."""
        while not self._stop.is_set():
            self._close_dropped()
            try:
                ready = self._selector.select(self._timeouts.relay_heartbeat_s)
            except (OSError, ValueError):
                return  # closed
            for key, _ in ready:
                if key.data is None:
                    self._accept()
                elif not key.data.gone:
                    self._receive(key.data)

    def _accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except BlockingIOError:
            return
        except OSError as exc:  # out of fds (EMFILE): do not spin on a listener that stays readable
            log.warning("relay_accept_failed", node=self._node, error=str(exc)[:200])
            self._stop.wait(self._timeouts.relay_heartbeat_s)
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
                body = bytes(client.buf[HEADER.size : HEADER.size + length])
                del client.buf[: HEADER.size + length]
                request = decode_request(body)
                if isinstance(request, LeaseRequest) and request.op is not LeaseOp.REVOKE:
                    self._reply([(client, self._answer_lease(client, request))])
                else:
                    self._puts.put((client, request))
        except BlockingIOError:
            return
        except RelayError as exc:  # not what a worker sends: refused
            log.warning("relay_client_refused", node=self._node, error=str(exc)[:200])
            self._drop([client])
        except (OSError, EOFError):  # the worker went away (exited, killed)
            self._drop([client])

    def _write_loop(self) -> None:
        """Write what the workers sent meanwhile in one transaction (at most ``MAX_BATCH`` puts);
        a compare-and-put, a revoke and the keys of ended member leases each on their own, in the
        order they came; progress records together once per ``keepalive_s`` (``_hold``)."""
        while not self._stop.is_set():
            now = self._clock()
            if self._unreleased and now >= self._retry_at:
                self._retry_unreleased()
            wait_s = self._timeouts.relay_heartbeat_s
            if self._held:
                if now >= self._flush_at:
                    held, self._held = self._held, []
                    self._guarded(lambda: self._write_held(held))
                    continue
                wait_s = min(wait_s, self._flush_at - now)
            if self._carry is not None:
                first, self._carry = self._carry, None
            else:
                try:
                    first = self._puts.get(timeout=wait_s)
                except queue.Empty:
                    continue
            self._guarded(lambda: self._write_from(first))

    def _guarded(self, write: Callable[[], None]) -> None:
        try:
            write()
        except Exception:  # a bug: its requests go unanswered (their workers leave the relay)
            log.exception("relay_write_failed", node=self._node)

    def _write_held(self, held: list[tuple[_Client, PutRequest]]) -> None:
        """The progress records held (``_hold``), at most ``MAX_BATCH`` a transaction; of one key
        twice (a worker does not send its next before its last is answered), the newer."""
        newest = {r.key: (c, r) for c, r in held if c.connected()}
        older = [(c, Reply(r.id)) for c, r in held if newest.get(r.key, (None, None))[1] is not r and c.connected()]
        items = list(newest.values())
        for i in range(0, len(items), MAX_BATCH):
            self._reply(self._write(items[i : i + MAX_BATCH]))
        self._reply(older)

    def _hold(self, client: _Client, request: PutRequest) -> bool:
        """Keep a worker's progress record to write with the node's others, ``keepalive_s`` after
        the first of them: each worker writes its own every ``keepalive_s``, at a time of its own,
        so written as they come a node's would cost etcd a transaction each. Whether its member
        lease still holds is checked when they are written (``_admit``), after any delete of
        its keys. Returns whether ``request`` was held."""
        if request.expected >= 0 or not request.key.startswith(self._progress_prefix):
            return False
        if not self._held:
            self._flush_at = self._clock() + self._timeouts.keepalive_s
        self._held.append((client, request))
        return True

    def _write_from(self, first: tuple[_Client | None, PutRequest | LeaseRequest | _End]) -> None:
        client, request = first
        if isinstance(request, _End):
            self._release(request)
            return
        assert client is not None
        if isinstance(request, LeaseRequest):
            self._revoke(client, request)
            return
        if request.expected >= 0:
            self._reply(self._compare_and_put(self._same_compares(client, request)))
            return
        if self._hold(client, request):
            return
        batch = [(client, request)]
        keys = {request.key}
        while len(batch) < MAX_BATCH:
            try:
                item = self._puts.get_nowait()
            except queue.Empty:
                break
            c, r = item
            if c is None or not isinstance(r, PutRequest) or r.expected >= 0 or r.key in keys:
                self._carry = item  # etcd refuses a key twice in one transaction: next batch
                break
            keys.add(r.key)
            batch.append((c, r))
        # A worker that left this relay (it heard nothing for relay_stale_s: this agent was
        # stopped) writes its records itself: one queued here must not land after its own.
        self._reply(self._write([(c, r) for c, r in batch if c.connected()]))

    def _reply(self, replies: list[tuple[_Client, Reply]]) -> None:
        for client, reply in replies:
            if not client.send_now(encode_reply(reply)):
                self._drop([client])

    def _admit(
        self, batch: list[tuple[_Client, PutRequest]]
    ) -> tuple[list[tuple[_Client, PutRequest]], list[tuple[_Client, Reply]]]:
        """The puts that may be written now (their keys noted under their member leases), and the
        answers to those that may not: their lease ended, or an ended lease's key is still to
        delete (etcd did not answer its delete; a put after it must wait for it)."""
        held = {k for e in self._unreleased for k, _ in e.keys}
        admitted, refused = [], []
        with self._lock:
            for c, r in batch:
                if r.key in held:
                    refused.append((c, Reply(r.id, error="the relay has a delete of this key still to make")))
                elif self._leases.note(r.lease, c, r.key, r.value if r.expected >= 0 else None):
                    admitted.append((c, r))
                else:
                    refused.append((c, Reply(r.id, error=LEASE_LOST)))
        return admitted, refused

    def _write(self, batch: list[tuple[_Client, PutRequest]]) -> list[tuple[_Client, Reply]]:
        batch, out = self._admit(batch)
        if not batch:
            return out
        node = self.node_lease
        try:
            revision = self._store.put_many([(r.key, r.value, node) for _, r in batch])
            return out + [(c, Reply(r.id, revision)) for c, r in batch]
        except EtcdUnavailable as exc:
            return out + [(c, Reply(r.id, error=str(exc)[:300] or "etcd unavailable")) for c, r in batch]
        except LeaseLost:  # the node's lease ended: its member leases with it
            self._lease_wake.set()
            return out + [(c, Reply(r.id, error=LEASE_LOST)) for c, r in batch]
        except Exception as exc:
            log.exception("relay_write_failed", node=self._node)
            return out + [(c, Reply(r.id, error=f"{type(exc).__name__}: {exc}"[:300])) for c, r in batch]

    def _same_compares(self, client: _Client, first: PutRequest) -> list[tuple[_Client, PutRequest]]:
        """``first`` and the compare-and-puts of the same key and expected revision queued right
        behind it (a node's workers campaign for the coordinator's seat together, on one view)."""
        group = [(client, first)]
        while True:
            try:
                item = self._puts.get_nowait()
            except queue.Empty:
                break
            c, r = item
            if c is None or not isinstance(r, PutRequest) or (r.key, r.expected) != (first.key, first.expected):
                self._carry = item
                break
            group.append((c, r))
        return group

    def _compare_and_put(self, group: list[tuple[_Client, PutRequest]]) -> list[tuple[_Client, Reply]]:
        """Compare-and-puts of one key and expected revision (the coordinator's seat), under the node's
        lease, as one: the first is sent to etcd (revision 1: written, 0: the compare failed), and
        the others, all received before it was sent, fail as they would right after it (it changed
        the key's revision, or found it changed); an error answers them all."""
        admitted, replies = self._admit(group)
        if not admitted:
            return replies
        (client, r), rest = admitted[0], admitted[1:]
        try:
            won = int(self._store.compare_and_put(r.key, r.expected, r.value, lease=self.node_lease))
            return replies + [(client, Reply(r.id, won))] + [(c, Reply(x.id, 0)) for c, x in rest]
        except LeaseLost:
            self._lease_wake.set()
            error = LEASE_LOST
        except Exception as exc:  # noqa: BLE001 (EtcdUnavailable, or refused: answer it)
            error = f"{type(exc).__name__}: {exc}"[:300]
        return replies + [(c, Reply(x.id, error=error)) for c, x in admitted]

    # -- member leases --------------------------------------------------------------------------

    def _answer_lease(self, client: _Client, r: LeaseRequest) -> Reply:
        """A grant, answered at once (no etcd request: the node's lease is the agent's)."""
        with self._lock:
            if not (self.node_lease and self._node_ok):
                return Reply(r.id, error="etcd did not answer this node's relay: it holds no node lease now")
            return Reply(r.id, revision=self._leases.grant(client, client.pid), lease=self.node_lease)

    def _revoke(self, client: _Client, r: LeaseRequest) -> None:
        with self._lock:
            ended = self._leases.end([r.lease]) if self._leases.holds(r.lease, client) else []
        end = _End(ended, self.node_lease)
        self._release(end)
        self._reply([(client, Reply(r.id) if end.done.is_set() else Reply(r.id, error="etcd did not delete its keys"))])

    def _end(self, leases: list[int], why: str) -> _End | None:
        """End these member leases now (no write under them from here) and tell their workers;
        their keys are deleted by the write loop, after every put queued before."""
        with self._lock:
            ended = self._leases.end(leases)
            owners = {lease: self._leases.owner_of(lease) for lease in ended}
        if not ended:
            return None
        pids = sorted({o.pid for o in owners.values() if isinstance(o, _Client) and o.pid})
        log.info("member_leases_ended", node=self._node, leases=ended, pids=pids, cause=why)
        end = _End(ended, self.node_lease)
        self._puts.put((None, end))
        self._tell(owners)
        return end

    def _tell(self, owners: Mapping[int, object]) -> None:
        """Tell each worker which of its member leases ended (one it cannot hear has left)."""
        by_owner: dict[_Client, list[int]] = {}
        for lease, owner in owners.items():
            if isinstance(owner, _Client) and not owner.gone:
                by_owner.setdefault(owner, []).append(lease)
        self._drop([c for c, ids in by_owner.items() if not c.send_now(encode_ended(Ended(tuple(ids))))])

    def _release(self, end: _End) -> None:
        with self._lock:
            end.keys += self._leases.take(end.leases)
        members = self._keys.member("")
        end.keys.sort(key=lambda kv: not kv[0].startswith(members))  # the one the coordinator reads, first
        if not end.keys or end.node != self.node_lease:  # none, or they went with the node's lease
            end.done.set()
            return
        try:
            self._store.delete_held(end.keys, end.node)
        except EtcdUnavailable as exc:
            log.warning("member_keys_not_deleted", node=self._node, keys=len(end.keys), error=str(exc)[:200])
            self._unreleased.append(end)
            self._retry_at = self._clock() + self._timeouts.keepalive_s
            return
        end.done.set()

    def _retry_unreleased(self) -> None:
        pending, self._unreleased = self._unreleased, []
        for end in pending:
            self._release(end)

    def release_members(self, member_ids: Collection[str], bound_s: float) -> bool:
        """End the member leases of these members now (the agent saw their workers dead or stopped),
        and wait at most ``bound_s`` for their keys to be deleted; True: deleted (or none held)."""
        with self._lock:
            leases = self._leases.holding([self._keys.member(m) for m in member_ids])
        end = self._end(leases, "released by the agent")
        return end is None or end.done.wait(bound_s)

    def _lease_loop(self) -> None:
        """Every ``STOP_POLL_S``: read the workers' process states, and end each member lease whose
        process has been stopped for ``lease_ttl_s``; every ``keepalive_s``: renew the node's
        lease (a new one when it ended), or follow the agent's."""
        renew_at = self._clock() + self._timeouts.keepalive_s
        while not self._stop.is_set():
            woken = self._lease_wake.wait(STOP_POLL_S)
            self._lease_wake.clear()
            if self._stop.is_set():
                return
            now = self._clock()
            if woken or now >= renew_at:
                self._renew_node()
                renew_at = now + self._timeouts.keepalive_s
            with self._lock:
                pids = self._leases.pids()
            states = {lease: process_stopped(pid) for lease, pid in pids.items()}
            with self._lock:
                self._leases.observe(states, now)
                expired = self._leases.expired(now)
            if expired:
                self._end(expired, f"its process stopped for {self._timeouts.lease_ttl_s:g} s (lease_ttl_s)")

    def _renew_node(self) -> None:
        if self._borrowed is not None:
            lease, ok = self._borrowed()
            if lease == self.node_lease:
                self._node_ok = ok
            else:  # the agent's lease ended and it holds a new one (or none yet)
                self._node_lost(lease, ok)
            return
        try:
            ttl = self._store.refresh_lease(self.node_lease) if self.node_lease else 0.0
        except LeaseLost:
            ttl = 0.0
        except EtcdUnavailable:
            self._node_ok = False
            return
        if ttl > 0:
            self._node_ok = True
            return
        self._node_lost(0, False)
        try:
            lease = self._store.grant_lease(self._timeouts.lease_ttl_s)
        except EtcdUnavailable:
            return
        with self._lock:
            self.node_lease, self._node_ok = lease, True

    def _node_lost(self, lease: int, ok: bool) -> None:
        """The node's lease ended: every member lease with it (their keys went with it)."""
        with self._lock:
            old, self.node_lease, self._node_ok = self.node_lease, lease, ok and bool(lease)
            owners = self._leases.forget_all()
        if old:
            log.warning("node_lease_expired", node=self._node, lease=old, member_leases=len(owners))
        self._tell(owners)
