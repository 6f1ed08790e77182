"""ElasticSampler: one seeded order per epoch, split over whoever is present, each sample once."""

from __future__ import annotations

from collections import Counter

import pytest

from elasticd.errors import ConfigError
from elasticd.worker.data.sampler import Batch, BatchMode, ElasticSampler, split_micro

pytestmark = pytest.mark.timeout(60)


def run_epoch_with_worlds(
    sampler: ElasticSampler, worlds: list[int], steps_per_world: int, epoch: int = 0
) -> tuple[list[list[Batch]], tuple[int, int], int]:
    """Drive the sampler like the trainer: each step, every rank takes its share of the batch at the
    synced (epoch, position); the world size changes every ``steps_per_world`` steps (cycling).

    Returns the per-step batches of all ranks, the final (epoch, position) and the steps run.
    """
    position = 0
    step = 0
    out: list[list[Batch]] = []
    while True:
        world = worlds[(step // steps_per_world) % len(worlds)]
        e, p = sampler.normalize(epoch, position, world)
        if e != epoch:
            return out, (e, p), step
        batches = [sampler.batch(step + 1, epoch, position, r, world) for r in range(world)]
        out.append(batches)
        epoch, position = ElasticSampler.after(batches[0])
        step += 1


def test_order_is_a_deterministic_permutation_per_seed_and_epoch() -> None:
    a, b = ElasticSampler(100, 8, seed=7), ElasticSampler(100, 8, seed=7)
    assert a.order(0) == b.order(0)
    assert sorted(a.order(0)) == list(range(100))
    assert a.order(0) != a.order(1), "each epoch must be reshuffled"
    assert a.order(1) == b.order(1)
    assert a.order(0) != ElasticSampler(100, 8, seed=8).order(0), "the seed must matter"
    assert a.order(0) != list(range(100)), "the order must be shuffled"
    # Going back to an earlier epoch gives the same order again (the cache must not leak).
    first = list(a.order(0))
    a.order(5)
    assert a.order(0) == first


@pytest.mark.parametrize(("gbs", "world"), [(8, 1), (8, 3), (10, 4), (7, 7), (5, 8), (64, 5)])
def test_shares_differ_by_at_most_one_and_cover_the_batch(gbs: int, world: int) -> None:
    s = ElasticSampler(1000, gbs, seed=1)
    for position in (0, 13, 992):
        shares = [s.batch(1, 0, position, r, world) for r in range(world)]
        sizes = [len(b.indices) for b in shares]
        take = min(gbs, 1000 - position)
        assert max(sizes) - min(sizes) <= 1
        assert sum(sizes) == take
        joined = [i for b in shares for i in b.indices]
        assert joined == s.order(0)[position : position + take], "shares are contiguous, in rank order"
        assert all(b.global_size == take and b.world_size == world and b.position == position for b in shares)
        assert [b.rank for b in shares] == list(range(world))
        assert sum(b.weight for b in shares) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "worlds",
    [[3, 2, 4, 1, 3], [1], [4], [5, 1], [2, 7, 3]],
    ids=lambda w: "-".join(map(str, w)),
)
@pytest.mark.parametrize("dataset_size", [97, 100])
def test_every_sample_used_exactly_once_across_world_changes(worlds: list[int], dataset_size: int) -> None:
    s = ElasticSampler(dataset_size, 10, seed=3)
    steps, (epoch, position), n = run_epoch_with_worlds(s, worlds, steps_per_world=2)
    used = Counter(i for batches in steps for b in batches for i in b.indices)
    assert sorted(used) == list(range(dataset_size))
    assert set(used.values()) == {1}, "a sample was used more than once"
    assert (epoch, position) == (1, 0)
    assert n == -(-dataset_size // 10)  # constant global batch: ceil(N / 10) steps whatever the world
    if len(worlds) > 1:
        assert {steps[i][0].world_size for i in range(len(steps))} == set(worlds[: (n + 1) // 2])


def test_world_change_mid_epoch_continues_where_the_old_world_stopped() -> None:
    s = ElasticSampler(50, 6, seed=0)
    before = [s.batch(1, 0, 0, r, 3) for r in range(3)]
    epoch, position = ElasticSampler.after(before[0])
    assert (epoch, position) == (0, 6)
    after = [s.batch(2, epoch, position, r, 2) for r in range(2)]
    assert [i for b in after for i in b.indices] == s.order(0)[6:12]


def test_epoch_rollover() -> None:
    s = ElasticSampler(10, 4, seed=5)
    last = s.batch(3, 0, 8, 0, 1)
    assert (last.epoch, last.position, last.global_size) == (0, 8, 2)  # the short tail is kept
    assert last.indices == s.order(0)[8:10]
    assert ElasticSampler.after(last) == (0, 10)
    nxt = s.batch(4, 0, 10, 0, 1)  # a position at the end means the next epoch
    assert (nxt.epoch, nxt.position) == (1, 0)
    assert nxt.indices == s.order(1)[0:4]
    assert s.normalize(0, 10, 1) == (1, 0)
    assert s.normalize(0, 9, 1) == (0, 9)


def test_drop_last_skips_the_short_tail() -> None:
    s = ElasticSampler(10, 4, seed=5, drop_last=True)
    assert s.normalize(0, 8, 1) == (1, 0)
    b = s.batch(3, 0, 8, 0, 2)
    assert (b.epoch, b.position, b.global_size) == (1, 0, 4)


def test_linear_scaling_grows_the_global_batch_with_the_world() -> None:
    s = ElasticSampler(1000, 4, seed=2, mode=BatchMode.LINEAR_SCALING)
    assert s.mode is BatchMode.LINEAR_SCALING
    for world in (1, 3, 5):
        assert s.global_size(world) == 4 * world
        shares = [s.batch(1, 0, 0, r, world) for r in range(world)]
        assert [len(b.indices) for b in shares] == [4] * world  # the per-rank batch is fixed
        assert all(b.global_size == 4 * world for b in shares)
    constant = ElasticSampler(1000, 4, seed=2)
    assert [constant.global_size(w) for w in (1, 3, 5)] == [4, 4, 4]


def test_linear_scaling_from_string_and_exactly_once() -> None:
    s = ElasticSampler(101, 4, seed=9, mode="linear_scaling")  # type: ignore[arg-type]
    assert s.mode is BatchMode.LINEAR_SCALING
    steps, (epoch, position), _ = run_epoch_with_worlds(s, [3, 2, 4, 1, 3], steps_per_world=1)
    used = Counter(i for batches in steps for b in batches for i in b.indices)
    assert sorted(used) == list(range(101)) and set(used.values()) == {1}
    assert (epoch, position) == (1, 0)


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"dataset_size": 0, "global_batch_size": 4}, "dataset_size"),
        ({"dataset_size": -5, "global_batch_size": 4}, "dataset_size"),
        ({"dataset_size": 10, "global_batch_size": 0}, "global_batch_size"),
        ({"dataset_size": 10, "global_batch_size": 11, "drop_last": True}, "global_batch_size"),
        ({"dataset_size": 10, "global_batch_size": 2, "mode": "bogus"}, "mode"),
    ],
)
def test_bad_arguments_raise_config_error(kwargs: dict[str, object], setting: str) -> None:
    with pytest.raises(ConfigError, match=setting):
        ElasticSampler(**kwargs)  # type: ignore[arg-type]


def test_global_batch_equal_to_dataset_is_allowed_with_drop_last() -> None:
    s = ElasticSampler(10, 10, drop_last=True)
    assert sorted(s.batch(1, 0, 0, 0, 1).indices) == list(range(10))


@pytest.mark.parametrize(("rank", "world"), [(3, 3), (-1, 3), (0, 0)])
def test_batch_rejects_a_rank_outside_the_world(rank: int, world: int) -> None:
    s = ElasticSampler(100, 4)
    with pytest.raises(ValueError):
        s.batch(1, 0, 0, rank, world)


# -- the endless stream (dataset_size=None) and the prediction of the next batch --------------------


@pytest.mark.parametrize(
    ("mode", "position", "world", "shares"),
    [
        (BatchMode.CONSTANT_GLOBAL, 0, 1, [[0, 1, 2, 3, 4]]),
        (BatchMode.CONSTANT_GLOBAL, 0, 2, [[0, 1], [2, 3, 4]]),
        (BatchMode.CONSTANT_GLOBAL, 35, 3, [[35], [36, 37], [38, 39]]),
        (BatchMode.CONSTANT_GLOBAL, 10**12, 2, [[10**12, 10**12 + 1], [10**12 + 2, 10**12 + 3, 10**12 + 4]]),
        (BatchMode.CONSTANT_GLOBAL, 7, 6, [[], [7], [8], [9], [10], [11]]),  # more ranks than samples per batch
        (BatchMode.LINEAR_SCALING, 4, 2, [list(range(4, 9)), list(range(9, 14))]),
    ],
)
def test_endless_stream_shares_are_global_sample_numbers(
    mode: BatchMode, position: int, world: int, shares: list[list[int]]
) -> None:
    s = ElasticSampler(None, 5, seed=3, mode=mode)
    assert s.endless
    got = [s.batch(9, 0, position, r, world) for r in range(world)]
    assert [b.indices for b in got] == shares
    assert all(b.epoch == 0 and b.position == position and b.global_size == sum(map(len, shares)) for b in got)
    assert s.permutations_built == 0, "an endless stream never builds a permutation"


@pytest.mark.parametrize("worlds", [[3, 2, 4, 1, 3], [1], [5, 1]], ids=lambda w: "-".join(map(str, w)))
def test_endless_stream_uses_each_sample_once_across_world_changes(worlds: list[int]) -> None:
    s = ElasticSampler(None, 7, seed=0)
    epoch, position, used = 0, 0, Counter[int]()
    for step in range(1, 41):
        world = worlds[(step // 3) % len(worlds)]
        assert s.normalize(epoch, position, world) == (epoch, position), "an endless stream never rolls over"
        shares = [s.batch(step, epoch, position, r, world) for r in range(world)]
        used.update(i for b in shares for i in b.indices)
        epoch, position = ElasticSampler.after(shares[0])
    assert (epoch, position) == (0, 40 * 7)
    assert sorted(used) == list(range(40 * 7)) and set(used.values()) == {1}
    assert s.permutations_built == 0


def test_endless_stream_has_no_epoch_order() -> None:
    with pytest.raises(ValueError, match="endless"):
        ElasticSampler(None, 4).order(0)


def test_endless_stream_rejects_drop_last() -> None:
    with pytest.raises(ConfigError, match="drop_last"):
        ElasticSampler(None, 4, drop_last=True)


def test_each_epoch_order_is_built_once_even_when_a_prefetch_looks_ahead() -> None:
    s = ElasticSampler(10, 4, seed=1)
    for _ in range(3):  # the trainer at the end of epoch 0, a prefetcher already in epoch 1
        s.batch(3, 0, 8, 0, 1)
        s.batch(4, 1, 0, 0, 1)
    assert s.permutations_built == 2
    s.order(2)  # a third epoch evicts the oldest, and only that one
    s.order(1)
    assert s.permutations_built == 3


@pytest.mark.parametrize(
    ("dataset_size", "kwargs", "start", "expected"),
    [
        # (step, epoch, position, rank, world) -> the next batch's (step, epoch, position, indices' slice)
        (20, {}, (1, 0, 0, 1, 2), (2, 0, 4, (6, 8))),
        (10, {}, (3, 0, 8, 0, 1), (4, 1, 0, (0, 4))),  # the short tail, then the next epoch
        (10, {}, (2, 0, 4, 0, 2), (3, 0, 8, (8, 9))),  # the tail is kept without drop_last
        (10, {"drop_last": True}, (2, 0, 4, 0, 2), (3, 1, 0, (0, 2))),
        (20, {"mode": BatchMode.LINEAR_SCALING}, (1, 0, 0, 0, 2), (2, 0, 8, (8, 12))),
        (None, {}, (5, 0, 16, 1, 2), (6, 0, 20, (22, 24))),
    ],
)
def test_next_batch_predicts_the_batch_after_a_commit_with_no_change(
    dataset_size: int | None,
    kwargs: dict[str, object],
    start: tuple[int, int, int, int, int],
    expected: tuple[int, int, int, tuple[int, int]],
) -> None:
    s = ElasticSampler(dataset_size, 4, seed=2, **kwargs)  # type: ignore[arg-type]
    nxt = s.next_batch(s.batch(*start))
    step, epoch, position, (lo, hi) = expected
    assert (nxt.step, nxt.epoch, nxt.position, nxt.rank, nxt.world_size) == (step, epoch, position, *start[3:])
    want = list(range(lo, hi)) if dataset_size is None else s.order(epoch)[lo:hi]
    assert nxt.indices == want
    # The trainer's own path: commit, normalize, ask for the next step's batch.
    e, p = s.normalize(*ElasticSampler.after(s.batch(*start)), start[4])
    assert nxt == s.batch(start[0] + 1, e, p, start[3], start[4])


@pytest.mark.parametrize(
    ("indices", "count", "parts"),
    [
        ([1, 2, 3, 4, 5], 1, [[1, 2, 3, 4, 5]]),
        ([1, 2, 3, 4, 5], 2, [[1, 2], [3, 4, 5]]),
        ([1, 2, 3, 4, 5], 5, [[1], [2], [3], [4], [5]]),
        ([1, 2], 3, [[], [1], [2]]),  # fewer samples than micro-batches: some are empty
        ([], 2, [[], []]),
    ],
)
def test_split_micro_is_contiguous_and_keeps_the_share(indices: list[int], count: int, parts: list[list[int]]) -> None:
    share = Batch(4, 1, 12, indices, 10, 3, 2)
    micros = split_micro(share, count)
    assert [m.indices for m in micros] == parts
    assert [(m.micro, m.micro_count) for m in micros] == [(k, count) for k in range(count)]
    assert all(
        (m.step, m.epoch, m.position, m.global_size, m.world_size, m.rank) == (4, 1, 12, 10, 3, 2) for m in micros
    )
    assert sum(m.weight for m in micros) == pytest.approx(share.weight)


@pytest.mark.parametrize(
    ("count", "batch"), [(0, Batch(1, 0, 0, [1], 1, 1, 0)), (2, Batch(1, 0, 0, [1], 1, 1, 0, micro=0, micro_count=2))]
)
def test_split_micro_rejects_a_bad_count_or_a_micro_batch(count: int, batch: Batch) -> None:
    with pytest.raises(ValueError):
        split_micro(batch, count)


def test_next_batch_walks_the_micro_batches_then_the_next_step() -> None:
    s = ElasticSampler(10, 4, seed=2)
    first = split_micro(s.batch(3, 0, 8, 0, 1), 2)  # the short tail: 2 samples, 1 per micro-batch
    assert s.next_batch(first[0]) == first[1]
    nxt = s.next_batch(first[1])
    assert nxt == split_micro(s.batch(4, 1, 0, 0, 1), 2)[0]
    assert (nxt.step, nxt.epoch, nxt.position, nxt.micro, nxt.micro_count) == (4, 1, 0, 0, 2)
