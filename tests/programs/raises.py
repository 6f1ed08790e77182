"""A worker whose script has a bug: it raises at one step, as a data or code bug does.

``--raise-at S`` raises ``ValueError("bad sample <n>")`` when computing step S (``n`` differs per
rank: the normalized message is one); ``--ranks`` picks which ranks raise (``all``, or one rank
number); ``--config-error`` raises elasticd's ``ConfigError`` before training instead (a restart
cannot cure it: the worker exits ``EXIT_NO_RESTART``). Without either it trains to ``--steps``."""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

import elasticd
from elasticd.errors import ConfigError


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--raise-at", type=int, default=0)
    p.add_argument("--ranks", default="all")
    p.add_argument("--config-error", action="store_true")
    args = p.parse_args()
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
        trainer.step(F.cross_entropy(model(x[batch.indices]), y[batch.indices]))
    print(f"rank {trainer.rank}: {trainer.step_count} steps", flush=True)


if __name__ == "__main__":
    main()
