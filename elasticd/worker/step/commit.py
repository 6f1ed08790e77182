"""The verdict on a step whose gradient all_reduce completed: a pure function of the tally alone.

Owns ``Vote`` (what each member puts in the vote slots of its last gradient bucket), ``Tally`` (the
slots summed by the all_reduce, so every member reads the same numbers) and ``commit_outcome``,
which turns a tally into a ``Verdict``. Imports nothing but the standard library: no torch, no
etcd, no clock, no lease. Every member that receives the sum computes the same verdict from the
same numbers, so a verdict is never one member's alone.

The gradient all_reduce is a two-phase commit's first phase and its decision in one operation:
each member's contribution is its vote, the sum is every vote, and every receiver decides alike.
APPLY does not commit: a member applies what the all_reduce delivered and holds the step as
pending; the step commits when the next collective of the same group completes (``journal``).
A member that never received the sum applies nothing and leaves the group, so the next collective
of that group can never complete, and the receivers' application stays pending until a sync
adopts it (its holder is rank 0 of the next generation) or discards it (a branch the job left).
See docs/design/commit-protocol.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

VOTE_SLOTS = 6  # the extra floats carried by the last gradient bucket (Vote.slots)


@dataclass(frozen=True)
class Vote:
    """One member's vote on the step it is about to send its last gradient bucket for."""

    weighted_loss: float  # its loss times its share of the global batch
    veto: bool  # it already knows this generation is abandoned (fenced, or its lease is gone)
    regroup: bool  # it asks the members to regroup after this step (newcomers wait, or it drains)
    nonfinite: bool = False  # its own gradients hold a NaN or an infinity (checked where no GradScaler is)
    # its loop ended at the step it holds: this is its goodbye, in the step's shape (no gradients)
    finished: bool = False

    def slots(self) -> list[float]:
        return [
            self.weighted_loss,
            float(self.veto),
            float(self.regroup),
            1.0,
            float(self.nonfinite),
            float(self.finished),
        ]


@dataclass(frozen=True)
class Tally:
    """The vote slots summed over the generation (identical on every member)."""

    loss: float
    vetoes: int
    regroups: int
    voters: int
    nonfinite: int = 0  # members whose own gradients were not finite
    finished: int = 0  # members whose contribution was their goodbye

    @classmethod
    def from_slots(cls, summed: Sequence[float]) -> Tally:
        if len(summed) != VOTE_SLOTS:
            raise ValueError(f"expected {VOTE_SLOTS} vote slots, got {len(summed)}")
        loss, vetoes, regroups, voters, nonfinite, finished = summed
        return cls(float(loss), round(vetoes), round(regroups), round(voters), round(nonfinite), round(finished))


class Outcome(StrEnum):
    # every receiver applies the step (optimizer.step(), counters) and holds it pending; a skipped
    # step (``Verdict.skip``) is applied with no update: the counters and the data move on
    APPLY = "apply"
    ABORT = "abort"  # nobody applies; every member leaves the generation and re-rendezvouses
    # nobody applies: a member's loop ended at the step every member holds (the job's last), and
    # its goodbye met the others' next step; the job is finished there, on every member
    FINISH = "finish"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str
    regroup: bool = False  # APPLY: re-rendezvous after this step
    skip: bool = False  # APPLY: the sum is not finite: every receiver applies no update (its gradients dropped)


def commit_outcome(tally: Tally, world_size: int) -> Verdict:
    """What every member that received the sum does with the step. Pure: the tally alone decides."""
    if tally.voters != world_size:
        return Verdict(Outcome.ABORT, f"{tally.voters} votes in a generation of {world_size}")
    if tally.finished:
        return Verdict(Outcome.FINISH, f"{tally.finished} member(s) ended the job at the step every member holds")
    if tally.vetoes:
        return Verdict(Outcome.ABORT, f"{tally.vetoes} member(s) vetoed: the generation is abandoned")
    if tally.nonfinite:
        return Verdict(
            Outcome.APPLY,
            f"{tally.nonfinite} member(s) had gradients that are not finite: the step is skipped",
            regroup=tally.regroups > 0,
            skip=True,
        )
    if tally.regroups:
        return Verdict(Outcome.APPLY, f"{tally.regroups} member(s) asked to regroup", regroup=True)
    return Verdict(Outcome.APPLY, "every member voted")
