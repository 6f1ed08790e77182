"""The benchmark's step-time arithmetic (pure logic over (step, end time, generation) rows)."""

from __future__ import annotations

import pytest

from elasticd.bench.common import BenchError
from elasticd.bench.recovery import join_pause, window_step_times


def test_mean_is_window_wall_time_over_steps_and_median_is_of_single_steps() -> None:
    # steps 1..5 end at these times: durations 1, 1, 4, 1 after step 1
    rows = [(1, 0.0, 1), (2, 1.0, 1), (3, 2.0, 1), (4, 6.0, 1), (5, 7.0, 1)]
    t = window_step_times([rows], lo=1)
    assert t.mean_s == pytest.approx(7.0 / 4)
    assert t.median_s == pytest.approx(1.0)


def test_window_starts_at_lo_and_keeps_the_last_generation_only() -> None:
    rows = [(1, 0.0, 1), (2, 10.0, 1), (3, 11.0, 2), (4, 13.0, 2), (5, 15.0, 2)]
    t = window_step_times([rows], lo=3)
    assert t.mean_s == pytest.approx(2.0)
    assert t.median_s == pytest.approx(2.0)


def test_mean_is_the_median_over_workers() -> None:
    fast = [(1, 0.0, 1), (2, 1.0, 1), (3, 2.0, 1)]
    slow = [(1, 0.0, 1), (2, 3.0, 1), (3, 6.0, 1)]
    mid = [(1, 0.0, 1), (2, 2.0, 1), (3, 4.0, 1)]
    assert window_step_times([fast, slow, mid], lo=1).mean_s == pytest.approx(2.0)


def test_no_consecutive_steps_is_an_error() -> None:
    with pytest.raises(BenchError):
        window_step_times([[(1, 0.0, 1)], []], lo=1)


def test_join_pause_is_the_last_commit_before_the_join_generation_to_its_first() -> None:
    commits = [
        {"t": 1.0, "generation": 2},
        {"t": 1.1, "generation": 2},
        {"t": 1.5, "generation": 3},
        {"t": 1.2, "generation": 2},
        {"t": 1.6, "generation": 3},
        {"t": 2.0, "generation": 4},
    ]
    assert join_pause(commits, 3) == pytest.approx(0.3)
    assert join_pause(commits, 5) is None  # no commit in it
    assert join_pause(commits[2:3], 3) is None  # none before it
