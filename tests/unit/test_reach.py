"""``rendezvous.reach``: when a stuck member asks its generation's hosts, who asks, and what the
answers make of the members (tables)."""

from __future__ import annotations

import pytest

from elasticd.rendezvous.probe import Answer
from elasticd.rendezvous.reach import (
    REACH_POLL_MAX_S,
    Checked,
    Stuck,
    Waiting,
    check_due,
    is_prober,
    next_checked,
    out_of_reach,
    reach_poll_s,
)

W = Waiting(generation=7, since=100.0)


@pytest.mark.parametrize(("waiting", "last", "now", "check_s", "due"), [
    (None, None, 200.0, 0.5, False),                           # not in a collective
    (W, None, 100.4, 0.5, False),                              # a short wait (the usual all_reduce)
    (W, None, 100.5, 0.5, True),                               # waited reach_check_s: ask
    (W, Checked(W, 100.5), 101.4, 0.5, False),                 # asked about this wait just now
    (W, Checked(W, 100.5), 101.5, 0.5, True),                  # ... again 2 x reach_check_s later
    (W, Checked(W, 101.5, 2), 103.4, 0.5, False),              # ... then 4 x: a long wait asks a few times
    (W, Checked(W, 101.5, 2), 103.5, 0.5, True),
    (W, Checked(Waiting(7, 90.0), 95.0), 100.5, 0.5, True),    # an earlier wait's check says nothing
    (W, Checked(Waiting(6, 100.0), 100.5), 100.6, 0.5, True),  # nor one of another generation
    (W, None, 1000.0, 0.0, False),                             # off
])
def test_check_due(waiting: Waiting | None, last: Checked | None, now: float, check_s: float, due: bool) -> None:
    assert check_due(waiting, last, now, check_s) is due


@pytest.mark.parametrize(("rank", "coordinator", "asks"), [
    (0, False, True), (1, False, True), (2, False, False), (57, False, False), (57, True, True), (-1, False, False),
])
def test_only_the_coordinator_and_ranks_0_and_1_ask(rank: int, coordinator: bool, asks: bool) -> None:
    assert is_prober(rank, coordinator) is asks


A, R, U, N = Answer.ACCEPTED, Answer.REFUSED, Answer.UNREACHABLE, Answer.UNASKED


@pytest.mark.parametrize(("got", "gone"), [
    ([A, A, A], []),                  # every host answers: a slow or stopped peer, its lease decides
    ([A, U, A], ["b"]),               # a host gone from the network
    ([R, A, U], ["a", "c"]),          # a process gone, a host gone
    ([N, N, N], []),                  # no numeric address: nothing is decided
])
def test_out_of_reach(got: list[Answer], gone: list[str]) -> None:
    assert out_of_reach(["a", "b", "c"], got) == gone


def test_out_of_reach_needs_an_answer_per_member() -> None:
    with pytest.raises(ValueError):
        out_of_reach(["a", "b"], [A])


@pytest.mark.parametrize(("check_s", "poll_s"), [(0.5, REACH_POLL_MAX_S), (0.2, 0.05), (0.0, REACH_POLL_MAX_S)])
def test_reach_poll_s(check_s: float, poll_s: float) -> None:
    assert reach_poll_s(check_s) == pytest.approx(poll_s)


def test_stuck_holds_the_current_wait() -> None:
    s = Stuck()
    assert s.current() is None
    s.began(3, 10.0)
    assert s.current() == Waiting(3, 10.0)
    s.began(4, 11.0)
    assert s.current() == Waiting(4, 11.0)
    s.ended()
    assert s.current() is None


def test_next_checked_counts_the_checks_of_one_wait() -> None:
    first = next_checked(W, None, 100.5)
    assert first == Checked(W, 100.5, 1)
    assert next_checked(W, first, 101.5) == Checked(W, 101.5, 2)
    other = Waiting(7, 200.0)
    assert next_checked(other, Checked(W, 101.5, 2), 200.5) == Checked(other, 200.5, 1)
