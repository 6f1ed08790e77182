"""The coordinator: the one member that reads the job's ``members/`` and ``ready/`` records,
judges the current generation and publishes the next (``Coordinator``).

Elected by create-if-absent of ``coordinator`` under the elected member's own lease (the
membership campaigns whenever it sees the key absent): when the coordinator dies its agent revokes
its lease, or the lease ends, and the next member to see the key gone takes over. Each round reads
the job once (``Keys.rendezvous``), writes the ``verdict`` (``decide.judge``: lost, left and
admitted members, whether the generation is orphaned, a lost state) when it differs from the one
stored, and publishes what ``decide.publish_decision`` says by compare-and-set on the generation
record: a stale coordinator (stopped, then continued) can only lose that race. Rounds follow the
changes: events that arrive during a round make one more round, so a burst of N joins costs a few
reads of the job, not N. The verdict on a generation with no live member says since when
(``orphaned_at``, by the first judging coordinator's wall clock, kept by the next ones), and a
resume without that generation waits ``resume_hold_s`` from it (``resume.resume_held_until``;
logged once per generation, ``resume_held``).

A deputy (``Membership.join``) runs the same rounds without the verdict when the coordinator is
late. Never imports etcd3 or torch; decides nothing itself.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import structlog

from elasticd.config import Timeouts, WorldConfig
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.rendezvous.decide import (
    Action,
    ActionKind,
    Window,
    candidates_of,
    generation_broken,
    held_out,
    join_window_closes_at,
    judge,
    missing_members,
    publish_decision,
    waiting_newcomers,
    without_gone,
)
from elasticd.rendezvous.probe import GONE, Answer, answers, to_probe
from elasticd.rendezvous.survivors import survivors_generation
from elasticd.retry import Clock
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import CoordinatorRecord, GenerationRecord, encode
from elasticd.wire.roster import encode_generation
from elasticd.wire.snapshot import Snapshot

log = structlog.get_logger(__name__)

DEPUTY_PROBE_S = 0.05  # a deputy's bound on asking missing members' hosts (it asks within its own join)


class NotCoordinator(Exception):
    """The job's ``coordinator`` record names another member (or none): this one stops."""


class Coordinator:
    """Rounds of reading the job, judging its generation and publishing the next one."""

    def __init__(
        self,
        store: KeyValueStore,
        keys: Keys,
        member_id: str,
        world: WorldConfig,
        timeouts: Timeouts,
        clock: Clock,
        read: Callable[[], Snapshot],
        published_event: Callable[[GenerationRecord], tuple[str, bytes]],
        elected: bool = True,
        take_over: Callable[[int], None] | None = None,
        noted: Callable[[], tuple[int, frozenset[str]]] = lambda: (0, frozenset()),
        wall: Clock = time.time,
    ) -> None:
        self._store = store
        self._keys = keys
        self._member_id = member_id
        self._world = world
        self._timeouts = timeouts
        self._clock = clock
        self._read = read
        self._published_event = published_event
        self._elected = elected  # False: a deputy (publishes, writes no verdict, needs no election)
        self._take_over = take_over  # a deputy's: claim the role from a coordinator it left out
        self._window: Window | None = None  # the current round (None: nobody waits)
        self._newcomers: frozenset[str] = frozenset()
        self._probed: dict[str, bool] = {}  # member -> gone: its host refused or did not answer (in _probed_generation)
        self._probed_generation = 0
        # (generation, members) this member's reach check found out of reach while the generation
        # was stuck (rendezvous.reach): left out without being asked again
        self._noted = noted
        self._held_names: frozenset[str] = frozenset()  # the members held out, as last logged
        self._wall = wall  # the wall clock: the verdict's orphaned_at, read by other hosts too
        self._broken_seen = 0
        self._held_logged = 0  # the generation whose resume hold was logged
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cancel: list[Callable[[], None]] = []

    # -- one round ---------------------------------------------------------------------------

    def round(self) -> float | None:
        """Read the job, write the verdict if it changed, publish if due.

        Returns:
            When (monotonic) the next round is due without any change (None: only on a change).

        Raises:
            NotCoordinator: an elected coordinator found the role taken by another member.
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
        """
        read = self._read()
        now, wall = self._clock(), self._wall()
        if self._elected and (read.coordinator is None or read.coordinator.member_id != self._member_id):
            raise NotCoordinator(read.coordinator.member_id if read.coordinator else "")
        held = held_out(read, wall, self._timeouts.reach_hold_s)
        self._log_held(read, held, wall)
        until = self._decide(without_gone(read, held) if held else read, now, wall)
        ends = [t for m, t in held.items() if m in read.members]  # a held member waits: look again then
        back = now + max(0.0, min(ends) - wall) if ends else None
        return back if until is None or (back is not None and back < until) else until

    def _log_held(self, snap: Snapshot, held: dict[str, float], wall: float) -> None:
        """Log the members held out (``decide.held_out``) when that set changes."""
        names = frozenset(m for m in held if m in snap.members)
        if names and names != self._held_names:
            log.info(
                "members_held_out",
                members=sorted(names)[:8],
                for_s=round(max(held.values()) - wall, 2),
                generation=snap.aborted,
            )
        self._held_names = names

    def _decide(self, snap: Snapshot, now: float, wall: float) -> float | None:
        window = self._track(snap, now)
        survivors = survivors_generation(snap, self._world)
        if survivors is not None:
            # a lost lease alone broke the generation: its survivors go on at once, no ready round
            # and no verdict (the new generation tells every member all there is to know)
            return self._publish(
                snap,
                Action(
                    ActionKind.PUBLISH, survivors.reason, record=survivors, expected_revision=snap.generation_revision
                ),
                now,
            )
        if window is None:
            action = None
        else:
            live = self._without_gone(snap, window)
            action = publish_decision(live, window, now, self._world, self._timeouts, wall=wall)
            self._log_hold(snap, action, now)
        closes = join_window_closes_at(snap, window, now, self._world, self._timeouts)
        if self._elected:
            error = action.error if action is not None and action.kind is ActionKind.STATE_LOST else ""
            verdict = judge(snap, self._world, error, join_open=closes is not None, now=wall)
            if verdict is not None and verdict != snap.verdict:  # None: nothing to say (a stale one says nothing)
                self._store.compare_and_put(self._keys.verdict, snap.verdict_revision, encode(verdict))
        if action is None:
            return None
        if action.kind is ActionKind.PUBLISH:
            return self._publish(snap, action, now)
        if closes is not None:  # the members are told of the newcomers when their window closes
            return closes if action.until is None else min(action.until, closes)
        return action.until

    def _publish(self, snap: Snapshot, action: Action, now: float) -> float:
        """Publish ``action.record`` by compare-and-set; returns ``now`` (read again at once: the
        verdict on the new generation, or the winner's record)."""
        assert action.record is not None
        record = replace(action.record, token=secrets.token_hex(16))
        pointer, buckets = encode_generation(record, lambda m: snap.members[m].node)
        won = self._store.compare_and_put(
            self._keys.generation,
            action.expected_revision,
            pointer,  # consumes its members' ready records (wire.snapshot.consumed)
            # its roster (a large generation), the history: in the same transaction
            put_keys={self._keys.roster(record.generation, b): v for b, v in buckets.items()}
            | dict([self._published_event(record)]),
            delete_ranges=[self._keys.rosters_before(record.generation)],
        )
        if won:
            log.info(
                "generation_published",
                generation=record.generation,
                world_size=record.world_size,
                members=list(record.members[:16]),
                cause=action.reason,
                by="coordinator" if self._elected else "deputy",
            )
            self._window = None
            if (
                self._take_over is not None
                and snap.coordinator is not None
                and snap.coordinator.member_id not in record.members
            ):
                # The coordinator did not come to this rendezvous (dead, unrevoked, or stopped):
                # the deputy that published without it takes its place, so the next round
                # (a newcomer, a verdict) does not wait for its lease to end.
                self._take_over(snap.coordinator_revision)
        return now

    def _log_hold(self, snap: Snapshot, action: Action, now: float) -> None:
        """Log a resume held (``resume.resume_held_until``) once per generation."""
        g = snap.generation
        if not action.resume_held or g is None or g.generation == self._held_logged or action.until is None:
            return
        self._held_logged = g.generation
        log.info(
            "resume_held",
            generation=g.generation,
            wait_s=round(action.until - now, 2),
            bound_s=self._timeouts.resume_hold_s,
            by="coordinator" if self._elected else "deputy",
        )

    def _without_gone(self, snap: Snapshot, window: Window) -> Snapshot:
        """``snap`` without the members of the broken generation that have not come to the
        rendezvous and whose host refuses their store port (their process is gone) or, asked by the
        elected coordinator, does not answer within ``probe_s`` (the host is down or cut off)
        (``rendezvous.probe``), or that this member's reach check found so: no last call is held
        for them (``decide.without_gone``). Each is asked once per generation. A deputy asks on the
        training thread, within its own join: it waits ``DEPUTY_PROBE_S`` at most, and a host that
        does not answer that soon keeps its last call."""
        g = snap.generation
        if g is None or window.broken_at is None:
            return snap
        if g.generation != self._probed_generation:
            self._probed, self._probed_generation = {}, g.generation
        noted_generation, noted = self._noted()
        if noted_generation == g.generation:
            for m in noted:
                self._probed.setdefault(m, True)
        missing = missing_members(snap, {r.member_id for r in candidates_of(snap)})
        ask = to_probe(missing, snap.members, self._probed)
        bound = self._timeouts.probe_s if self._elected else min(self._timeouts.probe_s, DEPUTY_PROBE_S)
        got = answers([(r.host, r.store_port) for r in ask], bound) if ask else []
        for rec, answer in zip(ask, got, strict=True):
            gone_now = answer in GONE and (self._elected or answer is Answer.REFUSED)
            self._probed[rec.member_id] = gone_now
            if gone_now:
                why = (
                    "refuses connections"
                    if answer is Answer.REFUSED
                    else f"does not answer within probe_s ({self._timeouts.probe_s:g} s): its host is out of reach"
                )
                log.info(
                    "member_gone",
                    gone=rec.member_id,
                    generation=g.generation,
                    why=f"its store port {rec.host}:{rec.store_port} {why}",
                )
        return without_gone(snap, {m for m in missing if self._probed.get(m)})

    def _track(self, snap: Snapshot, now: float) -> Window | None:
        """The round's window on this clock: when members began to wait, when the set of waiting
        newcomers last changed, when the generation was first seen broken."""
        if not candidates_of(snap):
            self._window, self._newcomers, self._broken_seen = None, frozenset(), 0
            return None
        newcomers = waiting_newcomers(snap)
        window = self._window or Window(entered_at=now, newcomers_changed_at=now)
        if newcomers != self._newcomers:
            window = replace(window, newcomers_changed_at=now)
            self._newcomers = newcomers
        broken = snap.generation.generation if snap.generation and generation_broken(snap) else 0
        if broken != self._broken_seen:
            self._broken_seen = broken
            window = replace(window, broken_at=now if broken else None)
        self._window = window
        return window

    # -- the elected coordinator's thread ------------------------------------------------------

    def start(self) -> None:
        """Watch what can change a round, and run rounds on a thread until ``stop``."""
        self._cancel = [self._store.watch_prefix(p, self._wake.set) for p in self._keys.coordinated]
        self._thread = threading.Thread(target=self._run, name="elasticd-coordinator", daemon=True)
        self._thread.start()
        log.info("coordinator_started", member=self._member_id)

    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for cancel in self._cancel:
            try:
                cancel()
            except EtcdUnavailable:
                pass
        self._cancel = []
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._timeouts.etcd_request_s * 2)

    def _run(self) -> None:
        until: float | None = None
        while not self._stop.is_set():
            self._wake.clear()  # a change during the round makes one more round
            try:
                until = self.round()
            except NotCoordinator as exc:
                log.info("coordinator_stopped", member=self._member_id, now=str(exc) or None)
                break
            except EtcdUnavailable as exc:
                log.warning("coordinator_round_failed", error=str(exc)[:200])
                until = None
            except Exception:  # a defect must not end the job's only coordinator in silence
                log.exception("coordinator_round_crashed")
                until = None
            self._wake.wait(round_wait_s(until, self._window, self._clock(), self._timeouts))
        self._stop.set()


def round_wait_s(until: float | None, window: Window | None, now: float, timeouts: Timeouts) -> float:
    """How long the coordinator waits for a change before its next round: until the time its last
    round named (a join window, a last call; at most ``keepalive_s``), else ``round_poll_s`` while a
    broken generation's rendezvous is open (members are arriving: a late watch event must not hold
    them), else ``view_poll_s``: nothing is due, its watches wake it on every change, and a round
    reads every member's records (at a fleet's size, megabytes). Pure."""
    if until is not None:
        return min(timeouts.keepalive_s, max(0.0, until - now))
    if window is not None and window.broken_at is not None:
        return min(timeouts.keepalive_s, timeouts.round_poll_s)
    return timeouts.view_poll_s


class Seat:
    """One member's seat in the coordinator election: campaign (create ``coordinator`` if absent,
    under the member's lease) when the job has none, run the ``Coordinator`` while the record names
    this member, stop it when it names another or none. Thread-safe (the watcher and the join
    both call ``follow``)."""

    def __init__(
        self, store: KeyValueStore, keys: Keys, record: CoordinatorRecord, new: Callable[[], Coordinator]
    ) -> None:
        self._store = store
        self._keys = keys
        self._record = record
        self._new = new
        self._lock = threading.Lock()
        self._coordinator: Coordinator | None = None
        self._closed = False

    def running(self) -> bool:
        return self._coordinator is not None and self._coordinator.running()

    def follow(self, view: Snapshot, lease: int) -> None:
        """Act on the ``coordinator`` record of ``view``.

        Raises:
            EtcdUnavailable: the campaign could not reach etcd.
        """
        with self._lock:
            if self._closed:
                return
            mine = view.coordinator is not None and view.coordinator.member_id == self._record.member_id
            if view.coordinator is None and lease:
                try:
                    mine = self._store.compare_and_put(self._keys.coordinator, 0, encode(self._record), lease=lease)
                except LeaseLost:
                    return
                if mine:
                    log.info("coordinator_elected", member=self._record.member_id)
            if mine and not self.running():
                self._coordinator = self._new()
                self._coordinator.start()
            elif not mine and self._coordinator is not None:
                self._coordinator.stop()
                self._coordinator = None

    def take_over(self, revision: int, lease: int) -> None:
        """Claim the role from the coordinator whose record is at ``revision`` (by compare-and-set:
        if it changed meanwhile, someone else settled it); the next ``follow`` runs it."""
        with self._lock:
            if self._closed or not lease:
                return
            try:
                if self._store.compare_and_put(self._keys.coordinator, revision, encode(self._record), lease=lease):
                    log.info("coordinator_taken_over", member=self._record.member_id)
            except LeaseLost:
                return

    def stop(self) -> None:
        with self._lock:
            self._closed = True
            if self._coordinator is not None:
                self._coordinator.stop()
                self._coordinator = None
