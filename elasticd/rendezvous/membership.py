"""The rendezvous executor: members, leases, generations; the decision is ``rendezvous.decide``.

Owns the membership protocol over a ``store.kv.KeyValueStore`` (satisfied by ``store.etcd``):

* every member registers ``members/<id>`` under its own lease, renewed in the background;
* a member that wants into the next generation writes ``ready/<id>`` under the same lease;
* ``next_action(snapshot, me, window, now)`` decides, purely, whether to wait, publish the next
  ``generation`` record (by compare-and-set on its ``mod_revision``), join a published one, or fail;
* a watcher keeps two flags fresh for the hot path: the current generation must be abandoned
  (a member lost its lease, the generation was aborted or superseded), or newcomers wait to join.

It runs the keepalive and watcher threads and the join loop; what they keep lives beside it: the
lease and whether etcd answers (``rendezvous.lease``), the hot-path flags (``rendezvous.watch``),
and the job records a member writes besides its presence (``rendezvous.publish``).

Never imports etcd3 or torch.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TypeVar

import structlog

from elasticd.config import Timeouts, WorldConfig
from elasticd.errors import (
    EtcdUnavailable,
    JobFinished,
    LeaseLost,
    ModelMismatch,
    RendezvousClosed,
    StateLost,
)
from elasticd.rendezvous.decide import (
    ActionKind,
    Me,
    Window,
    candidates_of,
    generation_broken,
    next_action,
    should_load_checkpoint,
)
from elasticd.rendezvous.lease import Lease, Reachability, Renewal
from elasticd.rendezvous.publish import Publisher
from elasticd.rendezvous.watch import GenerationWatch
from elasticd.retry import Clock, Deadline
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import (
    CheckpointRecord,
    GenerationRecord,
    MemberRecord,
    ReadyRecord,
    encode,
)
from elasticd.wire.snapshot import Snapshot, parse_snapshot

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Joined:
    """The outcome of a rendezvous, from this member's point of view."""

    record: GenerationRecord
    rank: int
    duration_s: float
    excused_s: float = 0.0  # time not counted against the join deadline (etcd down, standby)

    @property
    def generation(self) -> int:
        return self.record.generation

    @property
    def world_size(self) -> int:
        return self.record.world_size


@dataclass(frozen=True)
class Standing:
    """One member's own standing (monotonic seconds)."""

    fenced: bool  # its generation was superseded or aborted (seen in etcd)
    lease_lost: bool  # etcd said its lease is gone
    renewed_at: float  # when it last asked for a renewal that etcd granted
    lease_ttl_s: float  # the TTL etcd granted (at least etcd's minimum)
    continued: bool  # stopped and continued since that renewal was asked (continued.py)


class MemberState(StrEnum):
    UNREGISTERED = "unregistered"
    REGISTERED = "registered"
    CLOSED = "closed"


class Membership:
    """One member's presence in a job: lease, registration, rendezvous, and the health watcher.

    Thread-safety: ``join``/``abort``/``close`` are called from the training thread; the keepalive
    and watcher threads only set flags read through ``must_abandon`` and ``join_pending``.
    """

    def __init__(
        self,
        store: KeyValueStore,
        keys: Keys,
        member: MemberRecord,
        world: WorldConfig,
        timeouts: Timeouts,
        clock: Clock = time.monotonic,
    ) -> None:
        self._store = store
        self._keys = keys
        self.record = member
        self._world = world
        self._timeouts = timeouts
        self._clock = clock
        self._lease = Lease(store, timeouts.lease_ttl_s, clock)
        self._state = MemberState.UNREGISTERED
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._publish = Publisher(store, keys, member.member_id, timeouts, clock, self._stop)
        self._watch = GenerationWatch(member.member_id, world)  # the hot-path flags
        self._cancel_watches: list[Callable[[], None]] = []
        self._threads: list[threading.Thread] = []
        self._warned_malformed: set[str] = set()
        self._etcd = Reachability(clock)  # whether the background threads' requests are answered
        self._renew = threading.Event()  # renew now (a commit waits for a renewal)

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def member_id(self) -> str:
        return self.record.member_id

    def start(self) -> None:
        """Register and start the keepalive and watcher threads.

        An unreachable etcd is waited for, up to ``etcd_outage_s`` (a worker started during an
        outage, e.g. one its agent restarted, waits for etcd instead of failing again).

        Raises:
            EtcdUnavailable: etcd stayed unreachable for ``etcd_outage_s``.
        """
        deadline = Deadline.after(self._timeouts.etcd_outage_s, self._clock)
        while True:
            try:
                self._register()
                break
            except EtcdUnavailable as exc:
                if deadline.expired():
                    raise
                log.warning("register_waiting_for_etcd", error=str(exc)[:200],
                            bound_s=round(deadline.remaining_s(), 1))
                self._stop.wait(min(self._timeouts.keepalive_s, deadline.remaining_s()))
        self._cancel_watches = [self._store.watch_prefix(p, self._on_change) for p in self._keys.membership_changes]
        for name, target in (("elasticd-keepalive", self._keepalive_loop), ("elasticd-watch", self._watch_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        """Leave the job now: revoke the lease so peers see this member gone at once."""
        if self._state == MemberState.CLOSED:
            return
        self._stop.set()
        self._changed.set()
        self._renew.set()
        for cancel in self._cancel_watches:
            try:
                cancel()
            except EtcdUnavailable:
                pass
        try:
            self._lease.revoke()
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("lease_revoke_failed", error=str(exc))
        for t in self._threads:
            t.join(timeout=self._timeouts.etcd_request_s * 2)
        self._state = MemberState.CLOSED
        log.info("membership_closed", member=self.member_id)

    def _put_ready(self, ready: ReadyRecord) -> None:
        """Write my ready record, re-registering first if my lease is gone."""
        try:
            self._store.put(self._keys.ready(self.member_id), encode(ready), lease=self._lease.id)
        except LeaseLost:
            log.warning("member_reregistered", member=self.member_id, cause="lease expired")
            self._register()
            self._store.put(self._keys.ready(self.member_id), encode(ready), lease=self._lease.id)

    def _register(self) -> None:
        lease = self._lease.grant()
        self._store.put(self._keys.member(self.member_id), encode(self.record), lease=lease)
        self._watch.regain_lease()
        self._state = MemberState.REGISTERED
        log.info("member_registered", member=self.member_id, lease=lease)

    # -- background threads -----------------------------------------------------------------

    def _on_change(self) -> None:
        self._changed.set()

    def set_progress(self, payload: Mapping[str, object]) -> None:
        """Hand the latest progress to the keepalive thread, which publishes it (off the hot path)."""
        self._publish.set_progress(payload)

    def renew_soon(self) -> None:
        """Ask the keepalive thread for a renewal now (a step waits for one)."""
        self._renew.set()

    def _background(self, wake: threading.Event, ask: Callable[[], T], then: Callable[[T], None]) -> None:
        """A background thread: on ``wake`` (or every keepalive interval) ``ask`` etcd, note whether
        it answered, and ``then`` act on the answer."""
        while not self._stop.is_set():
            wake.wait(self._timeouts.keepalive_s)
            wake.clear()
            if self._stop.is_set():
                return
            try:
                answer = ask()
            except EtcdUnavailable as exc:
                self._etcd.answered(False, str(exc))
                continue
            self._etcd.answered(True)
            then(answer)

    def _keepalive_loop(self) -> None:
        # The renewal first: a step may be waiting for it (a vote of "stale"); the progress writes
        # after it, and only while etcd answers (each could spend the retry budget).
        self._background(self._renew, self._lease.renew, self._renewed)

    def _renewed(self, renewal: Renewal) -> None:
        self._lease.keep(renewal)
        self._publish.flush_progress(self._lease.id)
        if renewal.ttl_s <= 0 and renewal.lease == self._lease.id:
            self._watch.lose_lease(renewal.lease)
            self._changed.set()

    def _watch_loop(self) -> None:
        # Watches can break (etcd restarts); polling every keepalive interval covers that.
        self._background(self._changed, self.snapshot, self._update_health)

    def snapshot(self) -> Snapshot:
        """Read and parse the job's rendezvous keys (``Keys.rendezvous``), in one transaction.

        Raises:
            EtcdUnavailable: etcd could not be reached within the retry bound.
        """
        snap = parse_snapshot(self._keys, self._store.get_prefixes(self._keys.rendezvous))
        for bad in snap.malformed:
            if bad not in self._warned_malformed:
                self._warned_malformed.add(bad)
                log.error("malformed_record_ignored", record=bad)
        return snap

    def _update_health(self, snap: Snapshot) -> None:
        self._watch.assess(snap)

    # -- hot-path flags ---------------------------------------------------------------------

    def lease_fresh(self) -> bool:
        """This member's lease is certainly alive: renewed less than ``TTL - keepalive_s`` ago (the
        TTL etcd granted), by a renewal asked after this process last continued from a stop (its
        agent revokes the lease of a worker stopped for ``stopped_worker_s``: see continued.py)."""
        return self._lease.fresh(self._timeouts.keepalive_s)

    def continued_since_renewal(self) -> bool:
        """This process was stopped and continued since it asked for its last granted renewal."""
        return self._lease.continued_since_renewal()

    def vote(self) -> tuple[bool, bool, bool]:
        """(veto, stale, reached_etcd) for this member's commit vote (``commit.Vote``): veto when
        the generation was superseded or aborted or the lease is gone; stale when the lease is not
        certainly alive (a renewal is then asked for at once); reached_etcd when the last request
        of the background threads was answered, within the last two keepalive intervals."""
        stale = not self.lease_fresh()
        if stale:
            self._renew.set()
        # Answered lately: the background threads ask every keepalive_s, so two intervals without
        # an answer mean etcd is not answering, before the client's retries have given up.
        reached = self._etcd.lately(2 * self._timeouts.keepalive_s)
        return self._watch.fenced or self._watch.lease_lost, stale, reached

    def standing(self) -> Standing:
        """What this member knows of its own standing now (the commit rule's ``Fence`` is built
        from it once a step's vote is summed)."""
        return Standing(fenced=self._watch.fenced, lease_lost=self._watch.lease_lost, renewed_at=self._lease.renewed_at,
                        lease_ttl_s=self._lease.granted_ttl_s, continued=self.continued_since_renewal())

    def must_abandon(self) -> bool:
        """The current generation cannot finish: a member is gone, or it was aborted/superseded."""
        return self._watch.abandon

    @property
    def abandon_reason(self) -> str:
        return self._watch.abandon_reason

    def join_pending(self) -> bool:
        """Newcomers wait to join: re-rendezvous at the next step boundary."""
        return self._watch.join_pending

    # -- rendezvous -------------------------------------------------------------------------

    def abort(self, generation: int, reason: str) -> None:
        """Mark ``generation`` broken so every member leaves it at once.

        Written off the training thread (which goes on to the rendezvous at once), and retried
        while etcd is unreachable, up to ``etcd_outage_s``: members waiting in a collective of that
        generation learn it as soon as etcd answers (they also leave when they see this member's
        ready record). Written by compare-and-set, and never over an abort of a newer generation.
        """
        self._publish.abort(generation, reason)

    def join(
        self, committed_step: int, deadline: Deadline, resume: Callable[[int], int] | None = None
    ) -> Joined:
        """Wait for (or publish) the next generation that includes this member.

        Args:
            committed_step: the newest step whose state this member holds (-1: none).
            deadline: when to give up.
            resume: loads durable state newer than the step given, if there is any, and returns
                the step now held. Called (at most once per join) when ``should_load_checkpoint``
                says so; the ready record then carries the new step.

        Time while etcd does not answer (up to ``etcd_outage_s``) and time as a standby (the job is
        at ``max_workers`` and healthy; up to ``standby_s``) is added to ``deadline``: a member that
        holds live state never gives up because etcd is down, and a standby waits for a place.

        Raises:
            RendezvousClosed: no generation could be formed before ``deadline``.
            ModelMismatch: this member's model differs from the job's.
            EtcdUnavailable: etcd stayed unreachable for ``etcd_outage_s``.
        """
        started = self._clock()
        prev = self._watch.current
        self._watch.leave()
        me = Me(self.member_id, self.record.signature, prev.generation if prev else 0)
        ready = ReadyRecord(
            member_id=self.member_id,
            committed_step=committed_step,
            prev_generation=prev.generation if prev else 0,
            prev_rank=prev.rank_of(self.member_id) if prev and self.member_id in prev.members else 0,
            signature=self.record.signature,
        )
        window = Window(entered_at=started, candidates_changed_at=started)
        last_cands: frozenset[str] = frozenset()
        last_reason = ""
        excused = {"etcd": 0.0, "standby": 0.0}  # seconds not counted against deadline
        bounds = {"etcd": self._timeouts.etcd_outage_s, "standby": self._timeouts.standby_s}
        excuse, since = "", started
        ready_written = False
        broken_seen = 0  # the broken generation whose break this member saw (0: none)
        while True:
            t = self._clock()
            if excuse:
                excused[excuse] += t - since
                if excused[excuse] > bounds[excuse]:
                    raise (EtcdUnavailable if excuse == "etcd" else RendezvousClosed)(
                        f"{last_reason} for longer than {excuse}_{'outage_' if excuse == 'etcd' else ''}s "
                        f"({bounds[excuse]:g} s)")
            excuse, since = "", t
            if deadline.at - deadline.clock() + sum(excused.values()) <= 0:
                raise RendezvousClosed(
                    f"no generation formed within the join timeout ({last_reason})"
                )
            self._changed.clear()
            try:
                if not ready_written:
                    if self._watch.lease_lost:
                        self._register()
                    self._put_ready(ready)
                    ready_written = True
                snap = self.snapshot()
            except EtcdUnavailable as exc:
                excuse, last_reason = "etcd", f"etcd unreachable: {str(exc)[:200]}"
                self._etcd.answered(False, str(exc))
                self._stop.wait(self._timeouts.keepalive_s)
                continue
            except LeaseLost as exc:  # the lease granted anew expired too (an overloaded host): again
                last_reason, ready_written = f"lease lost while registering: {str(exc)[:200]}", False
                self._stop.wait(self._timeouts.keepalive_s)
                continue
            self._etcd.answered(True)
            if resume is not None and should_load_checkpoint(snap, ready.committed_step):
                held = resume(ready.committed_step)
                resume = None
                if held != ready.committed_step:
                    ready = replace(ready, committed_step=held)
                    if self.member_id in self.snapshot().ready:  # not consumed by a generation meanwhile
                        self._put_ready(ready)
                continue
            cands = frozenset(r.member_id for r in candidates_of(snap))
            now = self._clock()
            if cands != last_cands:
                window = replace(window, candidates_changed_at=now)
                last_cands = cands
            broken = snap.generation.generation if snap.generation and generation_broken(snap) else 0
            if broken != broken_seen:
                broken_seen = broken
                window = replace(window, broken_at=now if broken else None)
            action = next_action(snap, me, window, now, self._world, self._timeouts)
            last_reason = action.reason
            if action.kind is ActionKind.JOIN:
                assert action.record is not None
                return self._joined(action.record, started, snap, sum(excused.values()))
            if action.kind is ActionKind.FAIL:
                self.close()
                raise ModelMismatch(action.error)
            if action.kind is ActionKind.STATE_LOST:
                self.close()
                raise StateLost(action.error)
            try:
                if action.kind is ActionKind.FINISHED:
                    self._store.delete(self._keys.ready(self.member_id))
                    raise JobFinished(action.reason)
                if action.kind is ActionKind.REREGISTER:
                    log.warning("member_reregistered", member=self.member_id, cause=action.reason)
                    if self.member_id not in snap.members:
                        self._register()
                    self._put_ready(ready)
                    continue
                if action.kind is ActionKind.PUBLISH:
                    assert action.record is not None
                    won = self._store.compare_and_put(
                        self._keys.generation,
                        action.expected_revision,
                        encode(action.record),  # consumes its members' ready records (wire.snapshot.consumed)
                        put_keys=dict([self._publish.published_event(action.record)]),  # the history, same txn
                    )
            except EtcdUnavailable as exc:
                excuse, last_reason = "etcd", f"etcd unreachable: {str(exc)[:200]}"
                self._stop.wait(self._timeouts.keepalive_s)
                continue
            except LeaseLost as exc:  # re-registering raced the lease's expiry: the next round re-registers
                last_reason = f"lease lost while registering: {str(exc)[:200]}"
                self._stop.wait(self._timeouts.keepalive_s)
                continue
            if action.kind is ActionKind.PUBLISH:
                assert action.record is not None
                if won:
                    log.info(
                        "generation_published",
                        generation=action.record.generation,
                        world_size=action.record.world_size,
                        members=list(action.record.members),
                        cause=action.reason,
                    )
                continue
            if action.standby:
                if excuse != "standby" and excused["standby"] == 0.0:
                    log.info("standby_waiting", member=self.member_id, reason=action.reason,
                             bound_s=self._timeouts.standby_s)
                excuse = "standby"
            wait_s = self._timeouts.keepalive_s
            if action.until is not None:
                wait_s = min(wait_s, max(0.0, action.until - now))
            self._changed.wait(max(0.0, min(wait_s, deadline.at - deadline.clock() + sum(excused.values()))))

    def _joined(self, record: GenerationRecord, started: float, snap: Snapshot, excused_s: float = 0.0) -> Joined:
        self._watch.enter(record, snap.generation_revision)
        self._update_health(snap)
        return Joined(record, record.rank_of(self.member_id), self._clock() - started, excused_s)

    def publish_checkpoint(self, record: CheckpointRecord, only_if_newer: bool = False) -> None:
        """Record the job's latest good durable checkpoint (best effort).

        Args:
            only_if_newer: write only if the key is absent or names an older step (by
                compare-and-set, so a concurrent save is never overwritten by an older record).
        """
        self._publish.checkpoint(record, only_if_newer)

    def mark_finished(self, generation: int, step: int) -> None:
        """Record that every member reached the target step together (late joiners stop)."""
        self._publish.finished(generation, step)

    def publish_progress(self, payload: Mapping[str, object]) -> None:
        """Best-effort progress record for ``elasticctl`` (leased: it vanishes with the member)."""
        self._publish.progress(payload, self._lease.id)


_incarnations = itertools.count()


def new_member_id(node: str, local_rank: int) -> str:
    """A member id unique per incarnation: node, local rank, pid, and a counter when one process
    joins more than once (a member that left must come back as a newcomer, never as its old self)."""
    n = next(_incarnations)
    return f"{node}.{local_rank}.{os.getpid()}" + (f".{n}" if n else "")
