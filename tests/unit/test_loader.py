"""ElasticLoader: real DataLoader worker processes fetch exactly the trainer's batches, prefetching ahead.

The trainer is played by a generator that yields batches from a real ElasticSampler the way
``ElasticTrainer.batches()`` does: a committed step advances the synced position; a failed step
yields the same position again, split over the world of the next step.
"""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    get_worker_info,
)

from elasticd.errors import ConfigError
from elasticd.worker.data.loader import ElasticLoader
from elasticd.worker.data.sampler import Batch, ElasticSampler, split_micro

pytestmark = pytest.mark.timeout(60)

WORKERS: dict[str, Any] = {"num_workers": 2, "multiprocessing_context": "fork"}
IN_FLIGHT = 2 * 2  # torch's default prefetch_factor (2) times the workers


class Indices(Dataset[int]):
    """Sample i is i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return i


class Generated:
    """A generated map-style dataset without a length: sample i is i."""

    def __getitem__(self, i: int) -> int:
        return i


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class Slow(Indices):
    """Sample 0 takes longer than the loader's timeout."""

    def __getitem__(self, i: int) -> int:
        if i == 0:
            time.sleep(0.6)
        return i


def as_list(samples: list[int]) -> list[int]:
    """A collate function that handles an empty share."""
    return [int(s) for s in samples]


def as_list_in_a_worker(samples: list[int]) -> list[int]:
    assert get_worker_info() is not None, "collate must run in a DataLoader worker process"
    return as_list(samples)


def data_of(data: Any) -> list[int] | None:
    return None if data is None else [int(x) for x in data]


# (world, committed) per step, for a dataset of 39 and a global batch of 6. Positions: 0, 6, 12
# (fails), 12, then 2 ranks: 18, 24 (fails), then 4 ranks: 24, 30, 36 (3 samples: rank 0's share is
# empty), the next epoch's 0 (fails), 0.
PLAN = [
    (3, True),
    (3, True),
    (3, False),
    (3, True),
    (2, True),
    (2, False),
    (4, True),
    (4, True),
    (4, True),
    (4, False),
    (4, True),
]
# Rank 0's view: whether the prefetch restarts at each batch: after a failed step (the same step
# again, or a new world), not at a commit nor at the rollover.
RESTARTS_RANK0 = [False, False, False, True, True, False, True, False, False, False, True]


def trainer_like(
    sampler: ElasticSampler, plan: list[tuple[int, bool]], rank: int, committed: list[Batch], micro: int = 1
) -> Iterator[Batch]:
    """Yield ``rank``'s batch (or its ``micro`` micro-batches) of each step it is present for;
    record those that commit."""
    step, epoch, position = 0, 0, 0
    for world, ok in plan:
        batch = sampler.batch(step + 1, epoch, position, rank % world, world)  # any rank: it moves the position
        if rank < world:
            for part in split_micro(batch, micro):
                yield part
                if ok:
                    committed.append(part)
        if ok:
            step = batch.step
            epoch, position = sampler.normalize(*ElasticSampler.after(batch), world)


@pytest.mark.parametrize(
    ("settings", "in_flight"),
    [({**WORKERS}, IN_FLIGHT), ({**WORKERS, "persistent_workers": False}, IN_FLIGHT), ({}, 0)],
    ids=["persistent", "fresh-workers", "in-process"],
)
def test_rank0_gets_exactly_its_batches_through_retries_resizes_and_a_rollover(
    settings: dict[str, Any], in_flight: int
) -> None:
    s = ElasticSampler(39, 6, seed=4)
    committed: list[Batch] = []
    with ElasticLoader(Indices(39), s, **settings) as loader:
        restarts = []
        for batch, data in loader.iterate(trainer_like(s, PLAN, 0, committed)):
            restarts.append(loader.restarts)
            assert data_of(data) == (batch.indices or None), f"step {batch.step}: data differs from the batch"
    assert [b - a == 1 for a, b in zip([0, *restarts], restarts)] == RESTARTS_RANK0
    assert loader.discarded == in_flight * sum(RESTARTS_RANK0)
    assert [(b.epoch, b.position) for b in committed][-3:] == [(0, 30), (0, 36), (1, 0)]
    assert s.permutations_built == 2, "prefetching past the epoch's end must not rebuild the orders"


def test_all_ranks_together_use_every_sample_of_the_epoch_once() -> None:
    s = ElasticSampler(39, 6, seed=4)
    used: Counter[tuple[int, int]] = Counter()
    discarded = 0
    for rank in range(4):
        committed: list[Batch] = []
        with ElasticLoader(Indices(39), s, **WORKERS) as loader:
            for batch, data in loader.iterate(trainer_like(s, PLAN, rank, committed)):
                assert data_of(data) == (batch.indices or None), f"rank {rank} step {batch.step}"
            discarded += loader.discarded
        used.update((b.epoch, i) for b in committed for i in b.indices)
    assert sorted(i for e, i in used if e == 0) == list(range(39))
    assert set(used.values()) == {1}, "a sample was used twice"
    assert {i for e, i in used if e == 1} == set(s.order(1)[:6])
    assert discarded > 0


def test_micro_batches_are_prefetched_and_a_failed_step_starts_over() -> None:
    s = ElasticSampler(39, 6, seed=4)
    committed: list[Batch] = []
    seen: list[tuple[int, int, int]] = []
    with ElasticLoader(Indices(39), s, **WORKERS) as loader:
        for batch, data in loader.iterate(trainer_like(s, PLAN, 0, committed, micro=2)):
            seen.append((batch.step, batch.micro, loader.restarts))
            assert data_of(data) == (batch.indices or None)
    restarted = [(step, m) for (step, m, r), (_, _, before) in zip(seen, [(0, 0, 0), *seen]) if r > before]
    assert restarted == [(3, 0), (4, 0), (5, 0), (8, 0)], "only the first micro-batch after a failed step"
    assert loader.discarded == IN_FLIGHT * 4
    wholes: list[Batch] = []
    list(trainer_like(s, PLAN, 0, wholes))
    assert [i for b in committed for i in b.indices] == [i for b in wholes for i in b.indices]


def test_endless_stream_yields_global_sample_numbers_across_resizes() -> None:
    s = ElasticSampler(None, 5, seed=1)
    plan = [(2, True), (2, True), (3, False), (3, True), (1, True)]
    used: Counter[int] = Counter()
    for rank in range(3):
        committed: list[Batch] = []
        with ElasticLoader(Generated(), s, **WORKERS) as loader:
            for batch, data in loader.iterate(trainer_like(s, plan, rank, committed)):
                assert data_of(data) == (batch.indices or None)
        used.update(i for b in committed for i in b.indices)
    assert sorted(used) == list(range(4 * 5)) and set(used.values()) == {1}
    assert s.permutations_built == 0


def test_custom_collate_gets_the_samples_and_an_empty_share() -> None:
    s = ElasticSampler(39, 6, seed=4)
    committed: list[Batch] = []
    with ElasticLoader(Indices(39), s, collate_fn=as_list_in_a_worker, **WORKERS) as loader:
        out = list(loader.iterate(trainer_like(s, PLAN, 0, committed)))
    assert all(isinstance(data, list) and data == batch.indices for batch, data in out)
    assert [] in [data for _, data in out], "the plan has an empty share for rank 0"


@pytest.mark.parametrize("pin", [False, True])
def test_pin_memory(pin: bool) -> None:
    s = ElasticSampler(39, 6, seed=4)
    committed: list[Batch] = []
    accelerator = torch.accelerator.is_available()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ElasticLoader(Indices(39), s, pin_memory=pin, **WORKERS) as loader:
            for batch, data in loader.iterate(trainer_like(s, PLAN[:5], 0, committed)):
                assert data_of(data) == batch.indices
                assert data.is_pinned() == (pin and accelerator)
    if pin and not accelerator:
        assert any("pin_memory" in str(w.message) for w in caught), "torch warns that it cannot pin"


def test_a_dataloaders_settings_are_reused_and_its_batch_size_ignored() -> None:
    s = ElasticSampler(39, 6, seed=4)
    dl = DataLoader(Indices(39), batch_size=32, shuffle=True, drop_last=True, collate_fn=as_list, **WORKERS)
    committed: list[Batch] = []
    with ElasticLoader.from_dataloader(dl, s) as loader:
        assert loader.persistent_workers is False  # the DataLoader's setting
        for batch, data in loader.iterate(trainer_like(s, PLAN[:4], 0, committed)):
            assert data == batch.indices  # as_list was reused; the order and size are the sampler's


def test_batch_size_none_gets_the_default_collate() -> None:
    s = ElasticSampler(39, 6, seed=4)
    with ElasticLoader.from_dataloader(DataLoader(Indices(39), batch_size=None), s) as loader:
        batch = s.batch(1, 0, 0, 0, 1)
        assert torch.equal(loader.fetch(batch), torch.tensor(batch.indices))


@pytest.mark.parametrize(
    ("make", "setting"),
    [
        (lambda ds: DataLoader(ds, sampler=DistributedSampler(ds, num_replicas=2, rank=0)), "DistributedSampler"),
        (lambda ds: DataLoader(ds, sampler=SubsetRandomSampler(range(10))), "SubsetRandomSampler"),
        (lambda ds: DataLoader(ds, sampler=RandomSampler(ds, replacement=True)), "sampler"),
        (lambda ds: DataLoader(ds, sampler=RandomSampler(ds, num_samples=5)), "sampler"),
        (lambda ds: DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 4, False)), "batch_sampler"),
        (lambda ds: DataLoader(Stream()), "IterableDataset"),
    ],
    ids=["distributed", "subset", "replacement", "num_samples", "batch_sampler", "iterable"],
)
def test_a_dataloader_that_chooses_its_own_order_is_a_config_error(make: Any, setting: str) -> None:
    with pytest.raises(ConfigError, match=setting) as err:
        ElasticLoader.from_dataloader(make(Indices(39)), ElasticSampler(39, 6))
    assert "drop the sampler" in str(err.value) or "dataset_size=None" in str(err.value)


@pytest.mark.parametrize(
    ("dataset", "kwargs", "setting"),
    [
        (Stream(), {}, "dataset_size=None"),
        (Indices(40), {}, "dataset_size"),
        (Indices(39), {"timeout": 0}, "timeout"),
        (Indices(39), {"prefetch_factor": 2}, "prefetch_factor"),  # without workers
        (Indices(39), {"persistent_workers": True}, "persistent_workers"),  # without workers
        (Indices(39), {"num_workers": -1}, "num_workers"),
        (Indices(39), {"num_workers": 1, "multiprocessing_context": "bogus"}, "multiprocessing_context"),
    ],
)
def test_bad_settings_are_config_errors(dataset: Any, kwargs: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError, match=setting):
        ElasticLoader(dataset, ElasticSampler(39, 6), **kwargs)


def test_a_slow_worker_times_out_and_close_ends_the_loader() -> None:
    s = ElasticSampler(39, 6, seed=4)
    loader = ElasticLoader(Slow(39), s, timeout=0.2, num_workers=1, multiprocessing_context="fork")
    with pytest.raises(RuntimeError, match="timed out"):
        loader.fetch(Batch(1, 0, 0, [0], 1, 1, 0))
    loader.close()
    with pytest.raises(ValueError, match="closed"):
        loader.fetch(s.batch(1, 0, 0, 0, 1))


def test_a_dataset_error_in_a_worker_is_raised_as_itself() -> None:
    s = ElasticSampler(39, 6, seed=4)
    bad = Batch(1, 0, 0, [38, 39], 2, 1, 0)  # 39 is past the end
    with ElasticLoader(Indices(39), s, **WORKERS) as loader, pytest.raises(IndexError):
        loader.fetch(bad)
