"""sync_state between real processes in a gloo group: rank 0's layout rides in the probe
all_reduce when it fits LAYOUT_SLOT_BYTES, and is broadcast when it does not; both end with the
newcomer holding rank 0's state (equal checksums) and the same parameters."""

from __future__ import annotations

import multiprocessing
from queue import Queue

import pytest

pytestmark = pytest.mark.timeout(120)


def _model(layers: int, seed: int):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])


def _worker(rank: int, layers: int, port_q: Queue[int], res_q: Queue[dict[str, object]]) -> None:
    import os

    import torch

    from elasticd.checkpoint import LAYOUT_SLOT_BYTES, TrainingState, sync_state
    from elasticd.config import Timeouts
    from elasticd.log import configure_logging
    from elasticd.process_group import GroupFactory, StoreServer
    from elasticd.retry import Deadline

    configure_logging(json=True, level=40)
    torch.set_num_threads(1)
    timeouts = Timeouts()
    never = lambda: False  # noqa: E731
    server = StoreServer("127.0.0.1", timeouts)
    if rank == 0:
        port_q.put(server.port)
        port = server.port
    else:
        port = port_q.get(timeout=60)
    factory = GroupFactory(server, "127.0.0.1", "gloo", rank, timeouts)
    group = factory.build(1, rank, 2, "127.0.0.1", port, Deadline.after(60), never)
    model = _model(layers, seed=rank)  # different weights: the newcomer's must be replaced
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if rank == 0:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()  # momentum buffers: optimizer state moves too
        opt.zero_grad()
        state = TrainingState(model, opt)
        state.counters.step = 7
    else:
        state = TrainingState(model, opt)
    layout, _ = state.pack()
    report = sync_state(group, state, Deadline.after(60), never, timeouts.abort_poll_s, 1 if rank == 0 else -1)
    res_q.put({"rank": rank, "checksum": report.checksum, "step": state.counters.step,
               "layout_bytes": len(layout), "slot": LAYOUT_SLOT_BYTES,
               "params": [p.detach().flatten().tolist() for p in model.parameters()], "transferred": report.transferred_bytes})
    res_q.close()
    res_q.join_thread()  # the result is in the pipe
    os._exit(0)  # as the benchmark: no destructors racing the peer's exit


@pytest.mark.parametrize("layers", [2, 600])
def test_newcomer_gets_rank_0_state_with_the_layout_in_the_probe_or_broadcast(layers: int) -> None:
    ctx = multiprocessing.get_context("spawn")
    port_q: Queue[int] = ctx.Queue()
    res_q: Queue[dict[str, object]] = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, layers, port_q, res_q), daemon=True) for r in range(2)]
    try:
        for p in procs:
            p.start()
        results = {int(r["rank"]): r for r in (res_q.get(timeout=30) for _ in procs)}  # type: ignore[call-overload]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    zero, newcomer = results[0], results[1]
    fits = int(zero["layout_bytes"]) <= int(zero["slot"])  # type: ignore[call-overload]
    assert fits == (layers == 2), "the two cases must cover both paths"
    assert newcomer["step"] == 7
    assert newcomer["checksum"] == zero["checksum"]
    assert int(newcomer["transferred"]) > 0  # type: ignore[call-overload]
    for a, b in zip(zero["params"], newcomer["params"], strict=True):  # type: ignore[call-overload]
        assert a == b
