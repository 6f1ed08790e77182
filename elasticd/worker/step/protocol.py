"""One member's side of a step: micro-batches, the gradient all_reduce with the vote, the verdict.

Owns ``StepResult`` (a step this member applied) and ``StepProtocol``: a step opens with this
rank's whole share of the global batch; each micro-batch's backward accumulates into the reducer's
buckets (weighted by its part of the share); the last one runs the bucketed all_reduce whose last
bucket carries this member's ``commit.Vote``; the summed vote is the ``commit.Tally``, and the
verdict is ``commit.commit_outcome`` of the tally alone. No clock, lease or etcd read enters the
verdict. Never applies a step (the trainer does: optimizers, counters, records) and never
re-rendezvouses.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from elasticd.config import Timeouts
from elasticd.errors import CollectiveError, ConfigError
from elasticd.rendezvous.membership import Membership
from elasticd.retry import Bound
from elasticd.worker.step.reducer import GradientReducer
from elasticd.worker.step.commit import VOTE_SLOTS, Tally, Verdict, Vote, commit_outcome
from elasticd.worker.group.process_group import Group
from elasticd.worker.data.sampler import Batch


class Replica(Protocol):
    """Sharded training: this rank's replica (``shard.replica.Replica``): its ranks' count, and
    the sum over them of each rank's values."""

    size: int

    def agree(self, values: Sequence[float], what: str) -> list[float]: ...


@dataclass(frozen=True)
class StepResult:
    """A step this member applied (a commit once confirmed: ``Journal.confirm``)."""

    step: int
    loss: float  # the global-batch mean loss
    generation: int
    world_size: int
    duration_s: float


@dataclass
class OpenStep:
    """The step this member is taking: its whole share, and what its micro-batches gave so far."""

    batch: Batch
    started: float
    weighted_loss: list[float] = field(default_factory=lambda: [0.0])  # read by the vote closure
    voted_drain: list[bool] = field(default_factory=lambda: [False])  # its vote asked to regroup for a drain
    tally: Tally | None = None  # the summed vote, once the all_reduce completed
    verdict: Verdict | None = None  # the tally's, once the sum arrived


class StepProtocol:
    """The per-step collective protocol of one member."""

    def __init__(
        self,
        reducer: GradientReducer,
        membership: Membership,
        drain: threading.Event,
        timeouts: Timeouts,
        replica: Replica | None = None,
    ) -> None:
        """``replica``: sharded training (``reducer`` is a ``shard.reducer.ShardReducer``, which
        sums gradient shards): the replica whose ranks' sums ``agree`` adds into one tally."""
        self._reducer, self._membership, self._drain = reducer, membership, drain
        self._timeouts, self._replica = timeouts, replica
        self._loss_checked = False  # the first accumulated loss was checked for a division by the count

    def backward(
        self, group: Group, op: OpenStep, micro: Batch, loss: torch.Tensor, shards: Group | None = None
    ) -> bool:
        """This micro-batch's backward; at the last one, the all_reduce and the verdict
        (``op.verdict``). True once the averaged gradients are in ``.grad`` and ``op.tally`` holds
        the summed vote. ``shards``: sharded training: the shard group of ``group`` the gradients
        are summed over (the verdict is the whole generation's).

        Raises:
            CollectiveError: the all_reduce failed, timed out or its generation was abandoned
                (the reducer forgot the step).
        """
        whole, last = op.batch, micro.micro == micro.micro_count - 1
        if micro.micro_count > 1 and not self._loss_checked:  # a script divides every loss alike: once
            self._loss_checked = True
            if constant_divisor(loss) == micro.micro_count:
                raise ConfigError(
                    f"ElasticTrainer.backward(loss): the loss is divided by {micro.micro_count}, the "
                    f"accumulation_steps; pass each micro-batch's own mean loss (elasticd weighs the "
                    f"micro-batches of a step itself, so a divided loss would scale the gradient down)"
                )
        if micro.micro == 0:
            # a closure over these, never over the trainer (a closure holding the trainer kept
            # retired groups alive until a garbage collection: fds grew by one per generation)
            membership, draining, wl, vd = self._membership, self._drain, op.weighted_loss, op.voted_drain
            reducer = self._reducer

            def vote() -> list[float]:  # called right before the last bucket goes out
                vd[0] = draining.is_set()  # only a drain the others were told of may end here
                regroup = membership.join_pending() or vd[0]
                return Vote(wl[0], membership.veto(), regroup, reducer.local_nonfinite()).slots()

            # begin() zeroes the gradients: they are views into its buckets
            self._reducer.begin(shards or group, whole.step, whole.weight, vote, sync=micro.micro_count == 1)
        elif last:
            self._reducer.sync_next()
        if not micro.indices and self._replica is not None:
            raise ConfigError(
                f"global_batch_size: step {whole.step} leaves rank {whole.rank} of {whole.world_size} no sample; "
                f"a sharded model's ranks each run every backward (FSDP2's collectives): give every rank "
                f"a share (a global batch of at least the largest world size, per micro-batch)"
            )
        if micro.indices:
            op.weighted_loss[0] += float(loss.detach()) * micro.weight
            # the reducer weighs the whole share (a sharded one: through the loss)
            share = len(micro.indices) / len(whole.indices) * self._reducer.loss_scale(whole.weight)
            (loss * share if share != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
        if not last:
            return False
        t = self._timeouts
        self._membership.reach.began(group.generation)  # a long wait is checked on (rendezvous.reach)
        try:
            summed = self._reducer.finish(
                Bound.after(t.collective_s, poll_s=t.abort_poll_s, abandon=self._membership.must_abandon)
            )
        except CollectiveError:
            self._reducer.cancel()
            if self._replica is not None:  # the replica's other ranks learn this one has no sum
                self._replica.agree([0.0] * (1 + VOTE_SLOTS), "the step's sums")
            raise
        finally:
            self._membership.reach.ended()
        if self._replica is not None:
            summed = self._whole_replica(summed, group.generation, whole.step)
        op.tally = Tally.from_slots(summed)
        op.verdict = commit_outcome(op.tally, group.world_size)
        return True

    def _whole_replica(self, summed: list[float], generation: int, step: int) -> list[float]:
        """The tally of the whole generation: this shard group's summed slots added to the other
        shard groups' (``Replica.agree``), the same on every replica that received every sum. A
        replica where a shard's sum did not arrive applies nothing.

        Raises:
            CollectiveError: a rank of this replica did not receive its shard's sum.
            ReplicaBroken: the replica's ranks could not combine their sums.
        """
        assert self._replica is not None
        got = self._replica.agree([1.0, *summed], "the step's sums")
        if round(got[0]) < self._replica.size:
            self._reducer.cancel()
            raise CollectiveError(
                f"step {step}: a shard's sum of generation {generation} did not arrive at every rank of this replica"
            )
        return got[1:]


def constant_divisor(loss: torch.Tensor) -> float | None:
    """The constant ``loss`` was divided by as its last operation (``x / c``, or ``x * (1 / c)``),
    or None: how a loss divided by the accumulation steps, as DDP scripts do, is recognized."""
    fn = loss.grad_fn
    other = getattr(fn, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.numel() != 1 or other.requires_grad:
        return None
    value = float(other)
    name = type(fn).__name__
    if name.startswith("DivBackward"):
        return value
    if name.startswith("MulBackward") and value != 0.0:
        return round(1.0 / value, 9)
    return None
