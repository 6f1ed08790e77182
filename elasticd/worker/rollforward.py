"""Rolling a refused step forward at the regroup, so that a step is never done twice.

Owns ``KeptSum`` (the gradient sum of a step that this member refused alone, while the sum said
every member commits), its probe slots, ``roll_forward`` (pure: which kept sum, if any, the
next generation applies, and which rank sends it) and ``RollForward`` (one member's kept sum and
the roll it was told of). Never decides whether a step is committed (``commit`` does), never moves
bytes itself (``collectives.GradientReducer.replace_sums`` does) and never applies a step (the
trainer does).

Why. Some refusals stay local (``commit.commit_outcome``, ``unanimous=False``): a member that
learns after the sum that its generation was fenced, or that its lease is gone, does not apply the
step while its peers, which have not learned it, do. It is then behind. If every peer that applied
the step is lost before the regroup, the survivors hold the step before it, and they used to do
the step again: a step committed in two generations. Now a member that refuses alone keeps the
sum. At the regroup the sync's probe says, for every rank, its (step, lineage) and its kept sum's
(step, base lineage, generation, global batch); when the newest state is the one a kept sum was
computed on, the new generation's next step is that step, on that step's global batch, and its
gradient sum is the kept one, sent by the lowest rank that kept it. Every member runs the
script's own code around it (clipping, unscaling, the scheduler, an EMA), as its peers did when
they applied it, and the audit records the commit under the generation whose sum it applies
(``sum_generation``). Nothing else is lost: the members of the new generation compute the step's
forward and backward once more (the same samples; only the sum is replaced) and, when the step is
not rolled, nothing is kept past the sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

KEPT_SLOTS = 5  # per rank in the sync's probe: step, base lineage, generation, global size, world size


@dataclass(frozen=True)
class Roll:
    """The step that a generation applies from a kept sum."""

    step: int
    generation: int    # the generation whose all_reduce summed it
    global_size: int   # its global batch (samples), from (epoch, position) of the state before it
    world_size: int    # that generation's size (the linear_scaling factor of the step)
    source: int        # the rank (of the new generation) whose kept sum every member applies


@dataclass
class KeptSum:
    """A step this member refused alone, with the sum its peers may have applied."""

    step: int
    base_lineage: int  # the lineage of the state the step was computed on (the generation it synced in)
    generation: int    # the generation whose all_reduce summed it (of the roll it was, if it was one)
    global_size: int
    world_size: int
    sums: list[torch.Tensor]  # every gradient bucket's sum (``GradientReducer.kept_sums``)

    def slots(self) -> list[int]:
        return [self.step, self.base_lineage, self.generation, self.global_size, self.world_size]


def roll_forward(steps: Sequence[int], lineages: Sequence[int], kept: Sequence[Sequence[int] | None]) -> Roll | None:
    """The roll, if any, after a sync in which every rank ends with rank 0's (step, lineage). Pure.

    Args:
        steps, lineages: each rank's state before the sync (rank 0's is every rank's after it).
        kept: each rank's kept sum as ``KeptSum.slots()``, or None.

    A kept sum applies when it was computed on rank 0's state: its step is the next one and its
    base lineage is rank 0's. Of several, the newest generation's (a step refused again while it
    was being rolled keeps its first generation), then the lowest rank.
    """
    if not steps or lineages[0] < 0:
        return None  # rank 0 holds no state (a checkpoint resume, or a new job)
    fits = [(k[2], -r, r, k) for r, k in enumerate(kept)
            if k is not None and k[0] == steps[0] + 1 and k[1] == lineages[0]]
    if not fits:
        return None
    _, _, rank, k = max(fits)
    return Roll(step=k[0], generation=k[2], global_size=k[3], world_size=k[4], source=rank)


class RollForward:
    """One member's kept sum, and the roll its last sync decided."""

    def __init__(self) -> None:
        self.kept: KeptSum | None = None
        self.roll: Roll | None = None

    def keep(self, kept: KeptSum) -> None:
        """Keep ``kept`` (a refused step's sum; or, on a rolled step, the sum every member got)."""
        self.kept = kept

    def slots(self) -> list[int] | None:
        return self.kept.slots() if self.kept is not None else None

    def synced(self, roll: Roll | None, generation: int) -> None:
        """After a sync in ``generation``: arm ``roll``. A kept sum that it does not use can never
        apply again (the state moved past it, or is of another lineage), so it is dropped; one it
        uses now sits on this generation's state (every member holds the state it was computed on),
        so a rolled step that fails is rolled again at the next sync, not done again."""
        self.roll = roll
        if roll is None:
            self.kept = None
        elif self.kept is not None:
            self.kept.base_lineage = generation

    def rolling(self, step: int) -> Roll | None:
        """The roll if ``step`` is the step it applies."""
        return self.roll if self.roll is not None and self.roll.step == step else None

    def source_sums(self, rank: int) -> list[torch.Tensor] | None:
        """The sums this rank sends for the armed roll (None: it receives them)."""
        if self.roll is None or self.roll.source != rank:
            return None
        assert self.kept is not None, "the roll's source kept no sum"
        return self.kept.sums

    def committed(self, step: int) -> None:
        """``step`` was applied here: a kept sum of it (or before it) is spent."""
        if self.kept is not None and self.kept.step <= step:
            self.kept = None
        if self.roll is not None and self.roll.step <= step:
            self.roll = None
