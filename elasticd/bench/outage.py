"""``python -m elasticd.bench outage``: what an etcd outage with no membership change costs.

Owns the ``outage`` benchmark. One job of the default workload (``agents/mlp.py``,
``workers`` worker processes on a real local etcd) trains; the bench measures its commit rate over
``window_s`` (the baseline, in the same run), SIGKILLs etcd, measures the rate over the outage
(``outage_s``, from the kill to the restart), restarts etcd on the same data dir and measures the
rate over ``window_s`` again. Then the workers drain and the audit logs are checked.

Figures: ``outage_rate_ratio`` = commits/s during the outage / commits/s before (target >= 0.9),
``after_rate_ratio`` (the same after etcd returned), ``steps_lost`` (missing or repeated, by
``audit.check``), ``regroups`` (generations after the first: 0 means nobody left a generation) and
``worker_failures`` (workers that did not exit 0).

Every process it starts is tracked by PID and killed in ``finally``.
"""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from elasticd.bench.common import (
    DATASET_SIZE,
    POLL_S,
    WORKLOAD,
    BenchError,
    LeaseSettings,
    figures_table,
    lost_steps,
    run_subcommand,
)
from elasticd.testing.audit import check_dir, first_commit_times
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import WorkerProcess, python_program

PHASE_TIMEOUT_S = 120.0  # bound on every wait of a phase
WARMUP_STEPS = 50  # committed before the baseline window starts
OUTAGE_TARGETS = {"outage_rate_ratio": ">= 0.9", "steps_lost": "0", "regroups": "0", "worker_failures": "0"}


@dataclass(frozen=True)
class OutageSettings(LeaseSettings):
    """What ``outage`` runs; printed next to the figures."""

    workers: int = 3
    outage_s: float = 60.0
    window_s: float = 20.0
    step_sleep_s: float = 0.0


def rate(times: dict[int, float], start: float, end: float) -> float:
    """Steps first committed within [start, end), per second (pure)."""
    if end <= start:
        raise ValueError("empty window")
    return sum(1 for t in times.values() if start <= t < end) / (end - start)


def wait_until(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(POLL_S)
    raise BenchError(f"timed out after {timeout:g} s waiting for {what}")


def start_workers(
    lease: LeaseSettings,
    endpoints: str,
    job_id: str,
    count: int,
    step_sleep_s: float,
    workdir: Path,
    workers: list[WorkerProcess],
) -> None:
    """Start ``count`` workers of the default workload into ``workers`` (the caller stops them) and
    wait for the warm-up steps."""
    env = {
        "ELASTICD_ETCD_ENDPOINTS": endpoints,
        "ELASTICD_JOB_ID": job_id,
        "ELASTICD_NODE_ID": "bench",
        **lease.worker_env(count),
    }
    for i in range(count):
        argv = python_program(
            WORKLOAD,
            "--steps",
            "100000000",
            "--step-sleep",
            str(step_sleep_s),
            "--audit",
            str(workdir / f"audit{i}.jsonl"),
        )
        workers.append(WorkerProcess(argv, {**env, "ELASTICD_LOCAL_RANK": str(i)}, workdir / f"worker{i}.log").start())
    wait_until(lambda: len(first_commit_times(workdir)) >= WARMUP_STEPS, PHASE_TIMEOUT_S, "the warm-up steps")


def drain(workers: list[WorkerProcess]) -> list[int | None]:
    """SIGTERM every worker (each finishes its step and leaves); their exit codes (None: still running)."""
    for w in workers:
        w.signal(signal.SIGTERM)
    return [w.wait(PHASE_TIMEOUT_S) for w in workers]


def run_outage(s: OutageSettings, workdir: Path) -> dict[str, object]:
    etcd = EtcdServer().start()
    workers: list[WorkerProcess] = []
    try:
        start_workers(s, etcd.endpoint, "outage", s.workers, s.step_sleep_s, workdir, workers)
        before_start = time.time()
        time.sleep(s.window_s)
        killed_at = time.time()
        etcd.kill()
        time.sleep(s.outage_s)
        for w in workers:
            if not w.alive():
                raise BenchError(f"a worker exited during the outage; see {w.log_path}")
        etcd.start()
        back_at = time.time()
        time.sleep(s.window_s)
        after_end = time.time()
        codes = drain(workers)
        times = first_commit_times(workdir)
        rep = check_dir(workdir, DATASET_SIZE)
        before = rate(times, before_start, killed_at)
        during = rate(times, killed_at, back_at)
        after = rate(times, back_at, after_end)
        figures = {
            "rate_before_steps_s": round(before, 2),
            "rate_during_steps_s": round(during, 2),
            "rate_after_steps_s": round(after, 2),
            "outage_rate_ratio": round(during / before, 3) if before else None,
            "after_rate_ratio": round(after / before, 3) if before else None,
            "steps_lost": lost_steps(rep),
            "regroups": max(0, len(rep.generations) - 1),
            "worker_failures": sum(1 for c in codes if c != 0),
        }
        return {
            "settings": asdict(s),
            "figures": figures,
            "targets": OUTAGE_TARGETS,
            "violations": rep.violations,
            "outage_measured_s": round(back_at - killed_at, 2),
        }
    finally:
        for w in workers:
            w.stop()
        etcd.stop()


def render(result: Mapping[str, object]) -> str:
    st = result["settings"]
    assert isinstance(st, dict)
    return figures_table(
        f"etcd outage of {result['outage_measured_s']} s with no membership change ({st['workers']} workers)",
        result,
        OUTAGE_TARGETS,
        22,
    )


def add_args(p: argparse.ArgumentParser) -> None:
    """``outage``'s flags."""
    d = OutageSettings()
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--outage-s", type=float, default=d.outage_s, help="how long etcd is down")
    p.add_argument("--window-s", type=float, default=d.window_s, help="the rate windows before and after")
    p.add_argument("--step-sleep", type=float, default=d.step_sleep_s)


def run_cmd(args: argparse.Namespace) -> int:
    """``outage``: run it, print the figures; 1 when a step was lost or the audit found a violation."""
    s = OutageSettings(
        workers=args.workers, outage_s=args.outage_s, window_s=args.window_s, step_sleep_s=args.step_sleep
    )
    return run_subcommand(args, "elasticd-bench-outage-", lambda workdir: run_outage(s, workdir), render)
