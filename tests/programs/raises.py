"""A worker whose script has a bug: it raises at one step, as a data or code bug does; or whose
node is bad: its gradients are NaN at some steps.

``--raise-at S`` raises ``ValueError("bad sample <n>")`` when computing step S (``n`` differs per
rank: the normalized message is one); ``--ranks`` picks which ranks raise (``all``, or one rank
number); ``--config-error`` raises elasticd's ``ConfigError`` before training instead (a restart
cannot cure it: the worker exits ``EXIT_NO_RESTART``). Without either it trains to ``--steps``."""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F

import elasticd
from elasticd.errors import ConfigError
from elasticd.log import configure_logging


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--raise-at", type=int, default=0)
    p.add_argument("--ranks", default="all")
    p.add_argument("--config-error", action="store_true")
    p.add_argument("--nan-at", type=int, default=0)
    p.add_argument("--nan-steps", type=int, default=1)
    p.add_argument("--nan-rank", type=int, default=0)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    configure_logging()
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    y = (x.sum(dim=1) > 0).long()
    model = torch.nn.Linear(8, 2)
    trainer = elasticd.ElasticTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=512, global_batch_size=32
    )
    if args.config_error:
        raise ConfigError("data_path: /no/such/dataset does not exist")
    for batch in trainer.batches(max_steps=args.steps):
        step = trainer.step_count + 1
        if step == args.raise_at and args.ranks in ("all", str(trainer.rank)):
            raise ValueError(f"bad sample {int(batch.indices[0])} in shard {os.getpid() % 97}")
        loss = F.cross_entropy(model(x[batch.indices]), y[batch.indices])
        if args.nan_at <= step < args.nan_at + args.nan_steps and trainer.rank == args.nan_rank:
            loss = loss * float("nan")
        time.sleep(args.step_sleep)
        trainer.step(loss)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
    print(f"rank {trainer.rank}: {trainer.step_count} steps; final {digest} finite {finite}", flush=True)


if __name__ == "__main__":
    main()
