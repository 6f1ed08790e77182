"""Straggler scores and their hysteresis (``wire.stragglers``), as tables."""

from __future__ import annotations

import random
import statistics

import pytest

from elasticd.wire.stragglers import release_score, slow_since, straggler_scores


@pytest.mark.parametrize(
    ("compute", "scores"),
    [
        ({}, {}),
        ({"a": 0.1}, {}),  # a world of one has no straggler
        ({"a": 0.1, "b": 0.2}, {"a": 0.5, "b": 2.0}),  # two: each against the other
        ({"a": 0.1, "b": 0.1, "c": 0.2}, {"a": 0.10 / 0.15, "b": 0.10 / 0.15, "c": 2.0}),
        ({"a": 0.1, "b": 0.0}, {"b": 0.0}),  # a median of 0 scores nothing
    ],
)
def test_a_score_is_the_compute_time_over_the_median_of_the_others(
    compute: dict[str, float], scores: dict[str, float]
) -> None:
    assert straggler_scores(compute) == pytest.approx(scores)


def test_scores_agree_with_the_median_of_the_others_taken_one_by_one() -> None:
    rng = random.Random(7)
    for n in (2, 3, 4, 5, 8, 33):
        compute = {f"m{i}": rng.choice([0.1, 0.2, 0.25, rng.uniform(0.05, 1.0)]) for i in range(n)}
        expected = {m: t / statistics.median(v for o, v in compute.items() if o != m) for m, t in compute.items()}
        assert straggler_scores(compute) == pytest.approx(expected)


BOUND = 1.5


@pytest.mark.parametrize(
    ("since", "score", "expected"),
    [
        (None, None, None),  # no score: not slow
        (None, 1.0, None),
        (None, 1.5, 100.0),  # at the bound: an episode starts now
        (None, 1.4, None),  # in the band, not slow before: no episode
        (90.0, 1.4, 90.0),  # in the band, slow before: the episode goes on
        (90.0, release_score(BOUND), 90.0),
        (90.0, 1.2, None),  # below the release score: it ends
        (90.0, 3.0, 90.0),
        (90.0, None, None),  # no score (its world shrank to one): it ends
    ],
)
def test_slow_since_has_hysteresis(since: float | None, score: float | None, expected: float | None) -> None:
    assert slow_since(since, score, 100.0, BOUND) == expected
    assert release_score(BOUND) == 1.25
