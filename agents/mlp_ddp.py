"""The default workload (agents/mlp.py) trained with plain torch DDP over gloo: the baseline.

The same model, data, global batch, optimizer and per-epoch sample order as ``agents/mlp.py``, but
with a fixed world and nothing elastic: ``torch.distributed.init_process_group`` from the standard
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` variables and ``DistributedDataParallel``.
It exists so that ``python -m elasticd.bench recovery`` can compare step times; it reports its own
per-step end times (and its rank's share of the loss) as one JSON object written to ``--out``.
The model and data come from ``agents/mlp.py`` itself, so the two programs cannot drift.
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--out", default=None, help="write {rank, world_size, t, loss} as JSON here")
    return p.parse_args(argv)


def epoch_order(samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The global order of an epoch, seeded exactly as elasticd's sampler seeds it."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(samples, generator=gen)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_dataset(args.samples, args.features, args.classes, args.seed)
    model = DistributedDataParallel(make_model(args.features, args.hidden, args.classes, args.seed))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    ends: list[float] = []
    losses: list[float] = []
    epoch, position = 0, 0
    order = epoch_order(args.samples, args.seed, epoch)
    started = time.time()
    for _ in range(args.steps):
        if position >= args.samples:
            epoch, position = epoch + 1, 0
            order = epoch_order(args.samples, args.seed, epoch)
        take = min(args.global_batch, args.samples - position)
        lo = position + rank * take // world
        hi = position + (rank + 1) * take // world
        idx = order[lo:hi]
        # DDP averages gradients over ranks; weighting each rank's mean loss by its share of the
        # global batch makes that average the global-batch mean, as elasticd computes it.
        share = (hi - lo) / take
        loss = F.cross_entropy(model(x[idx]), y[idx]) * (share * world)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        position += take
        ends.append(time.time())
        losses.append(float(loss.detach()) / world)
    dist.destroy_process_group()
    if args.out:
        out = Path(args.out)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps({"rank": rank, "world_size": world, "start_t": started, "t": ends, "loss": losses}))
        os.replace(tmp, out)  # readers never see a partial file
    return 0


if __name__ == "__main__":
    sys.exit(main())
