"""A real elastic job on one GPU: ``python tests/programs/gpu_job.py [--workdir D]``. Not part of the test suite.

Exit 0: every check passed; 1: a check failed; 77: skipped (no CUDA, or a torch without NCCL).

One GPU allows a NCCL world of one (NCCL refuses two ranks of one communicator on one device),
so this runs the NCCL path of the real product end to end at that size; ``python -m elasticd.chaos
--device cuda --fp16`` (gloo groups, the model on the GPU) covers several members on one GPU.

1. A real etcd and one real ``elasticd`` agent with ``--backend nccl`` running ``agents/mlp.py
   --device cuda --fp16`` (model, data and optimizer state on the GPU, fp16 autocast and a
   ``GradScaler``) with durable checkpoints. etcd is SIGKILLed and restarted on its data dir while
   the job trains: with no membership change, training goes on. Every step 1..N is committed
   exactly once; the worker's log names the NCCL backend; the agent exits 0.
2. The whole job lost (a fresh etcd): a second job on the same checkpoint directory resumes on the
   GPU from the checkpoint at step N (model, optimizer and scaler state) and commits exactly
   N+1..M; its final model differs from the first's (it trained on).
3. NCCL groups with the model on the CPU (mlp.py's default on a GPU node): 100 steps once each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from elasticd.testing.audit import read_lines  # noqa: E402
from elasticd.testing.etcd import EtcdServer  # noqa: E402
from elasticd.testing.localcluster import WorkerProcess, local_agent_argv, python_program  # noqa: E402

SKIPPED = 77
STEPS_1 = 400
STEPS_2 = 600
JOB_TIMEOUT_S = 240.0  # bound on each job (a CUDA start takes seconds; 400 small steps take a few more)
ETCD_KILL_AT_STEP = 120  # etcd is killed once the audit shows this step
ETCD_DOWN_S = 3.0  # how long etcd stays down: past the 2 s lease TTL


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAILED ") + what, flush=True)
    if not ok:
        sys.exit(1)


def commits(audit: Path) -> list[int]:
    return [int(str(r["step"])) for r in read_lines([audit]) if r.get("event") == "commit"]


def run_job(
    workdir: Path, etcd: EtcdServer, name: str, steps: int, kill_etcd: bool, cpu: bool, model_on_cpu: bool = False
) -> WorkerProcess:
    config = workdir / "elasticd.toml"
    config.write_text("# every setting from the flags\n")
    audit = workdir / f"{name}.jsonl"
    device = ["--device", "cpu"] if cpu or model_on_cpu else ["--device", "cuda", "--fp16"]
    program = python_program(
        "agents/mlp.py",
        *device,
        "--steps",
        str(steps),
        "--checkpoint-dir",
        str(workdir / f"ckpt-{name}" if model_on_cpu else workdir / "ckpt"),
        "--checkpoint-every-steps",
        "100",
        "--audit",
        str(audit),
        "--save-final",
        str(workdir / f"{name}-final.pt"),
        "--step-sleep",
        "0.01",
    )
    argv = local_agent_argv(
        config, [etcd.endpoint], "gpu", "node-0", "1:1", 2.0, 0.5, program, "--backend", "gloo" if cpu else "nccl"
    )  # the later flag wins over the helper's
    agent = WorkerProcess(argv, {}, workdir / f"agent-{name}.log", new_session=True).start()
    deadline = time.monotonic() + JOB_TIMEOUT_S
    killed = False
    while agent.alive() and time.monotonic() < deadline:
        if kill_etcd and not killed and audit.exists() and max(commits(audit), default=0) >= ETCD_KILL_AT_STEP:
            etcd.kill()
            print(f"etcd SIGKILLed after step {max(commits(audit))}; down {ETCD_DOWN_S} s", flush=True)
            time.sleep(ETCD_DOWN_S)
            etcd.start()
            print("etcd restarted on its data dir", flush=True)
            killed = True
        time.sleep(0.2)
    if agent.alive():
        agent.kill_group()
        check(False, f"{name}: the job ended within {JOB_TIMEOUT_S:g} s")
    check(agent.wait(5) == 0, f"{name}: the agent exited 0")
    if kill_etcd:
        check(killed, f"{name}: etcd was killed and restarted during training")
    return agent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU: checks this program where no GPU is")
    args = p.parse_args()
    backend = "gloo" if args.cpu else "nccl"
    if not args.cpu and (not torch.cuda.is_available() or not dist.is_nccl_available()):
        print("skipped: needs CUDA and a torch built with NCCL", flush=True)
        return SKIPPED
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-job-"))
    workdir.mkdir(parents=True, exist_ok=True)
    where = "CPU" if args.cpu else torch.cuda.get_device_name(0)
    print(f"work dir {workdir}; torch {torch.__version__}, {where}", flush=True)
    etcd = EtcdServer(data_dir=str(workdir / "etcd")).start()
    try:
        agent = run_job(workdir, etcd, "first", STEPS_1, kill_etcd=True, cpu=args.cpu)
        steps = commits(workdir / "first.jsonl")
        check(
            sorted(steps) == list(range(1, STEPS_1 + 1)),
            f"first: steps 1..{STEPS_1} committed once each ({len(steps)} commits, {len(set(steps))} distinct)",
        )
        log = agent.log_text()
        check(f'"backend": "{backend}"' in log, f"first: the worker's groups are {backend} groups (its log)")
        check("Traceback" not in log, "first: no traceback in the agent's log")
        # the whole job lost, etcd's data with it: only the durable checkpoints remain
        etcd.stop(remove_data=False)
        etcd = EtcdServer(data_dir=str(workdir / "etcd-second")).start()
        agent = run_job(workdir, etcd, "second", STEPS_2, kill_etcd=False, cpu=args.cpu)
        steps = commits(workdir / "second.jsonl")
        check(
            sorted(steps) == list(range(STEPS_1 + 1, STEPS_2 + 1)),
            f"second: resumed from the checkpoint at {STEPS_1}, committed {STEPS_1 + 1}..{STEPS_2} once each "
            f"(first {min(steps, default=0)}, {len(steps)} commits)",
        )
        first = torch.load(workdir / "first-final.pt")
        second = torch.load(workdir / "second-final.pt")
        check(any(not torch.equal(first[k], second[k]) for k in first), "second: trained on from the first's state")
        check(all(bool(torch.isfinite(v).all()) for v in second.values()), "second: final parameters finite")
        # 3. NCCL groups with the model on the CPU (agents/mlp.py's default on a GPU node: backend
        # auto is NCCL there): the gradients cross to the GPU for the all_reduce and back
        etcd.stop(remove_data=False)
        etcd = EtcdServer(data_dir=str(workdir / "etcd-third")).start()
        agent = run_job(workdir, etcd, "third", 100, kill_etcd=False, cpu=args.cpu, model_on_cpu=True)
        third = commits(workdir / "third.jsonl")
        check(
            sorted(third) == list(range(1, 101)), f"third (model on the CPU, {backend} groups): steps 1..100 once each"
        )
        check(f'"backend": "{backend}"' in agent.log_text(), f"third: the worker's groups are {backend} groups")
        summary = {"first_commits": STEPS_1, "second_first_step": min(steps), "log_lines": len(log.splitlines())}
        print(json.dumps(summary), flush=True)
    finally:
        etcd.stop(remove_data=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
