"""The coordinator's rounds over an in-memory store (no threads started; the clock is manual):
when it publishes, what verdict it writes and how often, and that a stale one stands down."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest

from elasticd.config import Timeouts, WorldConfig
from elasticd.rendezvous.coordinator import Coordinator, NotCoordinator, round_wait_s
from elasticd.rendezvous.decide import Window, held_out
from elasticd.rendezvous.deputy import deputy_starts_s, deputy_tier
from elasticd.rendezvous.reader import JobReader
from elasticd.wire.keys import Keys
from elasticd.wire.snapshot import Snapshot
from elasticd.wire.records import (
    AbortRecord,
    CoordinatorRecord,
    GenerationRecord,
    MemberRecord,
    ReadyRecord,
    decode_generation,
    decode_verdict,
    encode,
)
from tests.fakes import FakeKeyValueStore, ManualClock

pytestmark = pytest.mark.timeout(30)
KEYS = Keys("/elasticd", "j")
T = Timeouts(join_window_s=0.25, last_call_s=0.3)


def _member(store: FakeKeyValueStore, name: str, lease: int, step: int = -1, prev: int = 0) -> None:
    store.put(KEYS.member(name), encode(MemberRecord(name, name.split(".")[0], 0, 1, "127.0.0.1", 1, "s")), lease=lease)
    store.put(KEYS.ready(name), encode(ReadyRecord(name, step, prev, 0, "s")), lease=lease)


def _coordinator(
    store: FakeKeyValueStore,
    clock: ManualClock,
    world: WorldConfig,
    me: str = "a.0.1",
    noted: list[tuple[int, frozenset[str]]] | None = None,
    elected: bool = True,
    wall: Callable[[], float] = time.time,
) -> Coordinator:
    store.put(KEYS.coordinator, encode(CoordinatorRecord(me, "a")))
    finding = noted if noted is not None else [(0, frozenset())]
    return Coordinator(
        store,
        KEYS,
        me,
        world,
        T,
        clock,
        JobReader(store, KEYS, "a").snapshot,
        lambda g: (KEYS.event(f"{g.generation:020d}.x.0"), b"{}"),
        elected=elected,
        noted=lambda: finding[-1],
        wall=wall,
    )


def test_it_waits_for_min_workers_then_publishes_with_a_token_and_writes_no_verdict_when_healthy() -> None:
    clock = ManualClock()
    store = FakeKeyValueStore(clock)
    lease = store.grant_lease(60)
    c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=2, max_workers=3))
    _member(store, "a.0.1", lease)
    assert c.round() is None and store.get(KEYS.generation) is None  # 1 ready < min_workers 2
    _member(store, "b.0.2", lease)
    until = c.round()  # the join window is open (2 < max 3)
    assert until == pytest.approx(clock() + T.join_window_s) and store.get(KEYS.generation) is None
    clock.advance(T.join_window_s)
    assert c.round() == clock()  # published: read again at once
    kv = store.get(KEYS.generation)
    assert kv is not None
    g = decode_generation(kv.value)
    assert g.members == ("a.0.1", "b.0.2") and len(g.token) == 32 and g.reason == "start"
    assert c.round() is None and store.get(KEYS.verdict) is None  # healthy, nobody waiting: nothing to say


def _three_published(steps: dict[str, int], lost: str) -> tuple[FakeKeyValueStore, Coordinator, int, int]:
    """Members at ``steps`` (the ``lost`` one under a lease of its own) and the coordinator's
    generation of the three, published: (store, coordinator, the others' lease, the lost one's)."""
    clock = ManualClock()
    store = FakeKeyValueStore(clock)
    keep, gone = store.grant_lease(60), store.grant_lease(60)
    c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=1, max_workers=3))
    for name, step in steps.items():
        _member(store, name, gone if name == lost else keep, step=step)
    c.round()
    clock.advance(1.0)
    c.round()
    return store, c, keep, gone


def test_a_lost_member_is_judged_once_and_the_survivors_regroup_when_the_first_may_not_hold_the_newest_step() -> None:
    """The ready round: the lost member was the only one at the newest step when the generation was
    published (``holders`` 1), so the survivors must say which step they hold."""
    store, c, keep, gone = _three_published({"a.0.1": 6, "b.0.2": 5, "c.0.3": 5}, lost="a.0.1")
    g = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g.world_size == 3 and g.holders == 1 and g.committed_step == 6
    store.revoke_lease(gone)
    c.round()
    assert decode_generation(store.get(KEYS.generation).value).generation == g.generation  # type: ignore[union-attr]
    kv = store.get(KEYS.verdict)
    assert kv is not None
    verdict = decode_verdict(kv.value)
    assert verdict.generation == g.generation and "a.0.1" in verdict.abandon
    c.round()
    assert store.get(KEYS.verdict).mod_revision == kv.mod_revision  # type: ignore[union-attr]  # not rewritten
    # the survivors come back to the rendezvous: the next generation is theirs
    _member(store, "b.0.2", keep, step=6, prev=g.generation)
    _member(store, "c.0.3", keep, step=6, prev=g.generation)
    c.round()
    g2 = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g2.members == ("b.0.2", "c.0.3") and g2.reason == "member_lost" and g2.token != g.token
    assert g2.committed_step == 6 and g2.holders == 2
    # the new generation is healthy: nothing to say, and the stale verdict on the old one stays as it was
    assert c.round() is None
    assert decode_verdict(store.get(KEYS.verdict).value).generation == g.generation  # type: ignore[union-attr]


def test_a_lost_lease_publishes_the_survivors_generation_at_once_with_no_ready_round_and_no_verdict() -> None:
    """A leave in one round: the survivors keep their order and need not write anything."""
    store, c, keep, gone = _three_published({"a.0.1": 5, "b.0.2": 5, "c.0.3": 5}, lost="b.0.2")
    clock = store.clock
    g = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g.members == ("a.0.1", "b.0.2", "c.0.3") and g.holders == 3
    store.revoke_lease(gone)
    assert c.round() == clock()  # published: read again at once
    g2 = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g2.generation == g.generation + 1 and g2.members == ("a.0.1", "c.0.3")
    assert g2.reason == "member_lost" and g2.committed_step == 5 and g2.holders == 2 and g2.token != g.token
    assert store.get(KEYS.verdict) is None  # the new generation says it all
    assert c.round() is None and store.get(KEYS.verdict) is None


def test_members_train_through_a_newcomers_join_window_and_regroup_once_it_closed() -> None:
    """The verdict's pending flag (which stops the members at their next step) is
    written when the newcomer's join window closes, not when it arrives, and the members' arrival at
    the rendezvous does not open the window again: one regroup, no idle join window."""
    clock = ManualClock()
    store = FakeKeyValueStore(clock)
    lease = store.grant_lease(60)
    c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=2, max_workers=4))
    _member(store, "a.0.1", lease, step=0)
    _member(store, "b.0.2", lease, step=0)
    c.round()
    clock.advance(T.join_window_s)
    c.round()
    g = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g.members == ("a.0.1", "b.0.2")
    c.round()
    clock.advance(5.0)  # training
    _member(store, "n.0.3", lease)  # a newcomer
    arrived = clock()
    until = c.round()
    assert store.get(KEYS.verdict) is None  # not yet: a and b train on through the window
    assert until == pytest.approx(arrived + T.join_window_s)
    clock.advance(T.join_window_s)
    c.round()
    kv = store.get(KEYS.verdict)
    assert kv is not None and decode_verdict(kv.value).pending == 1 and not decode_verdict(kv.value).abandon
    clock.advance(0.05)  # a and b reach their step boundary
    _member(store, "a.0.1", lease, step=9, prev=g.generation)
    c.round()
    _member(store, "b.0.2", lease, step=9, prev=g.generation)
    assert c.round() == clock()  # published at once: their arrival did not reopen the window
    g2 = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g2.members == ("a.0.1", "b.0.2", "n.0.3") and g2.reason == "join"


def test_a_coordinator_whose_record_names_another_stands_down() -> None:
    clock = ManualClock()
    store = FakeKeyValueStore(clock)
    c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=1))
    store.put(KEYS.coordinator, encode(CoordinatorRecord("b.0.2", "b")))
    with pytest.raises(NotCoordinator):
        c.round()


def test_a_large_generation_is_published_with_its_roster_and_older_rosters_go() -> None:
    clock = ManualClock()
    store = FakeKeyValueStore(clock)
    lease = store.grant_lease(60)
    n = 100
    c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=n, max_workers=n))
    store.put(KEYS.roster(0, 0), b'{"ranks": {}}')  # an older roster
    for i in range(n):
        _member(store, f"n{i:03d}.0.{i}", lease)
    c.round()
    rows = store.get_prefix(KEYS.roster_prefix)
    assert {KEYS.roster_of(r.key)[0] for r in rows} == {1} and len(rows) == 2  # buckets_for(100)
    full = JobReader(store, KEYS, "x").snapshot().generation
    mine = JobReader(store, KEYS, "n042").view().generation
    assert full is not None and full.world_size == n and "" not in full.members
    assert mine is not None and mine.rank_of("n042.0.42") == full.rank_of("n042.0.42") and "" in mine.members


def test_garbage_in_place_of_the_generation_publishes_nothing_for_members_still_training() -> None:
    """Hand-written garbage replaced the record: the ready records consumed by the generation it
    replaced must not look like waiting members (a generation 1 was published again for them)."""
    clock = ManualClock()
    store = FakeKeyValueStore(clock)
    lease = store.grant_lease(60)
    c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=1, max_workers=1))
    _member(store, "a.0.1", lease)
    c.round()
    assert decode_generation(store.get(KEYS.generation).value).generation == 1  # type: ignore[union-attr]
    store.put(KEYS.generation, b"[[[[")
    before = store.get(KEYS.generation)
    c.round()
    assert store.get(KEYS.generation) == before  # nothing published over it
    _member(store, "a.0.1", lease, prev=1)  # the member comes to the rendezvous: a fresh ready record
    c.round()
    g = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g.generation == 2 and g.members == ("a.0.1",)


T_POLL = Timeouts(keepalive_s=1.5, lease_ttl_s=4.0, round_poll_s=0.25, view_poll_s=3.0)


@pytest.mark.parametrize(
    ("until", "window", "now", "expected"),
    [
        (None, None, 10.0, 3.0),  # nobody waits: only the safety net, every view_poll_s
        (10.2, None, 10.0, 0.2),  # the time the last round named
        (9.0, Window(8.0, 8.0, 8.5), 10.0, 0.0),  # ... already past
        (20.0, Window(8.0, 8.0, 8.5), 10.0, 1.5),  # ... far off: at most keepalive_s
        (None, Window(8.0, 8.0, 8.5), 10.0, 0.25),  # a broken generation's round: poll
        (None, Window(8.0, 8.0, None), 10.0, 3.0),  # standbys beside a healthy one: no poll
    ],
)
def test_round_wait_s(until: float | None, window: Window | None, now: float, expected: float) -> None:
    assert round_wait_s(until, window, now, T_POLL) == pytest.approx(expected)


def _listening() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(4)
    return s


def _member_at(
    store: FakeKeyValueStore, name: str, lease: int, port: int, step: int = -1, prev: int = 0, ready: bool = True
) -> None:
    store.put(
        KEYS.member(name), encode(MemberRecord(name, name.split(".")[0], 0, 1, "127.0.0.1", port, "s")), lease=lease
    )
    if ready:
        store.put(KEYS.ready(name), encode(ReadyRecord(name, step, prev, 0, "s")), lease=lease)


@pytest.mark.parametrize("how", ["refused", "unreachable", "noted", "alive", "unreachable to a deputy"])
def test_a_missing_member_whose_port_refuses_or_whose_host_is_silent_is_left_out_at_once(how: str) -> None:
    """A node lost with its agent: nobody revoked its worker's lease, but the port the worker
    advertised refuses connections (``refused``), or its host does not answer at all (``unreachable``:
    a host down or cut off; here an accept queue that is full, so the kernel drops the SYN), or the
    reach check of a stuck member found it so (``noted``, ``rendezvous.reach``): the survivors'
    generation is published without the last call (rendezvous.probe). A port that still accepts (a
    live or a stopped process) decides nothing: it gets its last call. So does a silent host asked
    by a deputy, which asks within its own join and waits DEPUTY_PROBE_S at most."""
    clock = ManualClock()
    store = FakeKeyValueStore(clock)
    lease = store.grant_lease(60)
    socks = [_listening() for _ in range(3)]
    ports = [s.getsockname()[1] for s in socks]
    noted: list[tuple[int, frozenset[str]]] = [(0, frozenset())]
    try:
        c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=1, max_workers=3), noted=noted)
        names = ["a.0.1", "b.0.2", "c.0.3"]
        for name, port in zip(names, ports, strict=True):
            _member_at(store, name, lease, port, step=0)
        c.round()
        clock.advance(T.join_window_s)
        c.round()
        g = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
        assert g.world_size == 3
        if how == "unreachable to a deputy":
            c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=1, max_workers=3), elected=False)
        if how == "refused":
            socks[2].close()  # c's process is gone; its lease lives on
        elif how.startswith("unreachable"):  # c's host is gone: nothing answers its port
            filler = socket.socket()
            socks.append(filler)
            socks[2].close()
            socks[2] = socket.socket()
            socks[2].bind(("127.0.0.1", 0))
            socks[2].listen(0)
            filler.connect(socks[2].getsockname())
            _member_at(store, "c.0.3", lease, socks[2].getsockname()[1], ready=False)
        elif how == "noted":
            noted.append((g.generation, frozenset({"c.0.3"})))
        clock.advance(5.0)
        # a's all_reduce broke (or a reach check aborted it): a and b come
        store.put(KEYS.abort, encode(AbortRecord(g.generation, "a.0.1", "gradient all_reduce failed")))
        _member_at(store, "a.0.1", lease, ports[0], step=7, prev=g.generation)
        _member_at(store, "b.0.2", lease, ports[1], step=7, prev=g.generation)
        until = c.round()
        g2 = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
        if how in ("refused", "unreachable", "noted"):
            assert g2.generation == g.generation + 1 and g2.members == ("a.0.1", "b.0.2") and until == clock()
        else:
            assert g2.generation == g.generation and until == pytest.approx(clock() + T.last_call_s)
            clock.advance(T.last_call_s)
            c.round()
            g2 = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
            assert g2.members == ("a.0.1", "b.0.2") and g2.reason == "aborted"
    finally:
        for s in socks:
            s.close()


def test_the_last_members_of_a_generation_are_not_given_up_on_a_probe_alone() -> None:
    """Every member of the generation left refuses its port and none came, a newcomer waits: no
    STATE_LOST is declared and nothing is published on the probe alone (their leases decide)."""
    clock = ManualClock()
    store = FakeKeyValueStore(clock)
    lease = store.grant_lease(60)
    c = _coordinator(store, clock, WorldConfig(job_id="j", min_workers=1, max_workers=3), me="n.0.9")
    for name in ("a.0.1", "b.0.2"):
        _member_at(store, name, lease, 1, step=0)  # port 1: nothing listens (refused)
    c.round()
    clock.advance(T.join_window_s)
    c.round()
    g = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    clock.advance(5.0)
    store.put(KEYS.abort, encode(AbortRecord(g.generation, "a.0.1", "boom")))
    _member_at(store, "n.0.9", lease, 1, step=-1)  # a newcomer without the state
    for _ in range(3):
        c.round()
        clock.advance(T.last_call_s)
    assert decode_generation(store.get(KEYS.generation).value).generation == g.generation  # type: ignore[union-attr]
    verdict = store.get(KEYS.verdict)
    assert verdict is None or not decode_verdict(verdict.value).error


@pytest.mark.parametrize(
    ("world", "tiers"),
    [
        (1, [0]),
        (2, [0, 0]),
        (3, [0, 0, 2]),  # tier 1 = ranks 0, 1; tier 2 = ranks 1, 2
        (4, [0, 0, 1, 2]),  # tier 1 = ranks 1, 2: rank 1 is tier 0 already
        (5, [0, 0, 1, 2, 3]),  # a small job: every rank deputizes, the later ones later
        (12, [0, 0, None, 1, 1, None, 2, 2, None, 3, 3, None]),
        (8, [0, 0, 1, 1, 2, 2, 3, 3]),
        # 4 nodes x 8 GPUs: one deputy pair per node, not four pairs on node 0
        (32, [0, 0] + [None] * 6 + [1, 1] + [None] * 6 + [2, 2] + [None] * 6 + [3, 3] + [None] * 6),
    ],
)
def test_deputy_tiers_are_spread_over_the_rank_order(world: int, tiers: list[int | None]) -> None:
    assert [deputy_tier(r, world) for r in range(world)] == tiers


@pytest.mark.parametrize(
    ("tier", "heard", "grace", "want"),
    [
        (None, False, 0.0, None),  # not a deputy
        (0, False, 0.0, 0.0),  # rank 0 and 1: at once, by default
        (0, True, 0.0, 0.0),  # ... also beside a coordinator at work
        (0, True, 0.4, 0.4),  # ... after coordinator_grace_s
        (1, False, 0.0, 0.5),  # later tiers: one deputy_step_s (0.5 s) per tier
        (3, False, 0.4, 1.9),
        (1, True, 0.0, None),  # not while the coordinator's verdict on the generation is there
        (3, True, 0.0, None),
    ],
)
def test_deputy_starts_by_tier_and_only_while_the_coordinator_is_silent(
    tier: int | None, heard: bool, grace: float, want: float | None
) -> None:
    got = deputy_starts_s(tier, heard, Timeouts(coordinator_grace_s=grace, deputy_step_s=0.5))
    assert got == (None if want is None else pytest.approx(want))


G5 = GenerationRecord(5, ("a", "b", "c"), "127.0.0.1", 1, "s", 0, "start")
G6 = GenerationRecord(6, ("a", "b"), "127.0.0.1", 1, "s", 0, "aborted")
G7 = GenerationRecord(7, ("a", "b", "c"), "127.0.0.1", 1, "s", 0, "join")


@pytest.mark.parametrize(
    ("g", "out", "now", "held"),
    [
        (G5, (), 1001.0, {}),  # an abort that names nobody
        (G5, ("c",), 1000.0, {"c": 1005.0}),  # found in the generation it is in (now aborted)
        (G6, ("c",), 1004.9, {"c": 1005.0}),  # left out: held while it waits as a newcomer
        (G6, ("c",), 1005.0, {}),  # the hold is over: it may join
        (G7, ("c",), 1002.0, {}),  # a newer generation took it back: a member like any other
        (G7, ("c", "d"), 1002.0, {"d": 1005.0}),
        (None, ("c",), 1001.0, {"c": 1005.0}),
    ],
)
def test_held_out(g: GenerationRecord | None, out: tuple[str, ...], now: float, held: dict[str, float]) -> None:
    snap = Snapshot(generation=g, aborted=5, out_of_reach=frozenset(out), aborted_at=1000.0)
    assert held_out(snap, now, 5.0) == held


def test_the_last_abort_read_names_who_is_held_out_and_since_when() -> None:
    store = FakeKeyValueStore(ManualClock())
    store.put(KEYS.abort, encode(AbortRecord(4, "a.0.1", "members out of reach", ("c.0.3",), 1234.5)))
    snap = JobReader(store, KEYS, "a").snapshot()
    assert (snap.aborted, snap.out_of_reach, snap.aborted_at) == (4, frozenset({"c.0.3"}), 1234.5)
    store.put(KEYS.abort, encode(AbortRecord(5, "a.0.1", "gradient all_reduce failed")))  # an older writer's form
    snap = JobReader(store, KEYS, "a").snapshot()
    assert (snap.aborted, snap.out_of_reach, snap.aborted_at) == (5, frozenset(), 0.0)


def test_a_member_named_out_of_reach_by_an_abort_is_held_out_for_reach_hold_s_though_it_comes_back() -> None:
    """A flapping link: a reach check found c's host silent and aborted the generation, naming c;
    c's host answers again in an up phase and c comes to the rendezvous at once. The next generation
    is published without c (taking it back during the flap would hold the group build for it); the
    round names when the hold ends, by the abort's time, whichever coordinator or deputy runs it;
    and c comes back after it."""
    clock = ManualClock()
    wall = [50_000.0]
    store = FakeKeyValueStore(clock)
    lease = store.grant_lease(600)
    world = WorldConfig(job_id="j", min_workers=1, max_workers=3)

    def coordinator(elected: bool = True) -> Coordinator:
        return _coordinator(store, clock, world, elected=elected, wall=lambda: wall[0] + clock())

    c = coordinator()
    for name in ("a.0.1", "b.0.2", "c.0.3"):
        _member(store, name, lease, step=0)
    c.round()
    clock.advance(T.join_window_s)
    c.round()
    g = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g.world_size == 3
    clock.advance(5.0)
    written = wall[0] + clock() - 1.0  # the prober wrote it a second ago
    store.put(KEYS.abort, encode(AbortRecord(g.generation, "a.0.1", "members out of reach", ("c.0.3",), written)))
    for name in ("a.0.1", "b.0.2", "c.0.3"):  # every member comes, c too (its link is up again)
        _member(store, name, lease, step=7, prev=g.generation)
    c.round()
    g2 = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g2.generation == g.generation + 1 and g2.members == ("a.0.1", "b.0.2")
    _member(store, "c.0.3", lease, step=7, prev=g.generation)  # c waits as a newcomer
    ends = clock() + T.reach_hold_s - 1.0
    assert c.round() == pytest.approx(ends)  # the round is due when the hold ends
    assert coordinator(elected=False).round() == pytest.approx(ends)  # a deputy's new rounds: the same end
    clock.advance(T.reach_hold_s - 1.1)
    c.round()
    assert decode_generation(store.get(KEYS.generation).value).generation == g2.generation  # type: ignore[union-attr]
    assert store.get(KEYS.verdict) is None  # nothing to say: c is not announced
    clock.advance(0.1)
    c.round()  # the hold is over: c is announced to the generation (it brings it to max_workers)
    assert decode_verdict(store.get(KEYS.verdict).value).pending  # type: ignore[union-attr]
    for name in ("a.0.1", "b.0.2"):  # they come at their next step boundary
        _member(store, name, lease, step=9, prev=g2.generation)
    c.round()
    g3 = decode_generation(store.get(KEYS.generation).value)  # type: ignore[union-attr]
    assert g3.generation == g2.generation + 1 and set(g3.members) == {"a.0.1", "b.0.2", "c.0.3"}
