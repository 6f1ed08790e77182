"""``agents/inline_ddp.py`` under elasticd, in the drop-in form: the same loops, ten lines changed.

elasticd's ``DistributedDataParallel`` replaces torch's (and ``init_process_group``): it takes the
optimizer, the micro-batch count and the objects newcomers must receive (the scheduler, the EMA
dict); elasticd's ``DistributedSampler`` replaces torch's and is told the batch size; the step
counter is read from the job; ``ddp.rank`` and ``ddp.close()`` replace ``dist.get_rank()`` and
``destroy_process_group()``. Run it with::

    elasticd --nnodes 1:4 --nproc-per-node 2 --rdzv-endpoint etcd1:2379 --rdzv-id inline -- agents/inline_elastic.py --steps 50
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
import torch.nn.functional as F  # noqa: E402
from recipe_parts import Clusters, collate, make_model, parse_args  # noqa: E402
from elasticd import DistributedDataParallel as DDP, DistributedSampler  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
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
    ddp = DDP(model, opt, accumulation_steps=args.accumulation, state={"sched": sched, "ema": ema})
    data = Clusters(args.samples, args.features, args.classes, args.seed)
    sampler = DistributedSampler(data, seed=args.seed, batch_size=args.batch_size)
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
            step = ddp.step_count
            if ddp.rank == 0 and args.checkpoint and step % args.checkpoint_every == 0:
                state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
                torch.save({**state, "ema": ema, "step": step}, args.checkpoint)
            if step == args.steps:
                break
        epoch += 1
    if ddp.rank == 0 and args.save_final:
        torch.save({"model": model.state_dict(), "ema": ema, "lr": sched.get_last_lr(), "step": step}, args.save_final)
    ddp.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
