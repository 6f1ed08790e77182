"""A job's history as a picture's data (``Timeline``, ``build_timeline``): what ``elasticctl
timeline`` draws (``ops.timeline_plot``). Pure.

Owns reading the job's events (``wire.ops.EventRecord``, oldest first) into series on one time
axis (seconds since the first event):

* committed steps over time: the points the events carry (``progress`` samples that rank 0 writes
  every ``progress_event_s``, ``recovered``, ``checkpoint_saved``, and each ``generation_published``'s
  committed step), kept increasing in both time and step;
* throughput: steps per second between consecutive step points;
* world size over time: a step function from the ``generation_published`` events, and each
  generation's number and reason;
* faults: what the agents saw (a worker exited or was stopped, restarts exhausted, a node drained)
  and generations published because members were lost or a generation was aborted;
* recoveries: from the fault noticed to the first commit after it (``recovered``: cause, duration);
* checkpoint saves (step, duration);
* node faults, per node: each crash, hang, failed health check and straggler episode
  (``wire.nodefaults.fault_of``, the rule ``elasticctl status`` counts by) and each cordon; a bug
  that stopped the job (``job_failed``) is a fault mark too.

Unknown kinds and fields of the wrong type are skipped: the history is written by many versions and
hosts, and a bad record must not cost the picture. Never does I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elasticd.wire.nodefaults import fault_of
from elasticd.wire.ops import EventKind, EventRecord

# generation_published reasons that follow a fault (the rest: start, join, regroup)
RATE_MIN_S = 1.0  # throughput is measured over at least this long between step points
LOSS_REASONS = ("aborted", "member_lost", "resume")  # resume: no member held the state


@dataclass(frozen=True)
class Generation:
    t: float  # seconds since the first event
    number: int
    world_size: int
    reason: str


@dataclass(frozen=True)
class Mark:
    """A fault, as an event showed it."""

    t: float
    kind: str  # the event kind, or "generation_<reason>" for a generation published after a loss
    label: str  # short text for the picture


@dataclass(frozen=True)
class Recovery:
    t: float  # when it ended (the first commit); it began ``duration_s`` before
    duration_s: float
    cause: str
    step: int


@dataclass(frozen=True)
class Save:
    t: float
    step: int
    duration_s: float | None


@dataclass(frozen=True)
class NodeFault:
    """One node's fault: ``crash``, ``hang``, ``health`` or ``straggler`` (``wire.nodefaults``), or
    ``cordon`` (its agent or an operator took it out of the job)."""

    t: float
    node: str
    kind: str


@dataclass(frozen=True)
class Timeline:
    job_id: str
    start: float  # wall clock of the first event (the time axis' 0)
    end_s: float  # the last event, on that axis
    steps: tuple[tuple[float, int], ...]  # (t, committed step), increasing in both
    throughput: tuple[tuple[float, float, float], ...]  # (t0, t1, steps/s over [t0, t1])
    generations: tuple[Generation, ...]
    faults: tuple[Mark, ...]
    recoveries: tuple[Recovery, ...]
    saves: tuple[Save, ...]
    node_faults: tuple[NodeFault, ...] = ()

    @property
    def nodes(self) -> tuple[str, ...]:
        """The nodes that had a fault, sorted."""
        return tuple(sorted({f.node for f in self.node_faults}))

    @property
    def lost_s(self) -> float:
        """Seconds between faults noticed and the next commit, summed over the recoveries."""
        return sum(r.duration_s for r in self.recoveries)


def _int(detail: Mapping[str, object], key: str) -> int | None:
    v = detail.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(detail: Mapping[str, object], key: str) -> float | None:
    v = detail.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def _fault(kind: str, detail: Mapping[str, object], source: str) -> str | None:
    """The label of a fault event, or None when the event is no fault."""
    node = source.split(".")[1] if source.startswith("agent.") and source.count(".") >= 2 else source
    if kind == EventKind.WORKER_EXITED:
        if detail.get("code") == 0 or detail.get("exit_kind") == "succeeded":
            return None  # finished, or drained: no fault
        how = detail.get("how", detail.get("exit_kind"))  # "was killed by SIGKILL"
        return f"{node}: worker {how.removeprefix('was ')}" if isinstance(how, str) else f"{node}: worker exited"
    if kind == EventKind.WORKER_STOPPED:
        return f"{node}: worker stopped"
    if kind == EventKind.RESTARTS_EXHAUSTED:
        return f"{node}: restarts exhausted"
    if kind == EventKind.JOB_FAILED:
        step = _int(detail, "step")
        return "job failed: bug" + (f" at step {step}" if step is not None else "")
    if kind == EventKind.NODE_DRAINING:
        cause = detail.get("cause")
        how = "elasticctl drain" if isinstance(cause, str) and cause.startswith("elasticctl drain") else cause
        return f"{node}: draining" + (f" ({how})" if isinstance(how, str) else "")
    return None


def build_timeline(job_id: str, events: Iterable[EventRecord]) -> Timeline:
    """The picture's data from a job's events (any order; sorted by time here). Pure."""
    evs = sorted((e for e in events if math.isfinite(e.time)), key=lambda e: e.time)
    if not evs:
        return Timeline(job_id, 0.0, 0.0, (), (), (), (), (), (), ())
    start = evs[0].time
    points: list[tuple[float, int]] = []
    gens: list[Generation] = []
    faults: list[Mark] = []
    recs: list[Recovery] = []
    saves: list[Save] = []
    for e in evs:
        t, d = e.time - start, e.detail
        step = _int(d, "step")
        if e.kind == EventKind.GENERATION_PUBLISHED:
            number, world = _int(d, "generation"), _int(d, "world_size")
            reason = d.get("reason") if isinstance(d.get("reason"), str) else ""
            assert isinstance(reason, str)
            if number is None or world is None:
                continue
            gens.append(Generation(t, number, world, reason))
            if reason in LOSS_REASONS:
                faults.append(Mark(t, f"generation_{reason}", f"gen {number} {reason.replace('_', ' ')}"))
            committed = _int(d, "committed_step")
            if committed is not None and committed >= 0:
                points.append((t, committed))
        elif e.kind == EventKind.RECOVERED:
            duration = _num(d, "duration_s")
            cause = d.get("cause") if isinstance(d.get("cause"), str) else "?"
            assert isinstance(cause, str)
            if duration is not None and step is not None:
                recs.append(Recovery(t, duration, cause, step))
                points.append((t, step))
        elif e.kind == EventKind.CHECKPOINT_SAVED:
            if step is not None:
                saves.append(Save(t, step, _num(d, "duration_s")))
                points.append((t, step))
        elif e.kind == EventKind.PROGRESS:
            if step is not None:
                points.append((t, step))
        else:
            label = _fault(e.kind, d, e.source)
            if label is not None:
                faults.append(Mark(t, e.kind, label))
    steps = _increasing(points)
    spaced = _spaced(steps, RATE_MIN_S)
    rates = tuple((t0, t1, (s1 - s0) / (t1 - t0)) for (t0, s0), (t1, s1) in zip(spaced, spaced[1:]))
    return Timeline(
        job_id,
        start,
        evs[-1].time - start,
        steps,
        rates,
        tuple(gens),
        tuple(faults),
        tuple(recs),
        tuple(saves),
        _node_faults(evs, start),
    )


def _node_faults(evs: Iterable[EventRecord], start: float) -> tuple[NodeFault, ...]:
    """Each event that is a fault of a named node (``wire.nodefaults.fault_of``), or its cordon."""
    out: list[NodeFault] = []
    for e in evs:
        node = e.detail.get("node")
        kind = "cordon" if e.kind == EventKind.NODE_CORDONED else fault_of(e)
        if kind is not None and isinstance(node, str):
            out.append(NodeFault(e.time - start, node, kind))
    return tuple(out)


def _spaced(points: tuple[tuple[float, int], ...], min_s: float) -> list[tuple[float, int]]:
    """The points at least ``min_s`` apart (the first kept; the last replaces a kept one too close):
    two points a few milliseconds apart, from hosts whose clocks differ, would make a spike."""
    out: list[tuple[float, int]] = []
    for p in points:
        if out and p[0] - out[-1][0] < min_s:
            if p is points[-1] and len(out) > 1:
                out[-1] = p
            continue
        out.append(p)
    return out


def _increasing(points: list[tuple[float, int]]) -> tuple[tuple[float, int], ...]:
    """The points in time order, keeping each only when its step is above every earlier one (a
    generation's committed step is written before its members catch up; clocks of hosts differ)."""
    out: list[tuple[float, int]] = []
    for t, s in sorted(points):
        if not out or s > out[-1][1]:
            out.append((t, s))
    return tuple(out)
