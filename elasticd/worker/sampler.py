"""Elastic data order: one deterministic global order per epoch, split over whoever is present.

Owns the mapping from (epoch, global sample position, rank, world size) to sample indices. Progress
is the global position, which is part of the synced state; when the world size changes, the rest of
the epoch is split over the new members, so every sample of an epoch is used exactly once across any
number of membership changes. Pure logic: no torch.distributed, no etcd.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

from elasticd.errors import ConfigError


class BatchMode(StrEnum):
    """How the global batch reacts to a change of world size."""

    CONSTANT_GLOBAL = "constant_global"  # global batch fixed; each rank's share shrinks or grows
    LINEAR_SCALING = "linear_scaling"    # per-rank batch fixed; global batch and LR scale with world


@dataclass(frozen=True)
class Batch:
    """This rank's part of one global batch."""

    step: int           # the step this batch will commit as (counters.step + 1)
    epoch: int
    position: int       # global position of the batch's first sample within the epoch
    indices: list[int]  # this rank's sample indices
    global_size: int    # samples in the whole global batch
    world_size: int
    rank: int

    @property
    def weight(self) -> float:
        """This rank's share of the global batch (its gradient weight)."""
        return len(self.indices) / self.global_size


class ElasticSampler:
    """A seeded global order per epoch and the split of each global batch over the ranks."""

    def __init__(
        self,
        dataset_size: int,
        global_batch_size: int,
        seed: int = 0,
        mode: BatchMode = BatchMode.CONSTANT_GLOBAL,
        drop_last: bool = False,
    ) -> None:
        if dataset_size < 1:
            raise ConfigError(f"dataset_size: must be >= 1, got {dataset_size}")
        if global_batch_size < 1:
            raise ConfigError(f"global_batch_size: must be >= 1, got {global_batch_size}")
        if drop_last and global_batch_size > dataset_size:
            raise ConfigError("global_batch_size: larger than the dataset with drop_last")
        self.dataset_size = dataset_size
        self.global_batch_size = global_batch_size
        self.seed = seed
        try:
            self.mode = BatchMode(mode)
        except ValueError as exc:
            raise ConfigError(f"batch_mode: must be one of {[m.value for m in BatchMode]}, got {mode!r}") from exc
        self.drop_last = drop_last
        self._cache: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        """The global order of epoch ``epoch`` (the same on every rank)."""
        if self._cache is None or self._cache[0] != epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._cache = (epoch, torch.randperm(self.dataset_size, generator=gen).tolist())
        return self._cache[1]

    def global_size(self, world_size: int) -> int:
        """Samples per global batch at this world size."""
        if self.mode is BatchMode.LINEAR_SCALING:
            return self.global_batch_size * world_size
        return self.global_batch_size

    def normalize(self, epoch: int, position: int, world_size: int) -> tuple[int, int]:
        """Move to the next epoch when the rest of this one is empty (or dropped)."""
        size = self.global_size(world_size)
        if position >= self.dataset_size or (self.drop_last and position + size > self.dataset_size):
            return epoch + 1, 0
        return epoch, position

    def batch(self, step: int, epoch: int, position: int, rank: int, world_size: int) -> Batch:
        """This rank's share of the global batch that starts at ``position`` of ``epoch``.

        The batch is split into ``world_size`` contiguous shares whose sizes differ by at most one.
        """
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        epoch, position = self.normalize(epoch, position, world_size)
        take = min(self.global_size(world_size), self.dataset_size - position)
        lo = position + rank * take // world_size
        hi = position + (rank + 1) * take // world_size
        order = self.order(epoch)
        return Batch(step, epoch, position, order[lo:hi], take, world_size, rank)

    @staticmethod
    def after(batch: Batch) -> tuple[int, int]:
        """(epoch, position) once ``batch`` is committed."""
        return batch.epoch, batch.position + batch.global_size
