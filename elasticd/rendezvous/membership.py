"""The rendezvous executor: members, leases, generations; the decision is ``rendezvous.decide``.

Owns the membership protocol over a ``store.kv.KeyValueStore`` (satisfied by ``store.etcd``):

* every member registers ``members/<id>`` under its own lease, renewed in the background;
* a member that wants into the next generation writes ``ready/<id>`` under the same lease;
* the elected coordinator (``rendezvous.coordinator``, which this member may run) publishes the next
  ``generation`` record; the member reads only its small view (``rendezvous.reader``) and
  ``member_action`` decides, purely, whether it joins a published generation, waits, or fails;
* a watcher keeps two flags fresh for the hot path from that view (the coordinator's ``verdict``):
  the current generation must be abandoned (a member lost its lease or left, the generation was
  aborted or superseded), or newcomers wait to join.

It runs the keepalive, watcher and reach threads and the join loop; what they keep lives beside it:
the lease and whether etcd answers (``rendezvous.lease``), the hot-path flags (``rendezvous.watch``),
the check on a collective stuck on a host gone from the network (``rendezvous.reach``), and the job
records a member writes besides its presence (``rendezvous.publish``).

Never imports etcd3 or torch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import replace

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
from elasticd.rendezvous.answer import Answerer
from elasticd.rendezvous.coordinator import Coordinator, Seat
from elasticd.rendezvous.decide import ActionKind, Me, member_action, should_resume, verdict_on
from elasticd.rendezvous.deputy import deputy_starts_s, deputy_tier
from elasticd.rendezvous.lease import Lease, Reachability, Renewal
from elasticd.rendezvous.member import Joined, MemberState
from elasticd.rendezvous.publish import Publisher
from elasticd.rendezvous.reach import ReachCheck
from elasticd.rendezvous.reader import JobReader
from elasticd.rendezvous.watch import GenerationWatch
from elasticd.retry import Clock, Deadline
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.progress import ProgressRecord
from elasticd.wire.records import (
    CheckpointRecord,
    CoordinatorRecord,
    GenerationRecord,
    MemberRecord,
    ReadyRecord,
    encode,
)
from elasticd.wire.snapshot import Snapshot

__all__ = ["Joined", "Membership"]  # Joined: re-exported from .member

log = structlog.get_logger(__name__)


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
        answerer: Answerer | None = None,
    ) -> None:
        self._store = store
        self._answerer = answerer  # answers reach checks on member.answer_port (started and closed here)
        self._keys = keys
        self.record = member
        self._world = world
        self._timeouts = timeouts
        self._clock = clock
        self._lease = Lease(store, timeouts.lease_ttl_s)
        self._state = MemberState.UNREGISTERED
        # A change seen by a watch wakes both the join loop and the watcher thread: one event each,
        # since a waiter that clears a shared one can swallow the other's wakeup.
        self._changed = threading.Event()  # the join loop's
        self._view_changed = threading.Event()  # the watcher thread's
        self._stop = threading.Event()
        self._publish = Publisher(store, keys, member.member_id, timeouts, clock, self._stop)
        self._watch = GenerationWatch(member.member_id)  # the hot-path flags
        self._seat = Seat(
            store, keys, CoordinatorRecord(member.member_id, member.node), lambda: self._new_coordinator(elected=True)
        )
        self._cancel_watches: list[Callable[[], None]] = []
        self._threads: list[threading.Thread] = []
        self._reader = JobReader(store, keys, member.node)
        self._etcd = Reachability()  # whether the background threads' requests are answered
        self._renew = threading.Event()  # renew now
        self._progress_due = threading.Event()  # a renewal was granted: publish the progress
        self._joining = False  # a join() runs (on the training thread)
        self.reach = ReachCheck(
            member.member_id,
            timeouts,
            clock,
            self.snapshot,
            self._publish.abort_now,
            self._seat.running,
            lambda: self._watch.abandon,
        )

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
            LeaseLost: every lease granted for ``etcd_outage_s`` expired before it could be used.
        """
        deadline = Deadline.after(self._timeouts.etcd_outage_s, self._clock)
        while True:
            try:
                self._register()
                break
            except (EtcdUnavailable, LeaseLost) as exc:  # LeaseLost: granted, then expired before the put
                if deadline.expired():  # (an overloaded host): again, like an outage
                    raise
                log.warning("register_waiting_for_etcd", error=str(exc)[:200], bound_s=round(deadline.remaining_s(), 1))
                self._stop.wait(min(self._timeouts.keepalive_s, deadline.remaining_s()))
        self._cancel_watches = [self._store.watch_prefix(p, self._on_change) for p in self._keys.member_watch]
        for name, target in (
            ("elasticd-keepalive", self._keepalive_loop),
            ("elasticd-watch", self._watch_loop),
            (
                "elasticd-progress",
                lambda: self._publish.progress_loop(
                    self._stop, self._progress_due, lambda: self._lease.id, self._timeouts.keepalive_s
                ),
            ),
            ("elasticd-reach", lambda: self.reach.run(self._stop)),
        ):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        if self._answerer is not None:
            self._answerer.start()

    def close(self) -> None:
        """Leave the job now: revoke the lease so peers see this member gone at once."""
        if self._state == MemberState.CLOSED:
            return
        self._stop.set()
        self._on_change()
        self._renew.set()
        self._progress_due.set()
        self.reach.wake()
        self._seat.stop()
        for cancel in self._cancel_watches:
            with contextlib.suppress(EtcdUnavailable):
                cancel()
        try:
            self._lease.revoke()
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("lease_revoke_failed", error=str(exc))
        for t in self._threads:
            t.join(timeout=self._timeouts.etcd_request_s * 2)
        if self._answerer is not None:
            self._answerer.close(self._timeouts.etcd_request_s * 2)
        self._state = MemberState.CLOSED
        log.info("membership_closed", member=self.member_id)

    def _put_ready(self, ready: ReadyRecord) -> int:
        """Write my ready record, re-registering first if my lease is gone; returns its revision."""
        try:
            return self._store.put(self._keys.ready(self.member_id), encode(ready), lease=self._lease.id)
        except LeaseLost:
            log.warning("member_reregistered", member=self.member_id, cause="lease expired")
            self._register()
            return self._store.put(self._keys.ready(self.member_id), encode(ready), lease=self._lease.id)

    def _delete_quietly(self, key: str) -> None:
        try:
            self._store.delete(key)
        except EtcdUnavailable as exc:
            log.warning("ready_record_delete_failed", error=str(exc)[:200])

    def _register(self) -> None:
        lease = self._lease.grant()
        self._store.put(self._keys.member(self.member_id), encode(self.record), lease=lease)
        self._watch.regain_lease()
        self._state = MemberState.REGISTERED
        log.info("member_registered", member=self.member_id, lease=lease)

    # -- background threads -----------------------------------------------------------------

    def _on_change(self) -> None:
        self._changed.set()
        self._view_changed.set()

    def set_progress(self, record: ProgressRecord) -> None:
        """Hand the latest progress to the keepalive thread, which publishes it (off the hot path)."""
        self._publish.set_progress(record)

    def _keepalive_loop(self) -> None:
        # Renewals only: the progress writes follow each granted renewal on a thread of their own
        # (Publisher.progress_loop), so a slow put never holds a renewal back.
        self._etcd.background(self._stop, self._renew, self._lease.renew, self._renewed, self._timeouts.keepalive_s)

    def _renewed(self, renewal: Renewal) -> None:
        self._progress_due.set()
        if renewal.ttl_s <= 0 and renewal.lease == self._lease.id:
            self._watch.lose_lease(renewal.lease)
            self._on_change()

    def _watch_loop(self) -> None:
        # Watches deliver changes at once (and a broken one is re-armed and read again); the poll
        # every view_poll_s is a safety net.
        self._etcd.background(
            self._stop, self._view_changed, self._watched_view, self._on_view, self._timeouts.view_poll_s
        )

    def _watched_view(self) -> Snapshot | None:
        # A join reads the view (and campaigns) itself.
        return None if self._joining else self._reader.view()

    def view(self) -> Snapshot:
        """This member's view of the job (``JobReader.view``). Raises EtcdUnavailable: etcd could
        not be reached within the retry bound."""
        return self._reader.view()

    def snapshot(self) -> Snapshot:
        """All of the job's rendezvous keys (``JobReader.snapshot``). Raises EtcdUnavailable: etcd
        could not be reached within the retry bound."""
        return self._reader.snapshot()

    def _on_view(self, view: Snapshot | None) -> None:
        if view is None:
            return
        self._watch.assess(view)
        try:
            self._elect(view)
        except EtcdUnavailable as exc:
            self._etcd.answered(False, str(exc))

    def _elect(self, view: Snapshot) -> None:
        """Campaign when the job has no coordinator, and run or stop this member's coordinator as
        the ``coordinator`` record says (from both the watcher and the join)."""
        if self._state == MemberState.REGISTERED and not self._stop.is_set():
            self._seat.follow(view, self._lease.id)

    def _new_coordinator(self, elected: bool) -> Coordinator:
        take_over = None if elected else (lambda revision: self._seat.take_over(revision, self._lease.id))
        return Coordinator(
            self._store,
            self._keys,
            self.member_id,
            self._world,
            self._timeouts,
            self._clock,
            self.snapshot,
            self._publish.published_event,
            elected=elected,
            take_over=take_over,
            noted=lambda: self.reach.out_of_reach,
        )

    def is_coordinator(self) -> bool:
        """This member runs the job's coordinator now."""
        return self._seat.running()

    def veto(self) -> bool:
        """This member already knows its generation is abandoned: it was fenced (superseded without
        it, or aborted), or its lease is gone (``commit.Vote.veto``)."""
        return self._watch.fenced or self._watch.lease_lost

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
        """Mark ``generation`` broken so every member leaves it at once. Written off the training
        thread (which goes on to the rendezvous at once), and retried while etcd is unreachable, up
        to ``etcd_outage_s``: members waiting in a collective of that generation learn it as soon as
        etcd answers (they also leave when they see this member's ready record). Written by
        compare-and-set, and never over an abort of a newer generation."""
        self._publish.abort(generation, reason)

    def join(self, committed_step: int, deadline: Deadline, resume: Callable[[int], int] | None = None) -> Joined:
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
        self._joining = True
        try:
            return self._join(committed_step, deadline, resume)
        finally:
            self._joining = False

    def _join(self, committed_step: int, deadline: Deadline, resume: Callable[[int], int] | None) -> Joined:
        started = self._clock()
        prev, superseded_in = self._watch.current, self._watch.superseded_in
        self._watch.leave()
        me = Me(
            self.member_id,
            self.record.signature,
            prev.generation if prev else 0,
            spare=bool(self.record.spare) and prev is None,
        )  # a spare until a generation takes it
        if prev is not None and superseded_in is not None and not self._watch.lease_lost:
            # the generation I leave was superseded by one that may take me as I am (a leave
            # without a ready round: rendezvous.survivors): join it without writing my record
            first = member_action(superseded_in, me, self._world)
            if first.kind is ActionKind.JOIN:
                assert first.record is not None
                return self._joined(first.record, started, superseded_in)
        ready = ReadyRecord(
            member_id=self.member_id,
            committed_step=committed_step,
            prev_generation=prev.generation if prev else 0,
            prev_rank=prev.rank_of(self.member_id) if prev and self.member_id in prev.members else 0,
            signature=self.record.signature,
        )
        # A deputy (a few ranks of the generation it leaves, in tiers) publishes itself when the
        # coordinator is late (deputy.deputy_starts_s): one that died unrevoked holds the role
        # until its lease ends.
        tier = deputy_tier(ready.prev_rank, prev.world_size) if prev and self.member_id in prev.members else None
        deputy = self._new_coordinator(elected=False) if tier is not None else None
        deputy_at: float | None = None  # seconds into this rendezvous: the deputy's rounds begin
        last_reason = ""
        excused = {"etcd": 0.0, "standby": 0.0}  # seconds not counted against deadline
        bounds = {"etcd": self._timeouts.etcd_outage_s, "standby": self._timeouts.standby_s}
        excuse, since = "", started
        ready_written = False
        ready_revision = 0  # my ready record's: a generation published after it consumed it
        while True:
            t = self._clock()
            if excuse:
                excused[excuse] += t - since
                if excused[excuse] > bounds[excuse]:
                    raise (EtcdUnavailable if excuse == "etcd" else RendezvousClosed)(
                        f"{last_reason} for longer than {excuse}_{'outage_' if excuse == 'etcd' else ''}s "
                        f"({bounds[excuse]:g} s)"
                    )
            excuse, since = "", t
            if deadline.at - deadline.clock() + sum(excused.values()) <= 0:
                raise RendezvousClosed(f"no generation formed within the join timeout ({last_reason})")
            self._changed.clear()
            until: float | None = None
            try:
                if not ready_written:
                    if self._watch.lease_lost:
                        self._register()
                    ready_revision = self._put_ready(ready)
                    ready_written = True
                view = self.view()
                self._elect(view)
                if resume is not None and should_resume(view, ready.committed_step):
                    held = resume(ready.committed_step)
                    resume = None
                    if held != ready.committed_step:
                        ready, ready_written = replace(ready, committed_step=held), False
                    continue
                action = member_action(view, me, self._world)
                last_reason = action.reason
                if action.kind is ActionKind.FINISHED:
                    self._store.delete(self._keys.ready(self.member_id))
                    fin = view.finished
                    raise JobFinished(action.reason, fin.generation if fin else -1, fin.step if fin else -1)
                if action.kind is ActionKind.WAIT and view.generation_revision > ready_revision:
                    # A generation published after my ready record left me out (a standby, or
                    # a record the coordinator read too late): it consumed the record
                    # (wire.snapshot.consumed), so I say again that I wait.
                    ready_written = False
                    continue
                if action.kind is ActionKind.WAIT and deputy is not None:
                    deputy_at = deputy_starts_s(tier, verdict_on(view) is not None, self._timeouts)
                    if deputy_at is not None and self._clock() - started >= deputy_at:
                        until = deputy.round()
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
            if action.kind is ActionKind.JOIN:
                assert action.record is not None
                if ready_revision > view.generation_revision:
                    # written after the generation that takes me (I read a large generation just as
                    # the next one replaced its roster, and wrote it again): it must not stand as
                    # "waiting" while I train. Rare: one delete, best effort.
                    self._delete_quietly(self._keys.ready(self.member_id))
                return self._joined(action.record, started, view, sum(excused.values()))
            if action.kind is ActionKind.FAIL:
                self.close()
                raise ModelMismatch(action.error)
            if action.kind is ActionKind.STATE_LOST:
                self.close()
                raise StateLost(action.error)
            if self._watch.lease_lost:  # my records are gone with my lease: register anew
                log.warning("member_reregistered", member=self.member_id, cause="lease expired")
                ready_written = False
                continue
            now = self._clock()
            if action.standby:
                if excuse != "standby" and excused["standby"] == 0.0:
                    log.info(
                        "standby_waiting", member=self.member_id, reason=action.reason, bound_s=self._timeouts.standby_s
                    )
                excuse = "standby"
            wait_s = self._timeouts.keepalive_s
            if until is not None:
                wait_s = min(wait_s, max(0.0, until - now))
            elif deputy_at is not None and now - started < deputy_at:
                wait_s = min(wait_s, started + deputy_at - now)
            self._changed.wait(max(0.0, min(wait_s, deadline.at - deadline.clock() + sum(excused.values()))))

    def _joined(self, record: GenerationRecord, started: float, snap: Snapshot, excused_s: float = 0.0) -> Joined:
        self._watch.enter(record, snap.generation_revision)
        self._watch.assess(snap)
        self.reach.joined(record.generation, record.rank_of(self.member_id))
        return Joined(record, record.rank_of(self.member_id), self._clock() - started, excused_s)

    def publish_checkpoint(self, record: CheckpointRecord) -> None:
        """Record the job's latest good durable checkpoint (best effort), by compare-and-set on
        (step, seq): never over a newer one."""
        self._publish.checkpoint(record)

    def mark_finished(self, generation: int, step: int) -> None:
        """Record that every member reached the target step together (late joiners stop)."""
        self._publish.finished(generation, step)
