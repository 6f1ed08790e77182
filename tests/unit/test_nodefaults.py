"""Each node's faults from the job's events, and the cordon rule (``wire.nodefaults``), as tables."""

from __future__ import annotations

import pytest

from elasticd.wire.nodefaults import (
    CordonRecord,
    crash_times,
    decode_cordon,
    describe,
    encode_cordon,
    fault_of,
    node_faults,
    should_cordon,
)
from elasticd.wire.ops import EventRecord


def ev(kind: str, t: float, node: str = "a", **detail: object) -> EventRecord:
    return EventRecord(t, kind, f"agent.{node}.1", {"node": node, **detail})


@pytest.mark.parametrize(
    ("event", "fault"),
    [
        (ev("worker_exited", 1, exit_kind="failed", code=1), "crash"),
        (ev("worker_exited", 1, exit_kind="signaled", code=None), "crash"),
        (ev("worker_exited", 1, exit_kind="succeeded", code=0), None),
        (ev("worker_exited", 1, exit_kind="failed", code=75), None),  # EXIT_REJOIN: asked to start again
        (ev("worker_hung", 1), "hang"),
        (ev("health_check_failed", 1), "health"),
        (ev("straggler_detected", 1), "straggler"),
        (ev("generation_published", 1), None),
        (ev("no_such_kind", 1), None),
    ],
)
def test_fault_of(event: EventRecord, fault: str | None) -> None:
    assert fault_of(event) == fault


def test_node_faults_counts_per_node_within_the_window() -> None:
    events = [
        ev("worker_exited", 10, exit_kind="failed", code=1),
        ev("worker_exited", 3000, exit_kind="failed", code=1),
        ev("worker_hung", 3500),
        ev("straggler_detected", 3550, node="b"),
        ev("worker_exited", 3560, node="b", exit_kind="succeeded", code=0),
        EventRecord(3570, "worker_hung", "agent.x.1", {}),  # no node: not counted
    ]
    faults = node_faults(events, now=3600.0, window_s=3600.0 - 100)
    assert {n: dict(c) for n, c in faults.items()} == {"a": {"crash": 1, "hang": 1}, "b": {"straggler": 1}}
    assert describe(faults["a"]) == "1 crash, 1 hang" and describe({}) == "-"
    assert crash_times(events, "a") == [10, 3000]


@pytest.mark.parametrize(
    ("crashes", "limit", "cordon"),
    [
        ([1, 2, 3], 3, False),  # not more than the limit
        ([1, 2, 3, 4], 3, True),
        ([-5000, 2, 3, 4], 3, False),  # one is out of the window
        ([1, 2, 3, 4, 5, 6], 0, False),  # 0: never
    ],
)
def test_should_cordon(crashes: list[float], limit: int, cordon: bool) -> None:
    assert should_cordon(crashes, now=10.0, limit=limit, window_s=3600.0) is cordon


def test_a_cordon_record_round_trips_and_garbage_is_refused() -> None:
    r = CordonRecord("a", "agent", "6 crashes", 5.0)
    assert decode_cordon(encode_cordon(r)) == r
    for bad in (b"[]", b"{}", b'{"node": 1, "by": "x", "reason": "y", "time": 1}', b"\xff"):
        with pytest.raises((ValueError, TypeError, UnicodeDecodeError)):
            decode_cordon(bad)
