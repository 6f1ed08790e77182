"""Elastic data order: one deterministic global order per epoch, split over whoever is present.

Owns the mapping from (epoch, global sample position, rank, world size) to sample indices. Progress
is the global position, which is part of the synced state; when the world size changes, the rest of
the epoch is split over the new members, so every sample of an epoch is used exactly once across any
number of membership changes. Pure logic: no torch.distributed, no etcd, no data loading (that is
``loader.py``).

Two sources: a dataset of ``dataset_size`` samples, read in a seeded permutation per epoch (built
once per epoch and cached), or, with ``dataset_size=None``, an endless stream of generated samples:
no epochs (the epoch stays 0), no permutation, and ``Batch.indices`` are the global sample numbers
``position + lo .. position + hi`` of this rank's share, so a program can generate sample ``i``
deterministically (say from ``seed + i``). Each global batch is split into contiguous shares in rank
order, so both sources use every sample exactly once across any number of resizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

import torch

from elasticd.errors import ConfigError


class BatchMode(StrEnum):
    """How the global batch reacts to a change of world size."""

    CONSTANT_GLOBAL = "constant_global"  # global batch fixed; each rank's share shrinks or grows
    LINEAR_SCALING = "linear_scaling"  # per-rank batch fixed; global batch and LR scale with world


@dataclass(frozen=True)
class Batch:
    """This rank's part of one global batch."""

    step: int  # the step this batch will commit as (counters.step + 1)
    epoch: int
    position: int  # global position of the batch's first sample within the epoch
    indices: list[int]  # this rank's sample indices (global sample numbers for an endless stream)
    global_size: int  # samples in the whole global batch
    world_size: int
    rank: int
    micro: int = 0  # which micro-batch of this rank's share (``split_micro``), from 0
    micro_count: int = 1  # micro-batches the share is split into (1: the whole share)
    blocks: tuple[int, ...] = ()  # the drop-in form: the whole step's stream blocks, rank after rank (``data.stream``)

    @property
    def weight(self) -> float:
        """This (micro-)batch's part of the global batch (its gradient weight)."""
        return len(self.indices) / self.global_size


def split_micro(batch: Batch, count: int) -> list[Batch]:
    """``batch`` (a rank's whole share) as ``count`` micro-batches for gradient accumulation.

    The indices are split into ``count`` contiguous parts whose sizes differ by at most one (some
    are empty when the share has fewer samples than ``count``); each part keeps the step, position,
    global size, rank and world of the share, so their weights add up to the share's.

    Raises:
        ValueError: ``count`` < 1, or ``batch`` is already a micro-batch.
    """
    if count < 1:
        raise ValueError(f"micro-batches per step: must be >= 1, got {count}")
    if batch.micro_count != 1:
        raise ValueError(f"batch is already micro-batch {batch.micro} of {batch.micro_count}")
    if count == 1:
        return [batch]
    n = len(batch.indices)
    return [
        replace(batch, indices=batch.indices[k * n // count : (k + 1) * n // count], micro=k, micro_count=count)
        for k in range(count)
    ]


# Epoch orders kept at once: the current epoch and the next, so a prefetch that looks past the end of
# the epoch (loader.py) and the trainer's current batch do not rebuild each other's permutation.
_CACHED_EPOCHS = 2


class ElasticSampler:
    """A seeded global order per epoch (or an endless stream) and the split of each global batch.

    Args:
        dataset_size: samples in the dataset, or None for an endless stream of generated samples.
        global_batch_size: samples per global batch (per rank with ``LINEAR_SCALING``).
        seed: the seed of every epoch's permutation.
        mode: how the global batch reacts to a change of world size.
        drop_last: skip an epoch's short last batch (not with an endless stream: it has none).

    Raises:
        ConfigError: a setting is out of range; the message names it.
    """

    def __init__(
        self,
        dataset_size: int | None,
        global_batch_size: int,
        seed: int = 0,
        mode: BatchMode = BatchMode.CONSTANT_GLOBAL,
        drop_last: bool = False,
    ) -> None:
        if dataset_size is not None and dataset_size < 1:
            raise ConfigError(f"dataset_size: must be >= 1 (or None for an endless stream), got {dataset_size}")
        if global_batch_size < 1:
            raise ConfigError(f"global_batch_size: must be >= 1, got {global_batch_size}")
        if drop_last and dataset_size is None:
            raise ConfigError("drop_last: an endless stream (dataset_size=None) has no short last batch to drop")
        if drop_last and dataset_size is not None and global_batch_size > dataset_size:
            raise ConfigError("global_batch_size: larger than the dataset with drop_last")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        try:
            self.mode = BatchMode(mode)
        except ValueError as exc:
            raise ConfigError(f"batch_mode: must be one of {[m.value for m in BatchMode]}, got {mode!r}") from exc
        self.drop_last = drop_last
        self._orders: dict[int, list[int]] = {}  # epoch -> its order; at most _CACHED_EPOCHS, oldest first
        self.permutations_built = 0  # how often a full epoch order was built (once per epoch)

    @property
    def endless(self) -> bool:
        """True for an endless stream of generated samples (``dataset_size=None``)."""
        return self.dataset_size is None

    def order(self, epoch: int) -> list[int]:
        """The global order of epoch ``epoch`` (the same on every rank).

        Raises:
            ValueError: the sampler is an endless stream, which has no epochs to order.
        """
        if self.dataset_size is None:
            raise ValueError("an endless stream (dataset_size=None) has no epoch order: its samples are 0, 1, 2, ...")
        cached = self._orders.get(epoch)
        if cached is None:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            cached = torch.randperm(self.dataset_size, generator=gen).tolist()
            self.permutations_built += 1
            if len(self._orders) >= _CACHED_EPOCHS:
                del self._orders[next(iter(self._orders))]
            self._orders[epoch] = cached
        return cached

    def global_size(self, world_size: int) -> int:
        """Samples per global batch at this world size."""
        if self.mode is BatchMode.LINEAR_SCALING:
            return self.global_batch_size * world_size
        return self.global_batch_size

    def normalize(self, epoch: int, position: int, world_size: int) -> tuple[int, int]:
        """Move to the next epoch when the rest of this one is empty (or dropped); an endless stream never does."""
        if self.dataset_size is None:
            return epoch, position
        size = self.global_size(world_size)
        if position >= self.dataset_size or (self.drop_last and position + size > self.dataset_size):
            return epoch + 1, 0
        return epoch, position

    def batch(self, step: int, epoch: int, position: int, rank: int, world_size: int, size: int | None = None) -> Batch:
        """This rank's share of the global batch that starts at ``position`` of ``epoch``.

        The batch is split into ``world_size`` contiguous shares whose sizes differ by at most one.
        An endless stream's shares are the global sample numbers themselves. ``size``: the global
        batch to split (the one a step's first micro-batch took); None: this world size's.

        Raises:
            ValueError: ``rank`` is not in a world of ``world_size``.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        epoch, position = self.normalize(epoch, position, world_size)
        size = self.global_size(world_size) if size is None else size
        take = size if self.dataset_size is None else min(size, self.dataset_size - position)
        lo = position + rank * take // world_size
        hi = position + (rank + 1) * take // world_size
        indices = list(range(lo, hi)) if self.dataset_size is None else self.order(epoch)[lo:hi]
        return Batch(step, epoch, position, indices, take, world_size, rank)

    @staticmethod
    def after(batch: Batch) -> tuple[int, int]:
        """(epoch, position) once ``batch`` is committed."""
        return batch.epoch, batch.position + batch.global_size

    def next_batch(self, batch: Batch) -> Batch:
        """The batch that follows ``batch`` if nothing changes (same rank, world and micro-batching).

        What a prefetcher should fetch next: the next micro-batch of the same share, or, after the
        last, the next step's (first micro-)batch, whose position advances by the global batch and
        rolls over into the next epoch the way the trainer does after a commit.
        """
        if batch.micro + 1 < batch.micro_count:  # the same global batch
            share = self.batch(batch.step, batch.epoch, batch.position, batch.rank, batch.world_size, batch.global_size)
            return split_micro(share, batch.micro_count)[batch.micro + 1]
        epoch, position = self.normalize(*self.after(batch), batch.world_size)
        share = self.batch(batch.step + 1, epoch, position, batch.rank, batch.world_size)
        return split_micro(share, batch.micro_count)[0]
