"""The durable-checkpoint parts of the rendezvous (pure): when a member looks on disk
(``should_load_checkpoint``), resume vs. state lost in ``next_action``, the hold on a resume while
the last generation may still be training cut off from etcd, and the tolerant ``checkpoint``
record decoder."""

from __future__ import annotations

import dataclasses
import json

import pytest

from elasticd.rendezvous.decide import ActionKind, Window, should_load_checkpoint
from elasticd.store.kv import KeyValue
from elasticd.wire.records import (
    CheckpointRecord,
    FinishedRecord,
    decode_checkpoint,
    encode,
)
from elasticd.wire.snapshot import Snapshot, parse_snapshot
from tests.unit.test_membership import KEYS, NOW, decide, gen, me, ready, settled, snap

pytestmark = pytest.mark.timeout(60)

CK = CheckpointRecord(
    step=40, path="/ckpt/job/00000004-step000000000040.ckpt", node="node-a", generation=3, seq=4, bytes=1000, time=1.5
)


HOLD_S = 60.0  # resume_hold_s's default (test_resume_hold.py checks it)
# a round whose generation was seen broken resume_hold_s ago: the resume hold is over
AFTER_HOLD = Window(entered_at=NOW - HOLD_S - 10, newcomers_changed_at=NOW - HOLD_S - 10, broken_at=NOW - HOLD_S)


def with_ck(s: Snapshot, ck: CheckpointRecord | None = CK, committed: int = -1) -> Snapshot:
    return dataclasses.replace(s, checkpoint=ck, committed_step=committed)


@pytest.mark.parametrize(
    "name, s, held, want",
    [
        ("fresh job, nothing in etcd: look on disk", snap(None), -1, True),
        ("fresh job, holding state already", snap(None), 5, False),
        ("live generation: its members hold the state", with_ck(snap(gen(3, ["a"], step=50), alive=["a"])), -1, False),
        ("every member gone, nothing held", with_ck(snap(gen(3, ["a", "b"], step=50))), -1, True),
        (
            "every member gone, holding an older step than the checkpoint",
            with_ck(snap(gen(3, ["a"], step=30))),
            30,
            True,
        ),
        ("every member gone, holding the newest step", with_ck(snap(gen(3, ["a"], step=30)), committed=41), 41, False),
        (
            "every member gone, committed record newer than held",
            with_ck(snap(gen(3, ["a"], step=30)), None, 60),
            50,
            True,
        ),
        ("finished job", dataclasses.replace(snap(gen(3, ["a"], step=50)), finished=FinishedRecord(3, 50)), -1, False),
    ],
)
def test_should_load_checkpoint(name: str, s: Snapshot, held: int, want: bool) -> None:
    assert should_load_checkpoint(s, held) is want


def _dead_job(ck: CheckpointRecord | None, ready_steps: dict[str, int]) -> Snapshot:
    """Generation 3 of members x, y (all gone), which reached step 55; newcomers wait."""
    s = snap(
        gen(3, ["x", "y"], step=50),
        alive=list(ready_steps),
        ready_recs=[ready(m, step) for m, step in ready_steps.items()],
    )
    return with_ck(s, ck, committed=55)


def test_no_live_state_and_no_checkpoint_is_state_lost() -> None:
    action = decide(_dead_job(None, {"a": -1, "b": -1}), me("a"), window=settled())
    assert action.kind is ActionKind.STATE_LOST
    assert "no durable checkpoint" in action.error and "step 55" in action.error


def test_a_member_holding_the_checkpoint_resumes_the_job_as_rank0() -> None:
    action = decide(_dead_job(CK, {"b": -1, "a": 40}), me("b"), window=AFTER_HOLD)
    assert action.kind is ActionKind.PUBLISH, action.reason
    assert action.record is not None
    assert action.record.members == ("a", "b") and action.record.committed_step == 40
    assert action.record.reason == "resume" and action.record.generation == 4


def test_an_older_good_checkpoint_resumes_too_when_the_newest_is_unusable() -> None:
    action = decide(_dead_job(CK, {"a": 30}), me("a"), window=AFTER_HOLD)
    assert action.kind is ActionKind.PUBLISH and action.record is not None
    assert action.record.committed_step == 30 and action.record.reason == "resume"


def test_nobody_could_load_the_recorded_checkpoint_waits_for_someone_who_can() -> None:
    action = decide(_dead_job(CK, {"a": -1, "b": -1}), me("a"), window=settled())
    assert action.kind is ActionKind.WAIT
    assert "step 40" in action.reason and CK.path in action.reason


def test_a_first_generation_from_disk_is_a_resume() -> None:
    s = snap(None, alive=["a", "b"], ready_recs=[ready("b", -1), ready("a", 40)])
    action = decide(s, me("a"), window=settled())
    assert action.kind is ActionKind.PUBLISH and action.record is not None
    assert action.record.members == ("a", "b") and action.record.reason == "resume"


def test_checkpoint_record_round_trip_and_tolerance() -> None:
    assert decode_checkpoint(encode(CK)) == CK
    extra = json.dumps({"step": 7, "path": "/p", "node": "n", "future_field": [1, 2]}).encode()
    assert decode_checkpoint(extra) == CheckpointRecord(step=7, path="/p", node="n")
    for bad in (
        b"[]",
        b'{"step": 7, "path": "/p"}',
        b'{"step": "7", "path": "/p", "node": "n"}',
        b'{"step": -1, "path": "/p", "node": "n"}',
        b'{"step": true, "path": "/p", "node": "n"}',
        b"\xff",
    ):
        with pytest.raises((ValueError, TypeError, UnicodeDecodeError)):
            decode_checkpoint(bad)


def test_parse_snapshot_reads_the_checkpoint_record_and_lists_garbage() -> None:
    good = parse_snapshot(KEYS, [KeyValue(KEYS.checkpoint, encode(CK), 5, 5)])
    assert good.checkpoint == CK and not good.malformed
    bad = parse_snapshot(KEYS, [KeyValue(KEYS.checkpoint, b'{"step": "x"}', 5, 5)])
    assert bad.checkpoint is None and len(bad.malformed) == 1 and KEYS.checkpoint in bad.malformed[0]
    assert KEYS.checkpoint == "/elasticd/job/checkpoint"


def test_a_live_generation_is_never_resumed_from_disk() -> None:
    """A live generation is never resumed from disk, whatever the record says."""
    s = with_ck(
        snap(
            gen(3, ["a", "b"], step=50),
            alive=["a", "b", "n"],
            ready_recs=[ready("a", 50, 3, 0), ready("b", 50, 3, 1), ready("n", 40)],
        ),
        CK,
        50,
    )
    action = decide(s, me("a", 3), window=settled())
    assert action.kind is ActionKind.PUBLISH and action.record is not None
    assert action.record.members[:2] == ("a", "b") and action.record.reason == "join"


def test_a_checkpoint_of_the_newest_step_is_a_resume_too() -> None:
    action = decide(_dead_job(CK, {"a": 55}), me("a"), window=AFTER_HOLD)
    assert action.kind is ActionKind.PUBLISH and action.record is not None
    assert action.record.committed_step == 55 and action.record.reason == "resume"


# The resume hold (decide.resume_held_until), through the whole decision: generation 3 of x, y
# reached step 55; every lease of it ended (its members died, or are cut off from etcd and train
# on); newcomers that loaded the checkpoint at step 40 wait. Windows on the coordinator's clock.
def _seen_broken(ago_s: float) -> Window:
    return Window(entered_at=NOW - ago_s, newcomers_changed_at=NOW - ago_s, broken_at=NOW - ago_s)


@pytest.mark.parametrize(
    "name, s, window, kind, until, reason",
    [
        (
            "just seen with no live member: held for resume_hold_s",
            _dead_job(CK, {"a": 40, "b": 40}),
            _seen_broken(0.0),
            ActionKind.WAIT,
            NOW + HOLD_S,
            None,
        ),
        (
            "seen 59 s ago: still held",
            _dead_job(CK, {"a": 40, "b": 40}),
            _seen_broken(HOLD_S - 1),
            ActionKind.WAIT,
            NOW + 1,
            None,
        ),
        (
            "a member left behind, holding step 30 in memory, is held too (a resume all the same)",
            _dead_job(CK, {"a": 30}),
            _seen_broken(1.0),
            ActionKind.WAIT,
            NOW - 1 + HOLD_S,
            None,
        ),
        (
            "resume_hold_s after it was seen: published as a resume",
            _dead_job(CK, {"a": 40, "b": 40}),
            _seen_broken(HOLD_S),
            ActionKind.PUBLISH,
            None,
            "resume",
        ),
        (
            "the cut-off generation reconnects within the hold: it leads with its newest step, no resume",
            with_ck(
                snap(
                    gen(3, ["x", "y"], step=50),
                    alive=["x", "y", "a"],
                    ready_recs=[ready("a", 40), ready("x", 55, 3, 0), ready("y", 55, 3, 1)],
                ),
                CK,
                55,
            ),
            _seen_broken(1.0),
            ActionKind.PUBLISH,
            None,
            "join",
        ),
        (
            "a new job started from disk (no earlier generation) never waits",
            with_ck(snap(None, alive=["a", "b"], ready_recs=[ready("a", 40), ready("b", 40)])),
            _seen_broken(0.5),
            ActionKind.PUBLISH,
            None,
            "resume",
        ),
        (
            "nothing to resume from (no checkpoint, nobody holds the state): state lost at once, not held",
            _dead_job(None, {"a": -1}),
            _seen_broken(0.0),
            ActionKind.STATE_LOST,
            None,
            None,
        ),
    ],
)
def test_a_resume_waits_until_the_last_generation_cannot_be_committing(
    name: str, s: Snapshot, window: Window, kind: ActionKind, until: float | None, reason: str | None
) -> None:
    action = decide(s, me("a"), window=window)
    assert action.kind is kind, action.reason
    if kind is ActionKind.WAIT:
        assert action.until == pytest.approx(until) and action.record is None
        assert "resume held" in action.reason and "generation 3" in action.reason
    if reason is not None:
        assert action.record is not None and action.record.reason == reason
    if name.startswith("the cut-off generation"):
        assert action.record is not None and action.record.members[:2] == ("x", "y")
        assert action.record.committed_step == 55
