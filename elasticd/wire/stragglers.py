"""Which member slows the job: a straggler score per member, its hysteresis, and the job's
``straggler`` record (the one replacement under way). Pure.

A member's compute time is its own part of a step, smoothed (``ProgressRecord.compute_s``: from the
step's start to its contribution to the gradient sum; the wait for the others is not in it). Its
**score** is its compute time over the median of the other members' of its generation: in a world
of two, a member at twice the other's time scores 2; a healthy job scores about 1 everywhere.
Every all_reduce waits for the slowest member, so a member scoring 2 halves the job's step rate.

A member is **slow** while its score is at least the bound (``straggler_score``); its slow
*episode* starts then and ends only when the score falls below ``release_score`` (halfway back to
1), so a score hovering at the bound neither starts nor ends episodes at every read. A member slow
for ``straggler_s`` or longer is a **straggler**: reported, or replaced by a waiting spare
(``straggler_policy``).

``StragglerRecord`` is ``straggler`` (leased for ``straggler_cooldown_s``): the agent that replaces
its node writes it by compare-and-set on absence, so that two nodes are never replaced at once and
the next replacement waits out the lease. No I/O, no clock reads.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass


def straggler_scores(compute: Mapping[str, float]) -> dict[str, float]:
    """Each member's compute time over the median of the others' (members with a compute time; fewer
    than two, or a median of 0: no scores). One sort for all of them: a large generation's scores
    are read every few seconds by every agent."""
    if len(compute) < 2:
        return {}
    ranked = sorted(compute.values())
    out = {}
    for member, t in compute.items():
        median = _median_without(ranked, t)
        if median > 0:
            out[member] = t / median
    return out


def _median_without(ranked: list[float], value: float) -> float:
    """The median of sorted ``ranked`` with one ``value`` taken out (whichever of equal ones: the
    rest is the same)."""
    i = bisect.bisect_left(ranked, value)
    m = len(ranked) - 1

    def at(j: int) -> float:  # index j of the list without position i
        return ranked[j if j < i else j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def release_score(bound: float) -> float:
    """The score a slow member must fall below for its episode to end: halfway from the bound to 1."""
    return 1.0 + (bound - 1.0) / 2.0


def slow_since(since: float | None, score: float | None, now: float, bound: float) -> float | None:
    """When the member's slow episode began, after a read at ``now`` found ``score`` (None: not
    slow; no score, e.g. a world of one, ends an episode)."""
    if score is None:
        return None
    if score >= bound:
        return now if since is None else since
    if since is not None and score >= release_score(bound):
        return since  # within the hysteresis band: the episode goes on
    return None


@dataclass(frozen=True)
class StragglerRecord:
    """``straggler``: the node whose agent is replacing it as a straggler (leased: the cooldown)."""

    node: str
    member: str
    score: float
    time: float  # wall clock of the decision


def encode_straggler(record: StragglerRecord) -> bytes:
    return json.dumps(asdict(record), sort_keys=True).encode()
