"""The chaos suite's pure parts: the schedule, and the invariant checks over hand-made records
(a repeat, a gap, a stall, differing finals, status disagreeing with the workers, a traceback)."""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import random
import sys

import pytest

from elasticd.chaos.__main__ import ChaosRun, Node
from elasticd.chaos.bug import BugEvidence, judge_bug, render_bug
from elasticd.chaos.ettr import (
    baseline_world,
    cost_by_kind,
    ettr,
    ettr_by_world,
    fault_free_step_by_world,
    fault_free_step_s,
    quiet_step_by_world,
    steps_by_world,
)
from elasticd.chaos.evidence import (
    AgentEnd,
    CheckpointFault,
    Commit,
    Evidence,
    FaultRecord,
    Final,
    LinkDown,
    Mark,
    StatusSample,
    Window,
    WorkerLife,
    parse_marks,
    traceback_hits,
)
from elasticd.chaos.judge import (
    agent_findings,
    commit_times,
    final_findings,
    find_stalls,
    judge,
    link_down_findings,
    rejoin_findings,
    status_findings,
    step_findings,
)
from elasticd.chaos.kinds_judge import checkpoint_findings, nan_findings
from elasticd.chaos.netns import (
    NetnsHost,
    NetnsPlan,
    host_index,
    netns_plan,
    netns_unusable,
    subnets_in_use,
    use_netns,
)
from elasticd.chaos.report import Report, render_table, report_to_dict
from elasticd.chaos.schedule import (
    KINDS,
    NAN_GRAD_STEPS,
    NONFINITE_STEPS,
    ClusterView,
    FaultKind,
    NodeView,
    Place,
    Settings,
    allowed,
    choose_fault,
    kinds_possible,
    link_down_s_default,
    next_delay,
    no_hang,
    no_poison,
    parse_faults,
    relayed,
    skipped_kinds,
)
from elasticd.errors import ConfigError
from elasticd.testing.localcluster import WorkerProcess

pytestmark = pytest.mark.timeout(30)

T0 = 1_000_000.0  # a wall-clock origin for hand-made records


def commits(*rows: tuple[int, int, float], world: int = 2) -> list[Commit]:
    """(step, generation, t) -> one commit line per rank of a world of ``world``."""
    return [Commit(f"node-{r}", step, gen, r, world, T0 + t) for step, gen, t in rows for r in range(world)]


def steady(n: int, gen: int = 1, dt: float = 0.1, start: float = 0.0) -> list[tuple[int, int, float]]:
    return [(s, gen, start + (s - 1) * dt) for s in range(1, n + 1)]


# -- steps ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rows, repeats, lost, last",
    [
        (steady(5), {}, (), 5),
        ([(1, 1, 0.0), (2, 1, 0.1), (3, 1, 0.2), (3, 2, 0.5), (4, 2, 0.6)], {3: (1, 2)}, (), 4),  # repeat
        ([(1, 1, 0.0), (2, 1, 0.1), (4, 2, 0.5)], {}, (3,), 4),  # gap
        ([(2, 1, 0.0), (2, 3, 0.1)], {2: (1, 3)}, (1,), 2),  # both
        ([], {}, (), 0),
    ],
)
def test_step_findings_finds_repeats_across_generations_and_gaps(rows, repeats, lost, last) -> None:
    f = step_findings(commits(*rows))
    assert dict(f.repeats) == repeats
    assert f.lost == lost
    assert f.last_step == last


def test_commit_times_take_the_first_line_of_each_step_and_generation() -> None:
    rows = [Commit("a", 1, 1, 0, 2, T0 + 0.2), Commit("b", 1, 1, 1, 2, T0 + 0.1), Commit("a", 1, 2, 0, 1, T0 + 3)]
    assert commit_times(rows) == [(T0 + 0.1, 1), (T0 + 3, 2)]


# -- stalls -----------------------------------------------------------------------------------

LIMIT = 4.0  # lease TTL 2 s + 2 s


def times(*rows: tuple[float, int]) -> list[tuple[float, int]]:
    return [(T0 + t, g) for t, g in rows]


@pytest.mark.parametrize(
    "rows, down, end, want",
    [
        # no interval over the limit
        ([(0, 1), (3.9, 1), (7.8, 1)], [], None, []),
        # a 10 s stall, no etcd trouble: counted in full
        ([(0, 1), (10, 2)], [], None, [(0.0, 10.0, 0.0)]),
        # etcd down for 8 of those 10 s and membership changed: 8 s excused
        ([(0, 1), (10, 2)], [(1, 9)], None, [(0.0, 10.0, 8.0)]),
        # etcd down but membership did not change: nothing excused
        ([(0, 1), (10, 1)], [(1, 9)], None, [(0.0, 10.0, 0.0)]),
        # overlapping windows count once; a window outside the stall counts not at all
        ([(0, 1), (10, 2), (10.1, 2)], [(1, 5), (3, 6), (20, 30)], None, [(0.0, 10.0, 5.0)]),
        # the job did not finish: the time after the last commit is a stall
        ([(0, 1), (1, 1)], [], 30.0, [(1.0, 29.0, 0.0)]),
    ],
)
def test_find_stalls_excuses_only_etcd_downtime_with_a_membership_change(rows, down, end, want) -> None:
    got = find_stalls(
        times(*rows), LIMIT, [Window(T0 + a, T0 + b) for a, b in down], [], end_t=None if end is None else T0 + end
    )
    assert [(round(s.start - T0, 3), round(s.length_s, 3), round(s.excused_s, 3)) for s in got] == want


def test_a_stall_names_the_faults_just_before_and_during_it() -> None:
    faults = [
        FaultRecord(T0 - 10, "worker_kill", "node-0"),
        FaultRecord(T0 - 1, "etcd_restart", "etcd"),
        FaultRecord(T0 + 5, "drain", "node-2"),
        FaultRecord(T0 + 20, "node_join", "node-4"),
    ]
    (stall,) = find_stalls(times((0, 1), (10, 2)), LIMIT, [], faults)
    assert stall.faults == ("etcd_restart(etcd)", "drain(node-2)")
    assert stall.generations == (1, 2)
    assert stall.counted_s == 10.0


# -- finals -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "finals, last, problems",
    [
        ([Final("a", 100, "x"), Final("b", 100, "x"), Final("c", 40, "y")], 100, 0),
        ([Final("a", 100, "x"), Final("b", 100, "z")], 100, 1),  # differ at the end
        ([Final("a", 40, "y"), Final("c", 40, "w"), Final("b", 100, "x")], 100, 1),  # differ at a drain
        ([Final("a", 40, "y")], 100, 1),  # nobody finished
        # a sharded job: each shard index holds its own bytes
        ([Final("a", 100, "x", 0), Final("a", 100, "u", 1), Final("b", 100, "x", 0), Final("b", 100, "u", 1)], 100, 0),
        ([Final("a", 100, "x", 0), Final("a", 100, "u", 1), Final("b", 100, "x", 0), Final("b", 100, "v", 1)], 100, 1),
    ],
)
def test_final_findings(finals, last, problems) -> None:
    assert len(final_findings(finals, last)) == problems


# -- status -----------------------------------------------------------------------------------

SLACK = 3.0


def sample(at: float, *pids: int) -> StatusSample:
    return StatusSample(T0 + at, T0 + at + 0.05, tuple(pids))


@pytest.mark.parametrize(
    "life, listed, problems",
    [
        # live and registered long ago: must be listed
        (WorkerLife(11, "n0", T0, None), True, 0),
        (WorkerLife(11, "n0", T0, None), False, 1),
        # registered 1 s before the sample: may or may not be listed
        (WorkerLife(11, "n0", T0 + 9, None), False, 0),
        (WorkerLife(11, "n0", T0 + 9, None), True, 0),
        # died long before: must not be listed; died just before: either way
        (WorkerLife(11, "n0", T0, T0 + 2), True, 1),
        (WorkerLife(11, "n0", T0, T0 + 2), False, 0),
        (WorkerLife(11, "n0", T0, T0 + 9), True, 0),
        # stopped since long before (its lease expired): must not be listed
        (WorkerLife(11, "n0", T0, None, (Window(T0 + 1, math.inf),)), True, 1),
        # continued 1 s before the sample: either way
        (WorkerLife(11, "n0", T0, None, (Window(T0 + 1, T0 + 9),)), False, 0),
        (WorkerLife(11, "n0", T0, None, (Window(T0 + 1, T0 + 9),)), True, 0),
        # hung since long before (worker_hang: left out, its process alive until its agent ends it): either way
        (WorkerLife(11, "n0", T0, None, rejoining=(Window(T0 + 1, math.inf),)), False, 0),
        (WorkerLife(11, "n0", T0, None, rejoining=(Window(T0 + 1, math.inf),)), True, 0),
        # left the job (drained: lease revoked) while its process lingers: need not be listed
        (WorkerLife(11, "n0", T0, None, left_t=T0 + 9), False, 0),
        (WorkerLife(11, "n0", T0, None, left_t=T0 + 11), False, 1),  # left after the sample: must be listed
    ],
)
def test_status_must_list_the_live_workers_within_the_slack(life, listed, problems) -> None:
    s = sample(10.0, 11) if listed else sample(10.0)
    assert len(status_findings([s], [life], SLACK)) == problems


@pytest.mark.parametrize(
    ("down", "problems"),
    [
        ((), 1),  # continued 4 s before the sample: must be listed by now
        ((Window(T0 + 5.5, T0 + 9.5),), 0),  # ... but etcd was down from its stop until 0.5 s before
        ((Window(T0 + 5.5, T0 + 6.0),), 1),  # etcd back a whole slack before the sample: listed by now
        ((Window(T0 - 20, T0 - 19),), 1),  # an outage long before its stop excuses nothing
    ],
)
def test_a_worker_that_lost_its_record_around_an_etcd_outage_gets_the_slack_from_etcds_return(
    down: tuple[Window, ...], problems: int
) -> None:
    # stopped at T0 + 4 (its agent revoked its lease), continued at T0 + 6; sampled at T0 + 10.
    # One sampled 0.8 s after etcd came back must not be flagged.
    life = WorkerLife(11, "n0", T0, None, (Window(T0 + 4, T0 + 6),))
    assert len(status_findings([sample(10.0)], [life], SLACK, etcd_down=down)) == problems
    assert status_findings([sample(10.0, 11)], [life], SLACK, etcd_down=down) == []


@pytest.mark.parametrize(
    ("new_seen", "problems"),
    [
        (T0 + 8, 0),  # the pid's new life was seen before the sample: the listed pid is its
        (T0 + 30, 1),  # ... seen only after the sample: the dead worker was listed
        (None, 1),  # no other life of the pid
    ],
)
def test_a_pid_given_out_again_is_the_listed_life(new_seen: float | None, problems: int) -> None:
    old = WorkerLife(11, "n0", T0, T0 + 2, seen_t=T0 - 1)
    lives = [old] if new_seen is None else [old, WorkerLife(11, "n0", None, None, seen_t=new_seen)]
    assert len(status_findings([sample(10.0, 11)], lives, SLACK)) == problems


def test_status_listing_an_unknown_pid_is_a_finding_and_failed_samples_are_skipped() -> None:
    lives = [WorkerLife(11, "n0", T0, None)]
    (problem,) = status_findings([sample(10.0, 11, 99)], lives, SLACK)
    assert "pid 99" in problem
    assert status_findings([StatusSample(T0 + 10, T0 + 11, (), error="exit 2")], lives, SLACK) == []


# -- logs -------------------------------------------------------------------------------------


def test_traceback_hits_in_plain_text_and_in_json_lines() -> None:
    plain = (
        'starting\nTraceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "    boom()\nZeroDivisionError: division by zero\nafter\n"
    )
    (hit,) = traceback_hits("agent-node-0.log", plain)
    assert hit == "agent-node-0.log:2: ZeroDivisionError: division by zero"
    line = json.dumps(
        {
            "event": "agent_crashed",
            "exception": 'Traceback (most recent call last):\n  File "a.py", line 3\nRuntimeError: bad',
        }
    )
    (hit,) = traceback_hits("agent-node-1.log", "ok\n" + line + "\n")
    assert hit == "agent-node-1.log:2: event 'agent_crashed': RuntimeError: bad"
    assert traceback_hits("x.log", '{"event": "step_committed"}\n') == []


# -- agents -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "end, bad, dup",
    [
        (AgentEnd("n0", 1, "", 0), 0, 0),
        (AgentEnd("n0", 1, "", 1, "etcd_unreachable"), 1, 0),
        (AgentEnd("n0", 1, "", None), 1, 0),
        (AgentEnd("n0", 1, "killed", -9), 0, 0),
        (AgentEnd("n0", 1, "drain", 0), 0, 0),
        (AgentEnd("n0", 1, "sigterm", 1), 1, 0),
        (AgentEnd("n0", 1, "duplicate", 2, "elasticd: node_id_taken: node id 'n0' of job 'j' is held by ..."), 0, 0),
        (AgentEnd("n0", 1, "duplicate", 1, "elasticd: etcd_unreachable: ..."), 0, 1),  # refused, not for the id
        (AgentEnd("n0", 1, "duplicate", 0), 0, 1),
        (AgentEnd("n0", 1, "duplicate", None), 0, 1),
    ],
)
def test_agent_findings(end, bad, dup) -> None:
    b, d = agent_findings([end])
    assert (len(b), len(d)) == (bad, dup)


# -- ETTR -------------------------------------------------------------------------------------


def test_fault_free_step_time_and_ettr() -> None:
    ts = times(*[(0.1 * i, 1) for i in range(11)])  # 11 commits, 0.1 s apart
    assert fault_free_step_s(ts, T0, T0 + 1.0) == pytest.approx(0.1)
    assert fault_free_step_s(ts, T0 + 5, T0 + 6) is None
    assert ettr(80, 0.1, 10.0) == pytest.approx(0.8)
    assert ettr(80, None, 10.0) is None


def run_of(world: int, gen: int, first: int, n: int, start: float, dt: float) -> list[Commit]:
    """Steps first..first+n-1 of generation ``gen`` at ``world``, ``dt`` apart from T0 + start, one
    line per rank (rank 0 first; the others 1 ms later)."""
    return [
        Commit(f"node-{r}", first + i, gen, r, world, T0 + start + i * dt + (0.001 if r else 0.0))
        for i in range(n)
        for r in range(world)
    ]


# Warm-up: world 3 at 0.1 s a step over [0, 1], a regroup, world 4 at 0.12 s over [3, 4.2].
WARM = run_of(3, 1, 1, 11, 0.0, 0.1) + run_of(4, 2, 12, 11, 3.0, 0.12)
WARM_WINDOWS = (Window(T0, T0 + 1.0), Window(T0 + 3.0, T0 + 4.2))


@pytest.mark.parametrize(
    "rows, windows, want",
    [
        (WARM, WARM_WINDOWS, {3: 0.1, 4: 0.12}),  # every size measured
        (WARM, WARM_WINDOWS[:1], {3: 0.1}),  # world 4 not in a window
        (WARM, (Window(T0, T0 + 4.2),), {3: 0.1, 4: 0.12}),  # the regroup 1.0 -> 3.0 s is no step time
        (WARM, (Window(T0 + 0.55, T0 + 0.75),), {3: 0.1}),  # steps before and after the window left out
        (WARM, (Window(T0 + 0.55, T0 + 0.65),), {}),  # one step in the window: no pair
        (WARM, (), {}),
        # step 6 committed again in generation 2 (a repeat) after a regroup: counted once, at its first line
        (run_of(3, 1, 1, 6, 0.0, 0.1) + run_of(2, 2, 6, 5, 2.0, 0.2), (Window(T0, T0 + 3.0),), {3: 0.1, 2: 0.2}),
    ],
)
def test_fault_free_step_by_world(rows, windows, want) -> None:
    got = fault_free_step_by_world(rows, windows)
    assert got == {w: pytest.approx(t) for w, t in want.items()}


@pytest.mark.parametrize(
    "world, measured, want",
    [
        (3, (3, 4), 3),
        (4, (3, 4), 4),
        (2, (3, 4), 3),  # below --nodes nothing is measured: the smallest measured size
        (1, (3, 4), 3),
        (5, (3, 4), 4),  # beyond: the largest
        (4, (3, 5), 3),  # a tie: the smaller
        (3, (), None),
    ],
)
def test_baseline_world_is_the_size_itself_else_the_nearest_measured(world, measured, want) -> None:
    assert baseline_world(world, measured) == want


@pytest.mark.parametrize(
    "rows, window, want",
    [
        (WARM, Window(T0 + 3.0, T0 + 4.2), {4: 11}),
        (WARM, Window(T0 + 0.45, T0 + 3.15), {3: 6, 4: 2}),  # steps before and after the window left out
        (WARM, Window(T0 + 10, T0 + 20), {}),
        # step 6 repeated in generation 2 at world 2: counted once, at world 3 where it was first committed
        (run_of(3, 1, 1, 6, 0.0, 0.1) + run_of(2, 2, 6, 5, 2.0, 0.2), Window(T0, T0 + 3.0), {3: 6, 2: 4}),
    ],
)
def test_steps_by_world_counts_each_step_once_within_the_window(rows, window, want) -> None:
    assert steps_by_world(rows, window) == want


@pytest.mark.parametrize(
    "steps, step_s, wall_s, want",
    [
        ({3: 10, 4: 10}, {3: 0.1, 4: 0.12}, 2.2, 1.0),  # each step at its own world size's time
        ({4: 10}, {3: 0.1, 4: 0.12}, 2.4, 0.5),
        ({2: 10, 4: 10}, {3: 0.1, 4: 0.12}, 2.2, 1.0),  # world 2 unmeasured: world 3's time
        ({5: 10}, {3: 0.1, 4: 0.12}, 1.2, 1.0),  # world 5 (beyond max) unmeasured: world 4's
        ({}, {3: 0.1}, 2.0, 0.0),  # no step committed
        ({3: 10}, {}, 2.0, None),  # nothing measured
        ({3: 10}, {3: 0.1}, 0.0, None),
    ],
)
def test_ettr_by_world(steps, step_s, wall_s, want) -> None:
    got = ettr_by_world(steps, step_s, wall_s)
    assert got == (None if want is None else pytest.approx(want))


# 300 steps at world 4, 0.05 s apart, from T0 (15 s); every 50th step takes 0.5 s (a slow step)
QUIET = [Commit("node-0", i + 1, 1, 0, 4, T0 + 0.05 * i + 0.45 * (i // 50)) for i in range(300)]


@pytest.mark.parametrize(
    "faults, window, want",
    [
        ([], Window(T0, T0 + 100), {4: 0.05}),  # the median: slow steps do not move it
        ([T0 + 2.0], Window(T0, T0 + 100), {4: 0.05}),  # steps within 3 s after the fault left out
        ([T0 + 2.0 * i for i in range(1, 20)], Window(T0, T0 + 100), {}),  # a fault every 2 s: too few quiet steps
        ([], Window(T0 + 50, T0 + 100), {}),  # outside the window
    ],
)
def test_quiet_step_by_world_is_the_median_of_steps_far_from_faults(faults, window, want) -> None:
    got = quiet_step_by_world(QUIET, faults, window)
    assert got == {w: pytest.approx(t) for w, t in want.items()}


def test_quiet_steps_leave_out_the_seconds_after_a_fault_and_before_the_next() -> None:
    fast = [Commit("n", i + 1, 1, 0, 3, T0 + 0.01 * i) for i in range(200)]  # 2 s of 0.01 s steps
    slow = [Commit("n", 201 + i, 1, 0, 3, T0 + 2.0 + 0.1 * i) for i in range(300)]  # then 0.1 s steps
    # a fault at 2 s: 150 fast steps end 0.5 s before it; the slow ones count from 3 s after it (270)
    assert quiet_step_by_world(fast + slow, [T0 + 2.0], Window(T0, T0 + 60))[3] == pytest.approx(0.1)
    assert quiet_step_by_world(fast, [T0 + 1.6], Window(T0, T0 + 60)) == {3: pytest.approx(0.01)}  # 110 before it
    assert quiet_step_by_world(fast, [T0 + 1.0], Window(T0, T0 + 60)) == {}  # 50: too few


# 10 steps at world 3 from T0 + 0.0 (0.1 s apart), a 1 s gap, 10 at world 2 from T0 + 2.0 (0.2 s apart)
COSTED = run_of(3, 1, 1, 10, 0.0, 0.1) + run_of(2, 2, 11, 10, 2.0, 0.2)


@pytest.mark.parametrize(
    "faults, step_s, window, want",
    [
        # one fault owns the whole window: 4 s, minus 10 x 0.1 and 10 x 0.2 of fault-free time
        ([(T0 + 0.0, "kill")], {3: 0.1, 2: 0.2}, Window(T0, T0 + 4.0), {"kill": (1, 1.0)}),
        # the gap (0.9 -> 2.0) falls to the fault before it; the other owns 2.0 -> 4.0 at full speed
        (
            [(T0 + 0.95, "kill"), (T0 + 2.0, "stop")],
            {3: 0.1, 2: 0.2},
            Window(T0, T0 + 4.0),
            {"kill": (1, 1.05), "stop": (1, 0.0)},
        ),
        # two of a kind add up; a fault outside the window is left out
        (
            [(T0 + 0.0, "kill"), (T0 + 2.0, "kill"), (T0 + 9.0, "stop")],
            {3: 0.1, 2: 0.2},
            Window(T0, T0 + 4.0),
            {"kill": (2, 1.0)},
        ),
        # world 2 unmeasured: world 3's step time stands for it, so world 2's slower steps show as cost
        ([(T0 + 0.0, "kill")], {3: 0.1}, Window(T0, T0 + 4.0), {"kill": (1, 2.0)}),
        ([(T0 + 0.0, "kill")], {}, Window(T0, T0 + 4.0), {}),
    ],
)
def test_cost_by_kind_charges_each_fault_the_time_until_the_next(faults, step_s, window, want) -> None:
    got = cost_by_kind(COSTED, faults, step_s, window)
    assert got.keys() == want.keys()
    for kind, (n, s) in want.items():
        assert got[kind][0] == n and got[kind][1] == pytest.approx(s, abs=1e-6), (kind, got[kind])


# -- the schedule -----------------------------------------------------------------------------


def view(
    ready: int,
    *,
    busy: int = 0,
    queued: int = 0,
    min_nodes: int = 2,
    max_nodes: int = 4,
    etcd_busy: bool = False,
    dup: bool = False,
    injected: dict[FaultKind, int] | None = None,
) -> ClusterView:
    nodes = tuple(NodeView(f"node-{i}", i < ready) for i in range(ready + busy))
    return ClusterView(nodes, queued, min_nodes, max_nodes, etcd_busy, dup, injected or {})


@pytest.mark.parametrize(
    "kind, v, ok",
    [
        (FaultKind.WORKER_KILL, view(3), True),
        (FaultKind.WORKER_KILL, view(2), False),  # would leave 1 < min 2
        (FaultKind.NODE_LOSS, view(2, busy=1), False),  # a busy node does not count as ready
        (FaultKind.DRAIN, view(3, min_nodes=1), True),
        (FaultKind.ETCD_OUTAGE, view(2), True),  # etcd faults take no node away
        (FaultKind.ETCD_OUTAGE, view(3, etcd_busy=True), False),  # one etcd fault at a time
        (FaultKind.NODE_JOIN, view(3), True),
        (FaultKind.NODE_JOIN, view(4), True),  # at max_nodes: a standby beyond max_workers
        (FaultKind.NODE_JOIN, view(5), False),  # one standby already
        (FaultKind.NODE_JOIN, view(4, queued=1), False),  # a replacement will take the standby's place
        (FaultKind.DUPLICATE_NODE, view(1), True),
        (FaultKind.DUPLICATE_NODE, view(3, dup=True), False),
        (FaultKind.DUPLICATE_NODE, view(3, etcd_busy=True), False),  # a refusal for want of etcd proves nothing
        (FaultKind.DRAIN, view(3, etcd_busy=True), False),  # the request is written to etcd
        (FaultKind.DUPLICATE_NODE, view(0, busy=3), False),  # no ready node to copy
    ],
)
def test_allowed(kind, v, ok) -> None:
    assert allowed(kind, v) is ok


def test_choose_fault_covers_the_least_injected_kinds_first_and_is_seeded() -> None:
    kinds = [FaultKind.WORKER_KILL, FaultKind.ETCD_RESTART, FaultKind.NODE_JOIN]
    v = view(3, injected={FaultKind.WORKER_KILL: 2, FaultKind.ETCD_RESTART: 1, FaultKind.NODE_JOIN: 1})
    picks = {choose_fault(v, kinds, random.Random(seed)).kind for seed in range(20)}  # type: ignore[union-attr]
    assert picks == {FaultKind.ETCD_RESTART}  # among the least injected, the etcd kind first
    v = view(3, etcd_busy=True, injected={FaultKind.WORKER_KILL: 2, FaultKind.ETCD_RESTART: 1, FaultKind.NODE_JOIN: 1})
    assert {choose_fault(v, kinds, random.Random(s)).kind for s in range(20)} == {FaultKind.NODE_JOIN}  # type: ignore[union-attr]
    both = [FaultKind.WORKER_KILL, FaultKind.NODE_JOIN]
    v = view(3, injected={FaultKind.WORKER_KILL: 1, FaultKind.NODE_JOIN: 1})
    assert {choose_fault(v, both, random.Random(s)).kind for s in range(20)} == set(both)  # type: ignore[union-attr]
    a = [choose_fault(view(3), kinds, random.Random(7)) for _ in range(3)]
    assert len(set(a)) == 1  # the same seed, the same choice
    choice = choose_fault(view(3), [FaultKind.WORKER_KILL], random.Random(1))
    assert choice is not None and choice.node in {"node-0", "node-1", "node-2"}


def test_choose_fault_returns_none_when_nothing_is_allowed() -> None:
    assert choose_fault(view(2), [FaultKind.WORKER_KILL, FaultKind.DRAIN], random.Random(0)) is None


def test_next_delay_is_clipped_around_the_mean() -> None:
    rng = random.Random(3)
    delays = [next_delay(rng, 10.0) for _ in range(500)]
    assert min(delays) >= 1.0 and max(delays) <= 40.0
    assert 7.0 < sum(delays) / len(delays) < 13.0


def test_parse_faults() -> None:
    assert parse_faults(None, 1) == kinds_possible(1)
    assert FaultKind.ETCD_LEADER_KILL not in kinds_possible(1)
    assert FaultKind.ETCD_LEADER_KILL in kinds_possible(3)
    assert parse_faults("drain, worker_kill,drain", 1) == (FaultKind.DRAIN, FaultKind.WORKER_KILL)
    with pytest.raises(ConfigError, match="unknown fault kind 'meteor'"):
        parse_faults("meteor", 1)
    with pytest.raises(ConfigError, match="needs --etcd-members 3"):
        parse_faults("etcd_leader_kill", 1)


# -- the verdict ------------------------------------------------------------------------------


def evidence(rows: list[tuple[int, int, float]], finals: list[Final], **kw: object) -> Evidence:
    base: dict[str, object] = dict(
        target_steps=max((s for s, _, _ in rows), default=0),
        commits=tuple(commits(*rows)),
        finals=tuple(finals),
        audit_violations=(),
        faults=(),
        etcd_down=(),
        samples=(),
        lives=(),
        tracebacks=(),
        agents=(AgentEnd("node-0", 1, "", 0),),
        warmup=Window(T0, T0 + 1.0),
        warmups=(Window(T0, T0 + 1.0),),
        faulted=Window(T0 + 1.0, T0 + 2.0),
        lease_ttl_s=2.0,
    )
    base.update(kw)
    return Evidence(**base)  # type: ignore[arg-type]


def failed(ev: Evidence) -> set[str]:
    return {i.name for i in judge(ev).invariants if not i.ok}


def test_a_clean_run_passes_every_invariant_and_reports_ettr() -> None:
    ev = evidence(steady(20), [Final("node-0", 20, "x"), Final("node-1", 20, "x")])
    v = judge(ev)
    assert v.ok, v.invariants
    assert v.step_s == pytest.approx(0.1)
    assert v.faulted_steps == 10 and v.ettr == pytest.approx(1.0) and v.ettr_single == pytest.approx(1.0)
    assert dict(v.step_s_by_world) == {2: pytest.approx(0.1)} and dict(v.faulted_steps_by_world) == {2: 10}


def test_ettr_takes_each_steps_world_size_and_the_report_shows_both_figures() -> None:
    # Warm-up at 3 (0.1 s a step) and 4 (0.12 s); the faults: 10 steps at world 4, a loss, 5 at world 2,
    # over 3.0 s. Per world size: (10 x 0.12 + 5 x 0.1) / 3 = 0.567; single baseline: 15 x 0.1 / 3 = 0.5.
    faulted = run_of(4, 2, 23, 10, 5.0, 0.12) + run_of(2, 3, 33, 5, 6.5, 0.1)
    ev = Evidence(
        target_steps=37,
        commits=tuple(WARM + faulted),
        finals=(Final("node-0", 37, "x"),),
        audit_violations=(),
        faults=(),
        etcd_down=(),
        samples=(),
        lives=(),
        tracebacks=(),
        agents=(),
        warmup=WARM_WINDOWS[0],
        warmups=WARM_WINDOWS,
        faulted=Window(T0 + 4.9, T0 + 7.9),
        lease_ttl_s=2.0,
    )
    v = judge(ev)
    assert v.faulted_steps == 15 and dict(v.faulted_steps_by_world) == {2: 5, 4: 10}
    assert v.ettr == pytest.approx(1.7 / 3.0) and v.ettr_single == pytest.approx(0.5)
    assert v.substituted == {2: 3}
    settings = Settings(1.0, 5.0, 7, (FaultKind.WORKER_KILL,), 3, 2, 4, 1, 5.0, 0.05, 37, 5.0)
    report = Report(settings, ev, v, T0, "/tmp/x")
    table = render_table(report)
    assert "fault-free step   world 3: 100.0 ms, world 4: 120.0 ms (warm-up, 5 s per world size)" in table
    assert "ETTR              0.567 (5 at world 2, 10 at world 4" in table
    assert "world 2: no fault-free measurement, used world 3's" in table
    assert "ETTR 1 baseline   0.500 (15 steps x 100.0 ms fault-free at world 3 / 3.0 s faulted)" in table
    data = json.loads(json.dumps(report_to_dict(report)))
    assert data["ettr"] == pytest.approx(1.7 / 3.0) and data["ettr_single_baseline"] == pytest.approx(0.5)
    assert data["fault_free_step_s"] == pytest.approx(0.1)
    assert data["fault_free_step_s_by_world"] == {"3": pytest.approx(0.1), "4": pytest.approx(0.12)}
    assert data["faulted_steps_by_world"] == {"2": 5, "4": 10}
    assert data["ettr_baseline_substituted"] == {"2": 3}
    empty = json.loads(
        json.dumps(report_to_dict(Report(settings, evidence([], []), judge(evidence([], [])), T0, "/tmp/x")))
    )
    assert (
        empty["ettr"],
        empty["ettr_single_baseline"],
        empty["fault_free_step_s_by_world"],
        empty["faulted_steps_by_world"],
        empty["ettr_baseline_substituted"],
    ) == (None, None, {}, {}, {})


@pytest.mark.parametrize(
    "quiet_steps, baseline, cost",
    [
        # 150 steps at 0.12 s after a fault and a 1 s regroup, on a machine slower than its warm-up
        # (0.1 s): against the quiet steps the fault costs its 0.9 s (18.9 s less 150 x 0.12), not 3.9 s
        (150, "quiet steps", 18.9 - 150 * 0.12),
        (50, "warm-up", 18.9 - 50 * 0.1),  # too few quiet steps: the warm-up's step time
    ],
)
def test_fault_costs_count_against_the_quiet_steps_when_there_are_enough(quiet_steps, baseline, cost) -> None:
    faulted = run_of(3, 2, 12, 5, 2.0, 0.12) + run_of(3, 3, 17, quiet_steps, 3.5, 0.12)
    ev = Evidence(
        target_steps=16 + quiet_steps,
        commits=tuple(WARM[:33] + faulted),
        finals=(Final("node-0", 16 + quiet_steps, "x"),),
        audit_violations=(),
        faults=(FaultRecord(T0 + 2.5, "worker_kill", "node-1"),),
        etcd_down=(),
        samples=(),
        lives=(),
        tracebacks=(),
        agents=(),
        warmup=WARM_WINDOWS[0],
        warmups=WARM_WINDOWS[:1],
        faulted=Window(T0 + 2.0, T0 + 21.4),
        lease_ttl_s=2.0,
    )
    v = judge(ev)
    assert v.cost_baseline == baseline
    assert v.cost_by_kind == {"worker_kill": (1, pytest.approx(cost))}
    settings = Settings(1.0, 5.0, 7, (FaultKind.WORKER_KILL,), 3, 2, 4, 1, 5.0, 0.05, 16 + quiet_steps, 5.0)
    report = Report(settings, ev, v, T0, "/tmp/x")
    assert f"total, mean; against the {baseline} step time)" in render_table(report)
    assert f"{'worker_kill':<22}{1:<10}{cost:6.1f} s  {cost:5.2f} s" in render_table(report)
    assert json.loads(json.dumps(report_to_dict(report)))["cost_baseline"] == baseline


@pytest.mark.parametrize(
    "rows, finals, kw, name",
    [
        (
            steady(10) + [(10, 2, 1.5)] + steady(12, gen=2, start=1.6)[10:],
            [Final("a", 12, "x")],
            {},
            "steps exactly once",
        ),
        ([r for r in steady(12) if r[0] != 7], [Final("a", 12, "x")], {}, "steps exactly once"),
        (steady(10) + [(11, 2, 30.0)], [Final("a", 11, "x")], {}, "no stall > 4 s"),
        (steady(10), [Final("a", 10, "x"), Final("b", 10, "y")], {}, "final parameters identical"),
        (steady(10), [Final("a", 10, "x")], {"target_steps": 50}, "job finished"),
        (steady(10), [Final("a", 10, "x")], {"tracebacks": ("agent-a.log:3: KeyError: 'x'",)}, "no traceback in logs"),
        (
            steady(10),
            [Final("a", 10, "x")],
            {"audit_violations": ("epoch 0: 3 samples used more than once",)},
            "audit check",
        ),
        (steady(10), [Final("a", 10, "x")], {"agents": (AgentEnd("b", 2, "duplicate", 0),)}, "duplicate node refused"),
        (
            steady(10),
            [Final("a", 10, "x")],
            {"samples": (StatusSample(T0 + 0.5, T0 + 0.6, (1234,)),)},
            "status agrees with workers",
        ),
    ],
)
def test_the_checker_detects_each_violation(rows, finals, kw, name) -> None:
    assert failed(evidence(rows, finals, **kw)) == {name}


def test_a_stall_during_an_etcd_outage_with_a_membership_change_is_excused() -> None:
    rows = steady(10) + [(11, 2, 10.0)]
    ev = evidence(rows, [Final("a", 11, "x")], etcd_down=(Window(T0 + 1.5, T0 + 9.0),))
    v = judge(ev)
    assert v.ok, v.invariants
    (stall,) = v.stalls
    assert stall.excused_s == pytest.approx(8.5)  # the outage, then the lease TTL it gives back (to the stall's end)


def test_the_table_and_the_json_object() -> None:
    ev = evidence(
        steady(10) + [(10, 2, 1.5)], [Final("a", 10, "x")], faults=(FaultRecord(T0 + 1.2, "worker_kill", "node-1"),)
    )
    settings = Settings(1.0, 5.0, 7, (FaultKind.WORKER_KILL, FaultKind.DRAIN), 3, 2, 4, 1, 5.0, 0.05, 10, 5.0)
    report = Report(settings, ev, judge(ev), T0, "/tmp/x", {"etcd_leader_kill": "needs --etcd-members 3"})
    table = render_table(report)
    assert "worker_kill           1" in table and "drain                 0" in table
    assert "steps exactly once            FAIL    repeated (step: generations) 10: (1, 2)" in table
    assert "etcd_leader_kill      -  (skipped: needs --etcd-members 3)" in table
    assert "result            FAIL" in table
    data = json.loads(json.dumps(report_to_dict(report)))
    assert data["ok"] is False and data["seed"] == 7
    assert data["injected"] == {"worker_kill": 1, "drain": 0}
    assert data["repeats"] == {"10": [1, 2]}
    assert {i["name"] for i in data["invariants"] if not i["ok"]} == {"steps exactly once"}


# -- network-namespace hosts and link_down ------------------------------------------------------


def test_the_netns_plan_names_every_interface_within_15_characters_and_addresses_hosts_from_10() -> None:
    plan = NetnsPlan("ecd4194304", 37)
    assert (plan.bridge, plan.bridge_addr) == ("ecd4194304b", "10.213.37.1")
    assert plan.host(0) == NetnsHost(0, "ecd4194304h0", "ecd4194304r0", "ecd4194304n0", "10.213.37.10")
    last = plan.host(239)
    assert last.addr == "10.213.37.249"
    assert max(len(n) for n in (plan.bridge, last.ns, last.root_veth, last.ns_veth)) <= 15
    for bad in (-1, 240):
        with pytest.raises(ValueError, match="outside 0..239"):
            plan.host(bad)


@pytest.mark.parametrize(
    "pid, used, subnet",
    [
        (1, set(), 2),  # 1 + pid % 254
        (253, set(), 254),
        (254, set(), 1),  # never .0 or .255
        (1, {2, 3}, 4),  # skips the /24s in use
        (253, {254}, 1),  # wraps around
    ],
)
def test_netns_plan_picks_a_free_subnet_from_the_pid(pid, used, subnet) -> None:
    plan = netns_plan(pid, used)
    assert (plan.prefix, plan.subnet) == (f"ecd{pid}", subnet)


def test_netns_plan_fails_when_every_subnet_is_in_use() -> None:
    with pytest.raises(ConfigError, match="every 10.213.X.0/24 is in use"):
        netns_plan(7, range(1, 255))


@pytest.mark.parametrize(
    "text, used",
    [
        ("", set()),
        ("2: eth0    inet 192.0.2.2/24 brd 192.0.2.255 scope global eth0", set()),
        ("9: ecd1b    inet 10.213.44.1/24 scope global ecd1b\n10.213.7.0/24 dev ecd2b proto kernel", {44, 7}),
        ("10.2130.1.0/24 dev x\n110.213.5.0/24 dev y", set()),  # other networks that look alike
    ],
)
def test_subnets_in_use(text, used) -> None:
    assert subnets_in_use(text) == used


@pytest.mark.parametrize("name, index", [("node-0", 0), ("node-12", 12)])
def test_host_index(name, index) -> None:
    assert host_index(name) == index


@pytest.mark.parametrize("name", ["node-", "node-x", "worker-1", "node-1-dup1", "3"])
def test_host_index_rejects_other_names(name) -> None:
    with pytest.raises(ValueError):
        host_index(name)


@pytest.mark.parametrize(
    "euid, ip, probe, why",
    [
        (0, "/usr/sbin/ip", "", ""),
        (1000, "/usr/sbin/ip", "", "not root"),
        (0, None, "", "no `ip` binary (apt-get install iproute2)"),
        (
            0,
            "/usr/sbin/ip",
            "ip netns add x: exit 1: Operation not permitted",
            "`ip netns` does not work here: ip netns add x: exit 1: Operation not permitted",
        ),
    ],
)
def test_netns_unusable(euid, ip, probe, why) -> None:
    assert netns_unusable(euid, ip, probe) == why


@pytest.mark.parametrize(
    "flag, unusable, on",
    [
        (None, "", True),
        (None, "not root", False),
        (True, "", True),
        (False, "", False),
        (False, "not root", False),
    ],
)
def test_use_netns(flag, unusable, on) -> None:
    assert use_netns(flag, unusable) is on


def test_asking_for_netns_where_it_cannot_be_had_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--netns: not root"):
        use_netns(True, "not root")


def test_link_down_needs_netns_hosts() -> None:
    assert FaultKind.LINK_DOWN not in kinds_possible(3)
    assert FaultKind.LINK_DOWN in kinds_possible(1, netns=True)
    assert parse_faults("link_down,worker_kill", 1, netns=True) == (FaultKind.LINK_DOWN, FaultKind.WORKER_KILL)
    with pytest.raises(ConfigError, match="link_down needs network-namespace hosts"):
        parse_faults("link_down", 3)
    assert skipped_kinds(3, "not root") == {
        "link_down": "needs network-namespace hosts: not root",
        "link_flap": "needs network-namespace hosts: not root",
    }
    assert skipped_kinds(1, "") == {
        "etcd_follower_kill": "needs --etcd-members 3",
        "etcd_leader_kill": "needs --etcd-members 3",
    }
    assert link_down_s_default(2.0) > 2.0 + 2.0  # past the lease and the stall bound


@pytest.mark.parametrize(
    "v, ok",
    [
        (view(3), True),
        (view(2), False),  # the cut-off host would leave 1 < min 2
        (view(2, min_nodes=1), True),
        (view(2, busy=1), False),  # a host already cut off (busy) does not count as ready
        (view(3, etcd_busy=True), False),  # with etcd down, nobody could notice the lost host
    ],
)
def test_link_down_never_takes_the_job_below_its_minimum(v, ok) -> None:
    assert allowed(FaultKind.LINK_DOWN, v) is ok


def rows_of(node: str, gen: int, *ts: float, world: int = 3) -> list[Commit]:
    return [Commit(node, int(t * 10), gen, 0, world, T0 + t) for t in ts]


HEALTHY = (
    rows_of("node-0", 1, 1.0, 2.0)
    + rows_of("node-1", 1, 1.0, 2.0)
    + rows_of("node-0", 2, 6.0, 9.0)
    + rows_of("node-1", 3, 14.0, 20.0)
)


def test_a_host_back_while_the_job_is_at_max_workers_is_a_standby_not_late() -> None:
    # node-1's link is down 3..8; the others then run at world 4 = max_workers until 90, and
    # node-1 commits again at 95: 87 s after its link came back, but only ~5 s of it below max.
    at_max = rows_of("node-0", 2, 6.0, 30.0, 60.0, 90.0, world=4)
    below = rows_of("node-0", 3, 92.0, world=3)
    commits = [c for c in HEALTHY if c.node == "node-0" and c.generation == 1] + at_max + below
    back = rows_of("node-1", 3, 95.0, world=3)
    down = [LinkDown("node-1", T0 + 3, T0 + 8)]
    assert link_down_findings(down, commits + back, 60.0, max_world=4) == []
    # without knowing max_workers, it is late; and at a max of 5, world 4 was no reason to wait
    assert "rejoined 87.0 s after" in link_down_findings(down, commits + back, 60.0)[0]
    assert "rejoined 87.0 s after" in link_down_findings(down, commits + back, 60.0, max_world=5)[0]
    # never back, but the job was at max all along: nothing to rejoin
    assert link_down_findings(down, commits, 60.0, max_world=4) == []


@pytest.mark.parametrize(
    "downs, commits_, problem",
    [
        # dropped (node-0 committed in generation 2 > 1 while node-1 was cut off), rejoined at 14
        ([LinkDown("node-1", T0 + 3, T0 + 8)], HEALTHY, ""),
        # the others committed nothing newer while it was cut off
        (
            [LinkDown("node-1", T0 + 3, T0 + 8)],
            [c for c in HEALTHY if c.generation != 2] + rows_of("node-0", 3, 14.0),
            "did not go on without it",
        ),
        # never rejoined, and the job went on for long after
        (
            [LinkDown("node-1", T0 + 3, T0 + 8)],
            [c for c in HEALTHY if c.node == "node-0"] + rows_of("node-0", 2, 100.0),
            "did not rejoin",
        ),
        # never rejoined, but the job ended soon after the link came back: nothing to rejoin
        ([LinkDown("node-1", T0 + 3, T0 + 8)], [c for c in HEALTHY if c.node == "node-0"], ""),
        # rejoined, but late
        (
            [LinkDown("node-1", T0 + 3, T0 + 8)],
            [c for c in HEALTHY if c.node == "node-0"] + rows_of("node-1", 4, 80.0),
            "rejoined 72.0 s after",
        ),
        # still down at the end
        ([LinkDown("node-1", T0 + 3, math.inf)], HEALTHY, "still down at the end"),
    ],
)
def test_link_down_findings(downs, commits_, problem) -> None:
    got = link_down_findings(downs, commits_, 60.0)
    if problem:
        (finding,) = got
        assert problem in finding and finding.startswith("node-1")
    else:
        assert got == []


def cut(down: float, up: float, synced: float | None = None) -> WorkerLife:
    """A worker registered at T0 whose link went down at ``down`` and came up at ``up`` (inf: not
    yet), that synced in a new generation at ``synced`` (None: not yet)."""
    rejoining = () if up == math.inf else (Window(T0 + up, math.inf if synced is None else T0 + synced),)
    return WorkerLife(11, "n0", T0, None, (), (Window(T0 + down, T0 + up),), rejoining)


@pytest.mark.parametrize(
    "life, listed, problems",
    [
        # cut off since 1 s before the sample: either way
        (cut(9, math.inf), True, 0),
        (cut(9, math.inf), False, 0),
        # cut off since long before: its lease is surely gone, it must not be listed
        (cut(1, math.inf), True, 1),
        (cut(1, math.inf), False, 0),
        # its link came back, and it has not synced yet: either way (it re-registers meanwhile)
        (cut(1, 6), True, 0),
        (cut(1, 6), False, 0),
        # synced again long before the sample: it must be listed again
        (cut(1, 2, 4), False, 1),
        (cut(1, 2, 4), True, 0),
    ],
)
def test_status_may_leave_out_a_worker_cut_off_by_a_link_down(life, listed, problems) -> None:
    s = sample(10.0, 11) if listed else sample(10.0)
    assert len(status_findings([s], [life], SLACK)) == problems


def test_a_stall_while_a_link_is_down_is_not_excused_and_the_link_is_judged() -> None:
    rows = steady(10) + [(11, 2, 10.0)]  # the survivors stalled 9 s after node-1's link went down
    ev = evidence(
        rows,
        [Final("a", 11, "x")],
        link_down=(LinkDown("node-1", T0 + 1.0, T0 + 6.0),),
        faults=(FaultRecord(T0 + 1.0, "link_down", "node-1"),),
    )
    v = judge(ev)
    (stall,) = v.stalls
    assert stall.excused_s == 0.0 and stall.faults == ("link_down(node-1)",)
    assert failed(ev) == {"no stall > 4 s", "link down: dropped, rejoined"}


def test_the_table_and_the_json_object_show_the_netns_hosts_and_link_downs() -> None:
    ev = evidence(steady(10), [Final("a", 10, "x")], link_down=(LinkDown("node-0", T0 + 0.2, T0 + 0.7),))
    settings = Settings(1.0, 5.0, 7, (FaultKind.LINK_DOWN,), 3, 2, 4, 1, 5.0, 0.05, 10, 5.0, True, 5.0)
    report = Report(settings, ev, judge(ev), T0, "/tmp/x")
    table = render_table(report)
    assert "hosts netns ==" in table
    assert "link down         node-0 0.2s+0.5s" in table
    data = json.loads(json.dumps(report_to_dict(report)))
    assert data["link_down"] == [{"node": "node-0", "start_s": 0.2, "length_s": 0.5}]
    assert data["settings"]["netns"] is True and data["settings"]["link_down_s"] == 5.0


def test_membership_closed_times_reads_the_workers_lines_of_an_agent_log() -> None:
    from elasticd.chaos.evidence import membership_closed_times

    log = "\n".join(
        [
            '{"member": "node-0.0.2994", "event": "membership_closed", "timestamp": "2026-11-24T01:34:21.876257Z"}',
            '{"member": "node-0.0.2994", "event": "membership_closed", "timestamp": "2026-11-24T01:35:00Z"}',
            '{"event": "step_committed", "member": "node-0.0.17"}',
            'not json "membership_closed"',
            '{"member": "odd", "event": "membership_closed", "timestamp": "2026-11-24T01:34:21Z"}',
        ]
    )
    # both lines: a pid the kernel gave out again closes a membership per life
    assert membership_closed_times(log) == {2994: (1795484061.876257, 1795484100.0)}


def test_discarded_steps_are_counted_by_reason_and_reported() -> None:
    from dataclasses import replace

    from elasticd.chaos.evidence import discarded_steps

    branch = "this member's state is not of rank 0's lineage: a branch the job left"
    log = "\n".join(
        [
            '{"steps": [15711], "reason": "%s", "event": "steps_discarded"}' % branch,
            '{"steps": [19933, 19934], "reason": "left the job", "event": "steps_discarded"}',
            '{"steps": [7], "reason": "%s", "event": "steps_discarded"}' % branch,
            '{"event": "step_committed", "steps": [1]}',
            'not json "steps_discarded"',
            '{"event": "steps_discarded", "reason": "no steps key"}',
        ]
    )
    assert discarded_steps(log) == {branch: 2, "left the job": 2}
    assert discarded_steps("") == {}
    settings = Settings(1.0, 5.0, 7, (FaultKind.WORKER_KILL,), 3, 2, 4, 1, 5.0, 0.05, 37, 5.0)
    ev = replace(evidence([], []), discarded={"left the job": 2})
    report = Report(settings, ev, judge(ev), T0, "/tmp/x")
    assert (
        "steps discarded   2 (applied by a member, never confirmed: the others committed them; "
        "2 left the job)" in render_table(report)
    )
    assert json.loads(json.dumps(report_to_dict(report)))["steps_discarded"] == {"left the job": 2}
    bare = Report(settings, evidence([], []), judge(evidence([], [])), T0, "/tmp/x")
    assert "steps discarded   0 (" in render_table(bare) and report_to_dict(bare)["steps_discarded"] == {}


def test_a_stall_after_etcd_returns_is_excused_for_a_lease_ttl_when_a_member_had_to_leave() -> None:
    """The 30-minute soak (seed 4): a link down, then the etcd leader killed. At its return etcd
    gives every lease its whole TTL again, so the cut host was seen gone a TTL after that."""
    from elasticd.chaos.judge import after_etcd_returns

    times = [(T0, 51), (T0 + 6.1, 52)]
    down = [Window(T0 + 1.3, T0 + 2.5)]
    faults = [FaultRecord(T0, "link_down", "node-3"), FaultRecord(T0 + 1.3, "etcd_leader_kill", "etcd")]
    (raw,) = find_stalls(times, 4.0, down, faults)
    assert raw.length_s - raw.excused_s > 4.0  # the etcd-down window alone does not cover it
    (stall,) = find_stalls(times, 4.0, after_etcd_returns(down, 2.0), faults)
    assert stall.length_s - stall.excused_s <= 4.0
    # the same generation before and after (the cut host came back in time): still excused,
    # because a member-removing fault came just before
    (same,) = find_stalls(
        [(T0, 82), (T0 + 6.8, 82)],
        4.0,
        after_etcd_returns([Window(T0 + 1.1, T0 + 6.6)], 2.0),
        [FaultRecord(T0, "link_down", "node-0")],
    )
    assert same.length_s - same.excused_s <= 4.0
    # no fault that removes a member, same generation: not excused
    (plain,) = find_stalls([(T0, 82), (T0 + 6.8, 82)], 4.0, after_etcd_returns([Window(T0 + 1.1, T0 + 6.6)], 2.0), [])
    assert plain.excused_s == 0.0


def test_a_worker_that_left_while_etcd_was_down_may_be_listed_until_a_ttl_after_etcd_returned() -> None:
    life = WorkerLife(11, "n0", T0, T0 + 2)  # gone at T0 + 2, during an outage
    s = sample(10.0, 11)
    assert len(status_findings([s], [life], SLACK)) == 1
    assert status_findings([s], [life], SLACK, etcd_down=[Window(T0 + 1, T0 + 8)], lease_ttl_s=2.0) == []
    assert len(status_findings([s], [life], SLACK, etcd_down=[Window(T0 + 1, T0 + 4)], lease_ttl_s=2.0)) == 1


def test_a_cut_host_need_not_be_dropped_while_etcd_cannot_expire_its_lease() -> None:
    from elasticd.chaos.evidence import Commit, LinkDown
    from elasticd.chaos.judge import link_down_findings

    commits = [Commit("node-0", step, 5, 0, 2, T0 + t) for step, t in enumerate((0.0, 9.0, 12.0), start=1)]
    down = [LinkDown("node-0", T0 + 1.0, T0 + 6.0)]
    assert len(link_down_findings(down, commits, 60.0)) == 1  # the others did not go on
    assert link_down_findings(down, commits, 60.0, etcd_down=[Window(T0 + 2.0, T0 + 9.0)]) == []


@pytest.mark.parametrize(
    ("relay", "node", "expected"),
    [
        ("off", 0, False),
        ("off", 1, False),
        ("on", 0, True),
        ("on", 3, True),
        ("mixed", 0, True),
        ("mixed", 1, False),
        ("mixed", 2, True),
    ],
)
def test_which_agents_run_with_relay_on(relay: str, node: int, expected: bool) -> None:
    assert relayed(relay, node) is expected


def test_an_agent_that_exits_between_two_polls_is_recorded_with_its_code_not_as_still_running(tmp_path) -> None:
    # CI once judged an agent "still running at the end" after it had logged its exit: the run's
    # loop ended when alive() (which reaps) saw it gone, before the poll that records the code.
    settings = Settings(1.0, 5.0, 7, (FaultKind.WORKER_KILL,), 3, 2, 4, 1, 5.0, 0.05, 10, 5.0)
    run = ChaosRun(settings, tmp_path, lambda _text: None)
    run.last_step = 10  # finished: an exit is not replaced
    proc = WorkerProcess([sys.executable, "-c", "print('bye')"], {}, tmp_path / "agent-node-0.log").start()
    run.nodes.append(Node("node-0", proc))
    assert proc.wait(30.0) == 0
    assert run.live_nodes() == []
    assert run.nodes[0].code == 0 and run.nodes[0].message == "bye"


def test_the_production_mix_draws_kinds_by_their_published_shares() -> None:
    from elasticd.chaos.schedule import PRODUCTION_MIX

    assert set(PRODUCTION_MIX) == set(kinds_possible(3, netns=True))  # every kind has a weight
    rng = random.Random(5)
    kinds = list(kinds_possible(3, netns=True))
    picks = collections.Counter(
        choose_fault(view(3, injected={}), kinds, rng, PRODUCTION_MIX).kind  # type: ignore[union-attr]
        for _ in range(4000)
    )
    total = sum(PRODUCTION_MIX[k] for k in kinds if allowed(k, view(3, injected={})))
    gpu = (picks[FaultKind.WORKER_ABORT] + picks[FaultKind.WORKER_KILL]) / 4000
    assert abs(gpu - (PRODUCTION_MIX[FaultKind.WORKER_ABORT] + PRODUCTION_MIX[FaultKind.WORKER_KILL]) / total) < 0.05
    assert picks[FaultKind.WORKER_KILL] > picks[FaultKind.LINK_DOWN] > picks[FaultKind.ETCD_RESTART]
    # a kind not allowed now is never drawn: one etcd fault at a time
    busy = view(3, etcd_busy=True)
    assert all(
        not KINDS[choose_fault(busy, kinds, rng, PRODUCTION_MIX).kind].etcd  # type: ignore[union-attr]
        for _ in range(200)
    )


# -- nan_grads, link_flap, the checkpoint kinds, the bug scenario ------------------------------


def lossy(rows: list[tuple[int, float]], world: int = 2) -> list[Commit]:
    """(step, loss) -> one commit line per rank, step s at T0 + s (generation 1)."""
    return [Commit(f"node-{r}", s, 1, r, world, T0 + s, loss) for s, loss in rows for r in range(world)]


def mark(node: str, event: str, step: int, t: float, errno: str = "") -> Mark:
    return Mark(node, event, step, T0 + t, errno)


NAN = float("nan")
POISON = FaultRecord(T0 + 4.5, "nan_grads", "node-1")
NAMED_5_6 = [mark("node-1", "gradients_not_finite", s, s + 0.1) for s in (5, 6)]
SKIPPED_5_6 = [mark(f"node-{r}", "step_skipped", s, s + 0.1) for s in (5, 6) for r in (0, 1)]


@pytest.mark.parametrize(
    "faults, marks, losses, problem",
    [
        # poisoned at 4.5: steps 5 and 6 named by node-1, skipped on both, their losses NaN
        ([POISON], NAMED_5_6 + SKIPPED_5_6, {5: NAN, 6: NAN}, None),
        # a NaN loss nobody named: a NaN was applied
        ([POISON], NAMED_5_6 + SKIPPED_5_6, {5: NAN, 6: NAN, 7: NAN}, "no member named"),
        # node-0 committed step 6 without skipping it
        ([POISON], NAMED_5_6 + SKIPPED_5_6[:3], {5: NAN, 6: NAN}, "without skipping it"),
        # non-finite gradients with no poison injected on that node
        ([], NAMED_5_6 + SKIPPED_5_6, {5: NAN, 6: NAN}, "no nan_grads was injected"),
        # more steps named than the poison's
        ([POISON], [*NAMED_5_6, mark("node-1", "gradients_not_finite", 7, 7.1)], {5: NAN, 6: NAN}, "3 steps named"),
        # poisoned, the node went on for longer than the bound, and no step was named
        ([POISON], [], {}, "no step named its gradients non-finite"),
    ],
)
def test_nan_findings(faults, marks, losses, problem) -> None:
    rows = lossy([(s, losses.get(s, 1.0 / s)) for s in range(1, 41)])
    found, summary = nan_findings(faults, marks, rows, faults)
    if problem is None:
        assert found == [] and "[5, 6]" in summary
    else:
        assert any(problem in f for f in found), found


def test_a_nan_run_is_judged_and_fails_when_a_nan_was_applied() -> None:
    finals = [Final("node-0", 40, "x"), Final("node-1", 40, "x")]
    base = dict(
        commits=tuple(lossy([(s, NAN if s in (5, 6) else 1.0) for s in range(1, 41)])),
        faults=(POISON,),
        marks=tuple(NAMED_5_6 + SKIPPED_5_6),
        target_steps=40,
    )
    ok = judge(evidence([], finals, **base))
    assert "NaN gradients skipped" in {i.name for i in ok.invariants} and ok.ok, ok.invariants
    applied = {**base, "commits": tuple(lossy([(s, NAN if s >= 5 else 1.0) for s in range(1, 41)]))}
    assert failed(evidence([], finals, **applied)) == {"NaN gradients skipped"}


def test_a_flapping_host_must_commit_again_after_its_link_stopped_flapping() -> None:
    flap = LinkDown("node-1", T0 + 10, T0 + 15)
    went_on = commits(*steady(100, dt=1.0))  # node-1 commits every second, before and after
    assert rejoin_findings(flap, went_on, 60.0) == []
    gone = [c for c in commits(*steady(100, dt=1.0)) if not (c.node == "node-1" and c.t > T0 + 15)]
    assert "did not rejoin" in rejoin_findings(flap, gone, 60.0)[0]
    finals = [Final("node-0", 100, "x"), Final("node-1", 100, "x")]
    assert failed(evidence(steady(100, dt=1.0), finals, link_flaps=(flap,))) == set()
    v = judge(evidence([], finals, commits=tuple(gone), target_steps=100, link_flaps=(flap,)))
    assert {i.name for i in v.invariants if not i.ok} >= {"link flap: host back"}


RO = CheckpointFault("checkpoint_readonly", T0 + 10, T0 + 15, (1, 2, 3), (1, 2, 3))


@pytest.mark.parametrize(
    "cfaults, marks, problem",
    [
        # two saves failed with EROFS while read-only; one succeeded after
        (
            [RO],
            [mark("node-0", "checkpoint_save_failed", 20, 11, "EROFS"), mark("node-0", "checkpoint_saved", 40, 21)],
            None,
        ),
        # a failure outside every fault
        (
            [RO],
            [mark("node-0", "checkpoint_save_failed", 60, 30, "EIO"), mark("node-0", "checkpoint_saved", 40, 21)],
            "no checkpoint fault in flight",
        ),
        # the wrong errno for the fault
        (
            [RO],
            [mark("node-0", "checkpoint_save_failed", 20, 11, "EIO"), mark("node-0", "checkpoint_saved", 40, 21)],
            "not ['EROFS']",
        ),
        # the newest checkpoint before the fault is gone, none newer
        ([dataclasses.replace(RO, after=(1, 2))], [mark("node-0", "checkpoint_saved", 40, 21)], "seq 3"),
        # no save after the restore although the job went on
        ([RO], [mark("node-0", "checkpoint_saved", 20, 9)], "no save succeeded after"),
        # still faulted at the end
        ([dataclasses.replace(RO, end=math.inf)], [], "still faulted at the end"),
        # ENOSPC is what a full filesystem gives
        (
            [dataclasses.replace(RO, kind="checkpoint_full")],
            [mark("node-0", "checkpoint_save_failed", 20, 16, "ENOSPC"), mark("node-0", "checkpoint_saved", 40, 21)],
            None,
        ),
    ],
)
def test_checkpoint_findings(cfaults, marks, problem) -> None:
    found, summary = checkpoint_findings(cfaults, marks, lossy([(s, 1.0) for s in range(1, 100)]))
    if problem is None:
        assert found == [], found
    else:
        assert any(problem in f for f in found), found


def test_parse_marks_reads_the_workers_lines_of_an_agent_log() -> None:
    lines = [
        {"event": "step_skipped", "step": 5, "timestamp": "2026-01-01T00:00:01Z"},
        {"event": "checkpoint_save_failed", "step": 20, "errno": "EROFS", "timestamp": "2026-01-01T00:00:02Z"},
        {"event": "gradients_not_finite", "step": 5, "timestamp": "2026-01-01T00:00:00.5Z"},
        {"event": "checkpoint_saved", "step": 40, "timestamp": "not a time"},
    ]
    text = "\n".join(json.dumps(x) for x in lines) + "\nTraceback (most recent call last)\n"
    got = parse_marks("node-1", text)
    assert [(m.event, m.step, m.errno) for m in got] == [
        ("gradients_not_finite", 5, ""),
        ("step_skipped", 5, ""),
        ("checkpoint_save_failed", 20, "EROFS"),
    ]
    assert {m.node for m in got} == {"node-1"}


@pytest.mark.parametrize(
    "kind, place, why",
    [
        (FaultKind.NAN_GRADS, Place(1), ""),
        (
            FaultKind.NAN_GRADS,
            Place(1, no_poison=no_poison("dropin", False)),
            "needs the workload's NaN poison: --form dropin",
        ),
        (FaultKind.NAN_GRADS, Place(1, no_poison=no_poison("short", True)), "GradScaler"),
        (FaultKind.WORKER_HANG, Place(1, no_poison=no_poison("short", True)), ""),  # a hang under fp16 too
        (FaultKind.WORKER_HANG, Place(1, no_hang=no_hang("dropin")), "needs the workload's hang: --form dropin"),
        (FaultKind.WORKER_HANG, Place(1, no_hang=no_hang("short", 2)), "agents/mlp_sharded.py has none"),
        (FaultKind.LINK_FLAP, Place(1, no_netns=""), ""),
        (FaultKind.LINK_FLAP, Place(1, no_netns="not root"), "needs network-namespace hosts: not root"),
        (
            FaultKind.CHECKPOINT_FULL,
            Place(1, no_mount="not root"),
            "needs a checkpoint filesystem of the run's own: not root",
        ),
        (FaultKind.CHECKPOINT_READONLY, Place(3), ""),
        (FaultKind.ETCD_LEADER_KILL, Place(1), "needs --etcd-members 3"),
    ],
)
def test_what_each_kind_needs(kind, place, why) -> None:
    assert why in place.missing(kind) and bool(place.missing(kind)) == bool(why)
    assert (kind in kinds_possible(place.etcd_members, place=place)) == (not why)
    if why:
        assert skipped_kinds(place.etcd_members, place=place)[kind.value] == place.missing(kind)
        with pytest.raises(ConfigError, match=f"--faults: {kind.value} needs"):
            parse_faults(kind.value, place.etcd_members, place=place)


def test_one_checkpoint_fault_at_a_time_and_the_new_kinds_in_the_mix() -> None:
    from elasticd.chaos.schedule import PRODUCTION_MIX

    busy = dataclasses.replace(view(3), checkpoint_busy=True)
    assert allowed(FaultKind.CHECKPOINT_FULL, view(3)) and not allowed(FaultKind.CHECKPOINT_FULL, busy)
    assert allowed(FaultKind.NAN_GRADS, view(2))  # takes no node away
    assert not allowed(FaultKind.LINK_FLAP, view(2)) and allowed(FaultKind.LINK_FLAP, view(3))
    # the published shares: host and maintenance 11, network 10.1, silent data corruption 1.4
    host = (FaultKind.NODE_LOSS, FaultKind.DRAIN, FaultKind.AGENT_SIGTERM, FaultKind.AGENT_STOP)
    assert sum(PRODUCTION_MIX[k] for k in host) + PRODUCTION_MIX[FaultKind.CHECKPOINT_READONLY] + PRODUCTION_MIX[
        FaultKind.CHECKPOINT_FULL
    ] == pytest.approx(11.0)
    assert PRODUCTION_MIX[FaultKind.LINK_DOWN] + PRODUCTION_MIX[FaultKind.LINK_FLAP] == pytest.approx(10.1)
    assert PRODUCTION_MIX[FaultKind.STRAGGLER] + PRODUCTION_MIX[FaultKind.NAN_GRADS] == pytest.approx(1.4)
    assert NAN_GRAD_STEPS < NONFINITE_STEPS  # the poisoned worker stays: its node is never taken as bad


def bug_evidence(**kw: object) -> BugEvidence:
    base: dict[str, object] = dict(
        step=30,
        codes={"node-0": 3, "node-1": 3},
        stopped_t={"node-0": T0 + 2.0, "node-1": T0 + 3.5},
        first_failure_t=T0,
        status={"health": "failed", "bug": {"step": 30, "exception": "ScriptBug: the batch of step 30 ..."}},
        status_error="",
        last_step=29,
        lease_ttl_s=2.0,
    )
    base.update(kw)
    return BugEvidence(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kw, failing",
    [
        ({}, set()),
        ({"codes": {"node-0": 3, "node-1": 1}}, {"every agent exits 3"}),
        (  # still running at the bound: no agent_stopped line
            {"codes": {"node-0": 3, "node-1": None}, "stopped_t": {"node-0": T0 + 2.0}},
            {"every agent exits 3", "stopped within 2 x TTL + 3 s = 7 s"},
        ),
        ({"stopped_t": {"node-0": T0 + 2.0, "node-1": T0 + 7.5}}, {"stopped within 2 x TTL + 3 s = 7 s"}),
        ({"first_failure_t": None}, {"stopped within 2 x TTL + 3 s = 7 s"}),
        ({"status": {"health": "degraded", "bug": None}}, {"status: failed at step 30, naming ScriptBug"}),
        (
            {"status": {"health": "failed", "bug": {"step": 31, "exception": "ScriptBug: x"}}},
            {"status: failed at step 30, naming ScriptBug"},
        ),
        ({"status": None, "status_error": "exit 1"}, {"status: failed at step 30, naming ScriptBug"}),
        ({"last_step": 28}, set()),  # step 29's commit line waits for step 30's sum, which never comes
        ({"last_step": 30}, {"no step at or past 30 committed"}),
        ({"last_step": 12}, {"no step at or past 30 committed"}),  # it never got near the step
        (
            {"status": {"health": "failed", "bug": {"step": 30, "exception": "__main__.ScriptBug: the batch ..."}}},
            set(),
        ),
        (
            {"status": {"health": "failed", "bug": {"step": 30, "exception": "ValueError: the batch ..."}}},
            {"status: failed at step 30, naming ScriptBug"},
        ),
    ],
)
def test_judge_bug(kw, failing) -> None:
    invariants = judge_bug(bug_evidence(**kw))
    assert {i.name for i in invariants if not i.ok} == failing
    text = render_bug(invariants, 30, 2, "/tmp/x")
    assert ("result: PASS" in text) == (not failing) and text.count("PASS") + text.count("FAIL") == 5


def test_a_sharded_run_counts_k_workers_a_node_and_reads_their_audit_files_by_node(tmp_path) -> None:
    settings = dataclasses.replace(
        Settings(1.0, 5.0, 7, (FaultKind.WORKER_KILL,), 3, 2, 4, 1, 5.0, 0.05, 10, 5.0), replica_size=2
    )
    assert settings.workers(3) == 6
    run = ChaosRun(settings, tmp_path, lambda _text: None)
    assert run.audit_dir == tmp_path / "audit" / "chaos"  # the agents' --audit-dir, per job
    assert run.audit_names("node-1") == ["node-1.0", "node-1.1"]
    assert run.node_of("node-1.1") == "node-1"
    flat = ChaosRun(Settings(1.0, 5.0, 7, (FaultKind.WORKER_KILL,), 3, 2, 4, 1, 5.0, 0.05, 10, 5.0), tmp_path, print)
    assert flat.audit_names("node-1") == ["node-1"] and flat.node_of("node-1") == "node-1"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replica-size", "0"], "--replica-size: at least 1"),
        (["--replica-size", "2", "--form", "dropin"], "--replica-size: more than 1 runs agents/mlp_sharded.py"),
        (["--replica-size", "2", "--scenario", "bug"], "--replica-size: more than 1 runs agents/mlp_sharded.py"),
    ],
)
def test_a_sharded_run_refuses_what_its_workload_cannot_do(flags: list[str], message: str) -> None:
    from elasticd.chaos.schedule import make_settings, parse_args

    with pytest.raises(ConfigError, match=message):
        make_settings(parse_args(["--minutes", "1", *flags]))
    assert make_settings(parse_args(["--minutes", "1", "--replica-size", "2"])).replica_size == 2
    assert "agents/mlp_sharded.py has none" in Place(1, no_poison=no_poison("short", False, 2)).missing(
        FaultKind.NAN_GRADS
    )
