"""The warm-spare figures of ``python -m elasticd.bench agent``: how soon a job is back at its full
size, with spares and without them, measured in the same run.

Each repetition runs one job of the default workload under ``nodes`` real agents (one worker each,
``--nnodes 1:<nodes>``), twice: with ``--spares 1`` on every node and one ``--standby`` node, and
with no spare at all. In each it measures:

* ``step_time_s``: the median step time at full size before any fault (``overhead_ratio`` is the
  one with idle spares over the one without: a waiting spare must not take the step's CPU);
* ``full_size_s``: SIGKILL of one node's training worker -> the first commit of a later generation
  at the original world size (with spares: the waiting spare took its place; without: the agent
  restarted the worker, a fresh Python importing torch, and it joined);
* ``node_replace_s``: SIGKILL of a node's agent and workers (a lost node) -> the first commit of a
  later generation at the original world size (with spares: the standby node's worker; without: a
  replacement agent started at the moment of the loss, as the fastest operator would);
* ``steps_lost``: committed steps missing or repeated, by the audit checker.

Every process is tracked by PID (the agents by process group) and killed in ``finally``.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from elasticd.bench.agentjob import SETTLE_STEPS, AgentBenchSettings, AgentJob, step_time, steps_at
from elasticd.bench.common import BenchError, fmt, median_of
from elasticd.errors import ElasticdError
from elasticd.testing.etcd import EtcdServer
from elasticd.wire.snapshot import parse_snapshot

OVERHEAD_STEPS = 60  # steps at full size whose median step time is compared (spares vs none)
SPARE_TARGETS = {"full_size_s": "<= 0.6 s", "node_replace_s": "<= 1.0 s", "overhead_ratio": "<= 1.03"}


@dataclass
class SpareRep:
    spares: bool
    step_time_s: float | None = None
    full_size_s: float | None = None
    node_replace_s: float | None = None
    steps_lost: int = 0
    violations: list[str] = field(default_factory=list)
    error: str | None = None


def _back_at(job: AgentJob, since: float, generation: int, world: int) -> float | None:
    """When the first commit of a generation after ``generation`` at ``world`` came (after ``since``)."""
    times = [
        float(r["t"])
        for r in job.commits_since(since, world)  # type: ignore[arg-type]
        if int(r["generation"]) > generation
    ]  # type: ignore[call-overload]
    return min(times) if times else None


def _spares_waiting(job: AgentJob) -> int:
    snap = parse_snapshot(job.keys, job.store.get_prefix(job.keys.prefix))
    training = set(snap.generation.members) if snap.generation else set()
    return sum(1 for mid, m in snap.members.items() if m.spare and mid not in training and mid in snap.ready)


def run_spare_rep(etcd: EtcdServer, workdir: Path, rep: int, s: AgentBenchSettings, spares: bool) -> SpareRep:
    out = SpareRep(spares)
    kind = "spares" if spares else "nospares"
    job = AgentJob(etcd, workdir / f"{kind}{rep}", f"{kind}{rep}x{int(time.time())}", s)
    nodes = [f"node-{i}" for i in range(s.nodes)]
    n = s.nodes
    try:
        job.watch.start()
        for node in nodes:
            job.start(node, *(("--spares", "1") if spares else ()))
        if spares:
            job.start("standby", "--standby")
        job.wait_for(lambda: len(steps_at(job.commits, n)) >= SETTLE_STEPS, f"{n} workers to train")
        if spares:
            job.wait_for(lambda: _spares_waiting(job) == n + 1, f"{n + 1} spares waiting")
        t0 = time.time()
        job.wait_for(lambda: len(steps_at(job.commits_since(t0), n)) >= OVERHEAD_STEPS, "steps at full size")
        out.step_time_s = step_time(job.commits_since(t0), n)

        # 1. a worker crashes: the job is back at its full size when?
        gen, pid = job.generation(), job.worker_pid(nodes[-1])
        killed_t = time.time()
        os.kill(pid, signal.SIGKILL)
        job.wait_for(lambda: _back_at(job, killed_t, gen, n) is not None, "the job back at its full size")
        out.full_size_s = _back_at(job, killed_t, gen, n) - killed_t  # type: ignore[operator]
        job.wait_for(lambda: len(steps_at(job.commits_since(killed_t), n)) >= SETTLE_STEPS, "steps at full size")

        # 2. a node is lost: a standby node takes its place (or a replacement agent, started at once)
        lost = nodes[0]
        job.expected_gone.add(lost)
        gen = job.generation()
        lost_t = time.time()
        job.agents[lost].kill_group()
        if not spares:
            job.start("replacement")
        job.wait_for(lambda: _back_at(job, lost_t, gen, n) is not None, "the job back at its full size")
        out.node_replace_s = _back_at(job, lost_t, gen, n) - lost_t  # type: ignore[operator]
        job.wait_for(lambda: len(steps_at(job.commits_since(lost_t), n)) >= SETTLE_STEPS, "steps after the loss")
    except (BenchError, ElasticdError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        job.stop()
    out.steps_lost, out.violations = job.audit()
    return out


def run_spare_reps(
    etcd: EtcdServer, workdir: Path, s: AgentBenchSettings, reps: int, progress: Callable[[str], None]
) -> dict[str, object]:
    """``reps`` repetitions with spares and without (alternating, so both see the same machine)."""
    done: list[SpareRep] = []
    for i in range(reps):
        for spares in (True, False):
            r = run_spare_rep(etcd, workdir, i, s, spares)
            progress(
                f"spares {'on' if spares else 'off'} rep {i + 1}/{reps}: full_size {fmt(r.full_size_s)} s, "
                f"node_replace {fmt(r.node_replace_s)} s, step {fmt(r.step_time_s, 4)} s, "
                f"steps_lost {r.steps_lost}" + (f", ERROR {r.error}" if r.error else "")
            )
            done.append(r)

    def med(name: str, spares: bool) -> float | None:
        return median_of(getattr(r, name) for r in done if r.spares is spares)

    on, off = med("step_time_s", True), med("step_time_s", False)
    figures = {
        "full_size_s": med("full_size_s", True),
        "full_size_s_no_spares": med("full_size_s", False),
        "node_replace_s": med("node_replace_s", True),
        "node_replace_s_no_spares": med("node_replace_s", False),
        "step_time_s_spares": on,
        "step_time_s_no_spares": off,
        "overhead_ratio": round(on / off, 4) if on and off else None,
        "spare_steps_lost": sum(r.steps_lost for r in done),
    }
    return {
        "figures": figures,
        "targets": SPARE_TARGETS,
        "reps": [r.__dict__ for r in done],
        "errors": [r.error for r in done if r.error],
        "violations": [v for r in done for v in r.violations],
    }


def render_spares(fig: dict[str, object]) -> list[str]:
    """The table rows of the spare figures."""

    def row(name: str, base: str, what: str, target: str) -> str:
        a, b = fig.get(name), fig.get(base)
        ratio = f"{a / b:.2f}x" if isinstance(a, float) and isinstance(b, float) and b else "-"
        return f"{name:<22} {fmt(a):>8}  {'vs ' + fmt(b) + ' (' + ratio + ')':<17} {target:<10} {what}"  # type: ignore[arg-type]

    return [
        row(
            "full_size_s",
            "full_size_s_no_spares",
            "worker SIGKILL -> first step at full size (spares vs none)",
            SPARE_TARGETS["full_size_s"],
        ),
        row(
            "node_replace_s",
            "node_replace_s_no_spares",
            "node lost -> first step at full size (standby node vs a new agent)",
            SPARE_TARGETS["node_replace_s"],
        ),
        f"{'overhead_ratio':<22} {fmt(fig.get('overhead_ratio'), 4):>8}  "  # type: ignore[arg-type]
        f"{'step ' + fmt(fig.get('step_time_s_spares'), 4) + ' / ' + fmt(fig.get('step_time_s_no_spares'), 4):<17} "  # type: ignore[arg-type]
        f"{SPARE_TARGETS['overhead_ratio']:<10} median step time, one idle spare per node vs none",
        f"{'spare_steps_lost':<22} {fig.get('spare_steps_lost')!s:>8}  {'':<17} {'0':<10} over the spare runs",
    ]
