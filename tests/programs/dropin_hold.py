"""A drop-in script (``elasticd.DistributedDataParallel`` over a DataLoader, the loop of
``agents/mlp_dropin.py``) that holds before one step until a file exists: the test decides what
the job's members know when that step's vote goes out (a newcomer waiting to join, for one).

Usage: dropin_hold.py --steps N --hold-before STEP --hold-file PATH --audit PATH [--save-final PATH]
It fetches one batch ahead, as a DataLoader with worker processes does (so after the last step
it is already in the next generation when it calls ``close``). A newcomer's own counter is 0 until
it joins, so it never holds. Exits 0 when its loop ends.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "agents"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mlp import make_dataset, make_model  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import elasticd  # noqa: E402
from elasticd.log import configure_logging  # noqa: E402

HOLD_BOUND_S = 120.0  # the longest it holds (the test creates the file well before)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--hold-before", type=int, required=True)
    p.add_argument("--hold-file", required=True)
    p.add_argument("--audit", required=True)
    p.add_argument("--save-final", default=None)
    args = p.parse_args()
    configure_logging()
    torch.set_num_threads(1)
    data = TensorDataset(*make_dataset(512, 16, 4, 0))
    model = make_model(16, 32, 4, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp = elasticd.DistributedDataParallel(model, opt, audit_path=args.audit)
    sampler = elasticd.DistributedSampler(data, seed=0, batch_size=16)
    loader = DataLoader(data, batch_size=16, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        it = iter(loader)
        ahead = next(it, None)
        while ahead is not None:
            x, y = ahead
            if ddp.step_count + 1 == args.hold_before:
                # until the file exists and this member's view of the job has the newcomer waiting
                # (so the step's vote asks for the regroup that admits it)
                deadline = time.monotonic() + HOLD_BOUND_S
                waiting = ddp.trainer._membership.join_pending  # noqa: SLF001 (a test's view)
                while not (Path(args.hold_file).exists() and waiting()) and time.monotonic() < deadline:
                    time.sleep(0.05)
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            step = ddp.step_count
            ahead = next(it, None)  # one batch ahead, as a DataLoader with worker processes fetches
            if step >= args.steps:
                break
        epoch += 1
    ddp.close()
    if args.save_final:
        torch.save(model.state_dict(), f"{args.save_final}.{os.getpid()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
