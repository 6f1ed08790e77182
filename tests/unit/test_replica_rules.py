"""Replicas in the pure rendezvous rules (``rendezvous.decide``, ``rendezvous.survivors``): a
sharded job's replica of K processes joins and leaves generations whole, its members stay
together in shard order, and it ranks by the least step any of its members holds. Tables of
hand-built snapshots; nothing touches a store or a clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.config import WorldConfig
from elasticd.rendezvous.decide import choose_members, rank_order, whole_replicas
from elasticd.rendezvous.survivors import survivors_generation
from elasticd.wire.records import MemberRecord
from tests.unit.test_membership import gen, member
from tests.unit.test_spare_rules import snapshot

pytestmark = pytest.mark.timeout(60)


def shard(mid: str, replica: str, index: int, size: int = 2) -> MemberRecord:
    return replace(member(mid), node=f"node-{replica}", replica=replica, shard=index, replica_size=size)


# replicas r1 (a0, a1), r2 (b0, b1), r3 (c0, c1) of two shards each
SHARDS = [
    shard("a0", "r1", 0),
    shard("a1", "r1", 1),
    shard("b0", "r2", 0),
    shard("b1", "r2", 1),
    shard("c0", "r3", 0),
    shard("c1", "r3", 1),
]


W6 = WorldConfig(min_workers=2, max_workers=6)
W5 = WorldConfig(min_workers=2, max_workers=5)

CHOICE = [
    # (what, alive, ready (in arrival order), steps, world, chosen)
    (
        "whole replicas, each in shard order, however their members arrived",
        SHARDS,
        ["b1", "a1", "c0", "a0", "b0", "c1"],
        {},
        W6,
        ["b0", "b1", "a0", "a1", "c0", "c1"],
    ),
    (
        "a replica with a member not ready waits outside, whole",
        SHARDS,
        ["a0", "a1", "b0", "c0", "c1"],
        {},
        W6,
        ["a0", "a1", "c0", "c1"],
    ),
    (
        "a replica whose member is gone takes no place",
        [r for r in SHARDS if r.member_id != "c1"],
        ["a0", "a1", "b0", "b1", "c0"],
        {},
        W6,
        ["a0", "a1", "b0", "b1"],
    ),
    (
        "max_workers counts processes: a replica that does not fit is left out",
        SHARDS,
        ["a0", "a1", "b0", "b1", "c0", "c1"],
        {},
        W5,
        ["a0", "a1", "b0", "b1"],
    ),
    (
        "the replica holding the newest step is first",
        SHARDS,
        ["a0", "a1", "b0", "b1", "c0", "c1"],
        {"b0": 7, "b1": 7, "a0": 5, "a1": 5},
        W6,
        ["b0", "b1", "a0", "a1", "c0", "c1"],
    ),
    (
        "a replica ranks by the least step any of its members holds",
        SHARDS,
        ["a0", "a1", "b0", "b1"],
        {"a0": 9, "a1": 3, "b0": 5, "b1": 5},
        W6,
        ["b0", "b1", "a0", "a1"],
    ),
    (
        "two records claiming one shard: the replica takes no place",
        SHARDS + [shard("x1", "r1", 1)],
        ["a0", "a1", "x1", "b0", "b1"],
        {},
        W6,
        ["b0", "b1"],
    ),
    (
        "a data-parallel member is a replica alone, beside sharded ones",
        SHARDS[:2] + [member("d")],
        ["d", "a0", "a1"],
        {},
        W6,
        ["d", "a0", "a1"],
    ),
]


@pytest.mark.parametrize(("what", "alive", "ready_ids", "steps", "world", "chosen"), CHOICE, ids=[c[0] for c in CHOICE])
def test_a_generation_takes_whole_replicas(
    what: str,
    alive: list[MemberRecord],
    ready_ids: list[str],
    steps: dict[str, int],
    world: WorldConfig,
    chosen: list[str],
) -> None:
    snap = snapshot(None, alive, ready_ids, steps)
    got = choose_members(snap, [snap.ready[m] for m in ready_ids], world)
    assert [r.member_id for r in got] == chosen, what


def test_whole_replicas_and_rank_order_of_data_parallel_members_are_unchanged() -> None:
    """Every member a replica alone: the rank order is the data-parallel one (newest step first,
    then survivors in their old order, then newcomers in arrival order)."""
    g = gen(4, ("p", "q", "r"), step=10)
    alive = [member(m) for m in ("p", "q", "r", "n")]
    snap = snapshot(g, alive, ["n", "r", "q", "p"], {"p": 10, "q": 10, "r": 11, "n": -1})
    cands = [snap.ready[m] for m in ("n", "r", "q", "p")]
    assert [[r.member_id for r in rep] for rep in whole_replicas(snap, cands)] == [["n"], ["r"], ["q"], ["p"]]
    assert [r.member_id for r in rank_order(snap, cands)] == ["r", "p", "q", "n"]


def test_survivors_of_a_replica_that_lost_a_member_leave_with_it() -> None:
    """b1 is gone: its replica's other member b0 is not a survivor; the others go on at once, in
    their old order."""
    g = replace(gen(5, ("a0", "a1", "b0", "b1", "c0", "c1"), step=20), holders=6)
    alive = [r for r in SHARDS if r.member_id != "b1"]
    snap = snapshot(g, alive, [])
    record = survivors_generation(snap, W6)
    assert record is not None and record.members == ("a0", "a1", "c0", "c1")


def test_no_survivors_generation_when_too_few_whole_replicas_remain() -> None:
    g = replace(gen(5, ("a0", "a1", "b0", "b1"), step=20), holders=4)
    alive = [r for r in SHARDS if r.member_id not in ("b1", "a0")]
    snap = snapshot(g, alive, [])
    assert survivors_generation(snap, WorldConfig(min_workers=2, max_workers=6)) is None
