"""The pure rendezvous decision ``next_action`` and ``parse_snapshot``, on hand-built state.

Every case is a snapshot, a member, its window and a fixed ``now``; nothing touches a store or a
clock. Timeouts: join window 0.25 s, last call 0.3 s. ``NOW`` is 1000.0.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import pytest

from elasticd.config import Timeouts, WorldConfig
from elasticd.rendezvous.decide import (
    Action,
    ActionKind,
    Me,
    Window,
    join_window_closes_at,
    judge,
    missing_members,
    next_action,
    waiting_newcomers,
    without_gone,
)
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import (
    AbortRecord,
    GenerationRecord,
    MemberRecord,
    VerdictRecord,
    ReadyRecord,
    encode,
)
from elasticd.wire.snapshot import DecodedRecords, Snapshot, parse_snapshot

pytestmark = pytest.mark.timeout(60)

SIG = "a" * 64
OTHER_SIG = "b" * 64
NOW = 1000.0
T = Timeouts(join_window_s=0.25, last_call_s=0.3)
KEYS = Keys("/elasticd", "job")

# -- builders -----------------------------------------------------------------------------------


def member(mid: str, sig: str = SIG) -> MemberRecord:
    """A live member; its store lives on a host derived from its id (to check who hosts it)."""
    return MemberRecord(
        mid,
        node=f"node-{mid}",
        local_rank=0,
        pid=100,
        host=f"host-{mid}",
        store_port=20000 + sum(map(ord, mid)),
        signature=sig,
    )


def ready(mid: str, step: int = 0, prev_gen: int = 0, prev_rank: int = 0, sig: str = SIG) -> ReadyRecord:
    return ReadyRecord(mid, committed_step=step, prev_generation=prev_gen, prev_rank=prev_rank, signature=sig)


def gen(number: int, members: Sequence[str], sig: str = SIG, step: int = 0) -> GenerationRecord:
    return GenerationRecord(
        number,
        tuple(members),
        store_host=f"host-{members[0]}",
        store_port=1,
        signature=sig,
        committed_step=step,
        reason="start",
    )


def snap(
    generation: GenerationRecord | None = None,
    alive: Sequence[str] = (),
    ready_recs: Sequence[ReadyRecord] = (),
    aborted: int = 0,
    generation_revision: int | None = None,
    member_sigs: dict[str, str] | None = None,
    verdict: VerdictRecord | None = None,
) -> Snapshot:
    """Members in ``alive`` are registered; ready records arrive in the order given."""
    sigs = member_sigs or {}
    return Snapshot(
        generation=generation,
        generation_revision=(
            generation_revision if generation_revision is not None else (50 if generation is not None else 0)
        ),
        members={m: member(m, sigs.get(m, SIG)) for m in alive},
        ready={r.member_id: r for r in ready_recs},
        ready_order={r.member_id: 100 + i for i, r in enumerate(ready_recs)},
        aborted=aborted,
        verdict=verdict,
    )


def me(mid: str, last_gen: int = 0, sig: str = SIG) -> Me:
    return Me(mid, sig, last_gen)


def settled(entered: float = NOW - 10.0, changed: float = NOW - 10.0) -> Window:
    """A window whose join window and last call are long over."""
    return Window(entered_at=entered, newcomers_changed_at=changed)


FRESH = Window(entered_at=NOW - 0.1, newcomers_changed_at=NOW - 0.1)  # both still open at NOW

W1 = WorldConfig(min_workers=1, max_workers=8)


def decide(s: Snapshot, m: Me, window: Window = FRESH, now: float = NOW, world: WorldConfig = W1) -> Action:
    return next_action(s, m, window, now, world, T)


# -- the table ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    snap: Snapshot
    me: Me
    window: Window = FRESH
    now: float = NOW
    world: WorldConfig = W1
    kind: ActionKind = ActionKind.WAIT
    members: tuple[str, ...] | None = None  # published (or joined) rank order
    generation: int | None = None  # published (or joined) generation number
    until: float | None = None
    reason: str | None = None  # PUBLISH: the record's reason
    extra: dict[str, object] = field(default_factory=dict)


G3_ABC = gen(3, ["a", "b", "c"])
READY_ABC_G3 = [ready("a", 7, 3, 0), ready("b", 7, 3, 1), ready("c", 7, 3, 2)]

CASES = [
    # -- JOIN ----------------------------------------------------------------------------------
    Case(
        "join: published generation includes me",
        snap(gen(4, ["b", "a"]), alive=["a", "b"]),
        me("a", last_gen=3),
        kind=ActionKind.JOIN,
        members=("b", "a"),
        generation=4,
    ),
    Case(
        "join: a newcomer joins the generation that takes it in",
        snap(gen(4, ["a", "b", "n"]), alive=["a", "b", "n"]),
        me("n", last_gen=0),
        kind=ActionKind.JOIN,
        members=("a", "b", "n"),
        generation=4,
    ),
    Case(
        "join wins even if my records are gone (the publisher consumed my ready record)",
        snap(gen(2, ["a"]), alive=[]),
        me("a", last_gen=1),
        kind=ActionKind.JOIN,
        generation=2,
    ),
    Case(
        "no join: the generation that includes me is the one I am leaving",
        snap(G3_ABC, alive=["a", "b", "c"], ready_recs=[ready("a", 7, 3, 0)]),
        me("a", last_gen=3),
        kind=ActionKind.WAIT,
    ),
    # -- healthy generation: wait for its members to reach a step boundary ----------------------
    Case(
        "newcomer waits while a healthy generation trains",
        snap(gen(1, ["a", "b"]), alive=["a", "b", "n"], ready_recs=[ready("n")]),
        me("n"),
        window=settled(),
        kind=ActionKind.WAIT,
        until=None,
    ),
    Case(
        "newcomer still waits when only some members reached the boundary",
        snap(gen(1, ["a", "b"]), alive=["a", "b", "n"], ready_recs=[ready("n"), ready("a", 5, 1, 0)]),
        me("n"),
        window=settled(),
        kind=ActionKind.WAIT,
    ),
    Case(
        "an abort of an older generation does not break the current one",
        snap(G3_ABC, alive=["a", "b", "c"], ready_recs=[ready("a", 7, 3, 0)], aborted=2),
        me("a", 3),
        window=settled(),
        kind=ActionKind.WAIT,
        until=None,
    ),
    Case(
        "survivors regroup (all members ready, no newcomer)",
        snap(G3_ABC, alive=["a", "b", "c"], ready_recs=READY_ABC_G3),
        me("b", 3),
        kind=ActionKind.PUBLISH,
        members=("a", "b", "c"),
        generation=4,
        reason="regroup",
    ),
    Case(
        "all members ready plus a newcomer: join window still open",
        snap(G3_ABC, alive=["a", "b", "c", "n"], ready_recs=[*READY_ABC_G3, ready("n")]),
        me("a", 3),
        window=Window(NOW - 5, NOW - 0.1),
        kind=ActionKind.WAIT,
        until=NOW - 0.1 + 0.25,
    ),
    Case(
        "all members ready plus a newcomer: window over, newcomer joins last",
        snap(G3_ABC, alive=["a", "b", "c", "n"], ready_recs=[ready("n"), *READY_ABC_G3]),
        me("a", 3),
        window=settled(),
        kind=ActionKind.PUBLISH,
        members=("a", "b", "c", "n"),
        generation=4,
        reason="join",
    ),
    # -- broken generation: last call, then publish without the missing -------------------------
    Case(
        "aborted: wait for members that have not come (last call)",
        snap(G3_ABC, alive=["a", "b", "c"], ready_recs=READY_ABC_G3[:2], aborted=3),
        me("a", 3),
        window=Window(NOW - 0.1, NOW - 10),
        kind=ActionKind.WAIT,
        until=NOW - 0.1 + 0.3,
    ),
    Case(
        "aborted: after last call, publish without the missing member",
        snap(G3_ABC, alive=["a", "b", "c"], ready_recs=READY_ABC_G3[:2], aborted=3),
        me("a", 3),
        window=Window(NOW - 0.31, NOW - 10),
        kind=ActionKind.PUBLISH,
        members=("a", "b"),
        generation=4,
        reason="aborted",
    ),
    Case(
        "aborted and everyone came: no last call",
        snap(G3_ABC, alive=["a", "b", "c"], ready_recs=READY_ABC_G3, aborted=3),
        me("a", 3),
        window=FRESH,
        kind=ActionKind.PUBLISH,
        members=("a", "b", "c"),
        generation=4,
        reason="aborted",
    ),
    Case(
        "lost lease: the dead member is not waited for",
        snap(G3_ABC, alive=["a", "b"], ready_recs=READY_ABC_G3[:2]),
        me("b", 3),
        window=FRESH,
        kind=ActionKind.PUBLISH,
        members=("a", "b"),
        generation=4,
        reason="member_lost",
    ),
    Case(
        "lost lease: a live member that has not come gets a last call",
        snap(G3_ABC, alive=["a", "b"], ready_recs=[READY_ABC_G3[1]]),
        me("b", 3),
        window=Window(NOW - 0.29, NOW - 10),
        kind=ActionKind.WAIT,
        until=NOW - 0.29 + 0.3,
    ),
    Case(
        "lost lease: after last call, publish without dead and missing",
        snap(G3_ABC, alive=["a", "b"], ready_recs=[READY_ABC_G3[1]]),
        me("b", 3),
        window=Window(NOW - 0.31, NOW - 10),
        kind=ActionKind.PUBLISH,
        members=("b",),
        generation=4,
        reason="member_lost",
    ),
    Case(
        "lost lease: a newcomer also waits through last call",
        snap(G3_ABC, alive=["a", "b", "n"], ready_recs=[READY_ABC_G3[0], ready("n")]),
        me("n"),
        window=Window(NOW - 0.1, NOW - 10),
        kind=ActionKind.WAIT,
        until=NOW - 0.1 + 0.3,
    ),
    # A newcomer waiting for long must not publish a generation of itself alone when a member's
    # lease expires (it would train from step 0 while the survivors hold their newer step).
    Case(
        "lost lease: a lone newcomer waits for the live members, who hold the state",
        snap(G3_ABC, alive=["a", "b", "n"], ready_recs=[ready("n")]),
        me("n"),
        window=settled(),
        kind=ActionKind.WAIT,
    ),
    Case(
        "lost lease: the last call runs from when the newcomer saw the break, not from its arrival",
        snap(G3_ABC, alive=["a", "b", "n"], ready_recs=[READY_ABC_G3[0], ready("n")]),
        me("n"),
        window=Window(NOW - 60, NOW - 60, broken_at=NOW - 0.1),
        kind=ActionKind.WAIT,
        until=NOW - 0.1 + 0.3,
    ),
    Case(
        "lost lease: after that last call, a survivor and the newcomer go on",
        snap(G3_ABC, alive=["a", "b", "n"], ready_recs=[READY_ABC_G3[0], ready("n", -1)]),
        me("n"),
        window=Window(NOW - 60, NOW - 60, broken_at=NOW - 0.31),
        kind=ActionKind.PUBLISH,
        members=("a", "n"),
        generation=4,
        reason="member_lost",
    ),
    # A generation of the one member holding step 2511 and three that
    # joined generations never built (they hold nothing); with the holder late, a deputy published
    # the three alone, from step 0, and the job started over. Members of a generation hold its
    # state only from the step it began at.
    Case(
        "never built: its members that hold nothing wait for the live one that holds the state",
        snap(
            gen(56, ["h", "x", "y"], step=2511),
            alive=["h", "x", "y"],
            ready_recs=[ready("x", 0, 56, 1), ready("y", -1, 56, 2)],
            aborted=56,
        ),
        me("x", 56),
        window=settled(),
        kind=ActionKind.WAIT,
    ),
    Case(
        "never built: with the holder gone as well, the state is lost",
        snap(
            gen(56, ["h", "x", "y"], step=2511),
            alive=["x", "y"],
            ready_recs=[ready("x", 0, 56, 1), ready("y", -1, 56, 2)],
        ),
        me("x", 56),
        window=settled(),
        kind=ActionKind.STATE_LOST,
    ),
    Case(
        "never built: the holder came, it leads the next generation",
        snap(
            gen(56, ["h", "x", "y"], step=2511),
            alive=["h", "x", "y"],
            ready_recs=[ready("h", 2511, 56, 0), ready("x", 0, 56, 1), ready("y", -1, 56, 2)],
        ),
        me("x", 56),
        window=settled(),
        kind=ActionKind.PUBLISH,
        members=("h", "x", "y"),
        generation=57,
    ),
    # -- first generation, join window, min/max workers -----------------------------------------
    Case(
        "start: join window open after the last arrival",
        snap(None, alive=["a", "b"], ready_recs=[ready("a"), ready("b")]),
        me("a"),
        window=Window(NOW - 5, NOW - 0.2),
        kind=ActionKind.WAIT,
        until=NOW - 0.2 + 0.25,
    ),
    Case(
        "start: join window closed, publish generation 1 in arrival order",
        snap(None, alive=["a", "b"], ready_recs=[ready("b"), ready("a")]),
        me("a"),
        window=Window(NOW - 5, NOW - 0.26),
        kind=ActionKind.PUBLISH,
        members=("b", "a"),
        generation=1,
        reason="start",
    ),
    Case(
        "start: at max_workers the join window is skipped",
        snap(None, alive=["a", "b"], ready_recs=[ready("a"), ready("b")]),
        me("a"),
        world=WorldConfig(min_workers=1, max_workers=2),
        kind=ActionKind.PUBLISH,
        members=("a", "b"),
        generation=1,
    ),
    Case(
        "min_workers: not enough ready",
        snap(None, alive=["a", "b", "c"], ready_recs=[ready("a"), ready("b")]),
        me("a"),
        window=settled(),
        world=WorldConfig(min_workers=3, max_workers=8),
        kind=ActionKind.WAIT,
    ),
    Case(
        "min_workers: reached",
        snap(None, alive=["a", "b", "c"], ready_recs=[ready("a"), ready("b"), ready("c")]),
        me("a"),
        window=settled(),
        world=WorldConfig(min_workers=3, max_workers=8),
        kind=ActionKind.PUBLISH,
        members=("a", "b", "c"),
    ),
    Case(
        "min_workers: a ready record whose lease is gone does not count",
        snap(None, alive=["a", "b"], ready_recs=[ready("a"), ready("b"), ready("ghost")]),
        me("a"),
        window=settled(),
        world=WorldConfig(min_workers=3, max_workers=8),
        kind=ActionKind.WAIT,
    ),
    Case(
        "min_workers: broken generation below minimum waits even after last call",
        snap(G3_ABC, alive=["a"], ready_recs=[READY_ABC_G3[0]]),
        me("a", 3),
        window=settled(),
        world=WorldConfig(min_workers=2, max_workers=8),
        kind=ActionKind.WAIT,
    ),
    Case(
        "max_workers: truncated to the first ranks, arrival order",
        snap(None, alive=list("abcde"), ready_recs=[ready(x) for x in "cabed"]),
        me("a"),
        window=settled(),
        world=WorldConfig(min_workers=1, max_workers=3),
        kind=ActionKind.PUBLISH,
        members=("c", "a", "b"),
        generation=1,
    ),
    Case(
        "max_workers: survivors are kept over newcomers",
        snap(
            gen(2, ["a", "b"]),
            alive=["a", "b", "x", "y"],
            ready_recs=[ready("x"), ready("b", 9, 2, 1), ready("y"), ready("a", 9, 2, 0)],
        ),
        me("x"),
        window=settled(),
        world=WorldConfig(min_workers=1, max_workers=3),
        kind=ActionKind.PUBLISH,
        members=("a", "b", "x"),
        generation=3,
        reason="join",
    ),
    # -- rank order -----------------------------------------------------------------------------
    Case(
        "rank order: survivors keep their old ranks, newcomers follow by arrival",
        snap(
            gen(5, ["c", "a", "b"]),
            alive=["a", "b", "c", "y", "x"],
            ready_recs=[ready("a", 4, 5, 1), ready("y"), ready("b", 4, 5, 2), ready("x"), ready("c", 4, 5, 0)],
            aborted=5,
        ),
        me("a", 5),
        window=settled(),
        kind=ActionKind.PUBLISH,
        members=("c", "a", "b", "y", "x"),
        generation=6,
        reason="aborted",
    ),
    Case(
        "rank order: the newest committed step is rank 0",
        snap(
            gen(5, ["c", "a", "b"]),
            alive=["a", "b", "c"],
            ready_recs=[ready("a", 4, 5, 1), ready("b", 5, 5, 2), ready("c", 4, 5, 0)],
            aborted=5,
        ),
        me("a", 5),
        window=settled(),
        kind=ActionKind.PUBLISH,
        members=("b", "c", "a"),
        generation=6,
    ),
    Case(
        "rank order: a newcomer holding a newer step (restored checkpoint) is rank 0",
        snap(
            gen(5, ["a", "b"]),
            alive=["a", "b", "n"],
            ready_recs=[ready("a", 4, 5, 0), ready("n", 8), ready("b", 4, 5, 1)],
        ),
        me("a", 5),
        window=settled(),
        kind=ActionKind.PUBLISH,
        members=("n", "a", "b"),
        generation=6,
    ),
    Case(
        "rank order: a newcomer's rank in an older generation means nothing",
        snap(
            gen(5, ["a", "b"]),
            alive=["a", "b", "x", "y"],
            ready_recs=[ready("x", 4, 2, 9), ready("y", 4, 2, 0), ready("b", 4, 5, 1), ready("a", 4, 5, 0)],
            aborted=5,
        ),
        me("a", 5),
        window=settled(),
        kind=ActionKind.PUBLISH,
        members=("a", "b", "x", "y"),
        generation=6,
    ),
    # -- model signature ------------------------------------------------------------------------
    Case(
        "model mismatch with the published generation fails",
        snap(gen(1, ["a"]), alive=["a", "n"], ready_recs=[ready("n", sig=OTHER_SIG)], member_sigs={"n": OTHER_SIG}),
        me("n", sig=OTHER_SIG),
        kind=ActionKind.FAIL,
    ),
    Case(
        "model mismatch with the first arrival fails (no generation yet)",
        snap(None, alive=["a", "n"], ready_recs=[ready("a"), ready("n", sig=OTHER_SIG)], member_sigs={"n": OTHER_SIG}),
        me("n", sig=OTHER_SIG),
        kind=ActionKind.FAIL,
    ),
    Case(
        "a mismatched member is never chosen",
        snap(None, alive=["a", "n"], ready_recs=[ready("a"), ready("n", sig=OTHER_SIG)], member_sigs={"n": OTHER_SIG}),
        me("a"),
        window=settled(),
        kind=ActionKind.PUBLISH,
        members=("a",),
        generation=1,
    ),
    # -- reregister -----------------------------------------------------------------------------
    Case(
        "my member record is gone: reregister",
        snap(None, alive=["b"], ready_recs=[ready("a"), ready("b")]),
        me("a"),
        kind=ActionKind.REREGISTER,
    ),
    Case(
        "my ready record is gone: reregister",
        snap(None, alive=["a", "b"], ready_recs=[ready("b")]),
        me("a"),
        kind=ActionKind.REREGISTER,
    ),
    Case(
        "reregister comes before the signature check",
        snap(gen(1, ["b"]), alive=["b"]),
        me("a", sig=OTHER_SIG),
        kind=ActionKind.REREGISTER,
    ),
    # -- generation numbers ---------------------------------------------------------------------
    Case(
        "generation number: past an abort record of a later generation",
        snap(gen(7, ["a", "b"]), alive=["a", "b"], ready_recs=[ready("a", 1, 7, 0), ready("b", 1, 7, 1)], aborted=9),
        me("a", 7),
        window=settled(),
        kind=ActionKind.PUBLISH,
        generation=10,
        reason="aborted",
    ),
    Case(
        "generation number: past a malformed generation record (known from ready records)",
        snap(None, alive=["a", "b"], ready_recs=[ready("a", 3, 6, 0), ready("b", 3, 6, 1)], generation_revision=77),
        me("a", 6),
        window=settled(),
        kind=ActionKind.PUBLISH,
        members=("a", "b"),
        generation=7,
        extra={"expected_revision": 77},
    ),
    Case(
        "generation number: past the newest generation any ready member was in",
        snap(gen(2, ["a"]), alive=["a", "n"], ready_recs=[ready("a", 3, 2, 0), ready("n", 0, 11, 0)]),
        me("a", 2),
        window=settled(),
        kind=ActionKind.PUBLISH,
        generation=12,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_next_action(case: Case) -> None:
    action = next_action(case.snap, case.me, case.window, case.now, case.world, T)
    assert action.kind is case.kind, action.reason
    if case.members is not None:
        assert action.record is not None
        assert action.record.members == case.members, action.reason
    if case.generation is not None:
        assert action.record is not None
        assert action.record.generation == case.generation
    if case.kind is ActionKind.WAIT:
        assert action.until == case.until
        assert action.record is None
    if case.reason is not None:
        assert action.record is not None and action.record.reason == case.reason
        assert action.reason == case.reason
    for name, want in case.extra.items():
        assert getattr(action, name) == want
    if case.kind is ActionKind.PUBLISH:
        assert action.record is not None
        assert action.expected_revision == case.snap.generation_revision
    if case.kind is ActionKind.FAIL:
        assert "signature" in action.error and action.record is None


def test_publish_record_describes_rank0_and_the_job() -> None:
    s = snap(
        gen(5, ["c", "a"], step=3), alive=["a", "c"], ready_recs=[ready("a", 4, 5, 1), ready("c", 3, 5, 0)], aborted=5
    )
    action = decide(s, me("c", 5), window=settled())
    assert action.kind is ActionKind.PUBLISH
    rec = action.record
    assert rec is not None
    assert rec.members == ("a", "c")
    assert (rec.store_host, rec.store_port) == (member("a").host, member("a").store_port)
    assert rec.committed_step == 4
    assert rec.signature == SIG
    assert rec.rank_of("c") == 1 and rec.world_size == 2


def test_every_publish_is_consistent_and_newer_than_anything_seen() -> None:
    """Random snapshots: whatever is published is a valid, strictly newer generation."""
    rng = random.Random(1234)
    ids = [f"m{i}" for i in range(7)]
    publishes = 0
    for _ in range(3000):
        g = None
        if rng.random() < 0.8:
            g = gen(rng.randint(1, 20), rng.sample(ids, rng.randint(1, 5)))
        alive = [m for m in ids if rng.random() < 0.8]
        recs = []
        for m in rng.sample(ids, len(ids)):
            if rng.random() < 0.7:
                in_g = g is not None and m in g.members and rng.random() < 0.7
                recs.append(
                    ready(
                        m,
                        rng.randint(-1, 9),
                        g.generation if in_g and g else rng.randint(0, 25),
                        g.members.index(m) if in_g and g else 0,
                        SIG if rng.random() < 0.9 else OTHER_SIG,
                    )
                )
        s = snap(
            g,
            alive=alive,
            ready_recs=recs,
            aborted=rng.choice([0, 0, rng.randint(1, 30)]),
            generation_revision=rng.choice([0, 3, 99]) if g is None else 42,
        )
        mid = rng.choice(ids)
        m = me(mid, last_gen=s.ready[mid].prev_generation if mid in s.ready else rng.randint(0, 20))
        world = WorldConfig(min_workers=rng.randint(1, 3), max_workers=rng.randint(3, 6))
        window = Window(NOW - rng.random(), NOW - rng.random())
        action = next_action(s, m, window, NOW, world, T)
        if action.kind is ActionKind.JOIN:
            assert action.record is s.generation and mid in action.record.members
            assert action.record.generation > m.last_generation
        if action.kind is not ActionKind.PUBLISH:
            continue
        publishes += 1
        rec = action.record
        assert rec is not None
        seen = [g.generation if g else 0, s.aborted, m.last_generation]
        seen += [r.prev_generation for r in s.ready.values()]
        assert rec.generation > max(seen)
        assert len(set(rec.members)) == len(rec.members)
        assert world.min_workers <= len(rec.members) <= world.max_workers
        assert all(x in s.members and x in s.ready for x in rec.members)
        assert all(s.ready[x].signature == rec.signature for x in rec.members)
        assert s.ready[rec.members[0]].committed_step == max(s.ready[x].committed_step for x in rec.members)
        assert rec.committed_step == s.ready[rec.members[0]].committed_step
        assert action.expected_revision == s.generation_revision
    assert publishes > 100  # the generator must actually reach the interesting branch


def test_a_lost_cas_leads_to_join_on_reread() -> None:
    """Two members decide from the same snapshot; the loser re-reads and joins the winner's record."""
    s = snap(None, alive=["a", "b"], ready_recs=[ready("a"), ready("b")])
    first = decide(s, me("a"), window=settled())
    second = decide(s, me("b"), window=settled())
    assert first.kind is second.kind is ActionKind.PUBLISH
    assert first.record == second.record  # deterministic: both would publish the same thing
    assert first.record is not None
    after = snap(first.record, alive=["a", "b"], generation_revision=60)
    assert decide(after, me("b")).kind is ActionKind.JOIN


# -- parse_snapshot ------------------------------------------------------------------------------


def kv(key: str, value: bytes, rev: int = 10, create: int | None = None) -> KeyValue:
    return KeyValue(key, value, rev, create if create is not None else rev)


def good_records() -> list[KeyValue]:
    return [
        kv(KEYS.generation, encode(gen(3, ["a", "b"])), rev=40, create=5),
        kv(KEYS.abort, encode(AbortRecord(2, "a", "boom")), rev=30),
        kv(KEYS.member("a"), encode(member("a")), rev=11),
        kv(KEYS.member("b"), encode(member("b")), rev=12),
        kv(KEYS.ready("b"), encode(ready("b", 3, 3, 1)), rev=45, create=44),
        kv(KEYS.ready("a"), encode(ready("a", 3, 3, 0)), rev=46, create=43),
        kv(KEYS.progress("a"), b'{"step": 3}', rev=47),
        kv(KEYS.event("1"), b"not even json", rev=48),  # not a record the rendezvous reads
    ]


def test_parse_snapshot_reads_well_formed_records() -> None:
    s = parse_snapshot(KEYS, good_records())
    assert s.malformed == ()
    assert s.generation == gen(3, ["a", "b"])
    assert s.generation_revision == 40
    assert s.aborted == 2
    assert dict(s.members) == {"a": member("a"), "b": member("b")}
    assert dict(s.ready) == {"a": ready("a", 3, 3, 0), "b": ready("b", 3, 3, 1)}
    assert dict(s.ready_order) == {"a": 43, "b": 44}  # arrival = create_revision, not mod_revision
    assert s.highest_generation_seen == 3


def _with(records: list[KeyValue], *changes: KeyValue, drop: tuple[str, ...] = ()) -> list[KeyValue]:
    new = {c.key: c for c in changes}
    return [new.pop(r.key, r) for r in records if r.key not in drop] + list(new.values())


_A_AGAIN = kv(KEYS.member("a"), encode(replace(member("a"), pid=9)), 50)
# (what, the read, records decoded for it): one DecodedRecords across the rows, in order
DECODED_READS = [
    ("the first read decodes every record it reads", good_records(), 5),
    ("the same read again decodes nothing", good_records(), 0),
    ("a member written again is decoded again", _with(good_records(), _A_AGAIN), 1),
    ("a member deleted is forgotten", _with(good_records(), _A_AGAIN, drop=(KEYS.member("b"),)), 0),
    ("back at its old revision, it is decoded again", _with(good_records(), _A_AGAIN), 1),
    ("a malformed record is never held", _with(good_records(), _A_AGAIN, kv(KEYS.member("c"), b"{not json", 60)), 1),
    ("and so is tried again", _with(good_records(), _A_AGAIN, kv(KEYS.member("c"), b"{not json", 60)), 1),
    (
        "a new generation is decoded",
        _with(good_records(), _A_AGAIN, kv(KEYS.generation, encode(gen(4, ["a", "b"])), 70, 5)),
        1,
    ),
]


def test_parse_snapshot_with_decoded_records_decodes_only_what_changed() -> None:
    decoded = DecodedRecords()
    for what, records, count in DECODED_READS:
        before = decoded.decoded
        assert parse_snapshot(KEYS, records, decoded) == parse_snapshot(KEYS, records), what
        assert decoded.decoded - before == count, what


def _obj(record: object, **changes: object) -> bytes:
    data = asdict(record)  # type: ignore[call-overload]
    for k, v in changes.items():
        if v is _DROP:
            del data[k]
        else:
            data[k] = v
    return json.dumps(data).encode()


_DROP = object()

MALFORMED = [
    ("garbage JSON", KEYS.member("c"), b"{not json"),
    ("invalid UTF-8", KEYS.member("c"), b"\xff\xfe\x00garbage"),
    ("empty value", KEYS.ready("c"), b""),
    ("JSON list", KEYS.member("c"), b'["c"]'),
    ("JSON null", KEYS.abort, b"null"),
    ("missing field", KEYS.member("c"), _obj(member("c"), pid=_DROP)),
    ("extra field", KEYS.ready("c"), _obj(ready("c"), surprise=1)),
    ("str for int", KEYS.member("c"), _obj(member("c"), local_rank="0")),
    ("bool for int", KEYS.ready("c"), _obj(ready("c"), committed_step=True)),
    ("float for int", KEYS.ready("c"), _obj(ready("c"), prev_rank=1.0)),
    ("int for str", KEYS.member("c"), _obj(member("c"), host=127001)),
    ("member key/id mismatch", KEYS.member("c"), encode(member("d"))),
    ("ready key/id mismatch", KEYS.ready("c"), encode(ready("d"))),
    ("ready id with a slash", KEYS.ready("c"), encode(ready("c/x"))),
    ("abort garbage", KEYS.abort, b"\x00\x01"),
    ("abort wrong type", KEYS.abort, _obj(AbortRecord(1, "a", "r"), generation="1")),
]

MALFORMED_GENERATION = [
    ("generation garbage", b"}{"),
    ("generation 0", _obj(gen(1, ["a"]), generation=0)),
    ("generation negative", _obj(gen(1, ["a"]), generation=-4)),
    ("generation not int", _obj(gen(1, ["a"]), generation="3")),
    ("members not a list", _obj(gen(1, ["a"]), members="ab")),
    ("members hold non-strings", _obj(gen(1, ["a"]), members=["a", 2])),
    ("members nested lists", _obj(gen(1, ["a"]), members=[["a"]])),
    ("members empty", _obj(gen(1, ["a"]), members=[])),
    ("members duplicated", _obj(gen(1, ["a"]), members=["a", "a"])),
    ("infinite generation", _obj(gen(1, ["a"]), generation=1e999)),
]


@pytest.mark.parametrize(("what", "key", "value"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_parse_snapshot_lists_malformed_records(what: str, key: str, value: bytes) -> None:
    clean = parse_snapshot(KEYS, good_records())
    records = [r for r in good_records() if r.key != key] + [kv(key, value, rev=99)]
    s = parse_snapshot(KEYS, records)
    assert len(s.malformed) == 1, s.malformed
    assert s.malformed[0].startswith(key + ": ")
    # The good records are all still there.
    assert s.generation == clean.generation
    assert {k: v for k, v in s.members.items()} == {k: v for k, v in clean.members.items() if KEYS.member(k) != key}
    assert {k: v for k, v in s.ready.items()} == {k: v for k, v in clean.ready.items() if KEYS.ready(k) != key}
    assert "c" not in s.members and "c" not in s.ready and "d" not in s.members and "d" not in s.ready
    if key == KEYS.abort:
        assert s.aborted == 0


@pytest.mark.parametrize(("what", "value"), MALFORMED_GENERATION, ids=[m[0] for m in MALFORMED_GENERATION])
def test_parse_snapshot_malformed_generation(what: str, value: bytes) -> None:
    records = [r for r in good_records() if r.key != KEYS.generation] + [kv(KEYS.generation, value, rev=77)]
    s = parse_snapshot(KEYS, records)
    assert s.generation is None
    assert s.generation_revision == 77  # so a new generation can replace it by CAS
    assert len(s.malformed) == 1 and s.malformed[0].startswith(KEYS.generation + ": ")
    # written before it (rev 45, 46): who it consumed is unknown, so every older record is spent
    assert set(s.members) == {"a", "b"} and set(s.ready) == set()
    later = parse_snapshot(
        KEYS, [r for r in records if r.key != KEYS.generation] + [kv(KEYS.generation, value, rev=46)]
    )
    assert set(later.ready) == {"a"}  # b (rev 45) is older than it, a (rev 46) not


def test_parse_snapshot_survives_deeply_nested_json() -> None:
    records = good_records() + [kv(KEYS.member("c"), b"[" * 100_000, rev=99)]
    s = parse_snapshot(KEYS, records)
    assert len(s.malformed) == 1 and s.malformed[0].startswith(KEYS.member("c"))


def test_malformed_generation_does_not_restart_numbering() -> None:
    """A garbage generation record is replaced by CAS on its revision, numbered past the ready
    records, spent ones too (those written before it: wire.snapshot.consumed)."""
    records = [r for r in good_records() if r.key != KEYS.generation] + [kv(KEYS.generation, b"}{", rev=44)]
    s = parse_snapshot(KEYS, records)
    action = decide(s, me("a", 3), window=settled())
    assert action.kind is ActionKind.PUBLISH
    assert action.record is not None and action.record.generation == 4
    assert action.expected_revision == 44
    # written after every ready record: they are spent, and still count for the numbering
    late = parse_snapshot(KEYS, [r for r in records if r.key != KEYS.generation] + [kv(KEYS.generation, b"}{", rev=77)])
    assert not late.ready and late.highest_generation_seen == 3


# -- a published generation consumes its members' ready records by revision -----------------------


def _kv(key: str, record: object, rev: int, create: int | None = None) -> KeyValue:
    return KeyValue(key, json.dumps(asdict(record)).encode(), rev, create if create is not None else rev)  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("gen_rev", "ready_revs", "left"),
    [
        (10, {"a": 5, "b": 6, "c": 17}, ["c"]),  # a, b in the generation, written before it: consumed
        (10, {"a": 11, "b": 6, "c": 7}, ["a"]),  # a came back to the rendezvous after it: fresh
        (10, {"c": 12}, ["c"]),  # a newcomer's record stays
        (10, {"a": 5, "c": 7}, []),  # c left out, written before: stale (dead, or it writes anew)
        (0, {"a": 5, "b": 6}, ["a", "b"]),  # no generation yet: nothing consumed
    ],
)
def test_ready_records_written_before_the_generation_record_are_consumed(
    gen_rev: int, ready_revs: dict[str, int], left: list[str]
) -> None:
    keys = Keys("/elasticd", "job")
    kvs = [_kv(keys.member(m), member(m), 1) for m in ("a", "b", "c")]
    kvs += [_kv(keys.ready(m), ready(m), r) for m, r in ready_revs.items()]
    if gen_rev:
        kvs.append(KeyValue(keys.generation, json.dumps(asdict(gen(1, ["a", "b"]))).encode(), gen_rev, gen_rev))
    s = parse_snapshot(keys, kvs)
    assert sorted(s.ready) == left and sorted(s.ready_order) == left
    assert not s.malformed


# -- a join window does not stop the generation's members ----------------------------------------
# The members of a healthy generation are told of newcomers (the verdict's pending flag) only once
# the newcomers' join window is over: a regroup earlier would only wait for it to close. The window
# runs from the last change of the set of waiting newcomers, not of every ready candidate, so the
# members' own arrival at the rendezvous does not open it again.

G2_AB = gen(2, ["a", "b"])


def _with_spare(s: Snapshot, mid: str) -> Snapshot:
    return replace(s, members={**s.members, mid: replace(s.members[mid], spare=1)})


W4 = WorldConfig(min_workers=1, max_workers=4)


@pytest.mark.parametrize(
    ("name", "s", "window", "world", "closes"),
    [
        (
            "a newcomer arrived 0.1 s ago: open until 0.25 s after it",
            snap(G2_AB, alive=["a", "b", "n"], ready_recs=[ready("n")]),
            Window(NOW - 0.1, NOW - 0.1),
            W4,
            NOW + 0.15,
        ),
        (
            "a second newcomer 0.05 s ago extends it",
            snap(G2_AB, alive=["a", "b", "n", "m"], ready_recs=[ready("n"), ready("m")]),
            Window(NOW - 0.3, NOW - 0.05),
            WorldConfig(min_workers=1, max_workers=8),
            NOW + 0.2,
        ),
        ("over", snap(G2_AB, alive=["a", "b", "n"], ready_recs=[ready("n")]), Window(NOW - 0.3, NOW - 0.3), W4, None),
        (
            "cut short: taking the newcomers in brings the generation to max_workers",
            snap(G2_AB, alive=["a", "b", "n", "m"], ready_recs=[ready("n"), ready("m")]),
            Window(NOW - 0.1, NOW - 0.1),
            W4,
            None,
        ),
        (
            "nobody new waits (members regroup)",
            snap(G2_AB, alive=["a", "b"], ready_recs=[ready("a", 3, 2, 0)]),
            Window(NOW - 0.1, NOW - 0.1),
            W4,
            None,
        ),
        (
            "a standby beyond max_workers is no newcomer to admit",
            snap(gen(2, ["a", "b", "c", "d"]), alive=["a", "b", "c", "d", "n"], ready_recs=[ready("n")]),
            Window(NOW - 0.1, NOW - 0.1),
            W4,
            None,
        ),
        (
            "no generation yet: the first one's join window is publish_decision's",
            snap(None, alive=["a", "n"], ready_recs=[ready("a"), ready("n")]),
            Window(NOW - 0.1, NOW - 0.1),
            W4,
            None,
        ),
        ("no window", snap(G2_AB, alive=["a", "b", "n"], ready_recs=[ready("n")]), None, W4, None),
        (
            "a broken generation is left at once: no window",
            snap(G2_AB, alive=["a", "n"], ready_recs=[ready("n")]),
            Window(NOW - 0.1, NOW - 0.1),
            W4,
            None,
        ),
        (
            "a spare alone: no join window (publish_decision waits none for spares)",
            _with_spare(snap(G2_AB, alive=["a", "b", "s"], ready_recs=[ready("s")]), "s"),
            Window(NOW - 0.1, NOW - 0.1),
            W4,
            None,
        ),
        (
            "a newcomer and a spare bring it to max_workers: cut short",
            _with_spare(snap(G2_AB, alive=["a", "b", "n", "s"], ready_recs=[ready("n"), ready("s")]), "s"),
            Window(NOW - 0.1, NOW - 0.1),
            W4,
            None,
        ),
    ],
)
def test_join_window_closes_at(
    name: str, s: Snapshot, window: Window | None, world: WorldConfig, closes: float | None
) -> None:
    got = join_window_closes_at(s, window, NOW, world, T)
    assert got == (pytest.approx(closes) if closes is not None else None), name


def test_judge_announces_newcomers_only_once_their_window_closed_and_a_break_at_once() -> None:
    waiting = snap(G2_AB, alive=["a", "b", "n"], ready_recs=[ready("n")])
    assert judge(waiting, W4, join_open=True) is None  # nothing to say yet: the members train on
    v = judge(waiting, W4)
    assert v is not None and v.pending == 1 and not v.abandon
    broken = snap(G2_AB, alive=["a", "n"], ready_recs=[ready("n")])  # b lost its lease
    v = judge(broken, W4, join_open=True)  # the members leave anyway: pending as without a window,
    assert v is not None and "b" in v.abandon and v.pending == 1  # so the record is not rewritten
    spare = _with_spare(snap(G2_AB, alive=["a", "b", "n", "s"], ready_recs=[ready("n"), ready("s")]), "s")
    assert waiting_newcomers(spare) == frozenset({"n"})  # a spare's arrival does not move the window


def test_the_members_own_arrival_does_not_reopen_the_join_window() -> None:
    """Publish as soon as every member came, once the window of the newcomer has closed (before,
    each member's ready record moved it and the members waited another join_window_s)."""
    s = snap(G2_AB, alive=["a", "b", "n"], ready_recs=[ready("n"), ready("a", 5, 2, 0), ready("b", 5, 2, 1)])
    assert waiting_newcomers(s) == frozenset({"n"})
    action = decide(s, me("a", 2), window=Window(NOW - 0.4, NOW - 0.3))
    assert action.kind is ActionKind.PUBLISH and action.record is not None
    assert action.record.members == ("a", "b", "n") and action.record.reason == "join"


def test_the_probe_alone_never_takes_out_the_last_member_that_holds_the_state() -> None:
    # x and y joined generation 56 but never synced it (below its step): h alone holds it
    g56 = gen(56, ["h", "x", "y"], step=2511)
    s = snap(g56, alive=["h", "x", "y"], ready_recs=[ready("x", 0, 56, 1), ready("y", -1, 56, 2)])
    assert sorted(without_gone(s, {"h"}).members) == ["h", "x", "y"]
    synced = snap(g56, alive=["h", "x", "y"], ready_recs=[ready("x", 2511, 56, 1), ready("y", -1, 56, 2)])
    assert sorted(without_gone(synced, {"h"}).members) == ["x", "y"]


@pytest.mark.parametrize(
    ("name", "alive", "gone", "left"),
    [
        ("a gone member is left out", ["a", "b", "n"], {"b"}, ["a", "n"]),
        ("nothing gone", ["a", "b", "n"], set(), ["a", "b", "n"]),
        (
            "never every live member of the generation: their leases decide",
            ["a", "b", "n"],
            {"a", "b"},
            ["a", "b", "n"],
        ),
        ("a dead one already without a record", ["a", "n"], {"a"}, ["a", "n"]),
    ],
)
def test_without_gone(name: str, alive: list[str], gone: set[str], left: list[str]) -> None:
    s = snap(G2_AB, alive=alive, ready_recs=[ready("n")])
    assert sorted(without_gone(s, gone).members) == left, name
    assert missing_members(s, {"n"}) == [m for m in ("a", "b") if m in alive]
