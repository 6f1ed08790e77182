"""The invariants of a chaos run, checked over its evidence (pure).

Owns ``judge``: every committed step exactly once, the job finished, identical final parameters,
no stall longer than lease TTL + 2 s (but for the time etcd was down when membership had to change),
``elasticctl status`` agreeing with the live workers, no traceback, a clean audit, agents exiting
0, a duplicate node refused, an isolated host dropped and rejoined; each a function over parsed
records (``step_findings``, ``find_stalls``, ``final_findings``, ``status_findings``,
``link_down_findings``, ``agent_findings``), and the ``Verdict`` with the ETTR figures. It reads
nothing and runs nothing: the executor gathers the ``Evidence``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
    Commit,
    Evidence,
    FaultRecord,
    Final,
    LinkDown,
    StatusSample,
    Window,
    WorkerLife,
)
from elasticd.chaos.kinds_judge import checkpoint_findings, nan_findings
from elasticd.chaos.schedule import FaultKind

REJOIN_BOUND_S = 60.0  # after its link came back, an isolated host's worker must commit again by then


@dataclass(frozen=True)
class Stall:
    start: float
    length_s: float
    excused_s: float  # the part while etcd was down and membership had to change
    generations: tuple[int, int]  # the generation of the commit before and after
    faults: tuple[str, ...]  # the faults injected just before it (and during it)

    @property
    def counted_s(self) -> float:
        return self.length_s - self.excused_s


@dataclass(frozen=True)
class StepFindings:
    last_step: int
    repeats: Mapping[int, tuple[int, ...]]  # step -> the generations that committed it
    lost: tuple[int, ...]
    generations: tuple[int, ...]


@dataclass(frozen=True)
class Invariant:
    name: str
    ok: bool
    detail: str


def step_findings(commits: Sequence[Commit]) -> StepFindings:
    """Every step 1..N committed exactly once across all generations: the repeats and the gaps."""
    gens_of: dict[int, set[int]] = {}
    for c in commits:
        gens_of.setdefault(c.step, set()).add(c.generation)
    last = max(gens_of, default=0)
    repeats = {s: tuple(sorted(g)) for s, g in sorted(gens_of.items()) if len(g) > 1}
    lost = tuple(s for s in range(1, last + 1) if s not in gens_of)
    return StepFindings(last, repeats, lost, tuple(sorted({c.generation for c in commits})))


def commit_times(commits: Sequence[Commit]) -> list[tuple[float, int]]:
    """(time, generation) of each committed (step, generation), by its first line, in time order."""
    first: dict[tuple[int, int], float] = {}
    for c in commits:
        key = (c.step, c.generation)
        first[key] = min(first.get(key, c.t), c.t)
    return sorted((t, gen) for (_, gen), t in first.items())


def _overlap(a: float, b: float, windows: Sequence[Window]) -> float:
    """Seconds of [a, b] covered by the windows (which may overlap each other)."""
    cuts = sorted((max(a, w.start), min(b, w.end)) for w in windows if w.end > a and w.start < b)
    total, reach = 0.0, a
    for s, e in cuts:
        s = max(s, reach)
        if e > s:
            total += e - s
            reach = e
    return total


# Faults that take a member out of the job: a stall after one needs a membership change.
MEMBER_REMOVING = frozenset(
    {
        FaultKind.WORKER_KILL,
        FaultKind.NODE_LOSS,
        FaultKind.WORKER_STOP,
        FaultKind.WORKER_HANG,
        FaultKind.DRAIN,
        FaultKind.AGENT_SIGTERM,
        FaultKind.LINK_DOWN,
        FaultKind.LINK_FLAP,
    }
)


def after_etcd_returns(etcd_down: Sequence[Window], lease_ttl_s: float) -> list[Window]:
    """The etcd-down windows, each extended by a lease TTL past its end (pure): an etcd that comes
    back (restart, new leader) gives every lease its whole TTL again, so a member that died meanwhile
    is seen gone only a TTL after etcd's return, whatever anybody does."""
    return [Window(w.start, w.end + lease_ttl_s) for w in etcd_down]


def find_stalls(
    times: Sequence[tuple[float, int]],
    limit_s: float,
    etcd_down: Sequence[Window],
    faults: Sequence[FaultRecord],
    end_t: float | None = None,
    lookback_s: float | None = None,
) -> list[Stall]:
    """Every interval without a commit longer than ``limit_s``, in time order.

    Args:
        times: (time, generation) of the commits, in time order (``commit_times``).
        limit_s: the longest interval allowed (lease TTL + 2 s).
        etcd_down: when etcd was down or had no quorum (pass ``after_etcd_returns`` of them to
            count the lease TTL etcd gives back at its return). Such time is excused only when
            membership had to change: the commit after the stall is in another generation than the
            one before, or a fault that takes a member out came just before or during the stall.
        faults: what was injected; each stall names those within ``lookback_s`` before it or during it.
        end_t: the end of the run when the job did not finish: the time after the last commit counts.
        lookback_s: default ``limit_s``.
    """
    back = limit_s if lookback_s is None else lookback_s
    spans = [(a, b, ga, gb) for (a, ga), (b, gb) in zip(times, times[1:], strict=False)]
    if end_t is not None and times and end_t > times[-1][0]:
        spans.append((times[-1][0], end_t, times[-1][1], -1))
    out = []
    for a, b, ga, gb in spans:
        if b - a <= limit_s:
            continue
        removing = any(f.kind in MEMBER_REMOVING and a - back <= f.t <= b for f in faults)
        excused = _overlap(a, b, etcd_down) if gb != ga or removing else 0.0
        near = tuple(f"{f.kind}({f.target})" for f in faults if a - back <= f.t <= b)
        out.append(Stall(a, b - a, excused, (ga, gb), near))
    return out


def final_findings(finals: Sequence[Final], last_step: int) -> list[str]:
    """Problems with the final parameters: workers that left at the same step differ (a sharded
    job's: those of one shard index), or no worker finished at the last step."""
    by_step: dict[tuple[int, int], set[str]] = {}
    for f in finals:
        by_step.setdefault((f.step, f.shard), set()).add(f.checksum)
    out = [
        f"workers that ended at step {step} hold different parameters{f' (shard {shard})' if shard else ''}: "
        f"{sorted(sums)}"
        for (step, shard), sums in sorted(by_step.items())
        if len(sums) > 1
    ]
    if last_step and last_step not in {step for step, _ in by_step}:
        out.append(f"no worker wrote a final line at the last step {last_step}")
    return out


def _reused(w: WorkerLife, lives: Sequence[WorkerLife], s: StatusSample) -> bool:
    """Another life of ``w``'s pid (the kernel gave it out again) was seen by the end of sample
    ``s`` and had not ended before its start: the pid listed is that one's."""
    return any(
        o is not w
        and o.pid == w.pid
        and o.seen_t is not None
        and o.seen_t <= s.t1
        and (o.ended_t is None or o.ended_t >= s.t0)
        for o in lives
    )


def status_findings(
    samples: Sequence[StatusSample],
    lives: Sequence[WorkerLife],
    slack_s: float,
    seen_margin_s: float = 0.5,
    etcd_down: Sequence[Window] = (),
    lease_ttl_s: float = 0.0,
) -> list[str]:
    """Where ``elasticctl status`` disagreed with the live workers by more than ``slack_s``.

    At a sample taken over [t0, t1], a worker registered before t0 - slack, alive until after t1 and
    not stopped (or cut off by a link down) since t0 - slack, nor out of reach around an etcd outage
    that ended after t0 - slack, must be listed; one gone, or stopped
    (or cut off) the whole time, since before t0 - slack must not be; every listed pid must be a
    worker of this run. ``seen_margin_s`` covers the delay with which a death is seen (the loop
    polls). ``etcd_down``: when etcd was down; ``lease_ttl_s``: how long a lease outlives etcd's return.
    """
    out = []
    known = {w.pid: w for w in lives}
    kept = after_etcd_returns(etcd_down, lease_ttl_s)
    for s in samples:
        if s.error:
            continue
        listed = set(s.pids)
        since = s.t0 - slack_s
        for w in lives:
            alive = (w.ended_t is None or w.ended_t > s.t1 + seen_margin_s) and (
                w.left_t is None or w.left_t > s.t1 + seen_margin_s
            )
            out_of_reach = (*w.paused, *w.cut_off)
            paused = any(p.end >= since and p.start <= s.t1 for p in (*out_of_reach, *w.rejoining))
            # One out of reach (its lease revoked or expired) around an etcd outage registers again
            # only once etcd answers: it gets the slack from etcd's return.
            relisting = any(
                d.start <= s.t1
                and d.end + slack_s >= s.t0
                and any(p.end >= d.start - slack_s and p.start <= d.end for p in (*out_of_reach, *w.rejoining))
                for d in etcd_down
            )
            if (
                w.registered_t is not None
                and w.registered_t <= since
                and alive
                and not paused
                and not relisting
                and w.pid not in listed
            ):
                out.append(
                    f"at {s.t0:.1f}: worker {w.node} pid {w.pid} is live (registered "
                    f"{s.t0 - w.registered_t:.1f} s before) but not listed"
                )
            # A worker that left while etcd was down keeps its lease (no revoke could land) until a
            # TTL after etcd's return: listing it meanwhile is right.
            lease_kept = any(d.start <= s.t1 and d.end + slack_s >= s.t0 for d in kept)
            gone = not lease_kept and (
                (w.ended_t is not None and w.ended_t <= since)
                or any(p.start <= since and p.end >= s.t1 for p in out_of_reach)
            )
            if gone and w.pid in listed and not _reused(w, lives, s):
                out.append(
                    f"at {s.t0:.1f}: worker {w.node} pid {w.pid} is listed but gone or stopped "
                    f"for more than {slack_s:g} s"
                )
        for pid in sorted(listed - set(known)):
            out.append(f"at {s.t0:.1f}: status lists pid {pid}, which is no worker of this run")
    return out


def standby_s(commits: Sequence[Commit], node: str, start: float, end: float, max_world: int) -> float:
    """Seconds of [start, end] in which the job, without ``node``, was at ``max_world`` workers
    (read from the other nodes' commits: from each commit at that size to the next commit): a host
    that comes back then is a standby beyond max_workers and waits, rightly, for a member to leave."""
    if max_world <= 0:
        return 0.0
    times = sorted((c.t, c.world_size) for c in commits if c.node != node and start <= c.t <= end)
    return sum(b[0] - a[0] for a, b in zip(times, times[1:]) if a[1] >= max_world)


def link_down_findings(
    downs: Sequence[LinkDown],
    commits: Sequence[Commit],
    rejoin_bound_s: float,
    etcd_down: Sequence[Window] = (),
    max_world: int = 0,
) -> list[str]:
    """Problems with each link down: the isolated host must be dropped (the other hosts commit, in a
    newer generation than its last one before the cut, while its link is still down) and must rejoin
    (a commit of its own after the link came back, within ``rejoin_bound_s`` unless the job ended
    sooner; time the job spent at ``max_world`` without it does not count: it was a standby then).
    A stall on the isolated host itself is expected and not looked for. The host cannot be dropped
    while etcd is down, nor before a TTL after etcd's return (``after_etcd_returns``): a link down
    that overlaps such a window need not see the others go on."""
    out = []
    last_t = max((c.t for c in commits), default=0.0)
    for d in downs:
        if d.end == math.inf:
            out.append(f"{d.node}: its link was still down at the end")
            continue
        before = [c.generation for c in commits if c.node == d.node and c.t <= d.start]
        newer_than = max(before, default=-1)
        went_on = any(c.node != d.node and d.start < c.t <= d.end and c.generation > newer_than for c in commits)
        etcd_bound = any(w.start <= d.end and w.end >= d.start for w in etcd_down)
        if not went_on and not etcd_bound and last_t > d.end:
            out.append(
                f"{d.node}: the other hosts did not go on without it while its link was down ({d.end - d.start:.1f} s)"
            )
        out += rejoin_findings(d, commits, rejoin_bound_s, max_world)
    return out


def rejoin_findings(d: LinkDown, commits: Sequence[Commit], rejoin_bound_s: float, max_world: int = 0) -> list[str]:
    """The host of a link that was down (or flapped) over ``d`` commits again after it came back,
    within ``rejoin_bound_s`` unless the job ended sooner; time the job spent at ``max_world``
    without it does not count (it was a standby then)."""
    last_t = max((c.t for c in commits), default=0.0)
    back = [c.t for c in commits if c.node == d.node and c.t > d.end]
    until = back[0] if back else last_t
    waited = until - d.end - standby_s(commits, d.node, d.end, until, max_world)
    if back and waited > rejoin_bound_s:
        return [
            f"{d.node}: rejoined {back[0] - d.end:.1f} s after its link came back, "
            f"{waited:.1f} s of it not as a standby (bound {rejoin_bound_s:g} s)"
        ]
    if not back and waited > rejoin_bound_s:
        return [
            f"{d.node}: did not rejoin after its link came back (the job went on for "
            f"{last_t - d.end:.1f} s, {waited:.1f} s of it below max_workers)"
        ]
    return []


def agent_findings(ends: Sequence[AgentEnd]) -> tuple[list[str], list[str]]:
    """(agents that should have exited 0 and did not, duplicates that were not refused)."""
    bad, dup = [], []
    for a in ends:
        if a.expected == "duplicate":
            if a.code is None or a.code == 0:
                how = "still running after its bound" if a.code is None else "exited 0"
                dup.append(f"second agent for {a.node} (pid {a.pid}) was not refused: {how}")
            elif a.node not in a.message:
                dup.append(
                    f"second agent for {a.node} (pid {a.pid}) exited {a.code} without naming the "
                    f"node id: {a.message[:160]}"
                )
        elif a.expected != "killed" and a.code != 0:
            how = "still running at the end" if a.code is None else f"exited {a.code}"
            bad.append(f"agent {a.node} (pid {a.pid}) {how}: {a.message[:200]}")
    return bad, dup


@dataclass(frozen=True)
class Verdict:
    invariants: tuple[Invariant, ...]
    stalls: tuple[Stall, ...]
    steps: StepFindings
    step_s: float | None  # the fault-free step time at --nodes (the single baseline)
    ettr: float | None  # by the fault-free step time at each step's world size
    faulted_steps: int
    step_s_by_world: Mapping[int, float] = field(default_factory=dict)  # measured in the warm-up
    faulted_steps_by_world: Mapping[int, int] = field(default_factory=dict)
    ettr_single: float | None = None  # every step at the fault-free step time at --nodes
    cost_by_kind: Mapping[str, tuple[int, float]] = field(default_factory=dict)  # ettr.cost_by_kind
    quiet_step_s_by_world: Mapping[int, float] = field(default_factory=dict)  # ettr.quiet_step_by_world
    ettr_quiet: float | None = None  # by the quiet steps' median step time at each world size
    cost_baseline: str = ""  # the step times cost_by_kind counts against: "quiet steps", "warm-up" ("": none)

    @property
    def ok(self) -> bool:
        return all(i.ok for i in self.invariants)

    @property
    def substituted(self) -> dict[int, int]:
        """world size of faulted steps with no fault-free measurement -> the measured size used."""
        out = {}
        for world in self.faulted_steps_by_world:
            used = baseline_world(world, self.step_s_by_world)
            if used is not None and used != world:
                out[world] = used
        return out


def _listed(items: Sequence[object], limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def _finals_summary(finals: Sequence[Final], last_step: int) -> str:
    at_last = sorted({f.checksum for f in finals if f.step == last_step})
    n = sum(1 for f in finals if f.step == last_step)
    earlier = sum(1 for f in finals if f.step != last_step)
    return f"{n} worker(s) at step {last_step}: {_listed(at_last)}" + (
        f"; {earlier} that left earlier agree per step" if earlier else ""
    )


def kind_invariants(ev: Evidence) -> list[Invariant]:
    """The invariants of the kinds injected in this run (none of a kind not injected)."""
    out = []
    if ev.link_down:
        isolated = link_down_findings(
            ev.link_down, ev.commits, REJOIN_BOUND_S, after_etcd_returns(ev.etcd_down, ev.lease_ttl_s), ev.max_world
        )
        detail = f"{len(ev.link_down)} link down(s): the others went on, the host rejoined"
        out.append(Invariant("link down: dropped, rejoined", not isolated, "; ".join(isolated[:5]) or detail))
    if ev.link_flaps:
        flapped = [p for d in ev.link_flaps for p in rejoin_findings(d, ev.commits, REJOIN_BOUND_S, ev.max_world)]
        flapped += [f"{d.node}: its link was still flapping at the end" for d in ev.link_flaps if d.end == math.inf]
        detail = f"{len(ev.link_flaps)} flapping link(s): each host committed again after"
        out.append(Invariant("link flap: host back", not flapped, "; ".join(flapped[:5]) or detail))
    nan_faults = [f for f in ev.faults if f.kind == FaultKind.NAN_GRADS]
    if nan_faults or any(m.event == "gradients_not_finite" for m in ev.marks):
        bad, detail = nan_findings(nan_faults, ev.marks, ev.commits, ev.faults)
        out.append(Invariant("NaN gradients skipped", not bad, "; ".join(bad[:5]) or detail))
    if ev.checkpoint_faults or any(m.event == "checkpoint_save_failed" for m in ev.marks):
        bad, detail = checkpoint_findings(ev.checkpoint_faults, ev.marks, ev.commits)
        out.append(Invariant("checkpoint saves resume", not bad, "; ".join(bad[:5]) or detail))
    return out


def judge(ev: Evidence) -> Verdict:
    """Check every invariant over the evidence of one run."""
    steps = step_findings(ev.commits)
    times = commit_times(ev.commits)
    limit = ev.lease_ttl_s + 2.0
    finished = steps.last_step >= ev.target_steps
    stalls = find_stalls(
        times, limit, after_etcd_returns(ev.etcd_down, ev.lease_ttl_s), ev.faults, None if finished else ev.end_t
    )
    counted = [s for s in stalls if s.counted_s > limit]
    finals = final_findings(ev.finals, steps.last_step)
    status = status_findings(
        ev.samples, ev.lives, ev.lease_ttl_s + 1.0, etcd_down=ev.etcd_down, lease_ttl_s=ev.lease_ttl_s
    )
    bad_agents, not_refused = agent_findings(ev.agents)
    inv = [
        Invariant(
            "steps exactly once",
            not steps.repeats and not steps.lost,
            f"1..{steps.last_step}, no repeat, no gap"
            if not steps.repeats and not steps.lost
            else "; ".join(
                filter(
                    None,
                    [
                        f"repeated (step: generations) {_listed([f'{s}: {g}' for s, g in steps.repeats.items()])}"
                        if steps.repeats
                        else "",
                        f"lost steps {_listed(list(steps.lost))}" if steps.lost else "",
                    ],
                )
            ),
        ),
        Invariant(
            "job finished",
            finished and not ev.problems,
            "; ".join([f"committed {steps.last_step} of {ev.target_steps} steps", *ev.problems]),
        ),
        Invariant(
            "final parameters identical", not finals, "; ".join(finals) or _finals_summary(ev.finals, steps.last_step)
        ),
        Invariant(
            f"no stall > {limit:g} s",
            not counted,
            f"{len(stalls)} stall(s), {len(counted)} not excused" if stalls else "none",
        ),
        Invariant(
            "status agrees with workers",
            not status,
            "; ".join(status[:5])
            if status
            else f"{sum(1 for s in ev.samples if not s.error)} sample(s) agreed within {ev.lease_ttl_s + 1:g} s",
        ),
        Invariant("no traceback in logs", not ev.tracebacks, "; ".join(ev.tracebacks[:5]) or "none"),
        Invariant("audit check", not ev.audit_violations, "; ".join(ev.audit_violations[:5]) or "no violation"),
        Invariant(
            "agents exit 0",
            not bad_agents,
            "; ".join(bad_agents[:5])
            or f"{sum(1 for a in ev.agents if a.expected not in ('killed', 'duplicate'))} agent(s) exited 0",
        ),
    ]
    inv += kind_invariants(ev)
    dups = [a for a in ev.agents if a.expected == "duplicate"]
    if dups:
        inv.append(
            Invariant(
                "duplicate node refused",
                not not_refused,
                "; ".join(not_refused) or "; ".join(f"{a.node}: exit {a.code}: {a.message[:120]}" for a in dups[:3]),
            )
        )
    step_s = fault_free_step_s(times, ev.warmup.start, ev.warmup.end) if ev.warmup else None
    by_world = fault_free_step_by_world(ev.commits, ev.warmups)
    faulted_by_world: dict[int, int] = {}
    ratio = single = quiet_ratio = None
    costs: dict[str, tuple[int, float]] = {}
    quiet: dict[int, float] = {}
    cost_baseline = ""
    if ev.faulted is not None:
        wall_s = ev.faulted.end - ev.faulted.start
        faulted_by_world = steps_by_world(ev.commits, ev.faulted)
        ratio = ettr_by_world(faulted_by_world, by_world, wall_s)
        single = ettr(sum(faulted_by_world.values()), step_s, wall_s)
        quiet = quiet_step_by_world(ev.commits, [f.t for f in ev.faults], ev.faulted)
        quiet_ratio = ettr_by_world(faulted_by_world, quiet, wall_s)
        # The costs against the quiet steps where there are enough of them: thousands of steps over
        # the whole run, where the warm-up's ~10 s can be a few % off (which gave costs below zero)
        cost_baseline, cost_step_s = (
            ("quiet steps", quiet) if quiet else ("warm-up", by_world) if by_world else ("", {})
        )
        costs = cost_by_kind(ev.commits, [(f.t, f.kind) for f in ev.faults], cost_step_s, ev.faulted)
    return Verdict(
        tuple(inv),
        tuple(stalls),
        steps,
        step_s,
        ratio,
        sum(faulted_by_world.values()),
        by_world,
        faulted_by_world,
        single,
        costs,
        quiet,
        quiet_ratio,
        cost_baseline,
    )
