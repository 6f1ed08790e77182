"""What a chaos run observed, as records the judge reads (pure).

Owns the records (``Commit``, ``Final``, ``FaultRecord``, ``StatusSample``, ``WorkerLife``,
``AgentEnd``, the ``Window`` of an etcd outage or a warm-up, ``LinkDown``, a worker's ``Mark``, a
``CheckpointFault``) gathered into one ``Evidence``, and the parsers that make them from the audit
lines and the agents' logs (``parse_commits``, ``parse_finals``, ``membership_closed_times``,
``discarded_steps``, ``parse_marks``, ``traceback_hits``). It reads
text it is given, never a file or a process, and never judges.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from elasticd.testing.audit import as_float, as_int
from elasticd.testing.localcluster import events_in

TRACEBACK = "Traceback (most recent call last)"


@dataclass(frozen=True)
class Window:
    start: float  # wall clock, as in the audit lines
    end: float


@dataclass(frozen=True)
class LinkDown:
    """A host's link was down over [start, end] (wall clock; end = inf while still down)."""

    node: str
    start: float
    end: float


@dataclass(frozen=True)
class Commit:
    node: str
    step: int
    generation: int
    rank: int
    world_size: int
    t: float
    loss: float | None = None  # the step's global loss (NaN where a member's gradients were not finite)


@dataclass(frozen=True)
class Final:
    node: str
    step: int
    checksum: str
    shard: int = 0  # a sharded job's rank holds its shard: checksums compare within one shard index


@dataclass(frozen=True)
class FaultRecord:
    t: float
    kind: str
    target: str
    detail: str = ""


@dataclass(frozen=True)
class StatusSample:
    t0: float  # wall clock before and after the call
    t1: float
    pids: tuple[int, ...]  # the members' pids it listed
    error: str = ""


@dataclass(frozen=True)
class WorkerLife:
    pid: int
    node: str
    registered_t: float | None  # when its audit start line (written once registered) was seen
    ended_t: float | None  # first seen gone
    paused: tuple[Window, ...] = ()  # SIGSTOP -> SIGCONT (end = inf while stopped)
    # Its host's link down -> up (end = inf while down): its lease expires meanwhile, so status may
    # leave it out, and must once its lease is surely gone.
    cut_off: tuple[Window, ...] = ()
    # Link up -> its next sync line (it re-registers in place and joins a generation), or hung
    # (worker_hang) -> its end: status may list it or not.
    rejoining: tuple[Window, ...] = ()
    # It left the job (drained, finished, or gave up: its membership closed and its lease was
    # revoked) while its process still ran, e.g. waiting for abandoned groups to close.
    left_t: float | None = None
    # When the run first saw it (None: not known): the kernel gives a pid out again, and the
    # lives of one pid follow each other.
    seen_t: float | None = None


def membership_closed_times(log_text: str) -> dict[int, tuple[float, ...]]:
    """pid -> wall times of its workers' ``membership_closed`` lines in an agent's log, oldest
    first: a pid the kernel gave out again closes more than one membership (pure)."""
    out: dict[int, list[float]] = {}
    for rec in events_in(log_text, "membership_closed"):
        try:
            pid = int(str(rec["member"]).split(".")[2])
            t = datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        out.setdefault(pid, []).append(t)
    return {pid: tuple(sorted(ts)) for pid, ts in out.items()}


# The workers' log lines a chaos run reads as marks: a member's own gradients not finite, a step
# skipped (every member), a durable checkpoint saved or failed.
MARKED = ("gradients_not_finite", "step_skipped", "checkpoint_saved", "checkpoint_save_failed")


@dataclass(frozen=True)
class Mark:
    """One such line: of the worker(s) of ``node`` (the log's node), at ``step``, at wall time ``t``."""

    node: str
    event: str
    step: int
    t: float
    errno: str = ""  # checkpoint_save_failed: the errno's name (EROFS, ENOSPC, ...)


def parse_marks(node: str, log_text: str) -> list[Mark]:
    """The ``MARKED`` lines of an agent's log (its workers' lines are in it), in order (pure)."""
    out: list[Mark] = []
    for event in MARKED:
        for rec in events_in(log_text, event):
            try:
                t = datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
                step = as_int(rec["step"])
            except (ValueError, KeyError, TypeError, AssertionError):
                continue
            out.append(Mark(node, event, step, t, str(rec.get("errno") or "")))
    return sorted(out, key=lambda m: m.t)


@dataclass(frozen=True)
class CheckpointFault:
    """A checkpoint filesystem fault over [start, end] (wall clock), and the complete checkpoints
    (their seqs: a manifest in place) in the job's directory when it began and when it ended."""

    kind: str
    start: float
    end: float
    before: tuple[int, ...]
    after: tuple[int, ...]


def discarded_steps(log_text: str) -> dict[str, int]:
    """reason -> how many applied steps the workers of an agent's log discarded unconfirmed
    (``steps_discarded`` lines: a branch the job left, or a leave before a confirmation). Counted,
    not judged: the audit holds no commit line for them, and the other members commit them."""
    out: dict[str, int] = {}
    for rec in events_in(log_text, "steps_discarded"):
        steps, reason = rec.get("steps"), rec.get("reason")
        if isinstance(steps, list) and isinstance(reason, str):
            out[reason] = out.get(reason, 0) + len(steps)
    return out


def parse_commits(pairs: Iterable[tuple[str, Mapping[str, object]]]) -> list[Commit]:
    """The commit lines of (node, audit record) pairs."""
    return [
        Commit(
            node,
            as_int(r["step"]),
            as_int(r["generation"]),
            as_int(r["rank"]),
            as_int(r["world_size"]),
            as_float(r["t"]),
            as_float(r["loss"]) if isinstance(r.get("loss"), (int, float)) else None,
        )
        for node, r in pairs
        if r.get("event") == "commit"
    ]


def parse_finals(pairs: Iterable[tuple[str, Mapping[str, object]]]) -> list[Final]:
    return [
        Final(node, as_int(r["step"]), str(r["checksum"]), as_int(r.get("shard", 0)))
        for node, r in pairs
        if r.get("event") == "final" and not (r.get("branch") or r.get("never_joined"))
    ]  # a branch's bytes are not the job's


def traceback_hits(name: str, text: str) -> list[str]:
    """Each Python traceback in a log (plain, or inside a JSON line's ``exception``), as
    ``name:line: what``."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if TRACEBACK not in line:
            continue
        what = line.strip()[:160]
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("exception"), str):
            last = rec["exception"].strip().splitlines()[-1:]
            what = f"event {rec.get('event')!r}: {last[0][:160] if last else ''}"
        else:
            for later in lines[i + 1 : i + 200]:
                if later and not later[0].isspace() and TRACEBACK not in later:
                    what = later.strip()[:160]
                    break
        out.append(f"{name}:{i + 1}: {what}")
    return out


@dataclass(frozen=True)
class AgentEnd:
    """How one agent process ended, and how it was meant to."""

    node: str
    pid: int
    expected: str  # "" finish, "killed", "drain", "sigterm", "duplicate"
    code: int | None  # None: still running when the run ended (then it was killed)
    message: str = ""  # the last line of its log


@dataclass(frozen=True)
class Evidence:
    """Everything the run observed, as the judge reads it."""

    target_steps: int
    commits: tuple[Commit, ...]
    finals: tuple[Final, ...]
    audit_violations: tuple[str, ...]
    faults: tuple[FaultRecord, ...]
    etcd_down: tuple[Window, ...]
    samples: tuple[StatusSample, ...]
    lives: tuple[WorkerLife, ...]
    tracebacks: tuple[str, ...]
    agents: tuple[AgentEnd, ...]
    warmup: Window | None  # the warm-up window at --nodes (the single baseline's)
    faulted: Window | None
    lease_ttl_s: float
    problems: tuple[str, ...] = ()  # what the executor could not do (a start failed, a bound passed)
    end_t: float | None = None  # the end of the run (for a job that did not finish)
    link_down: tuple[LinkDown, ...] = ()
    warmups: tuple[Window, ...] = ()  # every warm-up window, one per world size (``warmup`` first)
    max_world: int = 0  # the job's max_workers (a host beyond it is a standby); 0: unknown
    discarded: Mapping[str, int] = field(default_factory=dict)  # reason -> steps applied, then discarded unconfirmed
    marks: tuple[Mark, ...] = ()  # the workers' MARKED lines
    link_flaps: tuple[LinkDown, ...] = ()  # a flapping link: its first down to its last up
    checkpoint_faults: tuple[CheckpointFault, ...] = ()
