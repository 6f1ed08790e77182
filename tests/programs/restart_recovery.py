"""Measure restart mode's recovery: a worker SIGKILLed -> the restarted group's first step.

Runs ``--reps`` jobs of agents/torchrun_ddp.py under two ``elasticd --mode restart`` agents (one
worker each) against a real etcd on loopback, SIGKILLs node b's worker once the job passed two
checkpoints, and reports per repetition (and the median) the times from the kill to: the agent's
``round_failed`` line, the restarted round's ``round_started``, and the first step of the restarted
workers. Default agent settings (restart_backoff_initial_s 0.5). Prints one JSON object.

    python tests/programs/restart_recovery.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import REPO_ROOT, log_events

AGENT = [sys.executable, "-c", "import sys; from elasticd.cli import agent_main; sys.exit(agent_main())"]


def _ts(rec: dict[str, object]) -> float:
    return datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()


def _steps(out: Path, rank: int) -> list[dict[str, object]]:
    p = out / f"rank{rank}.jsonl"
    rows = []
    for line in p.read_text().splitlines() if p.exists() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return [r for r in rows if r["event"] == "step"]


def one(etcd: EtcdServer, root: Path, job: str, steps: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    script = [
        "agents/torchrun_ddp.py",
        "--steps",
        str(steps),
        "--save-every",
        "20",
        "--step-sleep",
        "0.02",
        "--ckpt-dir",
        str(root / "ckpt"),
        "--out-dir",
        str(root / "out"),
    ]
    root.mkdir(parents=True)
    procs = []
    for node in ("a", "b"):
        with (root / f"agent-{node}.log").open("ab") as log:
            procs.append(
                subprocess.Popen(
                    [
                        *AGENT,
                        "--mode",
                        "restart",
                        "--etcd",
                        etcd.endpoint,
                        "--job-id",
                        job,
                        "--node-id",
                        node,
                        "--nnodes",
                        "2:2",
                        "--",
                        *script,
                    ],
                    env=env,
                    cwd=REPO_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
    try:
        deadline = time.monotonic() + 120
        while max((int(r["step"]) for r in _steps(root / "out", 0)), default=0) < 45:
            if time.monotonic() > deadline:
                raise RuntimeError("the job did not reach step 45")
            time.sleep(0.02)
        victim = int(log_events(root / "agent-b.log", "worker_started")[-1]["pid"])
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        for p in procs:
            if p.wait(120) != 0:
                raise RuntimeError(f"an agent failed; see {root}")
        failed = _ts(log_events(root / "agent-b.log", "round_failed")[0])
        started = max(_ts(r) for n in "ab" for r in log_events(root / f"agent-{n}.log", "round_started")[1:2])
        first = min(float(r["t"]) for k in (0, 1) for r in _steps(root / "out", k) if r["restart_count"] == 1)
        return {
            "detect_s": round(failed - killed, 3),
            "round_started_s": round(started - killed, 3),
            "first_step_s": round(first - killed, 3),
        }
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    etcd = EtcdServer().start()
    try:
        with tempfile.TemporaryDirectory(prefix="restart-recovery-") as tmp:
            reps = [one(etcd, Path(tmp) / f"rep{i}", f"rr{os.getpid()}x{i}", args.steps) for i in range(args.reps)]
    finally:
        etcd.stop()
    median = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
    print(json.dumps({"reps": reps, "median": median}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
