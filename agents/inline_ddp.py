"""A plain torchrun + DDP training script, written inline as a new user writes one.

Its own loops (epochs, steps, micro-batches with ``next(it)`` and ``no_sync()``), a
``DistributedSampler`` with ``set_epoch``, a ``DataLoader`` with worker processes and
``drop_last``, AdamW with two parameter groups, a warmup + cosine ``LambdaLR``, bf16 autocast, a
loss divided by the micro-batch count, clipping, an EMA kept as a plain dict of tensors, its own
step counter, rank-0 ``torch.save`` checkpoints and a ``break`` at the last step.
``agents/inline_elastic.py`` is the same script under elasticd (the drop-in form);
``tests/integration/test_dropin.py`` counts the lines that differ. Run it with::

    python -m torch.distributed.run --standalone --nproc-per-node 2 agents/inline_ddp.py --steps 50
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the agents dir: recipe_parts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from recipe_parts import Clusters, collate, make_model, parse_args  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = make_model(args)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr)

    def warmup_cosine(s: int) -> float:
        return min(1.0, (s + 1) / args.warmup) * (
            0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    step = 0
    if args.init_from and os.path.exists(args.init_from):
        ck = torch.load(args.init_from, map_location="cpu", weights_only=True)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        ema = ck["ema"]
        step = ck["step"]
    ddp = DDP(model)
    data = Clusters(args.samples, args.features, args.classes, args.seed)
    sampler = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(
        data,
        batch_size=args.batch_size,
        sampler=sampler,
        num_workers=args.workers,
        collate_fn=collate,
        drop_last=True,
        persistent_workers=args.workers > 0,
    )
    epoch = 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        it = iter(loader)
        for _ in range(len(loader) // args.accumulation):
            for micro in range(args.accumulation):
                x, y = next(it)
                time.sleep(args.step_sleep)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                    loss = F.cross_entropy(ddp(x), y) / args.accumulation
                with ddp.no_sync() if micro < args.accumulation - 1 else contextlib.nullcontext():
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            opt.zero_grad()
            sched.step()
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    ema[k].mul_(args.ema_decay).add_(v, alpha=1 - args.ema_decay)
            step += 1
            if dist.get_rank() == 0 and args.checkpoint and step % args.checkpoint_every == 0:
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
                torch.save({**state, "ema": ema, "step": step}, args.checkpoint)
            if step == args.steps:
                break
        epoch += 1
    if dist.get_rank() == 0 and args.save_final:
        torch.save({"model": model.state_dict(), "ema": ema, "lr": sched.get_last_lr(), "step": step}, args.save_final)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
