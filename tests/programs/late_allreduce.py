"""Two ranks of a real gloo group and elasticd's GradientReducer: rank 0 abandons a step whose
all_reduce rank 1 has not joined yet, cancels it and starts the next step's backward; then rank 1
joins the old all_reduce with large gradients. Prints rank 0's gradients of the new step, which
must be what its own backward made (the old all_reduce must land in the old, abandoned buffer).

Usage: late_allreduce.py RANK STORE_PORT
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._C._distributed_c10d import PrefixStore, TCPStore  # noqa: E402

from elasticd.errors import CollectiveError  # noqa: E402
from elasticd.retry import Bound  # noqa: E402
from elasticd.worker.step.reducer import GradientReducer  # noqa: E402
from elasticd.worker.step.commit import Vote  # noqa: E402
from elasticd.worker.group.process_group import Group  # noqa: E402


def main() -> int:
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=30)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    pg = dist.ProcessGroupGloo(PrefixStore("g/", store), rank, 2, opts)
    group = Group(pg, 1, rank, 2, "gloo", torch.device("cpu"))
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"))

    def vote() -> list[float]:
        return Vote(0.0, False, False).slots()

    x = torch.ones(1, 4)
    if rank == 1:
        time.sleep(1.5)  # rank 0 has abandoned its step and begun the next one by now
        reducer.begin(group, 1, 1.0, vote)
        (1000.0 * model(x).sum()).backward()  # gradients of 1000: the late sum is ~1001
        reducer.finish(Bound.after(20, poll_s=0.02))
        time.sleep(1.0)
        return 0
    reducer.begin(group, 1, 1.0, vote)
    model(x).sum().backward()  # gradients of 1
    try:
        reducer.finish(Bound.after(20, poll_s=0.02, abandon=lambda: True))  # abandoned at once
        raise AssertionError("the all_reduce completed without rank 1")
    except CollectiveError:
        reducer.cancel()
    reducer.begin(group, 2, 1.0, vote)  # the next step: new views
    (2.0 * model(x).sum()).backward()  # gradients of 2
    time.sleep(3.0)  # rank 1 completes the old all_reduce meanwhile
    grad = model.weight.grad
    assert grad is not None
    print(json.dumps({"grad": grad.flatten().tolist()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
