"""A worker whose parameters are bfloat16 (or float16), under elasticd: its gradients are summed in
that dtype, and the commit vote must still count every member and carry the loss exactly.

Writes one JSON line per committed step to ``--out``: the step, this rank's own loss (float64 of
the bfloat16 value), its share of the global batch, the world size and the global loss the
commit reported. The test adds the ranks' ``loss x share`` per step and compares it with the
global loss: a vote summed in bfloat16 rounds it (~0.4 %), a float32 vote does not.

Usage: low_precision.py --dtype bfloat16 --out FILE [--steps N] [--audit FILE] [--save-final FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import elasticd  # noqa: E402
from elasticd.log import configure_logging  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=9)  # odd: the shares (5/9, 4/9) are not bf16 values
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--audit", default=None)
    p.add_argument("--save-final", default=None)
    args = p.parse_args()
    configure_logging()
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(512, 16, generator=gen).to(dtype)
    y = torch.randint(0, 4, (512,), generator=gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).to(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = elasticd.ElasticTrainer(
        model, optimizer, dataset_size=512, global_batch_size=args.global_batch, seed=1, audit_path=args.audit
    )
    signal.signal(signal.SIGTERM, lambda *_: trainer.drain())
    with trainer, open(args.out, "a", encoding="utf-8") as out:
        for batch in trainer.batches(max_steps=args.steps):
            if args.step_sleep:
                time.sleep(args.step_sleep)
            loss = F.cross_entropy(model(x[batch.indices]), y[batch.indices])
            result = trainer.step(loss)
            if result is not None:
                out.write(
                    json.dumps(
                        {
                            "step": result.step,
                            "rank": batch.rank,
                            "world": result.world_size,
                            "loss": float(loss.detach()),
                            "share": batch.weight,
                            "global_loss": result.loss,
                        }
                    )
                    + "\n"
                )
                out.flush()
        if args.save_final and trainer.step_count >= args.steps:
            torch.save({k: v.float() for k, v in model.state_dict().items()}, args.save_final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
