"""``python -m elasticd.bench sharded``: sharded training (HSDP) next to data-parallel training.

Owns the ``sharded`` benchmark. Jobs of ``agents/mlp_sharded.py`` (the default MLP, AdamW, a step
schedule) run under real ``elasticd`` agents on a real etcd, each node one replica: sharded (the
agents' ``--replica-size 2``, two workers per node, FSDP2 over gloo) and data parallel (one
unsharded worker per node), the same model and global batch, in the same run:

* ``sigkill_s`` (sharded) and ``ddp_sigkill_s``: one worker SIGKILLed (in the sharded job, rank 1
  of a replica: its agent ends the other) -> the surviving replicas' first commit in a later
  generation, median over ``--reps``;
* ``transfer_ratio_k2_vs_k1``: a newcomer replica's state sync (rank 0's replica to it) in the
  sharded job, its throughput (the bytes of every shard / the slowest shard's sync) over the
  data-parallel job's (the same state, one rank to one), median over ``--reps``; a wide model
  (``--hidden``) so that the bytes dominate;
* ``overhead_ratio``: the sharded elastic job's step time over plain HSDP without elasticd
  (``agents/mlp_sharded.py --plain 2``: torch alone, FSDP2 over a (replicate, shard) mesh), the
  same ranks and batches, steps ``--window-from`` .. ``--steps``;
* ``steps_lost``: missing or repeated steps found by ``audit.check`` over the jobs.

Every process it starts is tracked by PID and killed in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from elasticd.bench.common import (
    DATASET_SIZE,
    PHASE_TIMEOUT_S,
    POLL_S,
    BenchError,
    figures_table,
    lost_steps,
    read_json_lines,
    run_subcommand,
)
from elasticd.bench.recovery import window_step_times
from elasticd.testing.audit import check_dir, read_lines
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import WorkerProcess, agent_program, free_port, log_events, python_program

PROGRAM = "agents/mlp_sharded.py"
SHARDED_TARGETS = {
    "sigkill_s": "<= 0.5",
    "transfer_ratio_k2_vs_k1": ">= 1.6",
    "overhead_ratio": "<= 1.03",
    "steps_lost": "0",
}


@dataclass(frozen=True)
class ShardedSettings:
    """What ``sharded`` runs; printed next to the figures."""

    reps: int = 3
    replicas: int = 2
    replica_size: int = 2
    hidden: int = 1024  # the transfer phase's model width (~4 MB of parameters, x3 with AdamW's moments)
    steps: int = 400  # the overhead phase's steps
    window_from: int = 50
    step_sleep_s: float = 0.02  # the fault phase's extra work per step


class Job:
    """One job under agents, one per node; every worker's audit lines in ``<dir>/audit/<job>/``."""

    def __init__(self, etcd: EtcdServer, workdir: Path, job_id: str, k: int, program_args: list[str]) -> None:
        self.etcd, self.dir, self.job_id, self.k, self.args = etcd, workdir, job_id, k, program_args
        self.dir.mkdir(parents=True, exist_ok=True)
        self.agents: dict[str, WorkerProcess] = {}

    def start(self, node: str, nodes: int) -> None:
        flags = ["--nproc-per-node", str(self.k), "--replica-size", str(self.k), "--backend", "gloo"]
        argv = agent_program(
            "--etcd", self.etcd.endpoint, "--job-id", self.job_id, "--node-id", node,
            "--min-workers", str(self.k), "--max-workers", str(self.k * nodes), "--join-window-s", "0.5",
            "--audit-dir", str(self.dir / "audit"), *flags, "--", *python_program(PROGRAM, *self.args),
        )  # fmt: skip
        self.agents[node] = WorkerProcess(argv, {}, self.dir / f"agent-{node}.log", new_session=True).start()

    def commits(self) -> list[dict[str, object]]:
        return [
            r for r in read_lines(sorted((self.dir / "audit" / self.job_id).glob("*.jsonl"))) if r["event"] == "commit"
        ]

    def wait_for(self, cond: object, what: str, timeout: float = PHASE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():  # type: ignore[operator]
                return
            for node, a in self.agents.items():
                if not a.alive():
                    raise BenchError(f"agent {node} exited while waiting for {what}; see {a.log_path}")
            time.sleep(POLL_S)
        raise BenchError(f"timed out after {timeout:g} s waiting for {what}")

    def worker_pids(self, node: str) -> list[int]:
        return [int(e["pid"]) for e in log_events(self.agents[node].log_path, "worker_started")]  # type: ignore[call-overload]

    def synced(self, node: str) -> list[dict[str, object]]:
        return log_events(self.agents[node].log_path, "state_synced")

    def steps_lost(self) -> int:
        return lost_steps(check_dir(self.dir / "audit" / self.job_id, DATASET_SIZE))

    def stop(self) -> None:
        for a in self.agents.values():
            a.stop()


def _sigkill_rep(etcd: EtcdServer, workdir: Path, job_id: str, k: int, s: ShardedSettings) -> tuple[float, int]:
    """Three replicas; rank k-1 of one SIGKILLed: seconds to the survivors' first commit after, steps lost."""
    job = Job(etcd, workdir, job_id, k, ["--steps", "100000", "--step-sleep", str(s.step_sleep_s)])
    try:
        for node in ("a", "b", "c"):
            job.start(node, 3)
        job.wait_for(lambda: sum(1 for c in job.commits() if c["world_size"] == 3 * k) >= 30 * k, "30 steps at 3")
        gen = max(int(c["generation"]) for c in job.commits())  # type: ignore[call-overload]
        killed_at = time.time()
        os.kill(job.worker_pids("b")[k - 1], signal.SIGKILL)

        def after() -> list[float]:
            return [float(c["t"]) for c in job.commits() if int(c["generation"]) > gen and float(c["t"]) > killed_at]  # type: ignore[call-overload,arg-type]

        job.wait_for(lambda: bool(after()), "the survivors' next commit")
        took = min(after()) - killed_at
        for a in job.agents.values():
            a.signal(signal.SIGTERM)
        deadline = time.monotonic() + PHASE_TIMEOUT_S
        while any(a.alive() for a in job.agents.values()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return took, job.steps_lost()
    finally:
        job.stop()


def _transfer_rep(etcd: EtcdServer, workdir: Path, job_id: str, k: int, s: ShardedSettings) -> float:
    """One replica trains; a newcomer replica joins: the bytes it received / the slowest shard's sync."""
    job = Job(etcd, workdir, job_id, k, ["--steps", "100000", "--step-sleep", "0.02", "--hidden", str(s.hidden)])
    try:
        job.start("a", 2)
        job.wait_for(lambda: len(job.commits()) >= 10 * k, "10 steps of one replica")
        job.start("n", 2)
        job.wait_for(lambda: any(c["world_size"] == 2 * k for c in job.commits()), "the newcomer's first commit")
        sends = [e for e in job.synced("a") if int(e.get("transferred_bytes", 0)) > 0]  # type: ignore[call-overload]
        last = max(int(e["generation"]) for e in sends)  # type: ignore[call-overload]
        mine = [e for e in sends if e["generation"] == last]
        nbytes = sum(int(e["transferred_bytes"]) for e in mine)  # type: ignore[call-overload]
        return nbytes / max(float(e["duration_s"]) for e in mine)  # type: ignore[arg-type]
    finally:
        job.stop()


def _plain(workdir: Path, s: ShardedSettings) -> float:
    """Plain HSDP, torch alone: the mean step time over the window."""
    workdir.mkdir(parents=True, exist_ok=True)
    world, port = s.replicas * s.replica_size, free_port()
    outs = [workdir / f"plain{r}.json" for r in range(world)]
    procs = []
    try:
        for r in range(world):
            env = {"RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            argv = python_program(
                PROGRAM, "--plain", str(s.replica_size), "--steps", str(s.steps), "--out", str(outs[r])
            )
            procs.append(WorkerProcess(argv, {**env, "OMP_NUM_THREADS": "1"}, workdir / f"plain{r}.log").start())
        deadline = time.monotonic() + PHASE_TIMEOUT_S * 2
        while not all(o.exists() for o in outs):
            if time.monotonic() > deadline or any(not p.alive() and p.wait(0) != 0 for p in procs):
                raise BenchError(f"the plain HSDP job failed or timed out; see {workdir}")
            time.sleep(POLL_S)
    finally:
        for p in procs:
            p.stop()
    series = [[(i + 1, t, 0) for i, t in enumerate(json.loads(o.read_text())["t"])] for o in outs]
    return window_step_times(series, s.window_from).mean_s


def _elastic(etcd: EtcdServer, workdir: Path, s: ShardedSettings) -> tuple[float, int]:
    """The same steps, sharded under agents: the mean step time over the window, steps lost."""
    job = Job(etcd, workdir, "sharded-overhead", s.replica_size, ["--steps", str(s.steps)])
    try:
        for i in range(s.replicas):
            job.start(f"n{i}", s.replicas)
        deadline = time.monotonic() + PHASE_TIMEOUT_S * 2
        while any(a.alive() for a in job.agents.values()) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        series: dict[str, list[tuple[int, float, int]]] = {}
        for f in sorted((job.dir / "audit" / job.job_id).glob("*.jsonl")):
            rows = [r for r in read_json_lines(f) if r.get("event") == "commit"]
            series[f.name] = [(int(r["step"]), float(r["t"]), int(r["generation"])) for r in rows]  # type: ignore[call-overload,arg-type]
        return window_step_times(series.values(), s.window_from).mean_s, job.steps_lost()
    finally:
        job.stop()


def run_sharded(s: ShardedSettings, workdir: Path) -> dict[str, object]:
    etcd = EtcdServer().start()
    try:
        kills = {
            k: [_sigkill_rep(etcd, workdir / f"kill{k}-{r}", f"kill{k}x{r}", k, s) for r in range(s.reps)]
            for k in (s.replica_size, 1)
        }
        rates = {
            k: [_transfer_rep(etcd, workdir / f"xfer{k}-{r}", f"xfer{k}x{r}", k, s) for r in range(s.reps)]
            for k in (s.replica_size, 1)
        }
        elastic_s, elastic_lost = _elastic(etcd, workdir / "elastic", s)
        plain_s = _plain(workdir / "plain", s)
    finally:
        etcd.stop()
    k = s.replica_size
    figures = {
        "sigkill_s": round(statistics.median(t for t, _ in kills[k]), 3),
        "ddp_sigkill_s": round(statistics.median(t for t, _ in kills[1]), 3),
        "transfer_mb_s": round(statistics.median(rates[k]) / 1e6, 1),
        "ddp_transfer_mb_s": round(statistics.median(rates[1]) / 1e6, 1),
        "transfer_ratio_k2_vs_k1": round(statistics.median(rates[k]) / statistics.median(rates[1]), 3),
        "step_s": round(elastic_s, 5),
        "plain_hsdp_step_s": round(plain_s, 5),
        "overhead_ratio": round(elastic_s / plain_s, 3),
        "steps_lost": sum(lost for _, lost in kills[k] + kills[1]) + elastic_lost,
    }
    return {
        "settings": asdict(s),
        "figures": figures,
        "targets": SHARDED_TARGETS,
        "samples": {
            "sigkill_s": [round(t, 3) for t, _ in kills[k]],
            "ddp_sigkill_s": [round(t, 3) for t, _ in kills[1]],
            "transfer_b_s": [round(r) for r in rates[k]],
            "ddp_transfer_b_s": [round(r) for r in rates[1]],
        },
    }


def render(result: Mapping[str, object]) -> str:
    st = result["settings"]
    assert isinstance(st, dict)
    return figures_table(
        f"sharded training ({st['replica_size']} ranks per replica) next to data parallel, {st['reps']} repetitions",
        result,
        SHARDED_TARGETS,
        26,
    )


def add_args(p: argparse.ArgumentParser) -> None:
    """``sharded``'s flags."""
    d = ShardedSettings()
    p.add_argument("--reps", type=int, default=d.reps, help="repetitions of the kill and of the join, per mode")
    p.add_argument("--hidden", type=int, default=d.hidden, help="the transfer phase's model width")
    p.add_argument("--steps", type=int, default=d.steps, help="the overhead phase's steps")


def run_cmd(args: argparse.Namespace) -> int:
    """``sharded``: run it, print the figures; 1 when a step was lost."""
    s = ShardedSettings(reps=args.reps, hidden=args.hidden, steps=args.steps)
    return run_subcommand(args, "elasticd-bench-sharded-", lambda workdir: run_sharded(s, workdir), render)
