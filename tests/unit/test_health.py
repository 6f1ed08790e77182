"""``judge`` then ``assess_health``, and ``newcomers_admitted``: what the coordinator makes of one
full snapshot, and what a member of the generation then makes of its view with that verdict, on
hand-built snapshots (builders from test_membership). Generation 3 = a, b, c; joined at revision 50."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.config import Timeouts, WorldConfig
from elasticd.rendezvous.decide import (
    ActionKind,
    Health,
    Window,
    assess_health,
    judge,
    newcomers_admitted,
    next_action,
)
from elasticd.wire.records import VerdictRecord
from elasticd.wire.snapshot import Snapshot
from tests.unit.test_membership import G3_ABC, NOW, gen, me, ready, settled, snap

pytestmark = pytest.mark.timeout(30)

W = WorldConfig(min_workers=1, max_workers=4)
W3 = WorldConfig(min_workers=1, max_workers=3)
ABC = ("a", "b", "c")

CASES = [
    # (what, snapshot, lease_lost, world, abandon, fenced, join_pending, reason contains)
    ("healthy", snap(G3_ABC, ABC), False, W, False, False, False, ""),
    ("my lease expired", snap(G3_ABC, ABC), True, W, True, True, None, "my lease"),
    (
        "a read from before my join says nothing",
        snap(G3_ABC, ("a",), generation_revision=40),
        False,
        W,
        False,
        False,
        None,
        "",
    ),
    (
        "garbage generation record: not a reason to stop",
        snap(None, ABC, generation_revision=60),
        False,
        W,
        False,
        False,
        None,
        "",
    ),
    (
        "superseded without me",
        snap(gen(4, ["b", "c"]), ABC, generation_revision=70),
        False,
        W,
        True,
        True,
        None,
        "superseded",
    ),
    # the survivors of a lost member (rendezvous.survivors): it cannot train without me, so a step
    # whose sum I hold is still mine to apply (a split otherwise)
    (
        "superseded by one that takes me",
        snap(gen(4, ["a", "b"]), ABC, generation_revision=70),
        False,
        W,
        True,
        False,
        None,
        "superseded",
    ),
    ("aborted", snap(G3_ABC, ABC, aborted=3), False, W, True, True, None, "aborted"),
    ("an abort of an older generation is history", snap(G3_ABC, ABC, aborted=2), False, W, False, False, False, ""),
    ("a member lost its lease", snap(G3_ABC, ("a", "b")), False, W, True, False, False, "lost their lease"),
    # A member whose step failed is at the rendezvous (its ready record names generation 3): the
    # others must not sit in a collective until collective_s because its abort is not in etcd yet.
    (
        "a member left for the rendezvous",
        snap(G3_ABC, ABC, ready_recs=[ready("c", 7, 3, 2)]),
        False,
        W,
        True,
        False,
        False,
        "left the generation",
    ),
    # (a member's own ready record exists only while it is at the rendezvous, where it assesses
    # nothing: GenerationWatch.leave comes first; the generation is broken for the others all the same)
    (
        "any member's ready record breaks it",
        snap(G3_ABC, ABC, ready_recs=[ready("a", 7, 3, 0)]),
        False,
        W,
        True,
        False,
        False,
        "left the generation",
    ),
    (
        "a newcomer with room: join pending",
        snap(G3_ABC, (*ABC, "d"), ready_recs=[ready("d", -1)]),
        False,
        W,
        False,
        False,
        True,
        "",
    ),
    # A standby beyond max_workers must not force a generation every step.
    (
        "a standby beyond max_workers: no join pending",
        snap(G3_ABC, (*ABC, "d"), ready_recs=[ready("d", -1)]),
        False,
        W3,
        False,
        False,
        False,
        "",
    ),
]


@pytest.mark.parametrize(
    ("what", "s", "lease_lost", "world", "abandon", "fenced", "pending", "why"), CASES, ids=[c[0] for c in CASES]
)
def test_assess_health(
    what: str,
    s: object,
    lease_lost: bool,
    world: WorldConfig,
    abandon: bool,
    fenced: bool,
    pending: bool | None,
    why: str,
) -> None:
    assert isinstance(s, Snapshot)
    view = replace(s, verdict=judge(s, world), members={}, ready={})  # what member "a" reads
    h = assess_health(view, G3_ABC, "a", 50, lease_lost)
    assert isinstance(h, Health)
    assert (h.abandon, h.fenced, h.join_pending) == (abandon, fenced, pending)
    assert why in h.reason


def test_newcomers_admitted_only_with_room() -> None:
    s = snap(G3_ABC, (*ABC, "d", "e"), ready_recs=[ready("d", -1), ready("e", -1)])
    assert newcomers_admitted(s, G3_ABC, WorldConfig(min_workers=1, max_workers=5)) == ("d", "e")
    assert newcomers_admitted(s, G3_ABC, W3) == ()


def test_a_standby_waits_as_a_standby_and_a_newcomer_with_room_does_not() -> None:
    s = snap(G3_ABC, (*ABC, "d"), ready_recs=[ready("d", -1)])
    full = next_action(s, me("d"), settled(), NOW, W3, Timeouts())
    assert (full.kind, full.standby) == (ActionKind.WAIT, True), full.reason
    room = next_action(s, me("d"), Window(NOW - 10, NOW - 10), NOW, W, Timeouts())
    assert (room.kind, room.standby) == (ActionKind.WAIT, False), room.reason


def test_a_verdict_on_another_generation_or_none_says_nothing() -> None:
    lost = snap(G3_ABC, ("a", "b"))
    verdict = judge(lost, W)
    assert verdict is not None
    for other in (None, replace(verdict, generation=2)):
        h = assess_health(replace(lost, verdict=other, members={}), G3_ABC, "a", 50, False)
        assert (h.abandon, h.join_pending) == (False, False)
    h = assess_health(replace(lost, verdict=verdict, members={}), G3_ABC, "a", 50, False)
    assert h.abandon and "['c']" in h.reason


def test_the_verdict_is_coarse_so_that_it_changes_o1_times_per_change() -> None:
    many = tuple(f"m{i:03d}" for i in range(100))
    g = gen(3, list(many))
    w = WorldConfig(min_workers=1, max_workers=200)
    assert judge(snap(g, many), w) is None  # healthy: nothing to say, nothing written
    first = judge(snap(g, many[:10]), w)
    assert isinstance(first, VerdictRecord) and first.abandon.endswith("and 82 more") and not first.orphaned
    # more members go: the stored reason stays, so the record (which every member watches) does not change
    assert judge(snap(g, many[:5], verdict=first), w) == first
    assert judge(snap(g, (), verdict=first), w) == replace(first, orphaned=1)
    # newcomers are a flag: a second newcomer does not change it
    one = judge(snap(g, (*many, "x"), ready_recs=[ready("x", -1)]), w)
    two = judge(snap(g, (*many, "x", "y"), ready_recs=[ready("x", -1), ready("y", -1)], verdict=one), w)
    assert one is not None and one.pending == 1 and two == one


def test_members_leaving_a_finished_job_are_not_judged_lost() -> None:
    """A clean finish: the members revoke their leases one by one after the finished record; the
    others must not be told to abandon (a warning per member at every clean end)."""
    from elasticd.wire.records import FinishedRecord

    gone = snap(G3_ABC, ("a",))
    assert judge(gone, W) is not None
    assert judge(replace(gone, finished=FinishedRecord(generation=3, step=100)), W) is None
    assert judge(replace(gone, finished=FinishedRecord(generation=2, step=50)), W) is not None  # an older finish
