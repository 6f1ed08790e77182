"""retry.Bound: one bounded wait. Its deadline runs on the clock it was given, it is abandoned by
its signal alone (never, by default), and a signal added for one callee leaves the caller's bound
as it was."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elasticd.retry import Bound

pytestmark = pytest.mark.timeout(10)


def test_a_bound_expires_on_its_own_clock_and_nothing_abandons_it_by_default() -> None:
    now = [100.0]
    bound = Bound.after(timedelta(seconds=2), poll_s=0.02, clock=lambda: now[0])
    assert (bound.poll_s, bound.remaining_s(), bound.expired(), bound.abandoned()) == (0.02, 2.0, False, False)
    now[0] = 101.5
    assert bound.remaining_s() == pytest.approx(0.5) and not bound.expired()
    now[0] = 102.0
    assert (bound.remaining_s(), bound.expired(), bound.abandoned()) == (0.0, True, False)


@pytest.mark.parametrize(
    ("own", "added", "abandoned"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_a_signal_added_for_a_callee_abandons_its_bound_and_leaves_the_callers(
    own: bool, added: bool, abandoned: bool
) -> None:
    caller = Bound.after(5, poll_s=0.01, abandon=lambda: own)
    callee = caller.abandoned_also_when(lambda: added)
    assert callee.abandoned() is abandoned
    assert caller.abandoned() is own
    assert (callee.deadline, callee.poll_s) == (caller.deadline, caller.poll_s)
