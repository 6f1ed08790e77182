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
from collections.abc import Mapping, Sequence
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
        median = median_without(ranked, 0, len(ranked), t)
        if median > 0:
            out[member] = t / median
    return out


def median_without(window: Sequence[float], start: int, n: int, value: float) -> float:
    """The median of ``n`` sorted values with one ``value`` (one of them) taken out, from the sorted
    values of ranks ``start`` on (``window``): all of them, or at least ranks ``n//2 - 2`` to
    ``n//2 + 1`` (``wire.digest.middle_of``). Of equal values, whichever is taken out: the rest is
    the same."""
    if value < window[0]:  # its rank: below the window, within it, or above it
        i = start - 1
    elif value > window[-1]:
        i = start + len(window)
    else:
        i = start + bisect.bisect_left(window, value)
    m = n - 1

    def at(j: int) -> float:  # rank j of the values without rank i
        return window[(j if j < i else j + 1) - start]

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
