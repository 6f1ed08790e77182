"""The NCCL path on a real GPU: ``python tests/programs/nccl_smoke.py``. Not part of the test suite.

Exit 0: every check passed; 1: a check failed; 77: skipped (no CUDA, or a torch without NCCL).

1. One GPU, a world of 1, in this process: NCCL's environment is set before the first group;
   the group is bound to the device and its communicator exists after ``build`` (eager,
   non-blocking init, ready probe); an all_reduce works; ``retire`` aborts it within
   ``group_abort_s`` and the process lives; generation 2 is built on the same device after the
   abort, and works.
2. Two GPUs or more (skipped with a note on one: NCCL refuses two ranks of one communicator on
   one device): two worker processes build generation 1 and all_reduce; rank 1 is SIGKILLed;
   rank 0's next all_reduce fails within its bound (the watchdog, under
   ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``, aborts the communicator without killing the process);
   rank 0 retires the broken group (abort, bounded), builds generation 2 alone and all_reduces.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from elasticd.config import Timeouts  # noqa: E402
from elasticd.errors import CollectiveError  # noqa: E402
from elasticd.retry import Bound, Deadline  # noqa: E402
from elasticd.worker.group.collectives import all_reduce  # noqa: E402
from elasticd.worker.group.process_group import Group, GroupFactory, StoreServer  # noqa: E402

SKIPPED = 77
TIMEOUTS = Timeouts(collective_s=5.0, group_build_s=20.0, group_abort_s=30.0)
HOST = "127.0.0.1"


def check(ok: bool, what: str) -> None:
    print(("ok    " if ok else "FAILED ") + what, flush=True)
    if not ok:
        sys.exit(1)


def reduce_ones(group: Group, world: int) -> None:
    t = torch.ones(4, device=group.device)
    all_reduce(t, group, dist.ReduceOp.SUM, Bound.after(TIMEOUTS.collective_s, poll_s=TIMEOUTS.abort_poll_s))
    check(bool(torch.all(t == world).item()), f"generation {group.generation}: all_reduce of {world} ranks")


def build(factory: GroupFactory, generation: int, rank: int, world: int, port: int) -> Group:
    # under a token, as the trainer's groups are: NCCL's unique id goes through the sealed store
    return factory.build(
        generation,
        rank,
        world,
        HOST,
        port,
        Bound.after(TIMEOUTS.group_build_s, poll_s=TIMEOUTS.abort_poll_s),
        token=f"{generation:032x}",
    )


def one_gpu() -> None:
    preset = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    server = StoreServer(HOST, TIMEOUTS)
    factory = GroupFactory(server, HOST, "nccl", 0, TIMEOUTS)
    check(
        os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING") == (preset or "2")
        and "TORCH_NCCL_NONBLOCKING_TIMEOUT" in os.environ,
        "NCCL environment set before the first group",
    )
    for generation in (1, 2):
        started = time.monotonic()
        group = build(factory, generation, 0, 1, server.port)
        check(group.pg.bound_device_id == factory.device, f"generation {generation}: bound to {factory.device}")
        backend = group.pg._get_backend(factory.device)
        check(
            bool(backend._is_initialized()),  # type: ignore[attr-defined]
            f"generation {generation}: communicator ready after build ({time.monotonic() - started:.2f} s)",
        )
        reduce_ones(group, 1)
        started = time.monotonic()
        factory.retire(group)
        check(
            time.monotonic() - started < TIMEOUTS.group_abort_s,
            f"generation {generation}: aborted in {time.monotonic() - started:.2f} s; the process lives",
        )
    factory.drain(Deadline.after(TIMEOUTS.collective_s + 1))


def worker(rank: int, store_port: int) -> int:
    """One of the two processes of part 2 (on GPU ``rank``)."""
    server = StoreServer(HOST, TIMEOUTS)
    factory = GroupFactory(server, HOST, "nccl", rank, TIMEOUTS)
    group = build(factory, 1, rank, 2, store_port)
    reduce_ones(group, 2)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(4, device=group.device)
    try:
        all_reduce(t, group, dist.ReduceOp.SUM, Bound.after(TIMEOUTS.collective_s + 5, poll_s=TIMEOUTS.abort_poll_s))
        check(False, "rank 0: an all_reduce with a dead peer failed")
    except CollectiveError as exc:
        check(True, f"rank 0: an all_reduce with a dead peer failed ({type(exc).__name__}); the process lives")
    started = time.monotonic()
    factory.retire(group)
    check(True, f"rank 0: broken group aborted in {time.monotonic() - started:.2f} s")
    reduce_ones(build(factory, 2, 0, 1, store_port), 1)
    factory.drain(Deadline.after(TIMEOUTS.collective_s + 1))
    return 0


def two_gpus() -> None:
    store = TCPStore(HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    procs = [
        subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--store-port", str(store.port)]) for r in (0, 1)
    ]
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    check(codes == [0, -signal.SIGKILL], f"two processes: rank 0 exited 0, rank 1 was killed ({codes})")


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--rank":
        return worker(int(sys.argv[2]), int(sys.argv[4]))
    if not torch.cuda.is_available() or not dist.is_nccl_available():
        print("skipped: needs CUDA and a torch built with NCCL", flush=True)
        return SKIPPED
    print(
        f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, "  # type: ignore[no-untyped-call]
        f"{torch.cuda.device_count()} GPU(s)"
    )
    one_gpu()
    if torch.cuda.device_count() >= 2:
        two_gpus()
    else:
        print("note: part 2 (a peer killed) needs 2 GPUs; skipped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
