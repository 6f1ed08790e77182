"""``python -m elasticd.bench straggler``: a slow-but-alive worker, found and replaced.

Each repetition runs one job of ``agents/mlp.py`` with a compute-bound step (no sleep: a stopped
worker's step takes longer by the stop) under three real agents: nodes ``a`` and ``b`` train
(``--nnodes 1:2``) and a ``--standby`` node's warm spare waits; every agent has
``--straggler-policy replace``. At full size the bench measures the fault-free step time, then
slows ``b``'s worker with a SIGSTOP/SIGCONT duty cycle (stopped half the time, as a throttled or
thermally capped device is) and measures:

* ``slowed_rate_ratio``: the step rate while ``b`` is slowed over the fault-free one (every
  all_reduce waits for the slowest member: about 0.5);
* ``detection_s`` and ``detection_steps``: the slowdown's start -> ``b``'s agent's
  ``straggler_detected`` (``straggler_s`` plus up to a read of the job), and the steps committed
  meanwhile;
* ``replace_s``: detection -> the first commit at full size of a later generation (the standby
  node's spare in ``b``'s place);
* ``recovered_rate_ratio``: the step rate in the RATE_WINDOW_S before BACK_BY_S (10 s) after the
  detection over the fault-free one (target >= 0.95: the rate is back within 10 s of detection);
* ``steps_lost``: committed steps missing or repeated (the audit checker).

Every process is tracked by PID (the agents by process group) and stopped in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from elasticd.bench.agentjob import SETTLE_STEPS, AgentBenchSettings, AgentJob, steps_at
from elasticd.bench.common import BenchError, dist_version, fmt, median_of, progress, run_subcommand
from elasticd.errors import ElasticdError
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import duty_cycle
from elasticd.wire.snapshot import parse_snapshot

COMPUTE_WORKLOAD = ("--hidden", "512", "--global-batch", "256")  # a step of compute, ~20-40 ms here
RATE_WINDOW_S = 4.0  # a step rate is the steps committed in a window this long over its length
BACK_BY_S = 10.0  # the recovered rate is measured in the window that ends this long after the detection
DUTY_S = 0.005  # the victim is stopped this long, then runs this long, over and over (shorter than a step)
STRAGGLER_TARGETS = {"recovered_rate_ratio": ">= 0.95", "steps_lost": "0"}


@dataclass(frozen=True)
class StragglerBenchSettings(AgentBenchSettings):
    reps: int = 3
    nodes: int = 2
    step_sleep_s: float = 0.0
    straggler_s: float = 3.0
    straggler_score: float = 1.5


@dataclass
class StragglerRep:
    base_rate: float | None = None  # steps per second
    slowed_rate: float | None = None
    detection_s: float | None = None
    detection_steps: int | None = None
    score: float | None = None
    replace_s: float | None = None
    recovered_rate: float | None = None
    steps_lost: int = 0
    violations: list[str] = field(default_factory=list)
    error: str | None = None


def _agent_event(job: AgentJob, node: str, name: str) -> dict[str, object] | None:
    path = job.agents[node].log_path
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        if f'"event": "{name}"' in line:
            try:
                return json.loads(line)  # type: ignore[no-any-return]
            except ValueError:
                continue
    return None


def _wall(stamp: object) -> float:
    from datetime import datetime

    return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()


def _spare_waits(job: AgentJob) -> bool:
    snap = parse_snapshot(job.keys, job.store.get_prefix(job.keys.prefix))
    training = set(snap.generation.members) if snap.generation else set()
    return any(m.spare and mid not in training and mid in snap.ready for mid, m in snap.members.items())


def _rate(commits: list[dict[str, object]], since: float, until: float) -> float | None:
    """Steps per second committed in [since, until) (every member's line counts its step once)."""
    steps = {r["step"] for r in commits if since <= float(r["t"]) < until}  # type: ignore[arg-type]
    return len(steps) / (until - since) if until > since else None


def run_straggler_rep(etcd: EtcdServer, workdir: Path, rep: int, s: StragglerBenchSettings) -> StragglerRep:
    out = StragglerRep()
    job = AgentJob(etcd, workdir / f"straggler{rep}", f"straggler{rep}x{int(time.time())}", s, COMPUTE_WORKLOAD)
    flags = (
        "--straggler-policy",
        "replace",
        "--straggler-s",
        str(s.straggler_s),
        "--straggler-score",
        str(s.straggler_score),
    )
    stop = threading.Event()
    try:
        job.watch.start()
        job.start("a", *flags)
        job.start("b", *flags)
        job.start("s", "--standby", *flags)
        job.wait_for(
            lambda: len(steps_at(job.commits, 2)) >= SETTLE_STEPS and _spare_waits(job), "a world of 2 and a spare"
        )
        t0 = time.time()
        time.sleep(RATE_WINDOW_S)
        job.poll()
        out.base_rate = _rate(job.commits, t0, t0 + RATE_WINDOW_S)
        victim, generation = job.worker_pid("b"), job.generation()
        job.expected_gone.add("b")  # drained as a straggler: its agent leaves
        slowed_at = time.time()
        t = threading.Thread(target=duty_cycle, args=(victim, DUTY_S, time.monotonic() + 90, stop), daemon=True)
        t.start()
        job.wait_for(lambda: _agent_event(job, "b", "straggler_detected") is not None, "b's straggler_detected")
        found = _agent_event(job, "b", "straggler_detected")
        assert found is not None
        detected_at = _wall(found["timestamp"])
        out.detection_s = detected_at - slowed_at
        out.score = float(found["score"])  # type: ignore[arg-type]
        out.detection_steps = len({r["step"] for r in job.commits_since(slowed_at) if float(r["t"]) < detected_at})  # type: ignore[arg-type]
        out.slowed_rate = _rate(job.commits, slowed_at + 1.0, detected_at)

        def back() -> list[float]:
            return [
                float(r["t"])  # type: ignore[arg-type]
                for r in job.commits_since(detected_at, 2)
                if int(r["generation"]) > generation  # type: ignore[call-overload]
            ]

        job.wait_for(lambda: bool(back()), "full size after the replacement")
        back_at = min(back())
        out.replace_s = back_at - detected_at
        end = detected_at + BACK_BY_S
        job.wait_for(lambda: time.time() > end + 0.5, "the window after the replacement", timeout=BACK_BY_S + 5)
        out.recovered_rate = _rate(job.commits, end - RATE_WINDOW_S, end)
    except (BenchError, ElasticdError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        stop.set()
        job.stop()
    out.steps_lost, out.violations = job.audit()
    return out


def run_straggler_bench(s: StragglerBenchSettings, workdir: Path, note: Callable[[str], None]) -> dict[str, object]:
    reps: list[StragglerRep] = []
    with EtcdServer(data_dir=str(workdir / "etcd")) as etcd:
        for i in range(s.reps):
            r = run_straggler_rep(etcd, workdir, i, s)
            note(
                f"rep {i + 1}/{s.reps}: detection {fmt(r.detection_s)} s ({r.detection_steps} steps, score "
                f"{fmt(r.score, 2)}), replace {fmt(r.replace_s)} s, steps/s {fmt(r.base_rate, 1)} -> slowed "
                f"{fmt(r.slowed_rate, 1)} -> {fmt(r.recovered_rate, 1)}" + (f", ERROR {r.error}" if r.error else "")
            )
            reps.append(r)

    def ratio(num: float | None, den: float | None) -> float | None:
        return None if num is None or den is None or den <= 0 else num / den

    figures = {
        "base_rate": median_of(r.base_rate for r in reps),
        "slowed_rate_ratio": median_of(ratio(r.slowed_rate, r.base_rate) for r in reps),
        "detection_s": median_of(r.detection_s for r in reps),
        "detection_steps": median_of(None if r.detection_steps is None else float(r.detection_steps) for r in reps),
        "replace_s": median_of(r.replace_s for r in reps),
        "recovered_rate_ratio": median_of(ratio(r.recovered_rate, r.base_rate) for r in reps),
        "steps_lost": sum(r.steps_lost for r in reps),
    }
    return {
        "benchmark": "straggler",
        "settings": {
            **asdict(s),
            "workload": f"agents/mlp.py {' '.join(COMPUTE_WORKLOAD)}",
            "duty_s": DUTY_S,
            "torch": dist_version("torch"),
        },
        "figures": figures,
        "targets": STRAGGLER_TARGETS,
        "reps": [asdict(r) for r in reps],
        "errors": [r.error for r in reps if r.error],
        "violations": [v for r in reps for v in r.violations],
    }


def render_straggler(result: Mapping[str, object]) -> str:
    fig, s = result["figures"], result["settings"]
    assert isinstance(fig, dict) and isinstance(s, dict)
    rows = [
        ("base_rate", f"fault-free steps per second at full size (2 workers, a {RATE_WINDOW_S:g} s window)", ""),
        ("slowed_rate_ratio", "step rate while b is slowed / fault-free", ""),
        ("detection_s", f"slowdown -> straggler_detected (straggler_s {s['straggler_s']:g})", ""),
        ("detection_steps", "steps committed meanwhile", ""),
        ("replace_s", "detection -> first commit at full size with the spare", ""),
        (
            "recovered_rate_ratio",
            f"step rate {BACK_BY_S - RATE_WINDOW_S:g}..{BACK_BY_S:g} s after detection / fault-free",
            ">= 0.95",
        ),
        ("steps_lost", "by the audit checker", "0"),
    ]
    lines = [
        f"elasticd straggler benchmark: nodes a, b training, a --standby node, {s['reps']} reps, "
        f"b's worker stopped/continued every {DUTY_S:g} s, --straggler-policy replace",
        "",
        f"{'figure':<22} {'median':>8}  {'target':<8} what",
    ]
    lines += [f"{n:<22} {fmt(fig[n]):>8}  {t:<8} {w}" for n, w, t in rows]
    errors, violations = result["errors"], result["violations"]
    assert isinstance(errors, list) and isinstance(violations, list)
    lines += [f"ERROR {e}" for e in errors] + [f"VIOLATION {v}" for v in violations]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    d = StragglerBenchSettings()
    p.add_argument("--reps", type=int, default=d.reps, help="repetitions (default %(default)s)")
    p.add_argument(
        "--straggler-s", type=float, default=d.straggler_s, help="the agents' --straggler-s (default %(default)s)"
    )


def run_cmd(args: argparse.Namespace) -> int:
    s = StragglerBenchSettings(reps=args.reps, straggler_s=args.straggler_s)
    return run_subcommand(
        args, "elasticd-bench-straggler-", lambda w: run_straggler_bench(s, w, progress), render_straggler
    )
