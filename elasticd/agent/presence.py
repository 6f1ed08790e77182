"""The node agent's presence in etcd: its node record under its own lease, drain requests, events.

Owns one daemon thread per agent that does all of the agent's etcd I/O except lease revocations of
dead workers, so that etcd never stalls the agent loop (worker supervision, the systemd watchdog):

* before the thread starts, ``claim`` creates ``nodes/<node>`` under a new lease (TTL
  ``lease_ttl_s``) by compare-and-set on absence, so two agents never hold one node id: while
  another lease holds the record it retries, and refuses once the record outlived
  ``lease_ttl_s + CLAIM_MARGIN_S`` of waiting (its agent is alive: it renews the lease); the
  decision is the pure ``decide_claim``;
* the thread renews the lease every ``keepalive_s``; a lost lease (etcd was away longer than the
  TTL) is granted anew and the record created again, by the same compare-and-set (another agent
  that claimed the node id meanwhile keeps it: ``node_record_taken``);
* it writes the latest record the agent handed over (``update``) when it differs from the last
  one written, and at least every ``stats_interval_s`` (so its ``time`` is a heartbeat);
* every ``keepalive_s`` it reads ``drain/<node>``; the first time one is there it calls
  ``on_drain`` with the request (``None`` when the value does not parse: a key there is a request
  whatever it holds). ``close`` deletes that key, so a restarted agent does not drain at once
  (``elasticctl drain`` also writes it under this agent's lease, so it cannot outlive the agent);
* ``event(kind, **detail)`` hands an event to an ``events.EventLog`` (never blocks).

An etcd outage is logged (``node_record_failed``) and retried on the next round; it never stops
the agent or its workers. etcd's permission denied (the etcd user's role does not cover the job) is
not retried: the thread ends and leaves it in ``denied``, for the agent loop to stop on. ``close`` is
bounded. Never imports etcd3 or torch.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import StrEnum

import structlog

from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable, LeaseLost, PermissionDenied
from elasticd.events import EventLog
from elasticd.retry import Clock
from elasticd.store.kv import KeyValue, KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.ops import (
    DrainRecord,
    NodeRecord,
    decode_drain,
    decode_node,
    encode_node,
)
from elasticd.wire.records import DECODE_ERRORS

log = structlog.get_logger(__name__)

# How much longer than lease_ttl_s a record of a dead agent may outlive its last renewal: etcd rounds
# a TTL to whole seconds (up to 0.5 s more), grants no less than its minimum (about 2 s with the
# default election timeout, so lease_ttl_s 1 lives 2 s), and reaps expired leases every 0.5 s.
CLAIM_MARGIN_S = 2.0


class ClaimKind(StrEnum):
    CLAIM = "claim"  # nodes/<node> is absent: create it under my lease (compare-and-set on absence)
    CLAIMED = "claimed"  # it is under my lease: mine (my own claim, whose reply was lost)
    WAIT = "wait"  # another lease holds it: perhaps a crashed agent of this node, not expired yet
    REFUSE = "refuse"  # another agent holds it: its lease outlived a whole TTL of waiting, or has none


@dataclass(frozen=True)
class ClaimDecision:
    kind: ClaimKind
    reason: str


def _utc(t: float | None) -> str:
    if t is None or t <= 0:
        return "an unknown time"
    return datetime.fromtimestamp(t, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe_holder(held: KeyValue) -> str:
    """Who holds a node record, for people: the agent's pid and host, and since when. Pure."""
    try:
        rec = decode_node(held.value)
    except DECODE_ERRORS:
        return f"a record that does not parse (lease {held.lease:x})"
    since = f"since {_utc(rec.since)}" if rec.since else "since before the node record had a start time"
    return (
        f"the elasticd agent pid {rec.agent_pid} on host {rec.host}, {since} (state {rec.state}, last "
        f"written {_utc(rec.time)}, lease {held.lease:x})"
    )


def decide_claim(
    held: KeyValue | None, my_lease: int, waited_s: float, lease_ttl_s: float, margin_s: float = CLAIM_MARGIN_S
) -> ClaimDecision:
    """Claim ``nodes/<node>``, wait for it, or refuse the node id. Pure.

    Whether the agent that wrote the record is alive cannot be told from here (it may be this
    node's own agent before a crash, or one on another host); only its lease can. A lease that is
    not renewed ends within ``lease_ttl_s`` (plus ``margin_s``) of its last renewal, which was before
    the waiting began; a record still there after that long is renewed, so its agent is alive.

    Args:
        held: the record as read now (None: absent).
        my_lease: the lease this agent claims it under (0: none granted yet).
        waited_s: seconds since this agent first tried to claim.
    """
    if held is None:
        return ClaimDecision(ClaimKind.CLAIM, "the node id is free")
    if my_lease and held.lease == my_lease:
        return ClaimDecision(ClaimKind.CLAIMED, "the record is under my lease (my own claim)")
    who = describe_holder(held)
    if not held.lease:
        return ClaimDecision(
            ClaimKind.REFUSE,
            f"it is held by {who}, in a record under no lease, which never "
            "expires; delete it if no agent runs this node",
        )
    bound = lease_ttl_s + margin_s
    if waited_s < bound:
        return ClaimDecision(
            ClaimKind.WAIT,
            f"it is held by {who}; waiting up to {bound:g} s (lease_ttl_s "
            f"{lease_ttl_s:g} + {margin_s:g} s) for that lease to expire, in case its agent is "
            "gone",
        )
    return ClaimDecision(
        ClaimKind.REFUSE,
        f"it is held by {who}, whose lease was still renewed after "
        f"{waited_s:.1f} s of waiting (lease_ttl_s {lease_ttl_s:g} + {margin_s:g} s): that agent "
        "is alive",
    )


def wait_began(began: float, seen_term: int, term: int, now: float) -> tuple[float, int]:
    """When the wait for a held node record's lease counts from, and the raft term seen with it.
    Pure. A higher raft term than the one seen means a new etcd leader since, and a new leader
    refreshes every lease to its full TTL (plus its election timeout, which ``CLAIM_MARGIN_S``
    covers): the crashed agent's lease then lives a whole TTL more, so the wait begins again. An
    agent restarted after a crash while etcd elected a leader (or came back from an outage) was
    otherwise refused its own node id, and ``RestartPreventExitStatus=2`` kept it down."""
    if term > seen_term:
        return (now if seen_term else began), term
    return began, seen_term


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
        self._taken_logged = False
        self._thread: threading.Thread | None = None
        self.denied: PermissionDenied | None = None  # set when etcd refused the thread's work; it ended

    @property
    def drain_seen(self) -> bool:
        return self._drain_seen

    def lease_now(self) -> tuple[int, bool]:
        """The node's lease (0: none now) and whether its last renewal was answered: the node's one
        etcd lease, which the node's relay holds its workers' records under (``relay.leases``)."""
        return self._lease, not self._failing

    def claim(
        self, record: NodeRecord, wait: Callable[[float], None], stopping: Callable[[], bool], job: str = ""
    ) -> ClaimDecision:
        """Create ``nodes/<node>`` holding ``record`` under a new lease of this agent, before ``start``.

        The record is created by compare-and-set on its absence, so of two agents with one node id
        at most one gets it. While another lease holds it, this retries every ``keepalive_s`` for up
        to ``lease_ttl_s + CLAIM_MARGIN_S`` (``decide_claim``): the holder may be this node's agent
        before a crash, whose lease has not expired yet.

        Args:
            wait: sleeps at most the seconds given (a stop request may cut it short).
            stopping: whether the agent was asked to stop (then the waiting ends).
            job: the job id, for the refusal's message.

        Returns:
            CLAIMED (the lease and the record are this presence's now), REFUSE (the reason names the
            other agent), or WAIT (``stopping`` turned true while waiting).

        Raises:
            EtcdUnavailable: etcd did not answer.
            PermissionDenied: the etcd user's role does not cover the job.
        """
        key = self._keys.node(self._node)
        ttl = self._timeouts.lease_ttl_s
        started = self._clock()
        lease = term = 0
        announced = False
        while True:
            held = self._store.get(key)
            now = self._clock()
            began, seen = wait_began(started, term, self._store.raft_term(), now)
            if began != started:
                log.info(
                    "node_id_wait_restarted",
                    node=self._node,
                    term=seen,
                    reason="etcd elected a new leader, which refreshed the holder's lease",
                )
            started, term = began, seen
            decision = decide_claim(held, lease, now - started, ttl)
            if decision.kind is ClaimKind.CLAIM:
                if not lease or self._store.refresh_lease(lease) <= 0:
                    lease = self._store.grant_lease(ttl)
                try:
                    won = self._store.compare_and_put(key, 0, encode_node(record), lease=lease)
                except LeaseLost:
                    lease = 0
                    continue
                if not won:
                    continue  # another agent created it first: read it and decide again
                decision = ClaimDecision(ClaimKind.CLAIMED, "created the record")
            if decision.kind is ClaimKind.CLAIMED:
                with self._lock:
                    self._latest = record
                self._lease, self._renewed_at = lease, now
                self._written, self._written_at = record, now
                log.info("node_registered", node=self._node, lease=lease, waited_s=round(now - started, 3))
                return decision
            if decision.kind is ClaimKind.REFUSE or stopping():
                self._give_back(lease)
                if decision.kind is ClaimKind.REFUSE:
                    decision = ClaimDecision(
                        ClaimKind.REFUSE,
                        f"node_id_taken: node id {self._node!r}"
                        f"{f' of job {job!r}' if job else ''} ({key}): {decision.reason}. "
                        "Give this agent another node_id (--node-id, ELASTICD_NODE_ID) or "
                        "stop the other agent first",
                    )
                    log.error("node_id_taken", node=self._node, key=key, reason=decision.reason)
                return decision
            if not announced:
                log.warning("node_id_held", node=self._node, key=key, reason=decision.reason)
                announced = True
            wait(min(self._timeouts.keepalive_s, max(0.0, started + ttl + CLAIM_MARGIN_S - now)))

    def _give_back(self, lease: int) -> None:
        if not lease:
            return
        try:
            self._store.revoke_lease(lease)
        except (EtcdUnavailable, LeaseLost, PermissionDenied) as exc:
            log.info("node_lease_left_to_expire", node=self._node, lease=lease, error=str(exc)[:200])

    def start(self) -> None:
        """Start the thread (it registers at once unless ``claim`` did; nothing here blocks on etcd)."""
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
        if self._failing or self.denied is not None:
            # etcd is away (or refuses us): do not wait out the store's retries; the lease ends by its
            # TTL, and the node record and a drain request (under that lease) with it.
            log.warning("node_record_left_to_expire", node=self._node, lease=self._lease)
            return
        try:
            if self._drain_seen:
                self._store.delete(self._keys.drain(self._node))
                log.info("drain_request_deleted", node=self._node)
            if self._lease:
                self._store.revoke_lease(self._lease)
        except (EtcdUnavailable, LeaseLost, PermissionDenied) as exc:
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
            except PermissionDenied as exc:  # each round would meet the same role: stop, tell the agent
                log.error("node_record_denied", node=self._node, error=str(exc))
                self.denied = exc
                return
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
                if self._written is None:
                    if not self._create(latest):
                        return
                else:
                    self._store.put(self._keys.node(self._node), encode_node(latest), lease=self._lease)
            except LeaseLost:
                self._lease = 0
                raise
            self._written, self._written_at = latest, now
        if not self._drain_seen:
            self._check_drain()

    def _create(self, record: NodeRecord) -> bool:
        """Create the record under the current lease iff it is absent (or already under that lease).
        Another agent that claimed this node id while our lease was gone keeps it; we do not write.

        Raises:
            LeaseLost, EtcdUnavailable.
        """
        key = self._keys.node(self._node)
        if self._store.compare_and_put(key, 0, encode_node(record), lease=self._lease):
            self._taken_logged = False
            return True
        held = self._store.get(key)
        if held is not None and held.lease == self._lease:  # our own create, whose reply was lost
            self._store.put(key, encode_node(record), lease=self._lease)
            return True
        if held is not None and not self._taken_logged:
            log.error("node_record_taken", node=self._node, key=key, holder=describe_holder(held))
            self._taken_logged = True
        return False

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
        log.info("drain_requested", node=self._node, requested_by=request.requested_by if request else None)
        self._on_drain(request)


def _content(record: NodeRecord) -> tuple[object, ...]:
    """A record without its write time: what decides whether it changed."""
    return (record.node, record.host, record.agent_pid, record.state, record.workers)
