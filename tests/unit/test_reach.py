"""``rendezvous.reach``: when a stuck member asks its generation's hosts, who asks, and what the
answers make of the members (tables); the executor against real sockets on loopback (a host gone
from the network stands as a port whose accept queue is full: the kernel drops the SYN)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest

from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable
from elasticd.rendezvous.answer import Answerer
from elasticd.rendezvous.probe import Answer
from elasticd.rendezvous.reach import (
    Checked,
    ReachCheck,
    Stuck,
    ask_after_s,
    Waiting,
    check_due,
    is_prober,
    next_checked,
    RECENT_WAITS,
    out_of_reach,
    reach_after_s,
    reach_sleep_s,
    verdict,
)
from elasticd.wire.records import GenerationRecord, MemberRecord
from elasticd.wire.snapshot import Snapshot

W = Waiting(generation=7, since=100.0)


@pytest.mark.parametrize(
    ("waiting", "last", "now", "check_s", "due"),
    [
        (None, None, 200.0, 0.5, False),  # not in a collective
        (W, None, 100.4, 0.5, False),  # a short wait (the usual all_reduce)
        (W, None, 100.5, 0.5, True),  # waited reach_check_s: ask
        (W, Checked(W, 100.5), 101.4, 0.5, False),  # asked about this wait just now
        (W, Checked(W, 100.5), 101.5, 0.5, True),  # ... again 2 x reach_check_s later
        (W, Checked(W, 101.5, 2), 103.4, 0.5, False),  # ... then 4 x: a long wait asks a few times
        (W, Checked(W, 101.5, 2), 103.5, 0.5, True),
        (W, Checked(Waiting(7, 90.0), 95.0), 100.5, 0.5, True),  # an earlier wait's check says nothing
        (W, Checked(Waiting(6, 100.0), 100.5), 100.6, 0.5, True),  # nor one of another generation
        (W, None, 1000.0, 0.0, False),  # off
    ],
)
def test_check_due(waiting: Waiting | None, last: Checked | None, now: float, check_s: float, due: bool) -> None:
    assert check_due(waiting, last, now, check_s) is due


@pytest.mark.parametrize(
    ("rank", "coordinator", "asks"),
    [
        (0, False, True),
        (1, False, True),
        (2, False, True),
        (3, False, False),
        (57, False, False),
        (57, True, True),
        (-1, False, False),
    ],
)
def test_only_the_coordinator_and_ranks_0_to_2_ask(rank: int, coordinator: bool, asks: bool) -> None:
    assert is_prober(rank, coordinator) is asks


A, R, U, N = Answer.ACCEPTED, Answer.REFUSED, Answer.UNREACHABLE, Answer.UNASKED


@pytest.mark.parametrize(
    ("got", "gone"),
    [
        ([A, A, A], []),  # every host answers: a slow or stopped peer, its lease decides
        ([A, U, A], ["b"]),  # a host gone from the network
        ([R, A, U], ["a", "c"]),  # a process gone, a host gone
        ([N, N, N], []),  # no numeric address: nothing is decided
    ],
)
def test_out_of_reach(got: list[Answer], gone: list[str]) -> None:
    assert out_of_reach(["a", "b", "c"], got) == gone


def test_out_of_reach_needs_an_answer_per_member() -> None:
    with pytest.raises(ValueError):
        out_of_reach(["a", "b"], [A])


WS = Waiting(3, 10.0)


@pytest.mark.parametrize(
    ("waiting", "last", "now", "check_s", "sleep_s", "began"),
    [
        (None, None, 10.0, 0.5, None, None),  # no wait in progress, none ever: sleep until one begins
        (None, None, 10.0, 0.5, None, 9.4),  # the last wait began longer ago than reach_check_s
        (None, None, 10.0, 0.5, 0.5, 9.8),  # a job stepping faster: look again after reach_check_s
        (None, None, 10.0, 0.0, None, 9.8),  # the check is off
        (WS, None, 10.0, 0.0, None, 10.0),  # the check is off
        (WS, None, 10.1, 0.5, 0.4, 10.0),  # until the wait has lasted reach_check_s
        (WS, None, 11.0, 0.5, 0.0, 10.0),  # due already
        (WS, Checked(WS, 10.5, 1), 10.6, 0.5, 0.9, 10.0),  # asked once: again reach_check_s x 2 after
        (WS, Checked(WS, 11.5, 2), 11.5, 0.5, 2.0, 10.0),  # asked twice: x 4
        (WS, Checked(Waiting(3, 9.0), 9.5, 3), 10.2, 0.5, 0.3, 10.0),  # the last check was of another wait
    ],
)
def test_reach_sleep_s(
    waiting: Waiting | None,
    last: Checked | None,
    now: float,
    check_s: float,
    sleep_s: float | None,
    began: float | None,
) -> None:
    got = reach_sleep_s(waiting, last, now, check_s, began)
    assert got == (None if sleep_s is None else pytest.approx(sleep_s))
    if waiting is not None and got is not None and got > 0:  # it wakes exactly when check_due turns
        assert not check_due(waiting, last, now + got - 1e-6, check_s) and check_due(waiting, last, now + got, check_s)
    if waiting is None and got is not None:  # a wait that begins meanwhile is not due before it looks
        assert not check_due(Waiting(3, now), None, now + got - 1e-6, check_s)


def test_the_idle_reach_thread_is_woken_by_a_wait_that_begins_and_by_wake() -> None:
    stuck = Stuck()
    woke: list[float] = []

    def sleeper() -> None:
        t0 = time.monotonic()
        stuck.sleep(5.0)
        woke.append(time.monotonic() - t0)

    for poke in (lambda: stuck.began(1, time.monotonic()), stuck.wake):
        stuck.ended(time.monotonic())
        t = threading.Thread(target=sleeper)
        t.start()
        time.sleep(0.1)  # asleep by now
        poke()
        t.join(2.0)
        assert woke and woke[-1] < 1.0
    stuck.began(2, time.monotonic())  # a wait in progress: no sleep at all
    t0 = time.monotonic()
    stuck.sleep(5.0)
    assert time.monotonic() - t0 < 0.5


def test_stuck_holds_the_current_wait() -> None:
    s = Stuck()
    assert s.current() is None
    s.began(3, 10.0)
    assert s.current() == Waiting(3, 10.0)
    s.began(4, 11.0)
    assert s.current() == Waiting(4, 11.0)
    s.ended(11.25)
    assert s.current() is None
    assert s.recent() == (0.25,)  # how long it lasted
    s.ended(12.0)  # no wait in progress: nothing recorded
    assert s.recent() == (0.25,)
    for i in range(RECENT_WAITS + 5):
        s.began(5, 20.0 + i)
        s.ended(20.0 + i + 0.01 * i)
    assert len(s.recent()) == RECENT_WAITS and s.recent()[-1] == pytest.approx(0.01 * (RECENT_WAITS + 4))
    before = s.recent()
    s.began(6, 100.0, build=True)  # a group build and sync: a wait like the others ...
    assert s.current() == Waiting(6, 100.0, build=True)
    s.ended(103.0)
    assert s.current() is None and s.recent() == before  # ... that does not set when the sums are asked about


SHORT = [0.01] * RECENT_WAITS


@pytest.mark.parametrize(
    ("waiting", "recent", "after_s"),
    [
        (Waiting(3, 0.0), SHORT, 0.1),  # a sum, in a job of short sums: early
        (Waiting(3, 0.0, build=True), SHORT, 0.5),  # a build: reach_check_s, whatever the sums did
        (Waiting(3, 0.0, build=True), [], 0.5),
        (None, SHORT, 0.1),  # no wait: as for a sum (the thread's sleep)
        (Waiting(3, 0.0), [], 0.5),  # a new member's sum: reach_check_s
    ],
)
def test_ask_after_s(waiting: Waiting | None, recent: list[float], after_s: float) -> None:
    assert ask_after_s(waiting, recent, 0.1, 0.5) == pytest.approx(after_s)


@pytest.mark.parametrize(
    ("recent", "min_s", "max_s", "after_s"),
    [
        ([], 0.1, 0.5, 0.5),  # nothing seen yet: the setting
        ([0.01] * (RECENT_WAITS // 2 - 1), 0.1, 0.5, 0.5),  # too few waits seen (a new generation's first steps)
        (SHORT, 0.1, 0.5, 0.1),  # short waits: at the floor
        ([*SHORT[1:], 0.03], 0.1, 0.5, 0.12),  # four times the longest recent wait
        ([*SHORT[1:], 0.3], 0.1, 0.5, 0.5),  # a straggler's long wait: no earlier than the setting
        (SHORT, 0.1, 0.0, 0.0),  # off stays off
        (SHORT, 0.5, 0.5, 0.5),  # the floor at the setting: as before
    ],
)
def test_a_job_whose_waits_stay_short_asks_sooner(
    recent: list[float], min_s: float, max_s: float, after_s: float
) -> None:
    """A host cut off from a job whose waits are a few ms is asked about at four times the longest
    recent wait (within the settings), not only after reach_check_s."""
    assert reach_after_s(recent, min_s, max_s) == pytest.approx(after_s)


def test_next_checked_counts_the_checks_of_one_wait() -> None:
    first = next_checked(W, None, 100.5)
    assert first == Checked(W, 100.5, 1)
    assert next_checked(W, first, 101.5) == Checked(W, 101.5, 2)
    other = Waiting(7, 200.0)
    assert next_checked(other, Checked(W, 101.5, 2), 200.5) == Checked(other, 200.5, 1)


@pytest.mark.parametrize(
    ("asked", "gone", "unreachable", "waiting", "abort"),
    [
        (["b", "c", "d"], [], 0, True, False),  # every host answered
        (["b", "c", "d"], ["c"], 1, True, True),  # one host gone from the network
        (["b", "c", "d"], ["c"], 0, True, True),  # one process gone (its port refuses)
        (["b", "c", "d"], ["c"], 1, False, False),  # the all_reduce finished meanwhile
        (["b", "c", "d"], ["b", "c"], 2, True, False),  # most silent: this host is likely the one cut off
        (["b", "c", "d"], ["b", "c"], 0, True, True),  # two processes gone: their ports refuse
        (["b", "c", "d", "e"], ["b", "c"], 2, True, True),  # half is not most
        (["b"], ["b"], 1, True, True),  # a generation of two: the abort's write decides
    ],
)
def test_verdict(asked: list[str], gone: list[str], unreachable: int, waiting: bool, abort: bool) -> None:
    v = verdict(asked, gone, unreachable, waiting)
    assert v.abort is abort
    if abort:
        assert all(m in v.why for m in gone)


@pytest.mark.parametrize(
    ("asked", "gone", "unreachable", "hung", "waiting", "abort"),
    [
        (["b", "c", "d"], [], 0, ["c"], True, True),  # one process hung: its host answers, its Python not
        (["b"], [], 0, ["b"], True, True),  # a generation of two
        (["b", "c", "d"], [], 0, ["c"], False, False),  # the all_reduce finished meanwhile (it was slow)
        (["b", "c", "d"], [], 0, ["b", "c"], True, False),  # most hung at once: a stall of every host
        (["b", "c", "d"], ["b"], 1, ["c"], True, False),  # one silent and one hung: most do not answer
        (["b", "c", "d", "e"], ["b"], 0, ["c"], True, True),  # one gone (refused), one hung
    ],
)
def test_verdict_on_hung_members(
    asked: list[str], gone: list[str], unreachable: int, hung: list[str], waiting: bool, abort: bool
) -> None:
    v = verdict(asked, gone, unreachable, waiting, hung)
    assert v.abort is abort
    if abort:
        assert all(m in v.why for m in [*gone, *hung]) and "unresponsive" in v.why


# -- the executor, against real sockets on loopback ----------------------------------------------


class _Job:
    """What a ``ReachCheck`` reads and writes, recorded: the job's members on real ports."""

    def __init__(self, ports: dict[str, int], generation: int = 7) -> None:
        self.members = {m: MemberRecord(m, m, 0, 1, "127.0.0.1", p, "s") for m, p in ports.items()}
        self.record = GenerationRecord(generation, tuple(ports), "127.0.0.1", 1, "s", 0, "start")
        self.reads = 0
        self.aborts: list[tuple[int, str]] = []
        self.silent: list[tuple[str, ...]] = []  # the members each abort names as out of reach
        self.etcd_down = False
        self.abandoned = False

    def read(self) -> Snapshot:
        self.reads += 1
        return Snapshot(generation=self.record, members=self.members)

    def abort_now(self, generation: int, why: str, out_of_reach: tuple[str, ...]) -> bool | None:
        if self.etcd_down:
            raise EtcdUnavailable("etcd did not answer")
        self.aborts.append((generation, why))
        self.silent.append(out_of_reach)
        return True

    def check(self, rank: int = 0, coordinator: bool = False, **timeouts: float) -> ReachCheck:
        rc = ReachCheck(
            "a",
            Timeouts(probe_s=0.2, **timeouts),
            time.monotonic,
            self.read,
            self.abort_now,
            lambda: coordinator,
            lambda: self.abandoned,
        )
        rc.joined(self.record.generation, rank)
        return rc


@contextmanager
def _hosts(*kinds: str) -> Iterator[dict[str, int]]:
    """A port per kind: ``live`` (listening), ``silent`` (a full accept queue: the kernel drops
    every SYN, as a host gone from the network answers nothing), ``gone`` (nothing listens)."""
    socks: list[socket.socket] = []
    ports: dict[str, int] = {}
    try:
        for i, kind in enumerate(kinds):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if kind == "live":
                s.listen(16)
            elif kind == "silent":
                s.listen(0)
                filler = socket.socket()
                socks.append(filler)
                filler.connect(("127.0.0.1", port))
            ports[f"{kind}{i}"] = port
        yield ports
    finally:
        for s in socks:
            s.close()


def _waiting(rc: ReachCheck, job: _Job) -> Waiting:
    rc.began(job.record.generation)
    w = rc._stuck.current()
    assert w is not None
    return w


def test_a_silent_host_gets_the_generation_aborted_and_is_noted() -> None:
    with _hosts("live", "silent", "live") as ports:
        job = _Job({"a": 1, **ports})
        rc = job.check()
        v = rc.check(_waiting(rc, job))
        assert v.abort and job.aborts and job.aborts[0][0] == 7 and "silent1" in job.aborts[0][1]
        assert rc.out_of_reach == (7, frozenset({"silent1"}))  # for this member's coordinator or deputy rounds
        assert job.silent == [("silent1",)]  # named in the abort: every coordinator holds it out (reach_hold_s)
        rc.check(_waiting(rc, job))
        assert job.reads == 1  # the members' records are read once per generation


def test_a_closed_port_is_a_process_gone_and_aborts_too() -> None:
    with _hosts("live", "gone") as ports:
        job = _Job({"a": 1, **ports})
        rc = job.check()
        assert rc.check(_waiting(rc, job)).abort and rc.out_of_reach == (7, frozenset({"gone1"}))
        assert job.silent == [()]  # a process gone, not a host out of reach: nobody is held out for it


@pytest.mark.parametrize("case", ["all answer", "wait ended", "abandoned", "most silent", "superseded"])
def test_nothing_is_aborted(case: str) -> None:
    kinds = (
        ("silent", "silent", "live")
        if case == "most silent"
        else ("live", "live")
        if case == "all answer"
        else ("live", "silent", "live")
    )
    with _hosts(*kinds) as ports:
        job = _Job({"a": 1, **ports})
        rc = job.check()
        w = _waiting(rc, job)
        if case == "wait ended":
            rc.ended()
        elif case == "abandoned":
            job.abandoned = True
        elif case == "superseded":
            job.record = GenerationRecord(8, job.record.members, "127.0.0.1", 1, "s", 0, "aborted")
        v = rc.check(w)
        assert not v.abort and job.aborts == [], v
        # what was found still counts for this member's rendezvous when another prober's abort, or
        # the end of the wait, came first; a majority silent or nobody silent notes nothing
        assert rc.out_of_reach == (
            (7, frozenset({"silent1"})) if case in ("wait ended", "abandoned") else (0, frozenset())
        )


def test_a_prober_that_cannot_write_the_abort_fails_the_check() -> None:
    with _hosts("live", "silent", "live") as ports:
        job = _Job({"a": 1, **ports})
        job.etcd_down = True
        rc = job.check()
        with pytest.raises(EtcdUnavailable):
            rc.check(_waiting(rc, job))
        assert job.aborts == []


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("rank", "coordinator", "asks"), [(0, False, True), (3, True, True), (3, False, False)])
def test_the_thread_asks_only_as_a_prober_of_a_long_wait(rank: int, coordinator: bool, asks: bool) -> None:
    with _hosts("live", "silent", "live") as ports:
        job = _Job({"a": 1, **ports})
        rc = job.check(rank=rank, coordinator=coordinator, reach_check_s=0.2)
        stop = threading.Event()
        t = threading.Thread(target=rc.run, args=(stop,), daemon=True)
        t.start()
        try:
            rc.began(7)
            deadline = time.monotonic() + 5
            while not job.aborts and time.monotonic() < deadline and (asks or time.monotonic() < deadline - 4):
                time.sleep(0.05)
        finally:
            stop.set()
            t.join(5)
        assert bool(job.aborts) is asks and job.reads == int(asks)


def test_reach_check_min_s_is_at_most_reach_check_s() -> None:
    from elasticd.errors import ConfigError

    Timeouts(reach_check_s=0.5, reach_check_min_s=0.5)
    Timeouts(reach_check_s=0.0, reach_check_min_s=0.1)  # the check off: the floor says nothing
    with pytest.raises(ConfigError, match="reach_check_min_s"):
        Timeouts(reach_check_s=0.5, reach_check_min_s=0.6)


def test_a_member_whose_host_accepts_but_whose_python_is_silent_is_left_out_as_hung() -> None:
    live = Answerer("127.0.0.1")
    live.start()
    mute = socket.socket()  # its kernel accepts; its Python sends nothing (a process hung holding the GIL)
    mute.bind(("127.0.0.1", 0))
    mute.listen(4)
    try:
        with _hosts("live", "live") as ports:
            job = _Job({"a": 1, **ports})
            hung, ok = list(ports)
            job.members[hung] = replace(job.members[hung], answer_port=mute.getsockname()[1])
            job.members[ok] = replace(job.members[ok], answer_port=live.port)
            rc = job.check(unresponsive_s=0.3)
            started = time.monotonic()
            v = rc.check(_waiting(rc, job))
            assert v.abort and hung in v.why and ok not in v.why and "unresponsive" in v.why
            assert 0.3 <= time.monotonic() - started < 2.0
            assert rc.out_of_reach == (7, frozenset({hung}))  # left out by this member's rounds at once
            assert job.silent == [(hung,)]  # named in the abort: every coordinator holds it out (reach_hold_s)

            job.aborts.clear()
            for off in (job.check(unresponsive_s=0.0), job.check(unresponsive_s=0.3)):
                if off._timeouts.unresponsive_s > 0:
                    job.members[hung] = replace(job.members[hung], answer_port=live.port)  # it answers now
                assert not off.check(_waiting(off, job)).abort  # not asked (0), or every member answered
            assert job.aborts == []
    finally:
        live.close(2.0)
        mute.close()
