"""Warm spares in the pure rendezvous rules (``rendezvous.decide``): who a generation takes, when
spares ask for a regroup, what a waiting spare does, and how status counts them. Tables of hand-built
snapshots; nothing touches a store or a clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.config import AgentConfig, Timeouts, WorldConfig
from elasticd.ops.status import WorkerState, build_status
from elasticd.rendezvous.decide import (
    ActionKind,
    Me,
    Window,
    choose_members,
    full_size,
    member_action,
    newcomers_admitted,
    publish_decision,
    spare_target,
    without_gone,
)
from elasticd.store.kv import KeyValue
from elasticd.wire.ops import NodeRecord, encode_node
from elasticd.wire.records import CoordinatorRecord, GenerationRecord, MemberRecord, encode
from elasticd.wire.snapshot import Snapshot
from tests.unit.test_membership import KEYS, NOW, SIG, gen, member, ready

pytestmark = pytest.mark.timeout(60)

T = Timeouts(join_window_s=0.25, last_call_s=0.3)
SETTLED = Window(NOW - 10, NOW - 10)


def spare(mid: str, node: str, standby: bool = False) -> MemberRecord:
    return replace(member(mid), node=node, spare=1, standby=int(standby))


def on(mid: str, node: str) -> MemberRecord:
    return replace(member(mid), node=node)


def snapshot(
    g: GenerationRecord | None, records: list[MemberRecord], ready_ids: list[str], steps: dict[str, int] | None = None
) -> Snapshot:
    """``records`` are alive; ``ready_ids`` wait, in that order (spares and newcomers hold nothing)."""
    steps = steps or {}
    return Snapshot(
        generation=g,
        generation_revision=50 if g else 0,
        members={r.member_id: r for r in records},
        ready={
            m: ready(
                m,
                steps.get(m, -1),
                prev_gen=g.generation if g and m in g.members else 0,
                prev_rank=g.rank_of(m) if g and m in g.members else 0,
            )
            for m in ready_ids
        },
        ready_order={m: 100 + i for i, m in enumerate(ready_ids)},
        coordinator=CoordinatorRecord("a", "n1"),
    )


# three nodes of one worker, each with one spare; b (node n2) crashed, so generation 3 is broken
G3 = gen(3, ("a", "b", "c"), step=40)
BASE = [on("a", "n1"), on("c", "n3"), spare("s1", "n1"), spare("s2", "n2"), spare("s3", "n3")]
W3 = WorldConfig(min_workers=1, max_workers=3)
W8 = WorldConfig(min_workers=1, max_workers=8)

CHOICE = [
    # (what, generation, alive, ready, world, chosen)
    ("a crashed worker's own node's spare replaces it", G3, BASE, ["a", "c", "s1", "s2", "s3"], W3, ["a", "c", "s2"]),
    (
        "the job is back at its full size, never past it, even below max_workers",
        G3,
        BASE,
        ["a", "c", "s1", "s2", "s3"],
        W8,
        ["a", "c", "s2"],
    ),
    (
        "a lost node: a standby node's spare takes its place",
        G3,
        [on("a", "n1"), on("c", "n3"), spare("s9", "n9", standby=True)],
        ["a", "c", "s9"],
        W3,
        ["a", "c", "s9"],
    ),
    (
        "between two empty nodes, the standby node comes last",
        G3,
        [on("a", "n1"), on("c", "n3"), spare("s9", "n9", standby=True), spare("s2", "n2")],
        ["a", "c", "s9", "s2"],
        W3,
        ["a", "c", "s2"],
    ),
    (
        "a lost node's spare (its leases not expired yet) comes after a working node's",
        G3,
        [on("a", "n1"), on("b", "n2"), on("c", "n3"), spare("s2", "n2"), spare("s3", "n3")],
        ["a", "c", "s2", "s3"],
        W3,
        ["a", "c", "s3"],
    ),
    (
        "... and after a standby node's",
        G3,
        [on("a", "n1"), on("b", "n2"), on("c", "n3"), spare("s2", "n2"), spare("s9", "n9", standby=True)],
        ["a", "c", "s2", "s9"],
        W3,
        ["a", "c", "s9"],
    ),
    ("no spare ready: the survivors go on alone", G3, [on("a", "n1"), on("c", "n3")], ["a", "c"], W3, ["a", "c"]),
    (
        "a first generation takes no spare while the regular workers reach min_workers",
        None,
        [on("a", "n1"), on("b", "n2"), spare("s1", "n1")],
        ["a", "b", "s1"],
        WorldConfig(min_workers=2),
        ["a", "b"],
    ),
    (
        "... nor when they do not: spares never start a job (the first one up would start it alone)",
        None,
        [on("a", "n1"), spare("s1", "n1")],
        ["a", "s1"],
        WorldConfig(min_workers=2),
        ["a"],
    ),
    ("a spare alone does not start a job", None, [spare("s1", "n1")], ["s1"], W3, []),
    (
        "below min_workers after a loss, spares fill up to it",
        gen(3, ("a", "b")),
        [on("a", "n1"), spare("s1", "n1")],
        ["a", "s1"],
        WorldConfig(min_workers=2),
        ["a", "s1"],
    ),
    (
        "a spare that a generation took is a member like any other",
        gen(4, ("a", "c", "s2"), step=50),
        [on("a", "n1"), on("c", "n3"), spare("s2", "n2"), spare("s3", "n3")],
        ["a", "s2", "s3"],
        W3,
        ["a", "s2", "s3"],
    ),
]


def test_a_lost_nodes_spare_comes_last_also_once_the_probe_left_its_member_out() -> None:
    # the node's member found gone (its store port refuses) while its lease lives: a node lost
    # whole; its spare's lease lives too, but the spare is as dead as the member
    s = snapshot(
        G3,
        [on("a", "n1"), on("b", "n2"), on("c", "n3"), spare("s2", "n2"), spare("s9", "n9", standby=True)],
        ["a", "c", "s2", "s9"],
        steps={"a": 40, "c": 40},
    )
    live = without_gone(s, {"b"})
    assert "b" not in live.members and live.lost_nodes == {"n2"}
    got = [r.member_id for r in choose_members(live, live.ready.values(), W3)]
    assert got == ["a", "c", "s9"], got


@pytest.mark.parametrize(("what", "g", "alive", "ready_ids", "world", "chosen"), CHOICE, ids=[c[0] for c in CHOICE])
def test_choose_members(
    what: str,
    g: GenerationRecord | None,
    alive: list[MemberRecord],
    ready_ids: list[str],
    world: WorldConfig,
    chosen: list[str],
) -> None:
    s = snapshot(g, alive, ready_ids, steps={"a": 40, "c": 40} if g is G3 else {"a": 50})
    got = [r.member_id for r in choose_members(s, s.ready.values(), world)]
    assert got == chosen, (what, got)


def test_the_published_generation_takes_the_spare_and_records_the_full_size() -> None:
    s = snapshot(G3, BASE, ["a", "c", "s1", "s2", "s3"], steps={"a": 40, "c": 40})
    act = publish_decision(s, SETTLED, NOW, W3, T)
    assert act.kind is ActionKind.PUBLISH and act.record is not None, act.reason
    assert act.record.members == ("a", "c", "s2") and act.record.reason == "member_lost"
    assert act.record.full_size == 3 and full_size(act.record) == 3


def test_spares_wait_quietly_while_the_generation_is_at_full_size() -> None:
    g = replace(gen(3, ("a", "c")), full_size=2)
    s = snapshot(g, [on("a", "n1"), on("c", "n3"), spare("s1", "n1")], ["s1"])
    assert newcomers_admitted(s, g, W8) == ()  # below max_workers, but at the job's full size
    act = publish_decision(s, SETTLED, NOW, W8, T)
    assert act.kind is ActionKind.WAIT, act.reason
    # a regular newcomer with room still joins (and the spare does not come with it)
    s2 = snapshot(g, [on("a", "n1"), on("c", "n3"), spare("s1", "n1"), on("d", "n4")], ["s1", "d"])
    assert newcomers_admitted(s2, g, W8) == ("d",)


def test_a_generation_below_its_full_size_asks_for_a_spare() -> None:
    """Two crashes, one spare: the second one's replacement spare, ready later, is taken then."""
    g = replace(gen(5, ("a", "c")), full_size=3)
    s = snapshot(g, [on("a", "n1"), on("c", "n3"), spare("s2", "n2")], ["s2"])
    assert newcomers_admitted(s, g, W8) == ("s2",)
    assert spare_target(g, W8) == 3 and spare_target(g, WorldConfig(max_workers=2)) == 2
    s_all = snapshot(g, [on("a", "n1"), on("c", "n3"), spare("s2", "n2")], ["a", "c", "s2"], steps={"a": 9, "c": 9})
    act = publish_decision(s_all, SETTLED, NOW, W8, T)
    assert act.record is not None and act.record.members == ("a", "c", "s2") and act.record.reason == "spare"


def test_a_waiting_spare_waits_as_a_standby_until_a_generation_takes_it() -> None:
    view = snapshot(G3, BASE, [])
    wait = member_action(view, Me("s1", SIG, 0, spare=True), W8)
    assert (wait.kind, wait.standby) == (ActionKind.WAIT, True), wait.reason
    taken = member_action(replace(view, generation=gen(4, ("a", "c", "s1"))), Me("s1", SIG, 0, spare=True), W8)
    assert taken.kind is ActionKind.JOIN


@pytest.mark.parametrize(
    ("nproc", "spares", "standby", "expect"),
    [
        (1, 0, False, [(0, 0, False), (0, 1, False)]),  # no spares: a restart is a newcomer
        (1, 1, False, [(0, 0, False), (1, 0, True), (0, 1, True), (1, 1, True)]),  # a restart goes back as a spare
        (2, 0, True, [(0, 0, True), (1, 0, True), (1, 2, True)]),  # a standby node: all spares
    ],
)
def test_which_worker_starts_as_a_spare(
    nproc: int, spares: int, standby: bool, expect: list[tuple[int, int, bool]]
) -> None:
    c = AgentConfig(program=("x",), nproc_per_node=nproc, spares_per_node=spares, standby_node=standby)
    assert c.slots == nproc + spares
    for local_rank, starts, is_spare in expect:
        assert c.starts_spare(local_rank, starts) is is_spare, (local_rank, starts)
    assert c.worker_env(0, spare=True).standby is standby


def test_status_counts_spares_per_node_and_names_a_standby_node() -> None:
    g = gen(3, ("a", "c"))
    rows = [KeyValue(KEYS.generation, encode(g), 50, 50, 0)]
    for r in (on("a", "n1"), on("c", "n3"), spare("s1", "n1"), spare("s9", "n9", standby=True)):
        rows.append(KeyValue(KEYS.member(r.member_id), encode(r), 10, 10, 1))
    for n in ("n1", "n3", "n9"):
        rows.append(
            KeyValue(
                KEYS.node(n),
                encode_node(NodeRecord(node=n, host="h", agent_pid=1, state="running", time=NOW, workers=())),
                10,
                10,
                1,
            )
        )
    st = build_status(KEYS, rows, now=NOW)
    assert {m.member_id: m.state for m in st.members}["s1"] is WorkerState.SPARE
    nodes = {n.node: (n.spares, n.standby) for n in st.nodes}
    assert nodes == {"n1": (1, False), "n3": (0, False), "n9": (1, True)}
    assert st.health.value == "healthy", st.reason  # waiting spares are not a degraded job
