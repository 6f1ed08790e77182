"""The resume hold (``rendezvous.resume``), pure, and the coordinator that applies it over an
in-memory store: a generation that resumes the job without any member of its last generation waits
``resume_hold_s`` from when that generation was first seen with no live member (the verdict's
``orphaned_at``, and the deciding process's own sight of it), since that generation may be cut off
from etcd and training on. A new job never waits.

``NOW`` is a monotonic time, ``WALL`` a wall-clock one; the hold is 30 s unless said otherwise."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from structlog.testing import capture_logs

from elasticd.config import Timeouts, WorldConfig
from elasticd.errors import ConfigError
from elasticd.rendezvous.coordinator import Coordinator
from elasticd.rendezvous.decide import ActionKind, Window, judge, publish_decision
from elasticd.rendezvous.reader import JobReader
from elasticd.rendezvous.resume import orphaned_since, resume_held_until
from elasticd.settings import worker_env_from_environ
from elasticd.wire.keys import Keys
from elasticd.wire.records import (
    CheckpointRecord,
    CoordinatorRecord,
    GenerationRecord,
    MemberRecord,
    ReadyRecord,
    VerdictRecord,
    decode_generation,
    decode_verdict,
    encode,
)
from elasticd.wire.snapshot import Snapshot
from tests.fakes import FakeKeyValueStore, ManualClock
from tests.unit.test_membership import NOW, gen, ready, snap

pytestmark = pytest.mark.timeout(30)

HOLD_S = 30.0
T = Timeouts(join_window_s=0.25, last_call_s=0.3, resume_hold_s=HOLD_S)
WALL = 1_700_000_000.0
G3 = gen(3, ["x", "y"], step=50)
CK = CheckpointRecord(step=40, path="/ckpt/job/00000004-step000000000040.ckpt", node="node-a")
W = WorldConfig(min_workers=1, max_workers=8)


def orphaned(at: float, generation: int = 3) -> VerdictRecord:
    """The coordinator's verdict on a generation none of whose members lives, judged so at ``at``."""
    return VerdictRecord(generation, "a" * 64, "members lost their lease: ['x', 'y']", 0, 1, "", at)


def dead(verdict: VerdictRecord | None = None, alive: tuple[str, ...] = ("a",)) -> Snapshot:
    """Generation 3 (x, y, at step 50) with every lease ended; ``a`` waits, holding the checkpoint."""
    s = snap(G3, alive=list(alive), ready_recs=[ready("a", 40)], verdict=verdict)
    return dataclasses.replace(s, checkpoint=CK, committed_step=55)


# -- the rule ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, s, seen, wall, until",
    [
        (
            "a new job (no earlier generation): nothing holds it",
            snap(None, alive=["a"], ready_recs=[ready("a", 40)]),
            NOW,
            WALL,
            None,
        ),
        (
            "a member of the last generation lives: nothing holds it (it holds the state, or the generation "
            "cannot train without it)",
            dead(alive=("a", "x")),
            NOW,
            WALL,
            None,
        ),
        (
            "every lease ended, no time recorded yet: resume_hold_s from this process's own sight",
            dead(),
            NOW - 10,
            WALL,
            NOW - 10 + HOLD_S,
        ),
        (
            "recorded 25 s ago by another coordinator: the 5 s left, not a new hold from my own sight",
            dead(orphaned(WALL - 25)),
            NOW - 1,
            WALL,
            NOW + 5,
        ),
        (
            "recorded an hour ago (a job restarted long after): over",
            dead(orphaned(WALL - 3600)),
            NOW,
            WALL,
            NOW - 3600 + HOLD_S,
        ),
        (
            "recorded by a clock an hour ahead: at most resume_hold_s past my own sight",
            dead(orphaned(WALL + 3600)),
            NOW - 1,
            WALL,
            NOW - 1 + HOLD_S,
        ),
        (
            "no wall clock given (next_action, tests): my own sight alone",
            dead(orphaned(WALL - 25)),
            NOW - 1,
            None,
            NOW - 1 + HOLD_S,
        ),
        (
            "a verdict on an older generation says nothing",
            dead(orphaned(WALL - 25, generation=2)),
            NOW - 1,
            WALL,
            NOW - 1 + HOLD_S,
        ),
        (
            "a verdict that does not say orphaned says nothing",
            dead(dataclasses.replace(orphaned(WALL - 25), orphaned=0)),
            NOW - 1,
            WALL,
            NOW - 1 + HOLD_S,
        ),
        (
            "a verdict orphaned with no time (written without one) says nothing",
            dead(orphaned(0.0)),
            NOW - 1,
            WALL,
            NOW - 1 + HOLD_S,
        ),
    ],
)
def test_resume_held_until(name: str, s: Snapshot, seen: float, wall: float | None, until: float | None) -> None:
    got = resume_held_until(s, seen, NOW, T, wall)
    assert got == (None if until is None else pytest.approx(until)), name


@pytest.mark.parametrize(
    "name, s, now, want",
    [
        ("no generation", snap(None, alive=["a"]), WALL, 0.0),
        ("a member lives", dead(alive=("a", "y")), WALL, 0.0),
        ("first judged orphaned now", dead(), WALL, WALL),
        ("kept from the stored verdict (a later coordinator)", dead(orphaned(WALL - 25)), WALL, WALL - 25),
        ("a stored verdict on another generation is not kept", dead(orphaned(WALL - 25, generation=2)), WALL, WALL),
        ("a stored verdict with no time: from now", dead(orphaned(0.0)), WALL, WALL),
    ],
)
def test_orphaned_since(name: str, s: Snapshot, now: float, want: float) -> None:
    assert orphaned_since(s, now) == want, name


def test_judge_records_when_the_generation_was_first_seen_orphaned_and_keeps_it() -> None:
    first = judge(dead(), W, now=WALL)
    assert first is not None and first.orphaned == 1 and first.orphaned_at == WALL
    again = judge(dead(first), W, now=WALL + 40)
    assert again == first  # the same record: not rewritten round after round
    back = judge(dead(first, alive=("a", "x")), W, now=WALL + 50)  # x reconnected
    assert back is not None and back.orphaned == 0 and back.orphaned_at == 0.0


def test_the_hold_goes_through_the_coordinators_decision() -> None:
    window = Window(NOW - 5, NOW - 5, broken_at=NOW - 5)
    held = publish_decision(dead(orphaned(WALL - 20)), window, NOW, W, T, wall=WALL)
    assert held.kind is ActionKind.WAIT and held.resume_held and held.until == pytest.approx(NOW + 10)
    assert "resume_hold_s" in held.reason
    done = publish_decision(dead(orphaned(WALL - 30)), window, NOW, W, T, wall=WALL)
    assert done.kind is ActionKind.PUBLISH and done.record is not None and done.record.reason == "resume"
    assert not done.resume_held and done.record.committed_step == 40


# -- the record and the setting ------------------------------------------------------------------


def test_the_verdict_carries_orphaned_at_and_refuses_garbage() -> None:
    v = orphaned(WALL + 0.25)
    assert decode_verdict(encode(v)) == v
    plain = dataclasses.replace(v, orphaned=0, orphaned_at=0.0)
    assert "orphaned_at" not in json.loads(encode(plain))  # a reader without the field reads it still
    assert decode_verdict(encode(plain)) == plain
    data = json.loads(encode(v))
    assert decode_verdict(json.dumps({**data, "orphaned_at": 7}).encode()).orphaned_at == 7.0
    for bad in (-1, "7", True, None):
        with pytest.raises((ValueError, TypeError)):
            decode_verdict(json.dumps({**data, "orphaned_at": bad}).encode())
    with pytest.raises(ValueError):
        decode_verdict(json.dumps({**data, "orphaned_at": math.nan}).encode())


def test_resume_hold_s_is_a_setting() -> None:
    assert Timeouts().resume_hold_s == 60.0  # the default test_membership_checkpoint.py counts on
    assert "trains on" in Timeouts.__dataclass_fields__["resume_hold_s"].metadata["doc"]
    env = worker_env_from_environ({"ELASTICD_NODE_ID": "n", "ELASTICD_RESUME_HOLD_S": "5"})
    assert env.timeouts.resume_hold_s == 5.0
    for bad in (0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ConfigError, match="resume_hold_s"):
            Timeouts(resume_hold_s=bad)


# -- the coordinator -------------------------------------------------------------------------------

KEYS = Keys("/elasticd", "j")


def _member(store: FakeKeyValueStore, name: str, lease: int, ready_step: int | None = None) -> None:
    store.put(KEYS.member(name), encode(MemberRecord(name, name.split(".")[0], 0, 1, "127.0.0.1", 1, "s")), lease=lease)
    if ready_step is not None:
        store.put(KEYS.ready(name), encode(ReadyRecord(name, ready_step, 0, 0, "s")), lease=lease)


def _coordinator(store: FakeKeyValueStore, clock: ManualClock, wall: list[float], me: str) -> Coordinator:
    store.put(KEYS.coordinator, encode(CoordinatorRecord(me, me.split(".")[0])))
    return Coordinator(
        store,
        KEYS,
        me,
        W,
        T,
        clock,
        JobReader(store, KEYS, "n").snapshot,
        lambda g: (KEYS.event(f"{g.generation:020d}.x.0"), b"{}"),
        wall=lambda: wall[0],
    )


def _generation(store: FakeKeyValueStore) -> GenerationRecord:
    kv = store.get(KEYS.generation)
    assert kv is not None
    return decode_generation(kv.value)


def test_a_coordinator_holds_the_resume_logs_it_once_and_the_next_coordinator_does_not_start_over() -> None:
    """Generation 1 (x, y at step 55) loses every lease without a revoke, as when its members are
    cut off from etcd; newcomers n and m loaded the checkpoint at step 40 and wait."""
    clock, wall = ManualClock(), [WALL]
    store = FakeKeyValueStore(clock)
    old, fresh = store.grant_lease(3), store.grant_lease(600)
    for name in ("x.0.1", "y.0.2"):
        _member(store, name, old)
    store.put(KEYS.generation, encode(GenerationRecord(1, ("x.0.1", "y.0.2"), "127.0.0.1", 1, "s", 55, "start")))
    store.put(KEYS.checkpoint, encode(CK))
    clock.advance(4.0)  # their lease ends: nobody renewed it
    wall[0] += 4.0
    t0, w0 = clock(), wall[0]
    _member(store, "n.0.3", fresh, ready_step=40)
    _member(store, "m.0.4", fresh, ready_step=40)
    c = _coordinator(store, clock, wall, "n.0.3")
    with capture_logs() as logs:
        assert c.round() == pytest.approx(t0 + HOLD_S)  # held: the next round is due when the hold ends
        kv = store.get(KEYS.verdict)
        assert kv is not None
        verdict = decode_verdict(kv.value)
        assert (verdict.generation, verdict.orphaned, verdict.orphaned_at) == (1, 1, w0)  # the marker
        clock.advance(20.0)
        wall[0] += 20.0
        assert c.round() == pytest.approx(t0 + HOLD_S) and _generation(store).generation == 1
        assert store.get(KEYS.verdict).mod_revision == kv.mod_revision  # type: ignore[union-attr]  # kept as is
    held = [e for e in logs if e["event"] == "resume_held"]
    assert len(held) == 1 and held[0]["generation"] == 1 and held[0]["bound_s"] == HOLD_S, logs
    # n's coordinator dies; m takes over 25 s after the marker: it waits the 5 s left, not 30 s again
    clock.advance(5.0)
    wall[0] += 5.0
    c2 = _coordinator(store, clock, wall, "m.0.4")
    assert c2.round() == pytest.approx(t0 + HOLD_S) and _generation(store).generation == 1
    clock.advance(5.0)
    wall[0] += 5.0
    c2.round()
    g = _generation(store)
    assert g.generation == 2 and g.reason == "resume" and g.committed_step == 40
    assert set(g.members) == {"n.0.3", "m.0.4"}
