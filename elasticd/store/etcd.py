"""A thin wrapper over python-etcd3 that satisfies ``membership.KeyValueStore``.

Owns the etcd3/gRPC imports, the retry of idempotent calls, endpoint failover, the translation of
etcd3/gRPC errors into ``EtcdUnavailable`` (and etcd's "permission denied" into ``PermissionDenied``,
never retried), listings in pages at one revision (``get_prefix``), and reading the certificate
and password files that an ``EtcdConfig`` names (``store.credentials``), when it connects. Holds no
protocol logic. Also the stand-ins for etcd3's watch stub that keep its watcher thread civil
(``PacedWatchStub``, ``ClosedWatchStub``).
"""

from __future__ import annotations

import os

# etcd3 0.12's protobuf modules, rebuilt so that protobuf's C implementation loads them: before
# etcd3 is first imported (its own load only in pure Python, ~100x slower: store.etcd_protos).
from elasticd.store.etcd_protos import install as _install_protos

_install_protos()
# gRPC's C core writes its own unstructured lines to stderr (a failed TLS handshake, a bad
# certificate), around our one clear error; set GRPC_VERBOSITY yourself to see them when debugging.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import etcd3
import etcd3.exceptions
import etcd3.utils
import grpc
import structlog

from elasticd.config import (
    EtcdConfig,
    RetryPolicy,
    Timeouts,
    parse_endpoint,
)
from elasticd.errors import ConfigError, EtcdUnavailable, LeaseLost, PermissionDenied
from elasticd.retry import call_with_retry
from elasticd.store.credentials import (  # noqa: F401 (re-exported: the etcd access API)
    SYSTEM_CA_BUNDLES,
    permission_denied,
    read_password,
    system_ca_bundle,
)
from elasticd.store.keepalive import KeepAliveBehind, KeepAliveStream, KeepAliveTimeout
from elasticd.store.kv import KeyValue, RangeQuery, RangeResult

log = structlog.get_logger(__name__)

MAX_RECEIVE_BYTES = 256 * 1024 * 1024  # the largest reply a client accepts (gRPC's default: 4 MiB)

_T = TypeVar("_T")

# Errors that mean "this endpoint did not answer": retried, then failed over, then EtcdUnavailable.
_TRANSIENT: tuple[type[BaseException], ...] = (
    etcd3.exceptions.ConnectionFailedError,
    etcd3.exceptions.ConnectionTimeoutError,
    etcd3.exceptions.InternalServerError,
    etcd3.exceptions.WatchTimedOut,  # a watch's creation got no answer (its stream broke meanwhile)
)
# gRPC status codes that a retry (or another endpoint) may cure; anything else is an answer.
_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
}


# -- etcd3's watch stub, kept civil: paced while etcd is down, quiet once the client is closed --


class PacedWatchStub:
    """Wraps etcd3's watch stub so that its watcher opens a new stream at most once per
    ``interval_s``.

    etcd3 0.12's watcher thread re-opens its stream at once, in an endless loop, whenever it
    breaks; while etcd is down every attempt fails at once, and the loop would spin a core (a
    fifth of a core per worker, half the training rate through an etcd outage on 2 cores).
    """

    def __init__(self, inner: Any, interval_s: float) -> None:
        self._inner, self._interval_s, self._last = inner, interval_s, float("-inf")

    def Watch(self, *args: object, **kwargs: object) -> Any:
        wait = self._last + self._interval_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last = time.monotonic()
        try:
            return self._inner.Watch(*args, **kwargs)
        except ValueError as exc:  # "Channel closed!": the client was closed while this one waited
            raise SystemExit from exc  # ends etcd3's watcher thread quietly, as ClosedWatchStub does


class ClosedWatchStub:
    """Stands in for etcd3's watch stub once the client is closed.

    etcd3 0.12's watcher thread re-opens its stream in an endless loop; on a closed channel that
    raises ValueError and prints a traceback from a long-lived process. SystemExit ends the thread
    quietly (``threading`` ignores it).
    """

    def Watch(self, *args: object, **kwargs: object) -> None:
        raise SystemExit


class _RetryableRpc(Exception):
    """A gRPC error whose status code is transient (wrapped so tenacity can tell it apart)."""


_RETRYABLE: tuple[type[BaseException], ...] = (*_TRANSIENT, _RetryableRpc)
READ_PAGE = 1000  # keys per page of a listing (get_prefix: status, events, drain)
READ_RESTARTS = 3  # a listing whose revision etcd compacted between two pages starts over at most so often


class _AuthUnanswered(EtcdUnavailable):
    """No answer to a new client's authentication (etcd is down or unreachable): worth waiting for,
    unlike credentials that etcd rejected."""


class EtcdClient:
    """etcd access for elasticd: every call bounded, retried when idempotent, errors translated."""

    def __init__(self, config: EtcdConfig, timeouts: Timeouts, retry: RetryPolicy) -> None:
        self._config = config
        self._timeouts = timeouts
        self._retry = retry
        self._endpoints = [parse_endpoint(e) for e in config.endpoints]
        # TLS whenever the settings ask for it: etcd3 0.12 makes a TLS channel only given a CA file.
        self._ca_cert = (config.ca_cert or system_ca_bundle()) if config.tls else None
        self._index = 0
        self._lock = threading.Lock()
        self._raft_term = 0  # the highest raft term seen in a get's answer (raft_term())
        # One client per endpoint, made once: a failover moves between them. (Making a new one at
        # each failover left the old channels and their watcher threads behind: through etcd
        # outages under chaos a worker grew to 400 threads.)
        self._clients: dict[int, etcd3.Etcd3Client] = {}
        self._client: etcd3.Etcd3Client | None = None
        self._streams: dict[int, KeepAliveStream] = {}  # id(client) -> its lease keepalive stream
        try:
            self._client = self._first_client()
        except _AuthUnanswered as exc:
            # With a user, etcd3 authenticates as it makes the client. An agent or worker started
            # while etcd is down must wait for it like any call does (its caller's etcd_outage_s),
            # not exit (a worker's exit would spend its agent's restart budget on the outage): the
            # first call connects (``_late_client``).
            log.warning("etcd_not_answering_at_start", error=str(exc)[:300])

    def _first_client(self) -> etcd3.Etcd3Client:
        """Connect to the first endpoint that accepts us (only authentication talks to etcd here).

        Raises:
            EtcdUnavailable: an endpoint rejected the credentials, and none accepted them.
            _AuthUnanswered: no endpoint answered.
        """
        failures: list[EtcdUnavailable] = []
        for index in range(len(self._endpoints)):
            try:
                client = self._connect(index)
            except EtcdUnavailable as exc:
                failures.append(exc)
                continue
            self._index = index
            self._clients[index] = client
            return client
        rejected = [f for f in failures if not isinstance(f, _AuthUnanswered)]
        raise (rejected or failures)[-1]

    def _late_client(self) -> etcd3.Etcd3Client:
        """The client, for an ``EtcdClient`` made while no endpoint answered its authentication.

        Raises:
            _RetryableRpc: still no endpoint answers (the call's retries, then its caller's bound on
                an outage, cover it).
            EtcdUnavailable: an endpoint rejected the credentials.
        """
        with self._lock:
            if self._client is None:
                try:
                    self._client = self._first_client()
                except _AuthUnanswered as exc:
                    raise _RetryableRpc(str(exc)) from exc
                log.info("etcd_connected_late", endpoint="%s:%d" % self._endpoints[self._index])
            return self._client

    def _connect(self, index: int) -> etcd3.Etcd3Client:
        """A client of endpoint ``index``; with a user it authenticates (one bounded request).

        Raises:
            EtcdUnavailable: authentication failed, or the endpoint did not answer it.
            ConfigError: the password file or a certificate file cannot be read.
        """
        host, port = self._endpoints[index]
        c = self._config
        user = c.user or None
        password = read_password(c) if user else None
        try:
            client = etcd3.client(
                host=host,
                port=port,
                timeout=self._timeouts.etcd_request_s,
                ca_cert=self._ca_cert,
                cert_cert=c.cert_cert or None,
                cert_key=c.cert_key or None,
                user=user,
                password=password,
                grpc_options=self._channel_options(),
            )
            if user and not c.tls:
                # etcd3 0.12 sends the auth token twice: as call credentials, which gRPC refuses on a
                # plaintext channel ("insufficient security level"), and as metadata, which etcd reads.
                client.call_credentials = None
                client.watcher._credentials = None
            client.watcher._watch_stub = PacedWatchStub(client.watcher._watch_stub, self._retry.etcd_reconnect_max_s)
            return client
        except OSError as exc:  # settings checked that the files exist; a value built in code was not
            raise ConfigError(f"etcd: cannot read a certificate file: {exc}") from exc
        except grpc.RpcError as exc:
            code = exc.code() if callable(getattr(exc, "code", None)) else None
            details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
            if code in _TRANSIENT_CODES:
                raise _AuthUnanswered(f"etcd at {host}:{port} did not answer authenticate: {code}: {details}") from exc
            raise EtcdUnavailable(
                f"etcd at {host}:{port} rejected the credentials of user {user!r}: {code}: {details}"
            ) from exc

    def _channel_options(self) -> list[tuple[str, int]]:
        """gRPC channel options: reconnect quickly to an etcd that comes back (it restores leases with
        their whole TTL: a member must renew within it); receive large reads (``MAX_RECEIVE_BYTES``)."""
        max_ms = max(1, round(self._retry.etcd_reconnect_max_s * 1000))
        return [
            ("grpc.initial_reconnect_backoff_ms", min(100, max_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, max_ms)),
            ("grpc.max_reconnect_backoff_ms", max_ms),
            # A full read of a job (the coordinator's, status') passes gRPC's default 4 MiB
            # near 7,500 members; etcd itself sends up to 2 GiB.
            ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ]

    def _failover(self, failed: etcd3.Etcd3Client) -> None:
        with self._lock:
            if self._client is not failed or len(self._endpoints) == 1:
                return
            self._index = (self._index + 1) % len(self._endpoints)
            log.warning("etcd_endpoint_failover", endpoint="%s:%d" % self._endpoints[self._index])
            known = self._clients.get(self._index)
            if known is not None:
                self._client = known
                return
            try:
                self._client = self._clients[self._index] = self._connect(self._index)
            except EtcdUnavailable as exc:  # it would not authenticate us: the next failure moves on
                log.warning("etcd_endpoint_failover_failed", error=str(exc))

    def _reauthenticate(self, failed: etcd3.Etcd3Client) -> None:
        with self._lock:
            if self._client is not failed:
                return
            log.info("etcd_reauthenticated", endpoint="%s:%d" % self._endpoints[self._index])
            try:
                self._client = self._clients[self._index] = self._connect(self._index)
                _close_client(failed)  # its watches break, and are armed again on the new one
            except EtcdUnavailable as exc:
                log.warning("etcd_reauthenticate_failed", error=str(exc))

    def _call(self, what: str, fn: Callable[[etcd3.Etcd3Client], _T], key: str = "") -> _T:
        """``fn`` on the current client, retried; ``key`` (the first one it touches) names the job
        in a ``PermissionDenied``."""

        def attempt() -> _T:
            client = self._client or self._late_client()
            try:
                return fn(client)
            except _TRANSIENT:
                self._failover(client)
                raise
            except grpc.RpcError as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                if code == grpc.StatusCode.NOT_FOUND and "lease" in str(exc):
                    raise LeaseLost(f"{what}: the lease no longer exists") from exc
                details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
                if code == grpc.StatusCode.PERMISSION_DENIED or "etcdserver: permission denied" in str(details):
                    raise permission_denied(self._config, what, key) from exc
                if code in _TRANSIENT_CODES:
                    self._failover(client)
                    raise _RetryableRpc(str(exc)) from exc
                if code == grpc.StatusCode.UNAUTHENTICATED and self._config.user:
                    self._reauthenticate(client)  # an auth token expires when unused (etcd --auth-token-ttl)
                    raise _RetryableRpc(str(exc)) from exc
                raise EtcdUnavailable(f"etcd rejected {what}: {code}: {exc}") from exc

        try:
            return call_with_retry(
                attempt, policy=self._retry, transient=_RETRYABLE, event="etcd_call_retried", call=what
            )
        except _RETRYABLE as exc:
            raise EtcdUnavailable(
                f"etcd at {','.join(self._config.endpoints)} did not answer {what} after "
                f"{self._retry.etcd_attempts} attempts: {exc}"
            ) from exc

    # -- KeyValueStore ----------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        value, meta = self._call("get", lambda c: c.get(key), key)
        if value is None or meta is None:
            return None
        self._raft_term = max(self._raft_term, int(meta.response_header.raft_term))
        return KeyValue(key, value, meta.mod_revision, meta.create_revision, meta.lease_id)

    def raft_term(self) -> int:
        return self._raft_term

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key under ``prefix``, in key order: ``pages`` joined. Should etcd compact the
        listing's revision between two pages, it starts over (at most ``READ_RESTARTS`` times)."""
        restarts = 0
        while True:
            try:
                return [kv for page in self.pages(prefix) for kv in page]
            except EtcdUnavailable as exc:
                if "compacted" not in str(exc) or restarts >= READ_RESTARTS:
                    raise
                restarts += 1

    def pages(self, prefix: str, page_keys: int = READ_PAGE) -> Iterator[list[KeyValue]]:
        """The keys under ``prefix`` in pages of ``page_keys``, in key order, every page read at the
        first one's revision (one consistent listing; no answer grows with the job).

        Raises:
            EtcdUnavailable: as every call; also when etcd compacted that revision between pages.
        """
        start, end = prefix.encode(), etcd3.utils.increment_last_byte(etcd3.utils.to_bytes(prefix))
        revision = 0  # 0: the newest (the first page), then that page's
        while True:
            req = etcd3.etcdrpc.RangeRequest(key=start, range_end=end, limit=page_keys, revision=revision)
            page = self._call(
                "get_prefix",
                lambda c, r=req: c.kvstub.Range(  # type: ignore[misc]
                    r, c.timeout, credentials=c.call_credentials, metadata=c.metadata
                ),
                prefix,
            )
            yield [_from_message(kv) for kv in page.kvs]
            if not page.more or not page.kvs:
                return
            revision, start = revision or page.header.revision, page.kvs[-1].key + b"\0"

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        _, results = self._ranges([RangeQuery(p) for p in prefixes], "get_prefixes")
        return [kv for r in results for kv in r.kvs]

    def read_ranges(self, queries: Sequence[RangeQuery]) -> tuple[int, list[RangeResult]]:
        """``KeyValueStore.read_ranges``: etcd's own range filters (``min_mod_revision``,
        ``keys_only``) in one transaction; each result's count is etcd's, taken before its filter."""
        return self._ranges(queries, "read_ranges")

    def _ranges(self, queries: Sequence[RangeQuery], what: str) -> tuple[int, list[RangeResult]]:
        def op(q: RangeQuery) -> Any:
            key = q.prefix.encode()
            return etcd3.etcdrpc.RequestOp(
                request_range=etcd3.etcdrpc.RangeRequest(
                    key=key,
                    range_end=etcd3.utils.increment_last_byte(key),  # the range end of etcd3's get_prefix
                    min_mod_revision=q.min_mod_revision,
                    keys_only=q.keys_only,
                )
            )

        def txn(c: etcd3.Etcd3Client) -> Any:
            req = etcd3.etcdrpc.TxnRequest(compare=[], success=[op(q) for q in queries], failure=[])
            return c.kvstub.Txn(req, c.timeout, credentials=c.call_credentials, metadata=c.metadata)

        first = next(iter(queries), RangeQuery("")).prefix
        answer = self._call(what, txn, first)
        results = [
            RangeResult([_from_message(kv) for kv in r.response_range.kvs], int(r.response_range.count))
            for r in answer.responses
        ]
        return int(answer.header.revision), results

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """``KeyValueStore.put``: the revision etcd answered (the key's new mod_revision)."""
        return int(self._call("put", lambda c: c.put(key, value, lease=lease or None), key).header.revision)

    def put_many(self, items: Sequence[tuple[str, bytes, int]]) -> int:
        """``KeyValueStore.put_many``: every (key, value, lease) in one transaction; the revision etcd
        answered (each key's new mod_revision).

        Raises:
            LeaseLost: a lease of ``items`` no longer exists (nothing was written).
        """

        def txn(c: etcd3.Etcd3Client) -> Any:
            ops = c._ops_to_requests([c.transactions.put(k, v, lease=lease or None) for k, v, lease in items])
            req = etcd3.etcdrpc.TxnRequest(compare=[], success=ops, failure=[])
            return c.kvstub.Txn(req, c.timeout, credentials=c.call_credentials, metadata=c.metadata)

        # Idempotent, as one put: a retry writes the same values again.
        return int(self._call("put_many", txn, items[0][0] if items else "").header.revision)

    def delete(self, key: str) -> None:
        self._call("delete", lambda c: c.delete(key), key)

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
        """``KeyValueStore.compare_and_put``; ``lease`` (0: none) attaches ``key`` alone to a lease.

        Raises:
            LeaseLost: the compare held but ``lease`` no longer exists (nothing was written).
            PermissionDenied: the etcd user's role does not cover the keys.
            EtcdUnavailable: etcd did not answer, or refused the request.
        """
        deletes = list(delete_keys)
        ranges = list(delete_ranges)
        extra = dict(put_keys or {})

        def txn(c: etcd3.Etcd3Client) -> bool:
            cmp = (
                c.transactions.version(key) == 0
                if expected_mod_revision == 0
                else c.transactions.mod(key) == expected_mod_revision
            )
            ops = [c.transactions.put(key, value, lease=lease or None)]
            ops += [c.transactions.delete(k) for k in deletes]
            ops += [c.transactions.delete(a, range_end=b) for a, b in ranges]
            ops += [c.transactions.put(k, v) for k, v in extra.items()]
            ok, _ = c.transaction(compare=[cmp], success=ops, failure=[])
            return bool(ok)

        # A CAS is safe to retry: a lost reply makes the retry fail the compare, and the caller re-reads.
        return self._call("compare_and_put", txn, key)

    def delete_held(self, items: Sequence[tuple[str, bytes | None]], lease: int) -> int:
        """``KeyValueStore.delete_held``: one transaction per key (its compare is its own), in the
        order given. Not one transaction of nested ones: etcd 3.4 sends no watch event for a key a
        nested transaction deletes."""
        deleted = 0
        for key, value in items:

            def txn(c: etcd3.Etcd3Client, key: str = key, value: bytes | None = value) -> bool:
                raw = etcd3.utils.to_bytes(key)
                cmp = [etcd3.etcdrpc.Compare(key=raw, target=etcd3.etcdrpc.Compare.LEASE, lease=lease)]
                if value is not None:
                    cmp.append(etcd3.etcdrpc.Compare(key=raw, target=etcd3.etcdrpc.Compare.VALUE, value=value))
                delete = etcd3.etcdrpc.RequestOp(request_delete_range=etcd3.etcdrpc.DeleteRangeRequest(key=raw))
                req = etcd3.etcdrpc.TxnRequest(compare=cmp, success=[delete], failure=[])
                reply = c.kvstub.Txn(req, c.timeout, credentials=c.call_credentials, metadata=c.metadata)
                return bool(reply.succeeded)

            # Idempotent: a retry after a lost reply finds the key gone and deletes nothing.
            deleted += self._call("delete_held", txn, key)
        return deleted

    def grant_lease(self, ttl_s: float) -> int:
        ttl = max(1, round(ttl_s))
        lease = self._call("lease", lambda c: c.lease(ttl))
        return int(lease.id)

    def refresh_lease(self, lease: int) -> float:
        """Renew ``lease``; its TTL now (0: gone). One keepalive stream per endpoint carries every
        renewal of this client (``store.keepalive``). An attempt on a stream that answers nothing
        for ``lease_renew_s`` (then twice that, up to ``etcd_request_s``) fails over: one stuck in a
        leader election moves on early; on a stream that answers others meanwhile (behind: a busy
        host or etcd) it waits up to ``etcd_request_s``."""
        bound = [min(self._timeouts.lease_renew_s, self._timeouts.etcd_request_s)]

        def keepalive(c: etcd3.Etcd3Client) -> float:
            timeout, bound[0] = bound[0], min(bound[0] * 2, self._timeouts.etcd_request_s)
            try:
                return self._stream_of(c).renew(lease, timeout, self._timeouts.etcd_request_s)
            except KeepAliveTimeout as exc:
                if not isinstance(exc, KeepAliveBehind):  # silent: this endpoint does not answer
                    self._failover(c)
                raise _RetryableRpc(str(exc)) from exc

        return self._call("refresh_lease", keepalive)

    def _stream_of(self, c: etcd3.Etcd3Client) -> KeepAliveStream:
        """The open keepalive stream to ``c``'s endpoint (a new one when there is none, or it ended)."""
        with self._lock:
            stream = self._streams.get(id(c))
            if stream is None or stream.broken:
                stream = self._streams[id(c)] = KeepAliveStream(
                    lambda requests: c.leasestub.LeaseKeepAlive(
                        requests, credentials=c.call_credentials, metadata=c.metadata
                    ),
                    lambda lease: etcd3.etcdrpc.LeaseKeepAliveRequest(ID=lease),
                )
            return stream

    def revoke_lease(self, lease: int) -> None:
        self._call("revoke_lease", lambda c: c.revoke_lease(lease))

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` after any change under ``prefix``; return a canceller.

        When the watch stream breaks (etcd restarted or went away), etcd3 0.12 drops the watch: it
        is armed again on a thread, every ``etcd_reconnect_max_s`` until etcd answers (for at most
        ``etcd_outage_s``), and ``callback`` is called on the break and once armed again, so the
        watcher re-reads what it may have missed.

        Raises:
            EtcdUnavailable: the first watch could not be armed.
            PermissionDenied: etcd refused the watch (the user's role does not cover ``prefix``).
        """
        lock = threading.Lock()
        current: list[tuple[etcd3.Etcd3Client, int]] = []  # the armed watch, if any
        state = {"token": 0, "rearming": False}  # token: the newest arming attempt
        cancelled = threading.Event()

        def handler(token: int) -> Callable[[object], None]:
            def on_event(response: object) -> None:
                callback()
                if not isinstance(response, Exception):
                    return
                # The stream died and etcd3 forgot this watch. Only the newest attempt's break
                # counts (a failed attempt's registration breaks too), and one thread re-arms.
                with lock:
                    if token != state["token"] or cancelled.is_set():
                        return
                    current.clear()
                    if state["rearming"]:
                        return
                    state["rearming"] = True
                threading.Thread(target=rearm, name="elasticd-rewatch", daemon=True).start()

            return on_event

        def arm() -> None:
            with lock:
                state["token"] += 1
                token = state["token"]
            found = self._call("watch", lambda c: (c, c.add_watch_prefix_callback(prefix, handler(token))), prefix)
            if found[1] < 0:  # etcd (3.4) answers a watch it does not permit with id -1, created and canceled
                raise permission_denied(self._config, "watch", prefix)
            with lock:
                if token == state["token"]:
                    current[:] = [found]
            if cancelled.is_set():
                cancel()

        def rearm() -> None:
            deadline = time.monotonic() + self._timeouts.etcd_outage_s
            try:
                while not cancelled.is_set() and time.monotonic() < deadline:
                    try:
                        arm()
                    except EtcdUnavailable:
                        cancelled.wait(self._retry.etcd_reconnect_max_s)
                        continue
                    except PermissionDenied as exc:  # trying again meets the same role
                        log.error("watch_not_rearmed", prefix=prefix, error=str(exc))
                        return
                    callback()
                    with lock:
                        if current or cancelled.is_set():  # armed, and not broken again meanwhile
                            state["rearming"] = False
                            return
                log.warning("watch_not_rearmed", prefix=prefix)
            finally:
                with lock:
                    state["rearming"] = False

        def cancel() -> None:
            cancelled.set()
            with lock:
                armed, current[:] = list(current), []
            for client, watch_id in armed:
                try:
                    client.cancel_watch(watch_id)
                except (*_TRANSIENT, grpc.RpcError) as exc:
                    raise EtcdUnavailable(f"cancel_watch failed: {exc}") from exc

        arm()
        return cancel

    def call_rpc(self, what: str, fn: Callable[[grpc.Channel, tuple[tuple[str, str], ...] | None], _T]) -> _T:
        """``fn(channel, metadata)``: a gRPC call that etcd3 0.12 does not wrap (etcd's Auth API), on
        the current endpoint with its auth token, bounded, retried and translated as every call here.

        Raises:
            PermissionDenied: etcd refused it to the user.
            EtcdUnavailable: etcd did not answer, or refused it otherwise.
        """
        return self._call(what, lambda c: fn(c.channel, c.metadata))

    def close(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
        for client in {id(c): c for c in (*self._clients.values(), self._client) if c is not None}.values():
            _close_client(client)


def _close_client(client: etcd3.Etcd3Client) -> None:
    """Close an etcd3 client, ending its watcher thread quietly (``ClosedWatchStub``)."""
    watcher = getattr(client, "watcher", None)
    if watcher is not None:
        watcher._watch_stub = ClosedWatchStub()
    try:
        client.close()
    except (*_TRANSIENT, grpc.RpcError):
        pass


def _from_message(kv: Any) -> KeyValue:
    """etcd's ``mvccpb.KeyValue`` message as a ``KeyValue``."""
    return KeyValue(kv.key.decode(errors="backslashreplace"), kv.value, kv.mod_revision, kv.create_revision, kv.lease)
