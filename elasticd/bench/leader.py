"""``python -m elasticd.bench leader``: what the loss of the etcd leader costs a training job.

Owns the ``leader`` benchmark. One job of the chaos soak's workload
(``agents/mlp.py`` with ``step_sleep_s``, ``workers`` worker processes) trains on a real 3-member
etcd cluster on loopback. Each repetition measures the commit rate over ``window_s`` with nothing
happening (the baseline, in the same run, right before), SIGKILLs the etcd leader, measures the rate
over the ``window_s`` after the kill (the election and the renewals it held fall in it), then starts
the member again on its data dir and lets the job settle. At the end the workers drain and the audit
logs are checked.

Figures: ``leader_rate_ratio`` = commits/s in the windows after the kills / commits/s in the
baselines (target >= 0.95), ``lost_per_kill_s`` = training time lost per kill (a window's length
less its commits at the baseline rate), ``max_gap_s`` (the longest time between two commits in the
windows after the kills), ``steps_lost`` (missing or repeated, by ``audit.check``), ``regroups``
(generations after the first: a leader election is no membership change) and ``worker_failures``.

No etcd answer enters a step's verdict, so a leader election costs training nothing but the
renewals it holds back (which never stop a step).

Every process it starts is tracked by PID and killed in ``finally``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from elasticd.bench.common import (
    DATASET_SIZE,
    BenchError,
    LeaseSettings,
    figures_table,
    lost_steps,
    run_subcommand,
)
from elasticd.bench.outage import drain, rate, start_workers
from elasticd.testing.audit import check_dir, first_commit_times
from elasticd.testing.etcd import ETCD_START_TIMEOUT_S, EtcdCluster
from elasticd.testing.localcluster import WorkerProcess

LEADER_TARGETS = {"leader_rate_ratio": ">= 0.95", "steps_lost": "0", "regroups": "0", "worker_failures": "0"}
SETTLE_S = 3.0  # after a killed member is back: the cluster and the leases settle before the next baseline


@dataclass(frozen=True)
class LeaderSettings(LeaseSettings):
    """What ``leader`` runs; printed next to the figures."""

    workers: int = 3
    reps: int = 5
    window_s: float = 5.0
    step_sleep_s: float = 0.05


def gaps_within(times: Mapping[int, float], start: float, end: float) -> list[float]:
    """The times between consecutive first commits within [start, end) (pure)."""
    inside = sorted(t for t in times.values() if start <= t < end)
    return [b - a for a, b in zip(inside, inside[1:], strict=False)]


def run_leader(s: LeaderSettings, workdir: Path) -> dict[str, object]:
    cluster = EtcdCluster(3, data_root=str(workdir / "etcd")).start()
    workers: list[WorkerProcess] = []
    try:
        start_workers(s, ",".join(cluster.endpoints), "leader", s.workers, s.step_sleep_s, workdir, workers)
        windows: list[tuple[float, float, float]] = []  # (baseline start, kill, window end), wall clock
        for _ in range(s.reps):
            victim = cluster.wait_for_leader(time.monotonic() + ETCD_START_TIMEOUT_S)
            quiet_at = time.time()
            time.sleep(s.window_s)
            killed_at = time.time()
            cluster.kill(victim)
            time.sleep(s.window_s)
            windows.append((quiet_at, killed_at, time.time()))
            for w in workers:
                if not w.alive():
                    raise BenchError(f"a worker exited after a leader kill; see {w.log_path}")
            cluster.start_member(victim, time.monotonic() + ETCD_START_TIMEOUT_S)
            time.sleep(SETTLE_S)
        codes = drain(workers)
        times = first_commit_times(workdir)
        rep = check_dir(workdir, DATASET_SIZE)
        quiet = [rate(times, a, k) for a, k, _ in windows]
        after = [rate(times, k, e) for _, k, e in windows]
        base = statistics.fmean(quiet)
        gaps = [g for _, k, e in windows for g in gaps_within(times, k, e)]
        figures = {
            "rate_quiet_steps_s": round(base, 2),
            "rate_after_kill_steps_s": round(statistics.fmean(after), 2),
            "leader_rate_ratio": round(statistics.fmean(after) / base, 3) if base else None,
            "lost_per_kill_s": round(
                statistics.fmean(s.window_s * (1 - a / q) for a, q in zip(after, quiet, strict=True) if q), 3
            ),
            "max_gap_s": round(max(gaps), 3) if gaps else None,
            "steps_lost": lost_steps(rep),
            "regroups": max(0, len(rep.generations) - 1),
            "worker_failures": sum(1 for c in codes if c != 0),
        }
        return {
            "settings": asdict(s),
            "figures": figures,
            "targets": LEADER_TARGETS,
            "violations": rep.violations,
            "samples": {"rate_quiet": [round(x, 2) for x in quiet], "rate_after_kill": [round(x, 2) for x in after]},
            "windows": [[round(t, 3) for t in w] for w in windows],  # (baseline start, kill, end), wall clock
        }
    finally:
        for w in workers:
            w.stop()
        cluster.stop()


def render(result: Mapping[str, object]) -> str:
    st = result["settings"]
    assert isinstance(st, dict)
    return figures_table(
        f"etcd leader SIGKILLed {st['reps']} times in a 3-member cluster ({st['workers']} "
        f"workers, {st['window_s']} s windows)",
        result,
        LEADER_TARGETS,
        24,
    )


def add_args(p: argparse.ArgumentParser) -> None:
    """``leader``'s flags."""
    d = LeaderSettings()
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--reps", type=int, default=d.reps, help="leader kills")
    p.add_argument("--window-s", type=float, default=d.window_s, help="the rate windows before and after a kill")
    p.add_argument("--step-sleep", type=float, default=d.step_sleep_s)


def run_cmd(args: argparse.Namespace) -> int:
    """``leader``: run it, print the figures; 1 when a step was lost or the audit found a violation."""
    s = LeaderSettings(workers=args.workers, reps=args.reps, window_s=args.window_s, step_sleep_s=args.step_sleep)
    return run_subcommand(args, "elasticd-bench-leader-", lambda workdir: run_leader(s, workdir), render)
