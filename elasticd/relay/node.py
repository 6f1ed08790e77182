"""A node's relay: one etcd watch and one read per change for all the workers of a node.

Without it every worker watches the job's generation keys and reads its view of the job itself, so
a change of membership costs etcd one watch event and one read per worker. With it (the agent's
``relay`` setting), the agent runs a ``NodeRelay``: it watches ``Keys.member_watch`` once, reads
``Keys.member_view`` (and, for a large generation, this node's roster bucket) once per change and
at least every ``relay_heartbeat_s``, and sends each read to its workers over a Unix socket. A
worker's ``RelayedStore`` answers the membership's view reads and watches from those frames and
sends its member and ready records to the relay, which writes what its workers
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
import threading
import time
from collections.abc import Callable

import structlog

from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.relay.messages import (
    HEADER,
    LEASE_LOST,
    MAX_FRAME,
    Frame,
    PutRequest,
    RelayError,
    Reply,
    decode_request,
    encode_frame,
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


# -- the agent's side ---------------------------------------------------------------------------


class _Client:
    """One worker's connection: what it sent that is not yet a whole message, and a lock that keeps
    frames and replies whole on its stream."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
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
        self, store: KeyValueStore, keys: Keys, node: str, path: str, timeouts: Timeouts, clock: Clock = time.monotonic
    ) -> None:
        self._store, self._keys, self._node, self.path = store, keys, node, path
        self._timeouts, self._clock = timeouts, clock
        self._lock = threading.Lock()
        self._frame = Frame(seq=0)
        self._clients: list[_Client] = []
        self._closing: list[_Client] = []  # dropped, to be closed by the serve thread
        self._puts: queue.Queue[tuple[_Client, PutRequest]] = queue.Queue()
        self._carry: tuple[_Client, PutRequest] | None = None  # the write loop's next batch starts with it
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
        for name, target in (
            ("read", self._read_loop),
            ("send", self._send_loop),
            ("serve", self._serve_loop),
            ("write", self._write_loop),
        ):
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
                    self._frame = Frame(
                        f.seq + 1, f.read_at, f.view, f.extra, str(exc)[:300] or "etcd unavailable", self._clock()
                    )
            except Exception as exc:
                log.exception("relay_read_failed", node=self._node)
                with self._lock:
                    f = self._frame
                    self._frame = Frame(
                        f.seq + 1,
                        f.read_at,
                        f.view,
                        f.extra,
                        f"the relay's read failed: {type(exc).__name__}: {exc}"[:300],
                        self._clock(),
                    )
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
            if self._carry is not None:
                batch, self._carry = [self._carry], None
            else:
                try:
                    batch = [self._puts.get(timeout=self._timeouts.relay_heartbeat_s)]
                except queue.Empty:
                    continue
            keys = {batch[0][1].key}
            while len(batch) < MAX_BATCH:
                try:
                    item = self._puts.get_nowait()
                except queue.Empty:
                    break
                if item[1].key in keys:  # etcd refuses a key twice in one transaction: next batch
                    self._carry = item
                    break
                keys.add(item[1].key)
                batch.append(item)
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
        except Exception as exc:
            log.exception("relay_write_failed", node=self._node)
            return [(c, Reply(r.id, error=f"{type(exc).__name__}: {exc}"[:300])) for c, r in batch]
        out = []
        for c, r in batch:
            try:
                out.append((c, Reply(r.id, self._store.put(r.key, r.value, r.lease))))
            except LeaseLost:
                out.append((c, Reply(r.id, error=LEASE_LOST)))
            except Exception as exc:  # noqa: BLE001 (EtcdUnavailable, or refused: answer it)
                out.append((c, Reply(r.id, error=f"{type(exc).__name__}: {exc}"[:300])))
        return out
