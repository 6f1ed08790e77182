"""A generation stuck on a host that is gone from the network: noticed by asking, not by waiting
for its lease (``Stuck``, and the pure rules ``check_due``, ``is_prober``, ``out_of_reach``).

A member whose host loses power, panics or is cut off sends nothing more: no reset closes its
peers' connections, so their collective waits, and its lease holds the generation until it expires
(the lease TTL: 2 s at least, 30 s in a large job). Its peers cannot tell it from a slow one by
waiting; but a slow or stopped process's kernel still answers a TCP connect, and a host that is
gone does not. So a member whose collective has waited ``reach_check_s`` asks the hosts of its
generation's members (``rendezvous.probe.answers``, bounded by ``probe_s``): if one does not answer
(``UNREACHABLE``) or nothing listens on its port any more (``REFUSED``), it aborts the generation
at once, and the coordinator leaves that member out of the next one without a last call.

Only the coordinator and ranks 0 and 1 of the generation ask (``is_prober``): up to three probers
of N hosts, at ``reach_check_s`` into a wait and then at doubling intervals (``check_due``), so the
cost is O(N) connects per stuck wait for the whole job, O(1) per member, and nothing while steps
finish within ``reach_check_s``. A prober that is itself the one cut off reaches
nobody, etcd included, so its abort is never written (one attempt, no retry). A false alarm (a lost
SYN) costs one regroup, never a step: every member that is alive comes to the rendezvous.

The executor is ``ReachCheck``, run on a thread of the ``Membership``; the training thread marks
its waits (``Stuck.began``/``ended``). Never imports etcd3 or torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable
from elasticd.rendezvous.probe import Answer, answers
from elasticd.retry import Clock
from elasticd.wire.records import MemberRecord
from elasticd.wire.snapshot import Snapshot

log = structlog.get_logger(__name__)

REACH_POLL_MAX_S = 0.1  # how often the reach thread looks at the training thread's wait, at most


@dataclass(frozen=True)
class Waiting:
    """The training thread waits in a collective of ``generation`` since ``since`` (monotonic)."""

    generation: int
    since: float


@dataclass(frozen=True)
class Checked:
    """The last reach check: the wait it was about, when it was made, and how many checks that
    wait has had."""

    waiting: Waiting
    at: float
    count: int = 1


class Stuck:
    """The training thread's current wait in a collective, read by the reach thread. One attribute
    holding an immutable value: a write and a read never tear."""

    def __init__(self) -> None:
        self._waiting: Waiting | None = None

    def began(self, generation: int, now: float) -> None:
        self._waiting = Waiting(generation, now)

    def ended(self) -> None:
        self._waiting = None

    def current(self) -> Waiting | None:
        return self._waiting


def check_due(waiting: Waiting | None, last: Checked | None, now: float, reach_check_s: float) -> bool:
    """Whether to ask the generation's hosts now (0: never): a wait has lasted ``reach_check_s``,
    and, if this wait was asked about already, the interval since has doubled with each check
    (``reach_check_s``, 2x, 4x, ...): a host cut off is found at the first, and a long wait for a
    stopped peer (whose lease decides) asks a few times, not every ``reach_check_s``. Pure."""
    if waiting is None or reach_check_s <= 0 or now - waiting.since < reach_check_s:
        return False
    return last is None or last.waiting != waiting or now - last.at >= reach_check_s * 2 ** last.count


def next_checked(waiting: Waiting, last: Checked | None, now: float) -> Checked:
    """The record of a check of ``waiting`` made at ``now`` after ``last``. Pure."""
    return Checked(waiting, now, last.count + 1 if last is not None and last.waiting == waiting else 1)


def is_prober(rank: int, coordinator: bool) -> bool:
    """Whether this member asks: the coordinator, and ranks 0 and 1 (a deputy tier: they cover a
    coordinator that is itself the host gone). Pure."""
    return coordinator or rank in (0, 1)


def out_of_reach(members: Sequence[str], answers: Sequence[Answer]) -> list[str]:
    """The members whose host did not answer or whose port is closed, in the order given. Pure."""
    return [m for m, a in zip(members, answers, strict=True) if a in (Answer.UNREACHABLE, Answer.REFUSED)]


def reach_poll_s(reach_check_s: float) -> float:
    """How often the reach thread looks at the wait: a fraction of ``reach_check_s``. Pure."""
    return min(REACH_POLL_MAX_S, reach_check_s / 4) if reach_check_s > 0 else REACH_POLL_MAX_S


class ReachCheck:
    """The reach thread of one member (``run``): while this member is a prober of the generation it
    waits in, ask that generation's hosts every ``reach_check_s`` of a wait, and abort it when one
    is out of reach. Reads the job's member records once per generation."""

    def __init__(self, member_id: str, timeouts: Timeouts, clock: Clock, read: Callable[[], Snapshot],
                 abort_now: Callable[[int, str], bool | None],
                 note_gone: Callable[[int, frozenset[str]], None],
                 coordinator: Callable[[], bool], abandoned: Callable[[], bool]) -> None:
        self._member_id = member_id
        self._timeouts = timeouts
        self._clock = clock
        self._read = read  # the whole job (a full reader's snapshot)
        self._abort_now = abort_now  # one attempt: a prober cut off itself must not write it later
        self._note_gone = note_gone  # to this member's coordinator, if it runs one
        self._coordinator = coordinator
        self._abandoned = abandoned  # the generation is being left already
        self.stuck = Stuck()  # written by the training thread
        self._rank = (0, -1)  # (generation, this member's rank in it), as last joined
        self._records: tuple[int, list[MemberRecord]] = (0, [])  # the members asked about, per generation
        # the last finding, (generation, members): a deputy's rounds leave them out without asking again
        self.out_of_reach: tuple[int, frozenset[str]] = (0, frozenset())

    def joined(self, generation: int, rank: int) -> None:
        self._rank = (generation, rank)

    def run(self, stop: threading.Event) -> None:
        last: Checked | None = None
        every_s = reach_poll_s(self._timeouts.reach_check_s)
        while not stop.wait(every_s):
            waiting, now = self.stuck.current(), self._clock()
            if not check_due(waiting, last, now, self._timeouts.reach_check_s):
                continue
            assert waiting is not None
            last = next_checked(waiting, last, now)
            generation, rank = self._rank
            if waiting.generation != generation or self._abandoned() or not is_prober(rank, self._coordinator()):
                continue
            try:
                self.check(waiting)
            except EtcdUnavailable as exc:
                log.warning("reach_check_failed", generation=waiting.generation, error=str(exc)[:200])

    def check(self, waiting: Waiting) -> None:
        """Ask the hosts of the generation ``waiting`` is in; abort it if one is out of reach.

        Raises:
            EtcdUnavailable: the job could not be read, or the abort not written.
        """
        g = waiting.generation
        if self._records[0] != g:
            snap = self._read()
            if snap.generation is None or snap.generation.generation != g:
                return  # superseded meanwhile: the watcher says so
            self._records = (g, [snap.members[m] for m in snap.generation.members
                                 if m in snap.members and m != self._member_id])
        records = self._records[1]
        started = self._clock()
        ids = [r.member_id for r in records]
        gone = out_of_reach(ids, answers([(r.host, r.store_port) for r in records], self._timeouts.probe_s))
        log.info("reach_checked", generation=g, asked=len(ids), out_of_reach=gone[:8],
                 waited_s=round(started - waiting.since, 3), took_s=round(self._clock() - started, 3))
        if not gone or self.stuck.current() != waiting:
            return  # all answered, or the collective finished meanwhile
        self.out_of_reach = (g, frozenset(gone))
        self._note_gone(*self.out_of_reach)
        more = f" and {len(gone) - 8} more" if len(gone) > 8 else ""
        written = self._abort_now(g, f"members out of reach: {gone[:8]}{more} (their hosts do not answer "
                                  f"or their processes are gone)")
        log.warning("members_out_of_reach", generation=g, gone=gone[:8], aborted=written is True)
