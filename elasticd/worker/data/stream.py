"""The drop-in form's data order: one sample stream, handed out in blocks, used exactly once.

Owns the rules behind ``elasticd.DistributedSampler``. The stream is every epoch's seeded order
one after the other (epoch 0's permutation, then epoch 1's, ...); block ``b`` is its samples
``b * batch_size .. (b + 1) * batch_size - 1``, one micro-batch. ``Consumed`` (part of the synced
state) holds the blocks that applied steps used. In one generation each member hands out (to its
``DataLoader``) first the blocks it already held (prefetched or in a step that did not complete),
then its stride of the free blocks (``GenerationPlan.block``); a step uses each member's next
``accumulation_steps`` blocks, so every member computes the same ``Consumed`` after each step.
A member that leaves returns its blocks to the free pool; nothing a survivor prefetched is lost.

The number of steps in an epoch is fixed when the epoch starts (``plan_epoch``), from the samples
left up to the epoch's end and the world size: every member's loop runs the same steps per epoch,
whatever resizes happen in it. Where the world grows, the epoch's last steps take the first blocks
of the next epoch's order; where it shrinks, the samples left over open the next epoch; either way
each sample of each epoch's order is used once. Pure logic: no torch.distributed, no data loading.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Consumed:
    """The blocks of the stream that applied steps used: every block below ``frontier``, and
    ``above`` (sorted, each >= ``frontier``)."""

    frontier: int = 0
    above: tuple[int, ...] = ()

    @property
    def count(self) -> int:
        return self.frontier + len(self.above)

    def __contains__(self, block: int) -> bool:
        if block < self.frontier:
            return True
        i = bisect.bisect_left(self.above, block)
        return i < len(self.above) and self.above[i] == block

    def add(self, blocks: Iterable[int]) -> Consumed:
        """These blocks used too.

        Raises:
            ValueError: a block was used already (a sample would be used twice).
        """
        new = sorted(blocks)
        if not self.above and new == list(range(self.frontier, self.frontier + len(new))):
            return Consumed(self.frontier + len(new))  # the usual step: the next blocks in order
        if len(set(new)) != len(new) or any(b in self for b in new):
            raise ValueError(f"blocks used twice: {sorted(b for b in set(new) if b in self or new.count(b) > 1)}")
        merged = sorted((*self.above, *new))
        frontier, i = self.frontier, 0
        while i < len(merged) and merged[i] == frontier:
            frontier, i = frontier + 1, i + 1
        return Consumed(frontier, tuple(merged[i:]))


@dataclass(frozen=True)
class Pool:
    """The free blocks in ascending order: ``holes`` (below ``start``), then every block from ``start``."""

    holes: tuple[int, ...]
    start: int

    def __getitem__(self, i: int) -> int:
        return self.holes[i] if i < len(self.holes) else self.start + i - len(self.holes)


def free_pool(consumed: Consumed, held: Iterable[int]) -> Pool:
    """The blocks neither used nor held by a member."""
    taken = set(consumed.above) | set(held)
    start = max(taken, default=consumed.frontier - 1) + 1
    start = max(start, consumed.frontier)
    return Pool(tuple(b for b in range(consumed.frontier, start) if b not in taken), start)


@dataclass(frozen=True)
class GenerationPlan:
    """Which block each rank of one generation hands out next: its held blocks, then its stride
    of the free pool."""

    held: tuple[tuple[int, ...], ...]  # per rank, in the order its DataLoader yields them
    pool: Pool

    @property
    def world_size(self) -> int:
        return len(self.held)

    def block(self, rank: int, j: int) -> int:
        """The ``j``-th block rank ``rank`` hands out in this generation (from 0)."""
        held = self.held[rank]
        if j < len(held):
            return held[j]
        return self.pool[(j - len(held)) * self.world_size + rank]

    def step_blocks(self, taken: int, count: int) -> list[int]:
        """Every rank's blocks ``taken .. taken + count - 1``: what one step used, when each rank
        had used ``taken`` blocks in this generation before it."""
        return [self.block(r, j) for r in range(self.world_size) for j in range(taken, taken + count)]


def conflicts(consumed: Consumed, held: Sequence[Sequence[int]]) -> set[int]:
    """The ranks whose held blocks cannot be used: a block steps already used (the rank missed
    a generation whose steps used what it had prefetched), or a block a lower rank also holds
    (a generation it missed handed it out again). Those ranks leave; the others can plan."""
    out, owner = set(), {}
    for rank, blocks in enumerate(held):
        for b in blocks:
            if b in consumed or owner.setdefault(b, rank) != rank:
                out.add(rank)
    return out


def make_plan(consumed: Consumed, held: Sequence[Sequence[int]]) -> GenerationPlan:
    """The plan of a generation whose ranks hold ``held`` (rank order; a newcomer holds nothing).

    Raises:
        ValueError: two ranks hold one block, or a rank holds a used one (it missed a generation
            whose steps used what it had prefetched).
    """
    flat = [b for h in held for b in h]
    if len(set(flat)) != len(flat):
        raise ValueError("two members hold the same block")
    used = [b for b in flat if b in consumed]
    if used:
        raise ValueError(f"a member holds blocks that steps already used: {used[:5]}")
    return GenerationPlan(tuple(tuple(h) for h in held), free_pool(consumed, flat))


@dataclass(frozen=True)
class EpochPlan:
    """The steps of one epoch, fixed at its start: the step count it started after, and how many."""

    epoch: int = -1
    start_step: int = 0
    steps: int = 0

    def steps_left(self, step: int) -> int:
        return max(0, self.start_step + self.steps - step)


def plan_epoch(
    epoch: int, step: int, consumed: Consumed, dataset_size: int, block_size: int, per_step: int
) -> EpochPlan:
    """Epoch ``epoch`` starting after step ``step``: as many steps as the stream's unused samples
    up to the epoch's end fill (each step uses ``per_step`` blocks: world size x accumulation
    steps); a remainder opens the next epoch."""
    left = (epoch + 1) * dataset_size - consumed.count * block_size
    return EpochPlan(epoch, step, max(0, left // (per_step * block_size)))


@dataclass
class StreamOrder:
    """Sample indices of stream blocks: epoch ``e``'s order is a permutation seeded ``seed + e``
    (``shuffle``) or ``range(dataset_size)``; the last few epochs' orders are cached."""

    dataset_size: int
    block_size: int
    seed: int = 0
    shuffle: bool = True
    _orders: dict[int, list[int]] = field(default_factory=dict)

    def indices(self, block: int) -> list[int]:
        epoch, offset = divmod(block * self.block_size, self.dataset_size)
        out = self._order(epoch)[offset : offset + self.block_size]
        while len(out) < self.block_size:  # the block runs into the next epochs' orders
            epoch += 1
            out += self._order(epoch)[: self.block_size - len(out)]
        return out

    def epoch_of(self, block: int) -> int:
        return block * self.block_size // self.dataset_size

    def _order(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            import torch

            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                order = torch.randperm(self.dataset_size, generator=g).tolist()
            else:
                order = list(range(self.dataset_size))
            if len(self._orders) >= 3:
                self._orders.pop(min(self._orders))
            self._orders[epoch] = order
        return order
