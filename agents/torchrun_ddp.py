"""A plain torchrun training script: DDP over gloo, with its own checkpoint. Knows nothing of elasticd.

It is what a user has before adopting elasticd, and runs unmodified both under ``torchrun`` and
under the ``elasticd`` agent in restart mode (``--mode restart``)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 agents/torchrun_ddp.py --ckpt-dir /tmp/ck
    elasticd --mode restart --nproc-per-node 2 -- agents/torchrun_ddp.py --ckpt-dir /tmp/ck

It reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (through
``init_process_group``'s ``env://``) and ``TORCHELASTIC_RESTART_COUNT``. The model, data, global
batch and per-epoch sample order are those of ``agents/mlp.py`` (imported from it, so they cannot
drift). Rank 0 saves ``<ckpt-dir>/checkpoint.pt`` every ``--save-every`` steps (``torch.save`` to a
temporary file, then an atomic rename); every rank loads it at start (``weights_only=True``) and
resumes after its step. SIGTERM ends it at once (Python's default), as torchrun expects.

With ``--out-dir``, each rank appends one JSON line per step to ``<out-dir>/rank<RANK>.jsonl``
(``event``: ``start`` or ``step``) and, at the end, writes ``final-rank<RANK>.json`` with the step
and a SHA-256 of its parameters, so a test can check progress and that all ranks agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the agents dir: make_dataset/make_model

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mlp import add_workload_arguments, make_dataset, make_model  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--ckpt-dir", required=True, help="where checkpoint.pt is saved and loaded")
    p.add_argument("--save-every", type=int, default=20, help="rank 0 saves a checkpoint every N steps")
    p.add_argument("--out-dir", default=None, help="per-rank JSON lines per step, and the final checksum")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra compute per step")
    return p.parse_args(argv)


def epoch_order(samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The global order of an epoch, seeded as elasticd's sampler seeds it (as agents/mlp_ddp.py)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(samples, generator=gen)


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def save_checkpoint(path: Path, state: dict[str, object]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)  # a reader sees the old checkpoint or the new one, never half of one


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt_dir = Path(args.ckpt_dir)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt = ckpt_dir / "checkpoint.pt"
    out = None
    if args.out_dir:
        Path(args.out_dir).mkdir(parents=True, exist_ok=True)
        out = (Path(args.out_dir) / f"rank{rank}.jsonl").open("a", buffering=1)

    x, y = make_dataset(args.samples, args.features, args.classes, args.seed)
    net = make_model(args.features, args.hidden, args.classes, args.seed)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    step, epoch, position = 0, 0, 0
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        net.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch, position = int(state["step"]), int(state["epoch"]), int(state["position"])
    model = DistributedDataParallel(net)
    if out:
        out.write(
            json.dumps(
                {
                    "event": "start",
                    "rank": rank,
                    "world_size": world,
                    "resumed_from": step,
                    "restart_count": restart_count,
                    "t": time.time(),
                }
            )
            + "\n"
        )
    order = epoch_order(args.samples, args.seed, epoch)
    while step < args.steps:
        if position >= args.samples:
            epoch, position = epoch + 1, 0
            order = epoch_order(args.samples, args.seed, epoch)
        if args.step_sleep:
            time.sleep(args.step_sleep)
        take = min(args.global_batch, args.samples - position)
        lo = position + rank * take // world
        hi = position + (rank + 1) * take // world
        idx = order[lo:hi]
        # DDP averages gradients over ranks; weighting each rank's mean loss by its share of the
        # global batch makes that average the global-batch mean.
        loss = F.cross_entropy(model(x[idx]), y[idx]) * ((hi - lo) / take * world)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step, position = step + 1, position + take
        if out:
            out.write(
                json.dumps(
                    {
                        "event": "step",
                        "rank": rank,
                        "world_size": world,
                        "step": step,
                        "loss": float(loss.detach()) / world,
                        "restart_count": restart_count,
                        "t": time.time(),
                    }
                )
                + "\n"
            )
        if rank == 0 and (step % args.save_every == 0 or step == args.steps):
            save_checkpoint(
                ckpt,
                {
                    "model": net.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step,
                    "epoch": epoch,
                    "position": position,
                },
            )
    if args.out_dir:
        final = Path(args.out_dir) / f"final-rank{rank}.json"
        final.write_text(json.dumps({"rank": rank, "world_size": world, "step": step, "checksum": checksum(net)}))
    dist.destroy_process_group()
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
