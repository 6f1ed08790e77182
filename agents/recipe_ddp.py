"""The training recipe as a plain torchrun + DDP script (the "before" of README's porting section).

AdamW with warmup + cosine LR, gradient clipping, accumulation over micro-batches, bf16 autocast,
an EMA of the weights, a DataLoader with worker processes and a torch.save checkpoint every N
steps. ``agents/recipe.py`` is the same script under elasticd; ``tests/integration/test_recipe.py``
checks that the two differ by at most ten lines. Run it with::

    python -m torch.distributed.run --standalone --nproc-per-node 2 agents/recipe_ddp.py --steps 50
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the agents dir: recipe_parts

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from recipe_parts import (EMA, Clusters, collate, epochs, load_checkpoint, make_model,  # noqa: E402
                          parse_args, save_checkpoint, save_final, warmup_cosine)
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = warmup_cosine(opt, args.warmup, args.steps)
    ema = EMA(model, args.ema_decay)
    step = load_checkpoint(args.init_from, model, opt, sched, ema)
    ddp = DDP(model)
    data = Clusters(args.samples, args.features, args.classes, args.seed)
    sampler = DistributedSampler(data, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, num_workers=args.workers, collate_fn=collate)
    for i, (x, y) in enumerate(epochs(loader, sampler), start=1):
        time.sleep(args.step_sleep)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss = F.cross_entropy(ddp(x), y) / args.accumulation
        with ddp.no_sync() if i % args.accumulation else contextlib.nullcontext():
            loss.backward()
        if i % args.accumulation:
            continue
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        ema.update(model)
        step += 1
        if dist.get_rank() == 0 and step % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint, step, model, opt, sched, ema)
        if step == args.steps:
            break
    if dist.get_rank() == 0:
        save_final(args.save_final, model, ema, sched)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
