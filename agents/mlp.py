"""The default workload: an MLP classifier on a seeded synthetic dataset (downloads nothing).

Written against the public worker API as a user would write it. Settings of the job come from the
``ELASTICD_*`` environment (set by the agent or the local cluster); the workload's own flags are
below. Exit codes: 0 done, 2 a fatal elasticd error (bad settings, model mismatch, ...).

Three flags make it a faulty workload for fault injection (``python -m elasticd.chaos``,
``python -m elasticd.bench agent``): with ``--nan-steps-on-sigusr2 N``, SIGUSR2 makes this worker's
next N backward passes produce NaN gradients (a bad node); with ``--raise-at-step S``, every rank
raises the same exception when it computes step S (a bug in the script); with ``--hang-on-sigusr1``,
SIGUSR1 hangs this worker with every thread (a C call that keeps the GIL and does not return).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import signal
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

HANG_S = 86400  # --hang-on-sigusr1: longer than any run (its agent ends it as hung)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import elasticd  # noqa: E402
from elasticd.errors import ConfigError  # noqa: E402
from elasticd.log import configure_logging  # noqa: E402


def make_dataset(n: int, features: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gaussian clusters around random class centres: learnable, deterministic, no download."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g) * 2.0
    y = torch.randint(0, classes, (n,), generator=g)
    x = centres[y] + torch.randn(n, features, generator=g)
    return x, y


def make_model(features: int, hidden: int, classes: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes),
    )


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The flags that define the workload (shared with the plain-DDP baseline, agents/mlp_ddp.py)."""
    p.add_argument("--steps", type=int, default=300, help="train until this many steps are committed")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cuda: the model and data on cuda:<ELASTICD_LOCAL_RANK> (modulo the GPUs visible)",
    )
    p.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 autocast with a torch.amp.GradScaler given to the trainer (needs --device cuda)",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    add_workload_arguments(p)
    p.add_argument("--audit", default=None, help="append one JSON line per committed step here")
    p.add_argument(
        "--audit-in-memory",
        action="store_true",
        help="keep the audit lines in memory and write them at exit (fault-free measurements only)",
    )
    p.add_argument("--save-final", default=None, help="write the final model state_dict here (torch.save)")
    p.add_argument("--break-at-end", action="store_true", help="leave the loop with a break after the last step")
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.0,
        help="seconds of extra compute per step (slows the demo and fault tests down)",
    )
    p.add_argument(
        "--nan-steps-on-sigusr2",
        type=int,
        default=0,
        metavar="N",
        help="on SIGUSR2, make the next N backward passes of this worker produce NaN gradients "
        "(the loss times NaN); 0: SIGUSR2 keeps its default action",
    )
    p.add_argument(
        "--hang-on-sigusr1",
        action="store_true",
        help="on SIGUSR1, hang with every thread: libc's sleep through ctypes.PyDLL, which keeps the GIL",
    )
    p.add_argument(
        "--raise-at-step",
        type=int,
        default=0,
        metavar="S",
        help="raise the same exception on every rank when computing step S (a bug in the script); 0: never",
    )
    # Durable checkpoints: each flag overrides its ELASTICD_CHECKPOINT_* variable.
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="directory of durable checkpoints (local or shared); resume from it when no member holds state",
    )
    p.add_argument("--checkpoint-every-steps", type=int, default=None, help="save every N committed steps")
    p.add_argument("--checkpoint-every-s", type=float, default=None, help="save every T seconds")
    p.add_argument("--checkpoint-keep", type=int, default=None, help="good checkpoints kept")
    p.add_argument(
        "--checkpoint-allow-new-model",
        action="store_true",
        default=None,
        help="start over from step 1 even if the directory holds another model's checkpoints (kept)",
    )
    return p.parse_args(argv)


def checkpoint_settings(args: argparse.Namespace) -> elasticd.CheckpointConfig:
    """The ELASTICD_CHECKPOINT_* settings with this program's flags on top.

    Raises:
        ConfigError: a value is invalid.
    """
    base = elasticd.worker_env_from_environ().checkpoint
    flags = {
        "checkpoint_dir": args.checkpoint_dir,
        "checkpoint_every_steps": args.checkpoint_every_steps,
        "checkpoint_every_s": args.checkpoint_every_s,
        "checkpoint_keep": args.checkpoint_keep,
        "checkpoint_allow_new_model": args.checkpoint_allow_new_model,
    }
    return dataclasses.replace(base, **{k: v for k, v in flags.items() if v is not None})


def pick_device(args: argparse.Namespace) -> torch.device:
    """``--device``: the CPU, or this worker's GPU (``ELASTICD_LOCAL_RANK`` modulo the GPUs visible).

    Raises:
        ConfigError: cuda (or --fp16) asked for where CUDA is not available.
    """
    if args.device == "cpu":
        if args.fp16:
            raise ConfigError("--fp16 needs --device cuda")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: CUDA is not available here")
    device = torch.device("cuda", elasticd.worker_env_from_environ().local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


class NanPoison:
    """``--nan-steps-on-sigusr2``: SIGUSR2 arms it; each ``apply`` then turns one loss into NaN
    (its backward gives NaN gradients) until ``steps`` losses were turned."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.left = 0

    def arm(self, *_: object) -> None:
        self.left = self.steps

    def apply(self, loss: torch.Tensor) -> torch.Tensor:
        if self.left <= 0:
            return loss
        self.left -= 1
        return loss * float("nan")


class ScriptBug(RuntimeError):
    """``--raise-at-step``: the exception every rank raises at that step."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()
    torch.set_num_threads(1)
    try:
        device = pick_device(args)
    except elasticd.ElasticdError as exc:
        print(f"elasticd: fatal: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    x, y = (t.to(device) for t in make_dataset(args.samples, args.features, args.classes, args.seed))
    # Every worker builds the same initial weights; rank 0's are sent to the others at the first sync anyway.
    model = make_model(args.features, args.hidden, args.classes, args.seed).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    scaler = torch.amp.GradScaler("cuda") if args.fp16 else None
    poison = NanPoison(args.nan_steps_on_sigusr2)
    if args.nan_steps_on_sigusr2 > 0:
        signal.signal(signal.SIGUSR2, poison.arm)
    if args.hang_on_sigusr1:
        signal.signal(signal.SIGUSR1, lambda *_: ctypes.PyDLL(None).sleep(HANG_S))
    try:
        trainer = elasticd.ElasticTrainer(
            model,
            optimizer,
            dataset_size=args.samples,
            global_batch_size=args.global_batch,
            seed=args.seed,
            audit_path=args.audit,
            audit_in_memory=args.audit_in_memory,
            checkpoint=checkpoint_settings(args),
            scaler=scaler,
        )
        # SIGTERM (what systemd and the agent send on stop): finish the current step, then leave.
        signal.signal(signal.SIGTERM, lambda *_: trainer.drain())
        with trainer:
            for batch in trainer.batches(max_steps=args.steps):
                if args.step_sleep:
                    time.sleep(args.step_sleep)
                if trainer.step_count + 1 == args.raise_at_step:
                    raise ScriptBug(f"the batch of step {args.raise_at_step} holds a label out of range")
                with torch.autocast(device.type, dtype=torch.float16, enabled=args.fp16):
                    loss = poison.apply(F.cross_entropy(model(x[batch.indices]), y[batch.indices]))
                trainer.step(scaler.scale(loss) if scaler is not None else loss)  # commit() steps the scaler
                if args.break_at_end and trainer.step_count == args.steps:
                    break  # the script's own end, as many DDP scripts have it
            if args.save_final and trainer.step_count >= args.steps:
                torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save_final)
    except elasticd.ElasticdError as exc:
        print(f"elasticd: fatal: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
