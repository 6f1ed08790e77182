"""A chaos run's ETTR (effective training time ratio), from its commits (pure).

Owns the fault-free step time (measured in the warm-up windows, per world size; and, as a second
baseline, the median of the faulted window's quiet steps: ``quiet_step_by_world``), the steps committed
in the faulted window per world size, and ETTR: the sum, over those steps, of the fault-free step
time at each one's world size, divided by the faulted wall time (and the old figure, every step at
one fault-free step time). It never judges a run: a low ETTR is reported, not failed.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Iterator, Mapping, Sequence

from elasticd.chaos.evidence import Commit, Window


def fault_free_step_s(times: Sequence[tuple[float, int]], start: float, end: float) -> float | None:
    """Mean seconds per committed step over [start, end] (the warm-up); None with fewer than 2."""
    inside = [t for t, _ in times if start <= t <= end]
    if len(inside) < 2:
        return None
    return (inside[-1] - inside[0]) / (len(inside) - 1)


def ettr(steps: int, step_s: float | None, wall_s: float) -> float | None:
    """Effective training time ratio: committed steps x fault-free step time / wall time."""
    if step_s is None or wall_s <= 0:
        return None
    return steps * step_s / wall_s


def first_commits(commits: Sequence[Commit]) -> dict[int, Commit]:
    """step -> its first commit line (the earliest: a step committed again, by another rank or in
    another generation, counts once, at the generation and world size it was first committed in)."""
    out: dict[int, Commit] = {}
    for c in commits:
        if c.step not in out or c.t < out[c.step].t:
            out[c.step] = c
    return out


def step_pairs(commits: Sequence[Commit]) -> Iterator[tuple[Commit, Commit]]:
    """(step - 1, step) for each step whose first commit and its predecessor's are in one generation
    at one world size: each pair is one step time (a regroup between two generations is none)."""
    first = first_commits(commits)
    for step, c in first.items():
        prev = first.get(step - 1)
        if prev is not None and (prev.generation, prev.world_size) == (c.generation, c.world_size):
            yield prev, c


def fault_free_step_by_world(commits: Sequence[Commit], windows: Sequence[Window]) -> dict[int, float]:
    """world size -> mean seconds per step in the warm-up ``windows``, by the commit lines' world size.

    Each pair of consecutive steps (``step_pairs``) whose first commits both fall in one window
    gives one step time of that size. A world size with no such pair is absent.
    """
    sums: dict[int, tuple[float, int]] = {}
    for prev, c in step_pairs(commits):
        if any(w.start <= prev.t and c.t <= w.end for w in windows):
            total, n = sums.get(c.world_size, (0.0, 0))
            sums[c.world_size] = (total + c.t - prev.t, n + 1)
    return {world: total / n for world, (total, n) in sorted(sums.items())}


QUIET_AFTER_S = 3.0  # a step time counts as quiet this long after the last fault ...
QUIET_BEFORE_S = 0.5  # ... and this long before the next
QUIET_MIN_STEPS = 100  # quiet step times a world size needs for a baseline of its own


def quiet_step_by_world(commits: Sequence[Commit], faults: Sequence[float], window: Window) -> dict[int, float]:
    """world size -> the median step time of the quiet steps of the faulted ``window``: pairs of
    consecutive steps (``step_pairs``) that end at least ``QUIET_BEFORE_S`` before
    the next fault and begin at least ``QUIET_AFTER_S`` after the last one. Thousands of steps over
    the whole run, where the warm-up measures ~10 s of it: a second fault-free baseline, for the
    machine's speed drifts (a warm-up 6 % slower than the run's quiet steps made one run's ETTR
    0.98 that was 0.95 by this one). A world size with fewer than ``QUIET_MIN_STEPS`` is absent. Pure."""
    times = sorted(faults)
    durations: dict[int, list[float]] = {}
    for prev, c in step_pairs(commits):
        if not (window.start <= prev.t and c.t <= window.end):
            continue
        k = bisect.bisect_right(times, prev.t)
        after_last = prev.t - times[k - 1] if k else float("inf")
        before_next = times[k] - c.t if k < len(times) else float("inf")
        if after_last >= QUIET_AFTER_S and before_next >= QUIET_BEFORE_S:
            durations.setdefault(c.world_size, []).append(c.t - prev.t)
    return {w: statistics.median(d) for w, d in sorted(durations.items()) if len(d) >= QUIET_MIN_STEPS}


def baseline_world(world: int, measured: Iterable[int]) -> int | None:
    """The measured world size whose fault-free step time stands for ``world``: itself, else the
    nearest (the smaller on a tie; below ``--nodes`` nothing is measured, so the smallest measured
    size stands for it). None: nothing was measured."""
    return min(measured, key=lambda m: (abs(m - world), m), default=None)


def steps_by_world(commits: Sequence[Commit], window: Window) -> dict[int, int]:
    """world size -> the steps first committed within ``window`` at that size (each step once)."""
    out: dict[int, int] = {}
    for c in first_commits(commits).values():
        if window.start <= c.t <= window.end:
            out[c.world_size] = out.get(c.world_size, 0) + 1
    return dict(sorted(out.items()))


def ettr_by_world(steps: Mapping[int, int], step_s: Mapping[int, float], wall_s: float) -> float | None:
    """ETTR with a fault-free step time per world size: the sum, over the committed steps, of the
    fault-free step time at each one's world size (``baseline_world`` for a size not measured),
    divided by the wall time. None: nothing was measured, or no wall time."""
    if not step_s or wall_s <= 0:
        return None
    total = 0.0
    for world, n in steps.items():
        used = baseline_world(world, step_s)
        assert used is not None  # step_s is not empty
        total += n * step_s[used]
    return total / wall_s


def cost_by_kind(
    commits: Sequence[Commit], faults: Sequence[tuple[float, str]], step_s: Mapping[int, float], window: Window
) -> dict[str, tuple[int, float]]:
    """fault kind -> (faults of that kind, seconds of training they cost), over ``window``.

    Each fault (wall clock, kind) owns the time from it to the next fault (or the window's end);
    its cost is that time minus the fault-free time of the steps first committed in it (each at
    its world size's fault-free step time, ``baseline_world``). What a fault sets off lands on it
    (a regroup, a replacement's start-up CPU), as does anything that overlaps the next fault's
    start only partly: a picture of where the time went, not a proof. Empty without a measured
    step time. Pure."""
    if not step_s:
        return {}
    inside = sorted(f for f in faults if window.start <= f[0] <= window.end)
    firsts = sorted(first_commits(commits).values(), key=lambda c: c.t)
    times = [c.t for c in firsts]
    done = [0.0]  # done[i]: fault-free seconds of the first i steps
    for c in firsts:
        done.append(done[-1] + step_s[baseline_world(c.world_size, step_s) or 0])
    out: dict[str, tuple[int, float]] = {}
    for i, (t, kind) in enumerate(inside):
        end = inside[i + 1][0] if i + 1 < len(inside) else window.end
        a, b = bisect.bisect_left(times, t), bisect.bisect_left(times, end)
        n, total = out.get(kind, (0, 0.0))
        out[kind] = (n + 1, total + (end - t) - (done[b] - done[a]))
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))
