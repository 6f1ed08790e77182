"""The default workload's model and data in the drop-in form: a DDP-style loop over a DataLoader.

The model, data and optimizer of ``agents/mlp.py``, trained by a script that keeps its own loop:
``elasticd.DistributedDataParallel`` and ``elasticd.DistributedSampler`` (or, with ``--plain``,
torch's own, under ``init_process_group`` from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``: the baseline
of the same loop). ``python -m elasticd.bench recovery --form dropin`` runs it; ``--out`` writes
each step's end time as JSON, as ``agents/mlp_ddp.py`` does.
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
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import elasticd  # noqa: E402
from elasticd.log import configure_logging  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(p)
    p.add_argument("--batch-size", type=int, default=21, help="samples per rank and step")
    p.add_argument("--plain", action="store_true", help="torch's DDP and DistributedSampler (the baseline)")
    p.add_argument("--audit", default=None, help="elasticd: one JSON line per committed step here")
    p.add_argument("--audit-in-memory", action="store_true", help="elasticd: keep the audit lines until exit")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of extra compute per step")
    p.add_argument("--out", default=None, help="write {rank, world_size, t} as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging()  # JSON log lines, as agents/mlp.py writes them (the chaos run reads them)
    torch.set_num_threads(1)
    data = TensorDataset(*make_dataset(args.samples, args.features, args.classes, args.seed))
    model = make_model(args.features, args.hidden, args.classes, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.plain:
        dist.init_process_group("gloo")
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        sampler = torch.utils.data.DistributedSampler(data, seed=args.seed, drop_last=True)
    else:
        ddp = elasticd.DistributedDataParallel(model, opt, audit_path=args.audit, audit_in_memory=args.audit_in_memory)
        sampler = elasticd.DistributedSampler(data, seed=args.seed, batch_size=args.batch_size)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    ends: list[float] = []
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            if args.step_sleep:
                time.sleep(args.step_sleep)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            step = step + 1 if args.plain else ddp.step_count  # a newcomer counts on from the job
            ends.append(time.time())
            if step >= args.steps:
                break
        epoch += 1
    rank, world = (dist.get_rank(), dist.get_world_size()) if args.plain else (ddp.rank, ddp.world_size)
    if args.plain:
        dist.destroy_process_group()
    else:
        ddp.close()
    if args.out:
        out = Path(args.out)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps({"rank": rank, "world_size": world, "t": ends, "loss": [0.0] * len(ends)}))
        os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
