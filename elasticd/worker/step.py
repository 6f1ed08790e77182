"""One member's side of a step: micro-batches, the gradient all_reduce with the vote, the verdict.

Owns ``StepResult`` (a committed step, as every member committed it) and ``StepProtocol``: a step opens with this rank's whole share of the global batch; each
micro-batch's backward accumulates into the reducer's buckets (weighted by its part of the share);
the last one runs the bucketed all_reduce whose last bucket carries this member's ``commit.Vote``
(and, for a step rolled forward, puts the kept sum in place of the gradients: ``rollforward``);
``decide`` turns the summed vote and this member's fence into a ``commit.Verdict`` and bounds how
long a step may be deferred; a member that refuses a step alone keeps its sum. Never applies a step
(the trainer does: optimizers, counters, records) and never re-rendezvouses.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace

import structlog
import torch

from elasticd.config import Timeouts, WorkerEnv
from elasticd.errors import CollectiveError
from elasticd.rendezvous.member import Standing
from elasticd.rendezvous.membership import Membership
from elasticd.retry import Clock, Deadline
from elasticd.worker.collectives import GradientReducer
from elasticd.worker.commit import Fence, Outcome, Tally, Verdict, Vote, commit_outcome
from elasticd.worker.process_group import Group
from elasticd.worker.rollforward import KeptSum, Roll, RollForward
from elasticd.worker.sampler import Batch

log = structlog.get_logger(__name__)

MISSED_SUM_WAIT_S = 0.3  # Injected.miss_sum_at: how long the member waits before it fails the step


@dataclass(frozen=True)
class StepResult:
    """A committed step, as every member of the generation committed it."""

    step: int
    loss: float          # the global-batch mean loss
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
    voted: list[Vote] = field(default_factory=list)  # this member's vote, once sent (for the logs)
    tally: Tally | None = None  # the summed vote, once the all_reduce completed
    fence: Fence | None = None  # what this member knew locally when the sum arrived
    summed_at: float = 0.0  # ... and when (monotonic)
    standing: Standing | None = None  # this member's standing then (a later granted renewal confirms the lease)
    verdict: Verdict | None = None  # the commit rule's, once the sum arrived
    roll: Roll | None = None  # the step applies a kept sum (its gradients were replaced)


@dataclass
class Injected:
    """Fault injection, each at one step, once (``WorkerEnv``: ``stop_after_sum``, ``miss_sum_at``,
    ``kill_after_apply``; 0: never)."""

    stop_after_sum: int = 0  # SIGSTOP itself between the sum and the fence
    miss_sum_at: int = 0  # drop the sum that arrived and fail the step (its last hop broke here alone)
    kill_after_apply: int = 0  # SIGKILL itself as it begins the step after this one (applied, unconfirmed)

    @classmethod
    def of(cls, env: WorkerEnv) -> Injected:
        return cls(env.stop_after_sum, env.miss_sum_at, env.kill_after_apply)


class StepProtocol:
    """The per-step collective protocol of one member."""

    def __init__(self, reducer: GradientReducer, membership: Membership, drain: threading.Event,
                 timeouts: Timeouts, clock: Clock, injected: Injected | None = None) -> None:
        self._reducer, self._membership, self._drain = reducer, membership, drain
        self._timeouts, self._clock = timeouts, clock
        self._deferred_since: float | None = None  # monotonic: the step is being deferred since then
        self._injected = injected if injected is not None else Injected()
        self.rolls = RollForward()

    def backward(self, group: Group, op: OpenStep, micro: Batch, loss: torch.Tensor) -> bool:
        """This micro-batch's backward; at the last one, the all_reduce and the verdict
        (``op.verdict``). True once the averaged gradients are in ``.grad`` and ``op.tally`` holds
        the summed vote (then ``op.verdict`` says whether this member applies the step).

        Raises:
            CollectiveError: the all_reduce failed, timed out or its generation was abandoned
                (the reducer forgot the step).
        """
        whole, last, inj = op.batch, micro.micro == micro.micro_count - 1, self._injected
        if micro.micro == 0:
            if inj.kill_after_apply and whole.step == inj.kill_after_apply + 1:
                os.kill(os.getpid(), signal.SIGKILL)  # fault injection: applied, not yet confirmed
            # a closure over these, never over the trainer (a closure holding the trainer kept
            # retired groups alive until a garbage collection: fds grew by one per generation)
            membership, draining, wl, vd, voted = (self._membership, self._drain, op.weighted_loss, op.voted_drain,
                                                   op.voted)

            def vote() -> list[float]:  # called right before the last bucket goes out
                veto, stale, reached = membership.vote()
                vd[0] = draining.is_set()  # only a drain the others were told of may end here
                regroup = membership.join_pending() or vd[0]
                voted[:] = [Vote(wl[0], veto, regroup, stale, reached)]
                return voted[0].slots()

            # begin() zeroes the gradients: they are views into its buckets
            self._reducer.begin(group, whole.weight, vote, sync=micro.micro_count == 1)
        elif last:
            self._reducer.sync_next()
        if micro.indices:
            op.weighted_loss[0] += float(loss.detach()) * micro.weight
            share = len(micro.indices) / len(whole.indices)  # the reducer weighs the whole share
            (loss * share if share != 1.0 else loss).backward()  # type: ignore[no-untyped-call]
        if not last:
            return False
        self._membership.reach.began(group.generation)  # a long wait is checked on (rendezvous.reach)
        began = self._clock()
        try:
            summed = self._reducer.finish(Deadline.after(self._timeouts.td("collective")),
                                          self._membership.must_abandon, self._timeouts.abort_poll_s)
        except CollectiveError:
            self._reducer.cancel()
            raise
        finally:
            self._membership.reach.ended()
        if whole.step == inj.miss_sum_at:  # fault injection: this member's last hop broke, once
            inj.miss_sum_at = 0
            self._reducer.cancel()
            time.sleep(MISSED_SUM_WAIT_S)  # it waits for a sum that does not come; its peers go on
            raise CollectiveError(f"the sum of step {whole.step} dropped here (fault injection: miss_sum_at)")
        if whole.step == inj.stop_after_sum:  # fault injection: a stop between the sum and the fence, once
            inj.stop_after_sum = 0
            os.kill(os.getpid(), signal.SIGSTOP)
        op.tally = Tally.from_slots(summed)
        st = self._membership.standing()  # the fence as of the sum, not of commit() (user code runs between)
        op.summed_at, op.standing = self._clock(), st
        t = self._timeouts
        op.fence = Fence(fenced=st.fenced, lease_lost=st.lease_lost, renewed_at=st.renewed_at,
                         lease_ttl_s=st.lease_ttl_s, continued=st.continued, waited_s=op.summed_at - began,
                         reach_s=t.reach_check_min_s if t.reach_check_s > 0 else math.inf)
        op.roll = self.rolls.rolling(whole.step)
        if op.roll is not None:
            try:
                self._reducer.replace_sums(group, self.rolls.source_sums(group.rank), op.roll.source,
                                           Deadline.after(self._timeouts.td("collective")),
                                           self._membership.must_abandon, self._timeouts.abort_poll_s)
            except CollectiveError:
                self._reducer.cancel()
                raise
            # every member now holds the sum: should the rolled step fail, the next sync rolls it again
            self._keep_sum(group, whole, op.roll)
            # the broadcast is a wait for the sum too (it can complete late as well): count it in
            op.summed_at = self._clock()
            op.fence = replace(op.fence, waited_s=op.summed_at - began)
        op.verdict = self.decide(group, op)
        if op.verdict.outcome is Outcome.ABORT and not op.verdict.unanimous:
            # Refused here alone: the others may apply it. Keep the sum (rollforward).
            self._keep_sum(group, whole, op.roll)
            log.warning("step_sum_kept", generation=group.generation, rank=group.rank, step=whole.step,
                        reason=op.verdict.reason)
        return True

    def _keep_sum(self, group: Group, whole: Batch, roll: Roll | None) -> None:
        """Keep this step's gradient sum, on this generation's state (once per step: a rolled step
        refused here is kept already)."""
        kept = self.rolls.kept
        if kept is not None and kept.step == whole.step and kept.base_lineage == group.generation:
            return
        self.rolls.keep(KeptSum(whole.step, group.generation, roll.generation if roll else group.generation,
                                whole.global_size, roll.world_size if roll else group.world_size,
                                self._reducer.kept_sums()))

    def decide(self, group: Group, op: OpenStep) -> Verdict:
        """The commit rule's verdict on ``op`` for this member. A RETRY deferred for over twice the
        lease TTL (a lease that neither renews nor expires) becomes an ABORT."""
        assert op.tally is not None and op.fence is not None, "decide() after backward() returned True"
        now = op.summed_at
        verdict = commit_outcome(op.tally, group.world_size, op.fence, now)
        if verdict.check_generation:  # one view read from etcd itself, within lease_confirm_s
            current = self._membership.confirm_generation()
            st = self._membership.standing()
            log.info("generation_checked", generation=group.generation, rank=group.rank, step=op.batch.step,
                     current=current, after=verdict.reason)
            op.fence = replace(op.fence, current=current, fenced=op.fence.fenced or st.fenced,
                               lease_lost=op.fence.lease_lost or st.lease_lost)
            if current or st.fenced or st.lease_lost:  # else etcd did not answer: the refusal stands
                verdict = commit_outcome(op.tally, group.world_size, op.fence, now)
        if verdict.confirmable and op.standing is not None and self._membership.confirm_lease(op.standing):
            log.info("lease_confirmed", generation=group.generation, rank=group.rank, after=verdict.reason)
            st = self._membership.standing()  # what the watcher learned meanwhile (after a stop: the backlog)
            op.fence = replace(op.fence, confirmed=True, fenced=op.fence.fenced or st.fenced,
                               lease_lost=op.fence.lease_lost or st.lease_lost)
            verdict = commit_outcome(op.tally, group.world_size, op.fence, now)
        if verdict.outcome is not Outcome.RETRY:
            self._deferred_since = None
            return verdict
        # Every member renews now: a renewal that etcd holds (a leader election) soon makes this
        # member's vote "not answered" (Reachability), which ends the retry; a granted one ends it too.
        self._membership.renew_soon()
        if self._deferred_since is None:  # logged once, at its first RETRY
            self._deferred_since = now
            mine = op.voted[0] if op.voted else None
            log.info("step_deferred", generation=group.generation, rank=group.rank, step=op.batch.step,
                     reason=verdict.reason, my_lease_stale=mine.stale if mine else None,
                     etcd_answered_me=mine.reached_etcd if mine else None)
            return verdict
        if now - self._deferred_since > 2 * self._timeouts.lease_ttl_s:
            self._deferred_since = None
            return Verdict(Outcome.ABORT, f"deferred for over 2 x lease_ttl_s: {verdict.reason}")
        return verdict

    def forget(self) -> None:
        """The step failed or the group changed: a new deferral starts afresh."""
        self._deferred_since = None
