"""sync_state between real processes in a gloo group.

Covers every way the state can move (``plan_transfer``): point-to-point sends to the ranks that
need it while a survivor that holds it stands by, and a broadcast when most ranks need it (the JSON
layout travels with the arena's pieces, whatever its length). Every case ends with every rank
holding rank 0's step, checksum and parameters.
A receiver frozen with SIGSTOP in the middle of a point-to-point transfer does not hold rank 0:
it gives the transfer up as soon as the generation is abandoned, and a receiver killed with
SIGKILL fails it at once.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from queue import Queue

import pytest

pytestmark = pytest.mark.timeout(120)


def _model(layers: int, width: int, seed: int):  # type: ignore[no-untyped-def]
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])


def _setup(rank: int, world: int, port_q: Queue[int]):  # type: ignore[no-untyped-def]
    import torch

    from elasticd.log import configure_logging
    from elasticd.testing.groups import fixed_gloo_group

    configure_logging(json=True, level=40)
    torch.set_num_threads(1)
    return fixed_gloo_group(rank, world, port_q)


def _trained_state(layers: int, width: int, holds: bool, seed: int):  # type: ignore[no-untyped-def]
    """Rank 0 and the survivors hold the same trained state (seed 0, one step); a newcomer a fresh
    model of its own seed."""
    import torch

    from elasticd.worker.state.training import TrainingState

    model = _model(layers, width, seed=0 if holds else seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainingState(model, opt)
    if holds:
        model(torch.randn(3, width, generator=torch.Generator().manual_seed(1))).sum().backward()
        opt.step()  # momentum buffers: optimizer state moves too
        opt.zero_grad()
        state.counters.step = 7
    return state


def _worker(
    rank: int, world: int, layers: int, holders: list[int], port_q: Queue[int], res_q: Queue[dict[str, object]]
) -> None:
    from elasticd.retry import Bound
    from elasticd.worker.state.sync import plan_transfer, sync_state

    timeouts, factory, group = _setup(rank, world, port_q)
    holds = rank in holders
    state = _trained_state(layers, 4, holds, seed=rank)
    layout, arena = state.pack()
    needy = [r for r in range(world) if r not in holders]
    plan = plan_transfer(world, needy, len(layout) + arena.numel(), "gloo", True)
    state.lineage = 1 if holds else -1
    report = sync_state(
        group,
        state,
        Bound.after(60, poll_s=timeouts.abort_poll_s),
        subgroup=lambda parent, ranks, name: factory.build_subgroup(
            parent, ranks, name, Bound.after(60, poll_s=timeouts.abort_poll_s)
        ),
        retire=factory.retire,
    )
    res_q.put(
        {
            "rank": rank,
            "checksum": report.checksum,
            "step": state.counters.step,
            "layout_bytes": len(layout),
            "mode": str(plan.mode),
            "params": [p.detach().flatten().tolist() for p in state.model.parameters()],
            "transferred": report.transferred_bytes,
        }
    )
    res_q.close()
    res_q.join_thread()  # the result is in the pipe
    os._exit(0)  # as the benchmark: no destructors racing the peer's exit


def _run(target, args_of, world: int):  # type: ignore[no-untyped-def]
    ctx = multiprocessing.get_context("spawn")
    port_q: Queue[int] = ctx.Queue()
    res_q: Queue[dict[str, object]] = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of(r), port_q, res_q), daemon=True) for r in range(world)]
    try:
        for p in procs:
            p.start()
        results = [res_q.get(timeout=60) for _ in range(world)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return {int(r["rank"]): r for r in results}  # type: ignore[call-overload]


@pytest.mark.parametrize(
    ("world", "holders", "mode"),
    [
        (2, [0], "p2p"),  # one newcomer
        (3, [0, 1], "p2p"),  # a survivor holds the state: rank 0 sends only to the newcomer
        (4, [0], "broadcast"),  # three need it: more than log2(4) sends, a broadcast
    ],
)
def test_every_rank_ends_with_rank_0_state(world: int, holders: list[int], mode: str) -> None:
    results = _run(_worker, lambda r: (r, world, 2, holders), world)
    zero = results[0]
    for rank, res in results.items():
        assert res["mode"] == mode
        assert res["step"] == 7
        assert res["checksum"] == zero["checksum"]
        for a, b in zip(zero["params"], res["params"], strict=True):  # type: ignore[call-overload]
            assert a == b
        if rank not in holders:
            assert int(res["transferred"]) > 0  # type: ignore[call-overload]
    if mode == "p2p":
        for rank in holders[1:]:
            assert results[rank]["transferred"] == 0, "a survivor holding the state receives nothing"


# -- a receiver that freezes or dies in the middle of a point-to-point transfer -------------------

_BIG_WIDTH = 2048  # ~34 MB of state with momentum: more than the sockets buffer, so rank 0's sends wait


def _sender_or_receiver(rank: int, fault: str, flag: str, port_q: Queue[int], res_q: Queue[dict[str, object]]) -> None:
    from elasticd.errors import CollectiveError
    from elasticd.retry import Bound
    from elasticd.worker.state.sync import _UNSET, _max_reduce, sync_state

    timeouts, _, group = _setup(rank, 2, port_q)
    state = _trained_state(2, _BIG_WIDTH, rank == 0, seed=rank)
    if rank == 1:
        # The receiver's side of sync_state's first collective, exactly as sync_state makes it
        # (a newcomer: step 0, no lineage), so rank 0 goes on into the point-to-point sends; then
        # the receiver freezes or dies before it takes a byte.
        probe = [_UNSET] * (2 + 2 * 2)  # sizes, and (step, lineage) per rank
        probe[4], probe[5] = 0, -1
        _max_reduce(probe, group, Bound.after(60, poll_s=timeouts.abort_poll_s))
        res_q.put({"rank": 1, "probed": True})
        res_q.close()
        res_q.join_thread()
        os.kill(os.getpid(), signal.SIGSTOP if fault == "sigstop" else signal.SIGKILL)
        os._exit(3)  # SIGCONT in teardown
    started = time.monotonic()
    outcome: dict[str, object] = {"rank": 0}
    try:
        # The test touches ``flag`` as the membership watcher would raise "abandon" when the frozen
        # peer's lease expires; a dead peer needs no flag: its connections break.
        state.lineage = 1
        sync_state(group, state, Bound.after(60, poll_s=timeouts.abort_poll_s, abandon=lambda: os.path.exists(flag)))
        outcome["error"] = None
    except CollectiveError as exc:
        outcome["error"] = type(exc).__name__
        outcome["message"] = str(exc)
    outcome["ended_at"] = time.time()
    outcome["after_s"] = time.monotonic() - started
    res_q.put(outcome)
    res_q.close()
    res_q.join_thread()
    os._exit(0)


@pytest.mark.parametrize("fault", ["sigstop", "sigkill"])
def test_a_receiver_lost_mid_transfer_does_not_hold_rank_0(fault: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    flag = tmp_path / "abandon"
    ctx = multiprocessing.get_context("spawn")
    port_q: Queue[int] = ctx.Queue()
    res_q: Queue[dict[str, object]] = ctx.Queue()
    procs = [
        ctx.Process(target=_sender_or_receiver, args=(r, fault, str(flag), port_q, res_q), daemon=True)
        for r in range(2)
    ]
    try:
        for p in procs:
            p.start()
        first = res_q.get(timeout=60)
        assert first == {"rank": 1, "probed": True}, first
        if fault == "sigstop":
            time.sleep(0.5)  # rank 0 is now stuck in its sends; then the "lease" expires
            flagged_at = time.time()
            flag.touch()
        outcome = res_q.get(timeout=45)
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.join(10)
    assert outcome["rank"] == 0
    if fault == "sigstop":
        # Abandoned within a few abort polls of the flag, not after gloo's 30 s collective timeout.
        assert outcome["error"] == "PeerLost", outcome
        assert float(outcome["ended_at"]) - flagged_at < 2.0, outcome  # type: ignore[arg-type]
    else:
        # The broken connection ends the sends at once, with no flag.
        assert outcome["error"] == "CollectiveError", outcome
        assert "state transfer failed" in str(outcome["message"]), outcome
        assert float(outcome["after_s"]) < 5.0, outcome  # type: ignore[arg-type]


# -- a registered scheduler is part of the state ----------------------------------------------------


def _scheduled_worker(rank: int, port_q: Queue[int], res_q: Queue[dict[str, object]]) -> None:
    import torch

    from elasticd.retry import Bound
    from elasticd.worker.state.sync import sync_state

    timeouts, _, group = _setup(rank, 2, port_q)
    state = _trained_state(2, 4, True, seed=0)  # both ranks hold step 7 of the same lineage...
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(state.optimizer, T_max=10)
    state.register("scheduler", sched)
    if rank == 1:  # ...but rank 1's scheduler stepped once more (the optimizer's lr put back: only it differs)
        lrs = [g["lr"] for g in state.optimizer.param_groups]
        sched.step()
        for g, lr in zip(state.optimizer.param_groups, lrs):
            g["lr"] = lr
    before = state.checksum()
    state.lineage = 1
    report = sync_state(group, state, Bound.after(60, poll_s=timeouts.abort_poll_s))
    res_q.put(
        {
            "rank": rank,
            "before": before,
            "checksum": report.checksum,
            "after": state.checksum(),
            "transferred": report.transferred_bytes,
            "scheduler": sched.state_dict(),
        }
    )
    res_q.close()
    res_q.join_thread()
    os._exit(0)


def test_a_rank_whose_scheduler_differs_receives_rank_0_state() -> None:
    results = _run(_scheduled_worker, lambda r: (r,), 2)
    zero, one = results[0], results[1]
    assert zero["before"] != one["before"]
    assert zero["checksum"] == one["checksum"] == zero["after"] == one["after"] == zero["before"]
    assert int(one["transferred"]) > 0  # type: ignore[call-overload]
    assert one["scheduler"] == zero["scheduler"] and zero["scheduler"]["last_epoch"] == 0  # type: ignore[index]
