"""One process recomputes a drop-in job from its audit log: every committed step's world size and
each rank's stream blocks, the same math as ``agents/inline_elastic.py`` on every member (each
rank's micro-batches under bf16 autocast, its gradients times 1/world size, summed in rank order,
clipping, AdamW, the LambdaLR, the EMA dict). Where the job lost, repeated or mis-weighted
anything, the replay's final state differs from the job's."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from elasticd.worker.data.stream import StreamOrder

AGENTS = Path(__file__).resolve().parents[1] / "agents"


def steps_of(records: list[dict[str, Any]]) -> list[tuple[int, list[int]]]:
    """(world size, the step's blocks rank after rank) of each committed step, in step order."""
    by_step: dict[int, tuple[int, list[int]]] = {}
    for r in records:
        if r.get("event") == "commit":
            by_step[int(r["step"])] = (int(r["world_size"]), [int(b) for b in r["blocks"]])
    assert sorted(by_step) == list(range(1, len(by_step) + 1)), sorted(by_step)
    return [by_step[s] for s in sorted(by_step)]


def replay(records: list[dict[str, Any]], argv: list[str]) -> dict[str, Any]:
    """The final state (as the script's ``--save-final`` writes it) of the steps in ``records``."""
    sys.path.insert(0, str(AGENTS))
    from recipe_parts import Clusters, collate, make_model, parse_args

    args = parse_args(argv)
    torch.set_num_threads(1)
    model = make_model(args)
    decay = [p for p in model.parameters() if p.dim() > 1]
    no_decay = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )

    def warmup_cosine(s: int) -> float:
        return min(1.0, (s + 1) / args.warmup) * (
            0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))
        )

    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data = Clusters(args.samples, args.features, args.classes, args.seed)
    order = StreamOrder(args.samples, args.batch_size, args.seed, True)
    params = [p for p in model.parameters()]
    for world, blocks in steps_of(records):
        total = [torch.zeros_like(p) for p in params]
        per_rank = len(blocks) // world
        for rank in range(world):
            for p in params:
                p.grad = None
            for b in blocks[rank * per_rank : (rank + 1) * per_rank]:
                x, y = collate([data[i] for i in order.indices(b)])
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                    loss = F.cross_entropy(model(x), y) / args.accumulation
                loss.backward()
            for t, p in zip(total, params, strict=True):
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                t.add_(g * (1.0 / world) if world != 1 else g)
        for t, p in zip(total, params, strict=True):
            p.grad = t
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        with torch.no_grad():
            for k, v in model.state_dict().items():
                ema[k].mul_(args.ema_decay).add_(v, alpha=1 - args.ema_decay)
    return {"model": model.state_dict(), "ema": ema, "lr": sched.get_last_lr()}


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
