"""A generation stuck on a host that is gone from the network: noticed by asking, not by waiting
for its lease (``ReachCheck``, and the pure rules ``check_due``, ``is_prober``, ``out_of_reach``,
``verdict``).

A member whose host loses power, panics or is cut off sends nothing more: no reset closes its
peers' connections, so their gradient all_reduce waits, and its lease holds the generation until it
expires (the lease TTL: 2 s at least, 30 s in a large job). Its peers cannot tell it from a slow one
by waiting; but a slow or stopped process's kernel still answers a TCP connect, and a host that is
gone does not. So a member whose all_reduce has waited ``reach_check_s`` (its wait in ``finish``,
the transfer's own tail included) asks the hosts of its generation's members
(``rendezvous.probe.answers``, bounded by ``probe_s``, with a second connect halfway through to a
host still silent: a single lost SYN, which Linux resends only after a second, must not cost a
regroup). If a host does not answer (``UNREACHABLE``) or nothing listens on its port
any more (``REFUSED``), it aborts the generation at once, and the coordinator leaves that member
out of the next one without a last call.

A job whose waits for the sum stay short asks sooner (``reach_after_s``): at ``REACH_WAIT_FACTOR``
times the longest of its last ``RECENT_WAITS`` waits, never before ``reach_check_min_s`` nor after
``reach_check_s``. In the chaos soak's job (waits of a few ms) a host cut off was asked about
after 0.5 s; at four times its longest recent wait the survivors ask after ~0.1 s. A job whose
stragglers make the all_reduce wait is asked about as late as before, so it probes no more often.

Only the coordinator and ranks 0, 1 and 2 of the generation ask (``is_prober``): up to four probers
of N hosts, at ``reach_check_s`` into a wait and then after doubling intervals (``check_due``), so
the cost is O(N) connects per stuck wait for the whole job, O(1) per member, and nothing while the
all_reduce's waits stay within ``reach_check_s``. A prober that finds most hosts silent is more
likely the one cut off: it does nothing and the leases decide (``verdict``); so does a generation
of two whose prober cannot write the abort (it reaches no etcd either). A false alarm costs a
regroup or two (the member comes to the next rendezvous, or rejoins), never a step.

A host that accepts is asked once more, of the member's Python (``rendezvous.answer``): a process
hung with every thread (a C call that holds the GIL) keeps its kernel's accept and, behind its
agent's relay, its lease; one whose Python sends no byte within ``unresponsive_s`` is left out like
one out of reach (``verdict``'s ``hung``), and named in the abort like one: every coordinator
and deputy holds it out for ``reach_hold_s``.

The same holds for the wait of a generation's group build and state sync (``Waiting.build``),
asked about after ``reach_check_s``: a member cut off or hung after the coordinator took it into a
generation, and before the build, held the others there until its lease ended.

The training thread marks its waits (``ReachCheck.began``/``ended``); the ``Membership`` runs the
thread. Never imports etcd3 or torch.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from elasticd.config import Timeouts
from elasticd.errors import ElasticdError
from elasticd.rendezvous.answer import Response, responses
from elasticd.rendezvous.probe import GONE, Answer, answers
from elasticd.retry import Clock
from elasticd.wire.records import MemberRecord
from elasticd.wire.snapshot import Snapshot

log = structlog.get_logger(__name__)

REACH_IDLE_S = 5.0  # the reach thread's sleep with no wait in progress, at most (a wait that begins wakes it)
RECENT_WAITS = 32  # the waits for the sum that set when a reach check asks (reach_after_s)
REACH_WAIT_FACTOR = 4.0  # ... it asks at this many times the longest of them (within its settings)
PROBER_RANKS = 3  # ranks 0, 1 and 2 ask, and the coordinator (is_prober)


@dataclass(frozen=True)
class Waiting:
    """The training thread waits in a collective of ``generation`` since ``since`` (monotonic):
    a step's sum, or (``build``) the generation's group build and state sync, where it waits for
    every member to arrive."""

    generation: int
    since: float
    build: bool = False


@dataclass(frozen=True)
class Checked:
    """The last reach check: the wait it was about, when it was made, and how many checks that
    wait has had."""

    waiting: Waiting
    at: float
    count: int = 1


class Stuck:
    """The training thread's current wait in a collective, read by the reach thread. One attribute
    holding an immutable value: a write and a read never tear. The reach thread sleeps while no wait
    is in progress (``sleep``) and the training thread wakes it when one begins: 1,000 members'
    reach threads looking ten times a second cost this machine ~0.2 s of CPU a second."""

    def __init__(self) -> None:
        self._waiting: Waiting | None = None
        self.last_began: float | None = None  # when the latest wait began (monotonic; None: none yet)
        self._idle = False  # the reach thread sleeps with no wait to watch: began() wakes it
        self._wake = threading.Event()
        self._recent: deque[float] = deque(maxlen=RECENT_WAITS)  # how long the last waits lasted (s) ...
        self._recent_seen: tuple[float, ...] = ()  # ... as the reach thread reads them (one attribute)

    def began(self, generation: int, now: float, build: bool = False) -> None:
        self._waiting = Waiting(generation, now, build)
        self.last_began = now
        if self._idle:  # one attribute read per step; the event only when the reach thread sleeps idle
            self._idle = False
            self._wake.set()

    def ended(self, now: float) -> None:
        waiting = self._waiting
        if waiting is not None and not waiting.build:  # ``recent`` is of the sums' waits
            self._recent.append(now - waiting.since)
            self._recent_seen = tuple(self._recent)
        self._waiting = None

    def current(self) -> Waiting | None:
        return self._waiting

    def recent(self) -> tuple[float, ...]:
        """How long the last ``RECENT_WAITS`` waits lasted, oldest first."""
        return self._recent_seen

    def sleep(self, bound_s: float) -> None:
        """The reach thread's sleep while no wait is in progress: until one begins, ``wake``, or ``bound_s``."""
        self._idle = True
        if self._waiting is None:  # read after the flag is up: a wait begun before it is seen here
            self._wake.wait(bound_s)
        self._idle = False
        self._wake.clear()

    def wake(self) -> None:
        self._wake.set()


def reach_after_s(recent: Sequence[float], min_s: float, max_s: float) -> float:
    """How long a wait for the sum lasts before a reach check asks (what ``check_due`` takes as
    ``reach_check_s``): ``REACH_WAIT_FACTOR`` times the longest of the ``recent`` waits, within
    [``min_s``, ``max_s``]; ``max_s`` until this member has seen ``RECENT_WAITS`` // 2 waits (a new
    member; the history is kept across its generations), and 0 (off) when ``max_s`` is 0. Pure."""
    if max_s <= 0 or len(recent) < RECENT_WAITS // 2:
        return max_s
    return min(max_s, max(min_s, REACH_WAIT_FACTOR * max(recent)))


def ask_after_s(waiting: Waiting | None, recent: Sequence[float], min_s: float, max_s: float) -> float:
    """How long ``waiting`` lasts before a reach check asks: ``max_s`` (``reach_check_s``) for a
    group build and sync, whose length the sums' waits say nothing about; for a step's sum (or no
    wait), ``reach_after_s`` of the ``recent`` sums. Pure."""
    return max_s if waiting is not None and waiting.build else reach_after_s(recent, min_s, max_s)


def reach_sleep_s(
    waiting: Waiting | None, last: Checked | None, now: float, reach_check_s: float, last_began: float | None = None
) -> float | None:
    """How long the reach thread sleeps before it looks again: until the wait in progress is due a
    check (``check_due``). With no wait in progress: ``reach_check_s`` when a wait began within the
    last ``reach_check_s`` (``last_began``: a job whose steps come faster than that; a wait that
    begins meanwhile is not due before the thread looks again, and the training thread wakes no
    thread at each step), else None (it sleeps until a wait begins). None when the check is off.
    Pure."""
    if reach_check_s <= 0:
        return None
    if waiting is None:
        return reach_check_s if last_began is not None and now - last_began < reach_check_s else None
    due = waiting.since + reach_check_s
    if last is not None and last.waiting == waiting:
        due = max(due, last.at + reach_check_s * 2**last.count)
    return max(0.0, due - now)


def check_due(waiting: Waiting | None, last: Checked | None, now: float, reach_check_s: float) -> bool:
    """Whether to ask the generation's hosts now (0: never): a wait has lasted ``reach_check_s``,
    and, if this wait was asked about already, the interval since has doubled with each check
    (``reach_check_s``, 2x, 4x, ...): a host cut off is found at the first, and a long wait for a
    stopped peer (whose lease decides) asks a few times, not every ``reach_check_s``. Pure."""
    if waiting is None or reach_check_s <= 0 or now - waiting.since < reach_check_s:
        return False
    return last is None or last.waiting != waiting or now - last.at >= reach_check_s * 2**last.count


def next_checked(waiting: Waiting, last: Checked | None, now: float) -> Checked:
    """The record of a check of ``waiting`` made at ``now`` after ``last``. Pure."""
    return Checked(waiting, now, last.count + 1 if last is not None and last.waiting == waiting else 1)


def is_prober(rank: int, coordinator: bool) -> bool:
    """Whether this member asks: the coordinator, and ranks 0 to ``PROBER_RANKS`` - 1 (a deputy
    tier: they cover a coordinator that is itself the member gone or hung, and a second prober cut
    off while the first is that member). Pure."""
    return coordinator or 0 <= rank < PROBER_RANKS


def out_of_reach(members: Sequence[str], answers: Sequence[Answer]) -> list[str]:
    """The members whose host did not answer or whose port is closed, in the order given. Pure."""
    return [m for m, a in zip(members, answers, strict=True) if a in GONE]


@dataclass(frozen=True)
class Verdict:
    """What a reach check makes of its answers (``verdict``)."""

    abort: bool
    why: str


def _names(members: Sequence[str]) -> str:
    return f"{list(members[:8])}{f' and {len(members) - 8} more' if len(members) > 8 else ''}"


def verdict(
    asked: Sequence[str], gone: Sequence[str], unreachable: int, still_waiting: bool, hung: Sequence[str] = ()
) -> Verdict:
    """Whether to abort the generation after asking the hosts of ``asked``: ``gone`` did not answer
    or refused (``unreachable`` of them did not answer), ``hung`` answered but their Python did not
    (``rendezvous.answer``), and whether the collective still waits. Pure.

    Not when all answered, or the wait ended meanwhile; nor when more than half of several members
    asked are silent or hung: a prober cut off itself sees every host silent, and a majority gone
    or hung at once (a stall of every host) is left to the leases and ``collective_s``."""
    if not gone and not hung:
        return Verdict(False, "every host answered")
    if not still_waiting:
        return Verdict(False, "the collective finished meanwhile")
    quiet = unreachable + len(hung)
    if len(asked) > 1 and 2 * quiet > len(asked):
        return Verdict(
            False, f"{quiet} of {len(asked)} members do not answer: this one is likely cut off; the leases decide"
        )
    why = []
    if gone:
        why.append(f"members out of reach: {_names(gone)} (their hosts do not answer or their processes are gone)")
    if hung:
        why.append(f"members unresponsive: {_names(hung)} (their hosts answer, their Python does not: hung)")
    return Verdict(True, "; ".join(why))


class ReachCheck:
    """The reach thread of one member (``run``): while this member is a prober of the generation it
    waits in, ask that generation's hosts, and abort it when one is out of reach (``verdict``).
    Reads the job's member records once per generation, at its first check."""

    def __init__(
        self,
        member_id: str,
        timeouts: Timeouts,
        clock: Clock,
        read: Callable[[], Snapshot],
        abort_now: Callable[[int, str, tuple[str, ...]], bool | None],
        coordinator: Callable[[], bool],
        abandoned: Callable[[], bool],
    ) -> None:
        self._member_id = member_id
        self._timeouts = timeouts
        self._clock = clock
        self._read = read  # the whole job (a full reader's snapshot)
        self._abort_now = abort_now  # one write, never retried later
        self._coordinator = coordinator
        self._abandoned = abandoned  # the generation is being left already
        self._stuck = Stuck()  # written by the training thread
        self._rank = (0, -1)  # (generation, this member's rank in it), as last joined
        self._records: tuple[int, list[MemberRecord]] = (0, [])  # the members asked about, per generation
        self._unasked_logged = 0  # the generation whose unaskable addresses were logged
        # the last finding, (generation, members): this member's coordinator and deputy rounds leave
        # them out without asking again
        self.out_of_reach: tuple[int, frozenset[str]] = (0, frozenset())

    def began(self, generation: int, build: bool = False) -> None:
        """The training thread waits for a collective of ``generation`` from now on; ``build``: for
        the generation's group build and state sync, asked about after ``reach_check_s`` (a step's
        sum: after ``reach_after_s`` of the recent sums)."""
        self._stuck.began(generation, self._clock(), build)

    def ended(self) -> None:
        self._stuck.ended(self._clock())

    def joined(self, generation: int, rank: int) -> None:
        self._rank = (generation, rank)

    def wake(self) -> None:
        """End the reach thread's idle sleep (its member closes)."""
        self._stuck.wake()

    def run(self, stop: threading.Event) -> None:
        last: Checked | None = None
        while not stop.is_set():
            waiting, now = self._stuck.current(), self._clock()
            t = self._timeouts
            after = ask_after_s(waiting, self._stuck.recent(), t.reach_check_min_s, t.reach_check_s)
            if not check_due(waiting, last, now, after):
                wait_s = reach_sleep_s(waiting, last, now, after, self._stuck.last_began)
                if wait_s is None:
                    self._stuck.sleep(REACH_IDLE_S)
                else:
                    stop.wait(wait_s)
                continue
            assert waiting is not None
            last = next_checked(waiting, last, now)
            generation, rank = self._rank
            if waiting.generation != generation or self._abandoned() or not is_prober(rank, self._coordinator()):
                continue
            try:
                self.check(waiting)
            except (ElasticdError, OSError) as exc:  # an etcd outage, a refusal, no descriptors: next time
                log.warning("reach_check_failed", generation=waiting.generation, error=str(exc)[:200])

    def _still_waiting(self, waiting: Waiting) -> bool:
        return self._stuck.current() == waiting and not self._abandoned()

    def check(self, waiting: Waiting) -> Verdict:
        """Ask the hosts of the generation ``waiting`` is in; abort it if the verdict says so.

        Raises:
            EtcdUnavailable: the job could not be read, or the abort not written.
        """
        g = waiting.generation
        if self._records[0] != g:
            snap = self._read()
            if snap.generation is None or snap.generation.generation != g:
                return Verdict(False, "superseded meanwhile")  # the watcher says so
            self._records = (
                g,
                [snap.members[m] for m in snap.generation.members if m in snap.members and m != self._member_id],
            )
        records = self._records[1]
        started = self._clock()
        ids = [r.member_id for r in records]
        first = answers([(r.host, r.store_port) for r in records], self._timeouts.probe_s, self._clock)
        if Answer.UNASKED in first and self._unasked_logged != g:
            self._unasked_logged = g
            log.warning(
                "reach_check_unaskable",
                generation=g,
                why="not a numeric address (advertise_addr)",
                members=[m for m, a in zip(ids, first, strict=True) if a is Answer.UNASKED][:8],
            )
        gone = out_of_reach(ids, first)
        silent = tuple(m for m, a in zip(ids, first, strict=True) if a is Answer.UNREACHABLE)
        unreachable = len(silent)
        hung: list[str] = []
        would = verdict(ids, gone, unreachable, True)  # were the wait still on
        if not would.abort and self._still_waiting(waiting):
            hung = self._hung(records, first)
            if hung:
                would = verdict(ids, gone, unreachable, True, hung)
        if would.abort:
            # noted before the abort is written: the members learn the abort at once, and this
            # member's rendezvous (its coordinator, or its deputy rounds) must know them gone by then
            # (also when another prober's abort ended the wait first)
            self.out_of_reach = (g, frozenset(gone) | frozenset(hung))
        v = verdict(ids, gone, unreachable, self._still_waiting(waiting), hung)
        log.info(
            "reach_checked",
            generation=g,
            asked=len(ids),
            out_of_reach=gone[:8],
            unresponsive=hung[:8],
            abort=v.abort,
            why=v.why,
            waited_s=round(started - waiting.since, 3),
            took_s=round(self._clock() - started, 3),
        )
        if not v.abort:
            return v
        written = self._abort_now(g, v.why, silent + tuple(hung))
        log.warning("members_out_of_reach", generation=g, gone=gone[:8], hung=hung[:8], aborted=written is True)
        return v

    def _hung(self, records: Sequence[MemberRecord], first: Sequence[Answer]) -> list[str]:
        """The members whose host accepted but whose Python sent no byte within ``unresponsive_s``
        (``rendezvous.answer``); none asked when that is 0 or a member has no answer port."""
        bound = self._timeouts.unresponsive_s
        ask = [r for r, a in zip(records, first, strict=True) if a is Answer.ACCEPTED and r.answer_port > 0]
        if bound <= 0 or not ask:
            return []
        got = responses([(r.host, r.answer_port) for r in ask], bound)
        return [r.member_id for r, x in zip(ask, got, strict=True) if x is Response.SILENT]
