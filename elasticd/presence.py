"""The node agent's presence in etcd: its node record under its own lease, drain requests, events.

Owns one daemon thread per agent that does all of the agent's etcd I/O except lease revocations of
dead workers, so that etcd never stalls the agent loop (worker supervision, the systemd watchdog):

* it grants a lease (TTL ``lease_ttl_s``), writes ``nodes/<node>`` under it, and renews it every
  ``keepalive_s``; a lost lease (etcd was away longer than the TTL) is granted anew and the record
  written again;
* it writes the latest record the agent handed over (``update``) when it differs from the last
  one written, and at least every ``stats_interval_s`` (so its ``time`` is a heartbeat);
* every ``keepalive_s`` it reads ``drain/<node>``; the first time one is there it calls
  ``on_drain`` with the request (``None`` when the value does not parse: a key there is a request
  whatever it holds). ``close`` deletes that key, so a restarted agent does not drain at once
  (``elasticctl drain`` also writes it under this agent's lease, so it cannot outlive the agent);
* ``event(kind, **detail)`` hands an event to an ``events.EventLog`` (never blocks).

An etcd outage is logged (``node_record_failed``) and retried on the next round; it never stops
the agent or its workers. ``close`` is bounded. Never imports etcd3 or torch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import structlog

from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.events import EventLog
from elasticd.membership import KeyValueStore, Keys
from elasticd.oprecords import DECODE_ERRORS, DrainRecord, NodeRecord, decode_drain, encode_node
from elasticd.retry import Clock

log = structlog.get_logger(__name__)


def agent_source(node: str, pid: int | None = None) -> str:
    """The writer id of a node agent in events: ``agent.<node>.<pid>``."""
    return f"agent.{node}.{os.getpid() if pid is None else pid}"


class NodePresence:
    """The agent's node record, drain watch and event log, on one background thread."""

    def __init__(
        self,
        store: KeyValueStore,
        keys: Keys,
        node: str,
        timeouts: Timeouts,
        stats_interval_s: float,
        events_keep: int,
        on_drain: Callable[[DrainRecord | None], None],
        clock: Clock = time.monotonic,
    ) -> None:
        self._store = store
        self._keys = keys
        self._node = node
        self._timeouts = timeouts
        self._refresh_s = stats_interval_s
        self._on_drain = on_drain
        self._clock = clock
        self.events = EventLog(store, keys, agent_source(node), events_keep)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._latest: NodeRecord | None = None
        self._written: NodeRecord | None = None
        self._written_at = float("-inf")
        self._lease = 0
        self._renewed_at = float("-inf")
        self._drain_seen = False
        self._failing = False
        self._thread: threading.Thread | None = None

    @property
    def drain_seen(self) -> bool:
        return self._drain_seen

    def start(self) -> None:
        """Start the thread (it registers at once; nothing here blocks on etcd)."""
        self._thread = threading.Thread(target=self._run, name="elasticd-node-record", daemon=True)
        self._thread.start()

    def update(self, record: NodeRecord) -> None:
        """Hand over the newest record; it is written soon if it differs from the last written one
        (``time`` aside). Never blocks."""
        with self._lock:
            changed = self._latest is None or _content(self._latest) != _content(record)
            self._latest = record
        if changed:
            self._wake.set()

    def event(self, kind: str, /, **detail: object) -> None:
        """Record an event in the job's history (best effort; never blocks, never raises)."""
        self.events.record(kind, **detail)

    def close(self, timeout_s: float) -> None:
        """Write the last events, delete a seen drain request, revoke the lease (the node record
        goes with it). Blocks at most about ``timeout_s``; etcd errors are logged."""
        deadline = self._clock() + timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, deadline - self._clock()))
        self.events.close(max(0.0, deadline - self._clock()))
        if self._failing:
            # etcd is away: do not wait out the store's retries; the lease ends by its TTL, and the
            # node record and a drain request (under that lease) with it.
            log.warning("node_record_left_to_expire", node=self._node, lease=self._lease)
            return
        try:
            if self._drain_seen:
                self._store.delete(self._keys.drain(self._node))
                log.info("drain_request_deleted", node=self._node)
            if self._lease:
                self._store.revoke_lease(self._lease)
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("node_record_cleanup_failed", error=str(exc)[:300])

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round()
                if self._failing:
                    log.info("node_record_restored", node=self._node)
                    self._failing = False
            except (EtcdUnavailable, LeaseLost) as exc:
                if not self._failing:
                    log.warning("node_record_failed", node=self._node, error=str(exc)[:300])
                self._failing = True
            self._wake.wait(self._timeouts.keepalive_s)
            self._wake.clear()

    def _round(self) -> None:
        now = self._clock()
        if self._lease and now - self._renewed_at >= self._timeouts.keepalive_s:
            if self._store.refresh_lease(self._lease) > 0:
                self._renewed_at = now
            else:
                log.warning("node_lease_expired", node=self._node, lease=self._lease)
                self._lease = 0
        if not self._lease:
            self._lease = self._store.grant_lease(self._timeouts.lease_ttl_s)
            self._renewed_at = now
            self._written = None
            log.info("node_registered", node=self._node, lease=self._lease)
        with self._lock:
            latest = self._latest
        stale = now - self._written_at >= self._refresh_s
        if latest is not None and (self._written is None or _content(self._written) != _content(latest) or stale):
            try:
                self._store.put(self._keys.node(self._node), encode_node(latest), lease=self._lease)
            except LeaseLost:
                self._lease = 0
                raise
            self._written, self._written_at = latest, now
        if not self._drain_seen:
            self._check_drain()

    def _check_drain(self) -> None:
        kv = self._store.get(self._keys.drain(self._node))
        if kv is None:
            return
        self._drain_seen = True
        request: DrainRecord | None
        try:
            request = decode_drain(kv.value)
        except DECODE_ERRORS as exc:
            request = None
            log.warning("drain_request_malformed", node=self._node, error=str(exc)[:200])
        log.info("drain_requested", node=self._node,
                 requested_by=request.requested_by if request else None)
        self._on_drain(request)


def _content(record: NodeRecord) -> tuple[object, ...]:
    """A record without its write time: what decides whether it changed."""
    return (record.node, record.host, record.agent_pid, record.state, record.workers)
