"""The drop-in form's data rules (``worker.data.stream``): tables, and a simulation of resizes with
prefetching members that checks every block is used once."""

from __future__ import annotations

import random

import pytest

from elasticd.worker.data.stream import (
    Consumed,
    EpochPlan,
    StreamOrder,
    conflicts,
    free_pool,
    make_plan,
    plan_epoch,
)


@pytest.mark.parametrize(
    ("start", "add", "frontier", "above"),
    [
        (Consumed(), [0, 1, 2], 3, ()),
        (Consumed(), [1, 3], 0, (1, 3)),
        (Consumed(0, (1, 3)), [0], 2, (3,)),
        (Consumed(0, (1, 3)), [0, 2], 4, ()),
        (Consumed(5), [], 5, ()),
    ],
)
def test_consumed_keeps_a_frontier_and_the_blocks_above(
    start: Consumed, add: list[int], frontier: int, above: tuple[int, ...]
) -> None:
    got = start.add(add)
    assert (got.frontier, got.above) == (frontier, above)
    assert got.count == start.count + len(add)


@pytest.mark.parametrize(("start", "add"), [(Consumed(3), [2]), (Consumed(0, (4,)), [4]), (Consumed(), [1, 1])])
def test_a_block_used_twice_is_refused(start: Consumed, add: list[int]) -> None:
    with pytest.raises(ValueError, match="used twice"):
        start.add(add)


@pytest.mark.parametrize(
    ("consumed", "held", "first"),
    [
        (Consumed(), [], [0, 1, 2, 3]),
        (Consumed(4), [], [4, 5, 6]),
        (Consumed(2, (4,)), [], [2, 3, 5, 6]),
        (Consumed(2, (4,)), [3, 7], [2, 5, 6, 8, 9]),
        (Consumed(0), [2], [0, 1, 3, 4]),
    ],
)
def test_the_free_pool_skips_used_and_held_blocks(consumed: Consumed, held: list[int], first: list[int]) -> None:
    pool = free_pool(consumed, held)
    assert [pool[i] for i in range(len(first))] == first


def test_each_rank_hands_out_its_held_blocks_then_its_stride_of_the_pool() -> None:
    plan = make_plan(Consumed(4), [[6, 9], [], [5]])
    # the pool: 4 7 8 10 11 12 13 14 ...; rank r's stride: pool[r], pool[r + 3], ...
    assert [plan.block(0, j) for j in range(4)] == [6, 9, 4, 10]
    assert [plan.block(1, j) for j in range(3)] == [7, 11, 14]
    assert [plan.block(2, j) for j in range(3)] == [5, 8, 12]
    assert plan.step_blocks(0, 2) == [6, 9, 7, 11, 5, 8]


@pytest.mark.parametrize(
    ("consumed", "held", "match"),
    [(Consumed(), [[1], [1]], "same block"), (Consumed(3), [[2], []], "already used")],
)
def test_a_plan_refuses_overlapping_or_used_held_blocks(consumed: Consumed, held: list[list[int]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_plan(consumed, held)


@pytest.mark.parametrize(
    ("epoch", "step", "consumed", "per_step", "steps"),
    [
        (0, 0, Consumed(), 4, 6),  # 384 samples / (4 blocks x 16)
        (0, 0, Consumed(), 6, 4),  # 384 / 96
        (1, 6, Consumed(24), 4, 6),  # 768 - 24 x 16 = 384 left up to epoch 1's end
        (1, 4, Consumed(24), 6, 4),
        (1, 10, Consumed(30), 4, 4),  # 288 left: 4 steps, the remaining 32 open epoch 2
        (2, 3, Consumed(0), 4, 18),  # an epoch far ahead of the stream: every unused sample up to its end
    ],
)
def test_an_epoch_gets_the_steps_its_unused_samples_fill(
    epoch: int, step: int, consumed: Consumed, per_step: int, steps: int
) -> None:
    got = plan_epoch(epoch, step, consumed, dataset_size=384, block_size=16, per_step=per_step)
    assert got == EpochPlan(epoch, step, steps)
    assert got.steps_left(step) == steps and got.steps_left(step + steps + 3) == 0


def test_the_stream_is_each_epochs_seeded_permutation_in_turn() -> None:
    import torch

    order = StreamOrder(dataset_size=10, block_size=4, seed=7)
    stream = [i for b in range(5) for i in order.indices(b)]  # 20 samples: epochs 0 and 1
    g = torch.Generator()
    assert stream[:10] == torch.randperm(10, generator=g.manual_seed(7)).tolist()  # torch's DistributedSampler order
    assert stream[10:] == torch.randperm(10, generator=g.manual_seed(8)).tolist()
    assert order.epoch_of(2) == 0 and order.epoch_of(3) == 1  # block 2 straddles the boundary
    assert StreamOrder(10, 4, shuffle=False).indices(1) == [4, 5, 6, 7]


@pytest.mark.parametrize("seed", range(20))
def test_resizes_with_prefetching_members_use_every_block_once(seed: int) -> None:
    """Generations of 1-4 members, each prefetching 0-3 blocks ahead; between generations some
    members leave (their held blocks return to the pool) and newcomers arrive. The blocks the
    steps used are exactly 0..n-1 but for the last few in flight."""
    rnd = random.Random(seed)
    accum = rnd.choice([1, 2, 3])
    consumed, used = Consumed(), []
    members: list[list[int]] = [[] for _ in range(rnd.randint(1, 4))]  # each member's held blocks
    for _ in range(30):
        plan = make_plan(consumed, members)
        world = plan.world_size
        handed = [len(h) for h in members]
        steps = rnd.randint(0, 5)
        for taken in range(0, steps * accum, accum):
            for r in range(world):  # each member's loader pulled its step's blocks and some more
                handed[r] = max(handed[r], taken + accum + rnd.randint(0, 3))
            blocks = plan.step_blocks(taken, accum)
            consumed = consumed.add(blocks)
            used.extend(blocks)
        held = [[plan.block(r, j) for j in range(steps * accum, handed[r])] for r in range(world)]
        survivors = [h for h in held if rnd.random() > 0.3] or held[:1]
        members = survivors + [[] for _ in range(rnd.randint(0, 2))]
        members = members[:4]
    assert len(used) == len(set(used))
    assert consumed.count == len(used)
    assert len(consumed.above) <= 4 * (3 + 3)  # held by members at a regroup, used later: bounded


@pytest.mark.parametrize(
    ("consumed", "held", "leaving"),
    [
        (Consumed(4), [[5, 6], [], [7]], set()),
        (Consumed(4), [[5], [3, 8]], {1}),  # rank 1 holds a used block
        (Consumed(4), [[5, 6], [6], [6, 9]], {1, 2}),  # the lowest rank keeps a block held twice
        (Consumed(0, (9,)), [[9], [9]], {0, 1}),
    ],
)
def test_the_ranks_whose_held_blocks_cannot_be_used_leave(
    consumed: Consumed, held: list[list[int]], leaving: set[int]
) -> None:
    assert conflicts(consumed, held) == leaving
    if not leaving:
        make_plan(consumed, held)
