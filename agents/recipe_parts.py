"""The parts of the training recipe that are not about distribution: data, model, EMA, schedule, files.

Shared by ``agents/recipe_ddp.py`` (plain torchrun + DDP) and ``agents/recipe.py`` (the same
script under elasticd), as a real project keeps its model and data in modules of its own. The data
is generated (Gaussian clusters, each sample from its own seeded generator), so nothing is
downloaded and every process sees the same dataset.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="an MLP classifier: AdamW, warmup + cosine LR, clipping, "
        "gradient accumulation, bf16 autocast, an EMA of the weights, a DataLoader"
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank and micro-batch")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="steps of linear LR warmup before the cosine decay")
    p.add_argument("--clip", type=float, default=0.5, help="max gradient norm")
    p.add_argument("--ema-decay", type=float, default=0.95)
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="bf16 autocast")
    p.add_argument("--samples", type=int, default=1024)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--init-from", default=None, help="a torch.save checkpoint to start from")
    p.add_argument("--checkpoint", default=None, help="rank 0 saves a torch.save checkpoint here")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--save-final", default=None, help="write the final model, EMA and scheduler state here")
    p.add_argument("--audit", default=None, help="elasticd: one JSON line per committed step here")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra compute per micro-batch")
    return p.parse_args(argv)


class Clusters(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Gaussian clusters around seeded class centres; sample ``i`` comes from its own generator."""

    def __init__(self, samples: int, features: int, classes: int, seed: int) -> None:
        self.samples, self.features, self.classes, self.seed = samples, features, classes, seed
        self.centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(seed)) * 2.0

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(i) + 1)
        y = int(torch.randint(0, self.classes, (1,), generator=g))
        return self.centres[y] + torch.randn(self.features, generator=g), torch.tensor(y)


def collate(items: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*items, strict=True)
    return torch.stack(xs), torch.stack(ys)


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    return torch.nn.Sequential(
        torch.nn.Linear(args.features, args.hidden),
        torch.nn.LayerNorm(args.hidden),
        torch.nn.GELU(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.GELU(),
        torch.nn.Linear(args.hidden, args.classes),
    )


def warmup_cosine(opt: torch.optim.Optimizer, warmup: int, total: int) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup from 10 % for ``warmup`` steps, then cosine decay to 1 % until ``total``."""
    lr = opt.param_groups[0]["lr"]
    return torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
            torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, total - warmup), eta_min=lr * 0.01),
        ],
        milestones=[warmup],
    )


class EMA:
    """An exponential moving average of the model's parameters (``state_dict``/``load_state_dict``)."""

    def __init__(self, model: torch.nn.Module, decay: float) -> None:
        self.decay = decay
        self.updates = 0
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        for k, v in model.state_dict().items():
            if k in self.shadow:
                self.shadow[k].mul_(self.decay).add_(v.detach(), alpha=1 - self.decay)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "shadow": dict(self.shadow)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.decay, self.updates = float(sd["decay"]), int(sd["updates"])
        self.shadow = {k: v.detach().clone() for k, v in sd["shadow"].items()}


def epochs(loader: torch.utils.data.DataLoader[Any], sampler: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch (a DistributedSampler reshuffles per epoch)."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def load_checkpoint(path: str | None, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, ema: EMA) -> int:
    """Load ``path`` (if given and present) into the objects; the step it was saved at, or 0."""
    if not path or not os.path.exists(path):
        return 0
    ck = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    sched.load_state_dict(ck["scheduler"])
    ema.load_state_dict(ck["ema"])
    return int(ck["step"])


def save_checkpoint(
    path: str | None, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, ema: EMA
) -> None:
    """A torch.save checkpoint (to a temporary file, then renamed), if a path is given."""
    if not path:
        return
    tmp = Path(path).with_suffix(".tmp")
    torch.save(
        {
            "step": step,
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "ema": ema.state_dict(),
        },
        tmp,
    )
    os.replace(tmp, path)


def save_final(path: str | None, model: torch.nn.Module, ema: EMA, sched: Any) -> None:
    """The final parameters, EMA and scheduler state (for tests comparing runs), if a path is given."""
    if path:
        torch.save(
            {
                "model": model.state_dict(),
                "ema": ema.state_dict()["shadow"],
                "ema_updates": ema.updates,
                "lr": torch.tensor(sched.get_last_lr()),
                "last_epoch": torch.tensor(sched.last_epoch),
            },
            path,
        )
