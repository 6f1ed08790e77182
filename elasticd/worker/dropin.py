"""The drop-in form: a torchrun + DDP script keeps its own loops; three objects are swapped.

Owns ``DistributedDataParallel`` (in place of torch's DDP wrapper and ``init_process_group``),
``DistributedSampler`` (in place of torch's) and the session behind them, ``_Session``: an
``ElasticTrainer`` driven from the script's own calls instead of its own loop.

- ``forward`` of a step's first micro-batch arms the gradient reducer (``GradientReducer``, which
  keeps this rank's own gradients); the backward of its ``accumulation_steps``-th micro-batch ends
  with the bucketed all_reduce carrying the vote, waited for in an autograd callback, like DDP.
  So ``loss.backward()`` returns with the averaged gradients in ``.grad`` for the script's clipping.
- Where that all_reduce fails or its verdict is ABORT, the same callback regroups (rendezvous, the
  new group, rank 0's state to newcomers) and sums this rank's kept gradients again in the new
  group: ``backward()`` returns only once the step's sum arrived, in some generation. Each
  ``optimizer.step()`` therefore applies exactly one step on every member, and the script's
  post-step code (its scheduler, EMA, counters) runs once per step, as under torchrun.
- ``optimizer.step()`` (a post-step hook) records the step as applied: counters, the blocks of the
  sample stream the step used (``data.stream``), the journal (the step commits when the next
  collective of the group completes), the durable checkpoint's schedule. A regroup the vote asked
  for (a newcomer, a drain) happens at the next batch: a step boundary.
- A member whose state the regroup replaced while its script was mid-step (it missed steps the
  others committed) raises ``MemberReplaced``; its agent starts it again as a newcomer.
- ``close()`` says goodbye in the step's shape (``_Session._goodbye``): a newcomer whose own loop
  opens a step after the job's last one meets it, reads the verdict FINISH and exits 0.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import structlog
import torch
import torch.distributed as dist

from elasticd.config import CheckpointConfig, WorkerEnv
from elasticd.errors import EXIT_REJOIN, CollectiveError, ConfigError, MemberReplaced
from elasticd.retry import Bound
from elasticd.store.kv import KeyValueStore
from elasticd.worker.data.sampler import Batch
from elasticd.worker.data.stream import (
    Consumed,
    EpochPlan,
    GenerationPlan,
    StreamOrder,
    conflicts,
    make_plan,
    plan_epoch,
)
from elasticd.worker.group.collectives import all_reduce
from elasticd.worker.group.process_group import Group
from elasticd.worker.step.commit import Outcome, Tally, Vote, Verdict, commit_outcome
from elasticd.worker.step.protocol import StepResult
from elasticd.worker.step.reducer import GradientReducer
from elasticd.worker.trainer import ElasticTrainer

log = structlog.get_logger(__name__)

_current: weakref.ref[_Session] | None = None  # the process's session (one DistributedDataParallel)


def _drain_current(*_: object) -> None:
    """SIGTERM: the process's session leaves after its next step (``ElasticTrainer.drain``)."""
    session = _current() if _current is not None else None
    if session is not None:
        session.drain()


class _DataState:
    """The sample stream's synced part: the blocks applied steps used, and the epoch's plan."""

    def __init__(self) -> None:
        self.consumed, self.epoch = Consumed(), EpochPlan()

    def state_dict(self) -> dict[str, Any]:
        e = self.epoch
        return {
            "frontier": self.consumed.frontier,
            "above": list(self.consumed.above),
            "epoch": [e.epoch, e.start_step, e.steps],
        }

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.consumed = Consumed(int(sd["frontier"]), tuple(int(b) for b in sd["above"]))
        self.epoch = EpochPlan(*(int(x) for x in sd["epoch"]))


class _Session(ElasticTrainer):
    """An ``ElasticTrainer`` driven by a script's own loop (see the module's docstring)."""

    def __init__(
        self, model: torch.nn.Module, optimizers: Sequence[torch.optim.Optimizer], accumulation_steps: int, **kw: Any
    ) -> None:
        super().__init__(model, list(optimizers), **kw)
        if self.env.replica_size > 1:
            raise ConfigError(
                "elasticd.DistributedDataParallel: a sharded model (replica_size > 1) trains with "
                "ElasticTrainer (docs/sharded.md)"
            )
        self.accum = accumulation_steps
        self.data_state = _DataState()
        self.state.register("elasticd_data", self.data_state)
        self.order: StreamOrder | None = None  # set by the DistributedSampler
        self.plan: GenerationPlan | None = None
        self.handed = self.taken = 0  # blocks of this generation's plan handed out / used by applied steps
        self.micro = 0  # micro-batches of the open step so far
        self._armed = self._queued = False
        self._reduced: tuple[Tally, Verdict, float] | None = None  # the open step's sum arrived
        self._stepped = 0  # optimizers stepped since the sum arrived
        self._replaced = False
        self._step_started = 0.0
        self._vote: Callable[[], list[float]] | None = None  # the vote closure, made at the first step
        self._hooks: list[Any] = []
        for opt in self.optimizers:
            self._hooks.append(opt.register_step_pre_hook(self._before_optimizer_step))
            self._hooks.append(opt.register_step_post_hook(self._after_optimizer_step))
        for p in model.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _make_reducer(self, device: torch.device) -> GradientReducer:
        return GradientReducer(list(self.model.parameters()), device, keep_local=True)

    def _state_replaced(self, reason: str) -> None:
        self._replaced = True
        super()._state_replaced(reason)

    # --- the generation ------------------------------------------------------------------------

    def ensure_current(self) -> None:
        """Joined, in the newest generation, with its plan; a due save started. Called at every
        batch (the sampler's next block, a forward)."""
        self._started()
        if self._drained:
            self.close()
            raise SystemExit(0)  # drained: the others regroup without this member
        self._save_if_due()
        membership = self._membership
        assert membership is not None
        if self._need_rendezvous or membership.must_abandon() or self.group is None:
            if not self._need_rendezvous and self.group is not None:
                self._fail(CollectiveError(membership.abandon_reason or "generation abandoned"))
            self._join_or_finish()
        if self._job_finished:  # it arrived after the job's last step: nothing to do here
            self.close()
            raise SystemExit(0)

    def _held(self) -> list[int]:
        """Blocks this member handed out and no applied step used: prefetched, or in the open step."""
        if self.plan is None or self.group is None:
            return []
        return [self.plan.block(self.group.rank, j) for j in range(self.taken, self.handed)]

    def _recover(self) -> None:
        held, in_step, step = self._held(), self._reduced is not None or self.micro > 0, self.state.counters.step
        had = self._has_state
        while True:
            self._replaced = False
            super()._recover()
            if had and (held or in_step) and (self._replaced or self.state.counters.step != step):
                self._leave_replaced(
                    f"the job went on without this member (its step {step}, the job's {self.state.counters.step})"
                )
            try:
                self._exchange(held)
            except CollectiveError as exc:
                self._fail(exc)
                continue
            if in_step and self._reduced is None and self._reducer is not None and self.group is not None:
                # between two micro-batches: the step goes on in the new group with what it accumulated
                self._reducer.rearm(self.group, 1.0 / self.group.world_size)
            return

    def _exchange(self, held: list[int]) -> None:
        """Every member's held blocks, to every member (two small all_reduces); the generation's plan."""
        group = self.group
        assert group is not None
        t = self.env.timeouts
        assert self._membership is not None
        bound = Bound.after(t.collective_s, poll_s=t.abort_poll_s, abandon=self._membership.must_abandon)
        lens = torch.zeros(group.world_size, dtype=torch.int64)
        lens[group.rank] = len(held)
        all_reduce(lens, group, dist.ReduceOp.SUM, bound)
        table = torch.zeros(group.world_size, max(1, int(lens.max())), dtype=torch.int64)
        table[group.rank, : len(held)] = torch.tensor(held, dtype=torch.int64) + 1
        all_reduce(table, group, dist.ReduceOp.SUM, bound)
        rows = [[int(b) - 1 for b in table[r, : int(lens[r])]] for r in range(group.world_size)]
        leaving = conflicts(self.data_state.consumed, rows)
        if group.rank in leaving:
            self._leave_replaced("batches it prefetched were used or handed out while it was away")
        if leaving:  # they leave; the others form the next generation without them
            raise CollectiveError(f"ranks {sorted(leaving)} of generation {group.generation} leave (their batches)")
        self.plan = make_plan(self.data_state.consumed, rows)
        self.handed, self.taken = len(held), 0

    def _leave_replaced(self, why: str) -> NoReturn:
        """This member's loop cannot go on (see ``MemberReplaced``): leave now, so the others
        regroup at once, and exit for the agent to start a newcomer."""
        log.warning("member_replaced", reason=why)
        self.close(clean=False)
        raise MemberReplaced(f"{why}: this worker exits (code {EXIT_REJOIN}) and starts again as a newcomer")

    # --- the data ------------------------------------------------------------------------------

    def bind(self, order: StreamOrder) -> None:
        if self.order is not None and (self.order.dataset_size, self.order.block_size) != (
            order.dataset_size,
            order.block_size,
        ):
            raise ConfigError("elasticd.DistributedSampler: one sampler (one dataset and batch size) per job")
        self.order = order

    def epoch_plan(self, epoch: int, start: bool) -> EpochPlan:
        """Epoch ``epoch``'s steps: the synced plan's, none for an epoch the job is past (a
        newcomer's loop catching up), or a new plan (recorded when ``start``)."""
        ds, step = self.data_state, self.state.counters.step
        if ds.epoch.epoch > epoch:
            return EpochPlan(epoch, step, 0)
        if ds.epoch.epoch == epoch:
            return ds.epoch
        assert self.order is not None and self.group is not None
        consumed, skip = ds.consumed, ds.epoch.epoch < 0 and ds.consumed.count == 0 and epoch > 0 and self.handed == 0
        if skip:  # a loop that starts at a later epoch (the script resumed itself) starts the stream there
            consumed = Consumed(epoch * self.order.dataset_size // self.order.block_size)
        new = plan_epoch(
            epoch, step, consumed, self.order.dataset_size, self.order.block_size, self.group.world_size * self.accum
        )
        if start:
            ds.consumed, ds.epoch = consumed, new
            if skip:  # every member skips alike, before any hands out a block
                self.plan = make_plan(consumed, [[] for _ in range(self.group.world_size)])
                self.handed = 0
        return new

    def blocks(self, epoch: int) -> Iterator[int]:
        """This member's blocks for its loop over epoch ``epoch`` (the sampler's iterator)."""
        self.ensure_current()
        if self.handed > self.taken + self.micro:
            raise ConfigError(
                f"elasticd.DistributedSampler: a loop over the DataLoader ended with {self.handed - self.taken} "
                "of its batches unused; run each epoch's loop to its end (len(loader) batches)"
            )
        plan = self.epoch_plan(epoch, start=True)
        for _ in range(plan.steps_left(self.state.counters.step) * self.accum):
            self.ensure_current()
            assert self.plan is not None and self.group is not None
            block = self.plan.block(self.group.rank, self.handed)
            self.handed += 1
            yield block

    # --- the step ------------------------------------------------------------------------------

    def before_forward(self) -> None:
        if self._reduced is not None:
            raise ConfigError(
                "elasticd.DistributedDataParallel: call optimizer.step() after the step's last backward, "
                "before the next forward"
            )
        self.ensure_current()
        assert self.group is not None and self._reducer is not None and self._membership is not None
        if self._vote is None:  # a closure over these, never over the session (see ElasticTrainer)
            membership, draining, reducer = self._membership, self._drain_requested, self._reducer

            def vote() -> list[float]:
                regroup = membership.join_pending() or draining.is_set()
                return Vote(0.0, membership.veto(), regroup, reducer.local_nonfinite()).slots()

            self._vote = vote
        if self.micro == 0:
            self._reducer.begin(
                self.group, self.state.counters.step + 1, 1.0 / self.group.world_size, self._vote, sync=self.accum == 1
            )
            self._step_started = self._clock()
        elif self.micro == self.accum - 1:
            self._reducer.sync_next()
        self.micro += 1
        self._armed = self.micro == self.accum

    def _on_grad(self, _param: torch.Tensor) -> None:
        if self._armed and not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._reduce)  # type: ignore[attr-defined]

    def _reduce(self) -> None:
        """End of the step's last backward: the sum, in this generation or the next ones."""
        self._armed = self._queued = False
        reducer, membership = self._reducer, self._membership
        assert reducer is not None and membership is not None
        t = self.env.timeouts
        while True:
            group = self.group
            assert group is not None
            failure: CollectiveError | None = None
            membership.reach.began(group.generation)
            try:
                summed = reducer.finish(
                    Bound.after(t.collective_s, poll_s=t.abort_poll_s, abandon=membership.must_abandon)
                )
            except CollectiveError as exc:
                failure = exc
            finally:
                membership.reach.ended()
            if failure is None:
                tally = Tally.from_slots(summed)
                verdict = commit_outcome(tally, group.world_size)
                if verdict.outcome is Outcome.FINISH:
                    self._finished_at_a_goodbye(group, verdict)
                if verdict.outcome is Outcome.APPLY:
                    self._journal.confirm()  # the whole group summed this step: each applied the one before
                    self._note_verdict(self.state.counters.step + 1, verdict)
                    self._reduced = (tally, verdict, self._step_started)
                    return
                failure = CollectiveError(f"step {self.state.counters.step + 1} not applied: {verdict.reason}")
            reducer.cancel()
            self._regroup_in_step(failure)

    def _finished_at_a_goodbye(self, group: Group, verdict: Verdict) -> NoReturn:
        """This member's step met the others' goodbye (``_goodbye``): their loops ended at the step
        every member of the generation holds, so the job is finished there. The completed sum
        confirms what this member applied before it; the step it opened is applied by nobody. The
        process exits 0, as a member that arrives after the job's end does."""
        self._journal.confirm()
        log.info(
            "job_finished_at_a_peers_goodbye",
            generation=group.generation,
            step=self.state.counters.step,
            reason=verdict.reason,
        )
        self._job_finished = True
        self._reduced, self.micro = None, 0
        self.close(clean=True)
        raise SystemExit(0)

    def _goodbye(self, group: Group, bound: Bound) -> None:
        """The goodbye in the step's shape: the gradient all_reduce of the next step, every bucket
        zero and the vote "finished". A script's loop counts its own steps, so a newcomer admitted
        at the job's last step opens one more; its all_reduce meets this one (a barrier would not
        match it), and the verdict (``Outcome.FINISH``) ends the job there on every member.

        Raises:
            CollectiveError: the all_reduce failed, or a vote is missing.
        """
        reducer = self._reducer
        assert reducer is not None

        def vote() -> list[float]:
            return Vote(0.0, False, False, finished=True).slots()

        reducer.begin(group, self.state.counters.step + 1, 1.0, vote)
        try:
            summed = reducer.finish(bound)
        finally:
            reducer.cancel()  # nothing is applied: the next contribution is not held back
        verdict = commit_outcome(Tally.from_slots(summed), group.world_size)
        if verdict.outcome is not Outcome.FINISH:
            raise CollectiveError(f"the goodbye at step {self.state.counters.step}: {verdict.reason}")

    def _regroup_in_step(self, exc: CollectiveError) -> None:
        """The open step's sum did not arrive: regroup, then send this rank's kept gradients again."""
        self._fail(exc)  # RestartsExhausted past retry.step_retries
        self._join_or_finish()
        assert self.group is not None and self._reducer is not None
        assert self._vote is not None
        self._reducer.begin(self.group, self.state.counters.step + 1, 1.0 / self.group.world_size, self._vote)
        self._reducer.replay()

    def _before_optimizer_step(self, *_: Any) -> None:
        if self._reduced is None:
            raise ConfigError(
                f"optimizer.step(): no averaged gradients for this step; run its {self.accum} micro-batch(es) "
                "(elasticd.DistributedDataParallel(accumulation_steps=...)) through the wrapper's forward and "
                "backward first"
            )

    def _after_optimizer_step(self, *_: Any) -> None:
        self._stepped += 1
        if self._stepped == len(self.optimizers):
            self._stepped = 0
            self._applied()

    def _applied(self) -> None:
        """Every optimizer stepped: the step is applied here (pending until the next collective)."""
        assert self._reduced is not None and self.group is not None and self._reducer is not None
        _, verdict, started = self._reduced
        self._reduced, self.micro = None, 0
        group, c = self.group, self.state.counters
        c.step += 1
        self._reducer.applied(c.step)
        self._failures_this_step = 0
        used: list[int] = []  # the step's blocks, rank after rank
        indices: list[int] = []  # this rank's samples
        if self.plan is not None and self.order is not None:
            used = self.plan.step_blocks(self.taken, self.accum)
            self.taken += self.accum
            self.data_state.consumed = self.data_state.consumed.add(used)
            if self._journal.auditing:
                mine = used[group.rank * self.accum : (group.rank + 1) * self.accum]
                indices = [i for b in mine for i in self.order.indices(b)]
        size = group.world_size * self.accum * (self.order.block_size if self.order else 0)
        epoch = self.data_state.epoch.epoch
        batch = Batch(c.step, epoch, -1, indices, size, group.world_size, group.rank, blocks=tuple(used))
        # the script computes its loss: the vote carries none (NaN: not known)
        result = StepResult(c.step, math.nan, group.generation, group.world_size, self._clock() - started)
        self.last_result = result
        if self._drain_requested.is_set() and verdict.regroup:
            self._drained = True
        elif verdict.regroup:
            self._need_rendezvous, self._cause, self._cause_detail = True, "regroup", ""
            self._failed_at = self._clock()
        sent = self._reducer.vote_sent_at  # its contribution: the compute of the step ends there
        compute_s = sent - started if sent >= started else None
        self._journal.committed(
            batch, c.step, result.loss, group.generation, group.world_size, result.duration_s, compute_s
        )
        self._save_due = group.rank == 0
        self._leave_if_unhealthy()

    def finish(self) -> None:
        """The script's loop ended: the goodbye (``_goodbye``) confirms the last step, then ``close``."""
        try:
            if self.group is not None and not self._closed and self._reduced is None and self.micro == 0:
                self._finish(self.state.counters.step)
        finally:
            self.close(clean=True)
            for h in self._hooks:
                h.remove()


class DistributedDataParallel(torch.nn.Module):
    """torch's ``DistributedDataParallel`` for an elastic job: swap the wrapper (and drop
    ``init_process_group``), keep the loop.

    Example (a torchrun + DDP script's lines that change)::

        ddp = elasticd.DistributedDataParallel(model, opt, accumulation_steps=4, state={"sched": sched, "ema": ema})
        sampler = elasticd.DistributedSampler(dataset, seed=0, batch_size=32)
        ...
        step = ddp.step_count            # in place of step += 1
        if ddp.rank == 0: ...            # in place of dist.get_rank() == 0
        ddp.close()                      # in place of dist.destroy_process_group()

    ``loss.backward()`` of a step's last micro-batch returns with the gradients averaged over the
    generation in ``.grad`` (each member's gradients weighted equally, as DDP does: a loss divided
    by the micro-batch count is right here); ``optimizer.step()`` applies the step on every member.
    A member that fails mid-step does not surface in the loop: the survivors regroup inside that
    ``backward()`` and finish the step among themselves.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        accumulation_steps: int = 1,
        state: Mapping[str, object] | None = None,
        init_from: str | Path | None = None,
        env: WorkerEnv | None = None,
        store: KeyValueStore | None = None,
        audit_path: str | Path | None = None,
        audit_in_memory: bool = False,
        checkpoint: CheckpointConfig | None = None,
    ) -> None:
        """
        Args:
            module: the model; every member builds the same architecture.
            optimizer: its optimizer(s): stepped by the script; their state travels and persists.
            accumulation_steps: micro-batches (forward + backward) per optimizer step; the last
                one's backward averages the gradients (``no_sync()`` is accepted and not needed).
            state: further objects newcomers receive and checkpoints keep: schedulers, an EMA
                (a ``state_dict()`` object or a plain dict of tensors and numbers).
            init_from, env, store, audit_path, audit_in_memory, checkpoint: as ``elasticd.ElasticTrainer``'s.

        Raises:
            ConfigError: a second DistributedDataParallel in one process, or an invalid value.
        """
        super().__init__()
        global _current
        if _current is not None and _current() is not None and not _current()._closed:  # type: ignore[union-attr]
            raise ConfigError("elasticd.DistributedDataParallel: one per process (close() the first one)")
        if accumulation_steps < 1:
            raise ConfigError(
                f"elasticd.DistributedDataParallel: accumulation_steps must be >= 1, got {accumulation_steps}"
            )
        opts = [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)
        self.module = module
        self._session = _Session(
            module,
            opts,
            accumulation_steps,
            state=state,
            init_from=init_from,
            env=env,
            store=store,
            audit_path=audit_path,
            audit_in_memory=audit_in_memory,
            checkpoint=checkpoint,
        )
        _current = weakref.ref(self._session)
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            # SIGTERM (the agent's and systemd's stop): finish the step, leave, exit 0 at the next batch
            signal.signal(signal.SIGTERM, _drain_current)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():  # an evaluation under no_grad is no micro-batch
            self._session.before_forward()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accepted for a DDP script's sake: the micro-batch count decides which backward sums."""
        yield

    @property
    def step_count(self) -> int:
        """Steps applied (synced: a newcomer's count is the job's)."""
        return self._session.step_count

    @property
    def rank(self) -> int:
        self._session.ensure_current()
        return self._session.rank

    @property
    def world_size(self) -> int:
        self._session.ensure_current()
        return self._session.world_size

    @property
    def confirmed_step(self) -> int:
        return self._session.confirmed_step

    def on_commit(self, callback: Any) -> None:
        self._session.on_commit(callback)

    @property
    def trainer(self) -> ElasticTrainer:  # the session (recoveries, last_result, checkpoints)
        return self._session

    def close(self) -> None:
        """End of training: the last step is confirmed by every member (a barrier), then leave."""
        self._session.finish()


class DistributedSampler(torch.utils.data.Sampler[int]):
    """torch's ``DistributedSampler`` for an elastic job: every sample of each epoch used once
    across any resizes; ``len()`` is this member's share of the epoch, the same steps on every member.

    Pass it to the script's own ``DataLoader(dataset, batch_size=batch_size, sampler=sampler, ...)``
    (worker processes, pinned memory, a collate function, ``drop_last``: as the script had them);
    call ``set_epoch(epoch)`` as before.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        *,
        batch_size: int,
    ) -> None:
        """
        Args:
            dataset: a map-style dataset (``len()``).
            shuffle, seed: epoch ``e``'s order is a permutation seeded ``seed + e`` (as torch's).
            batch_size: the DataLoader's ``batch_size`` (samples per micro-batch and rank).

        Raises:
            ConfigError: ``num_replicas`` or ``rank`` given (the job decides them), no
                ``len(dataset)``, a batch size below 1.
        """
        if num_replicas is not None or rank is not None:
            raise ConfigError(
                "elasticd.DistributedSampler: the job sets the world size and rank; drop num_replicas/rank"
            )
        try:
            size = len(dataset)
        except TypeError as exc:
            raise ConfigError("elasticd.DistributedSampler: the dataset needs a len() (a map-style dataset)") from exc
        if batch_size < 1 or size < 1:
            raise ConfigError(
                f"elasticd.DistributedSampler: batch_size and len(dataset) must be >= 1 (got {batch_size}, {size})"
            )
        self.order = StreamOrder(size, batch_size, seed, shuffle)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _session(self) -> _Session:
        session = _current() if _current is not None else None
        if session is None or session._closed:
            raise ConfigError(
                "elasticd.DistributedSampler: create elasticd.DistributedDataParallel(model, optimizer) first"
            )
        session.bind(self.order)
        return session

    def __iter__(self) -> Iterator[int]:
        session = self._session()
        for block in session.blocks(self.epoch):
            yield from self.order.indices(block)

    def __len__(self) -> int:
        session = self._session()
        session.ensure_current()
        plan = session.epoch_plan(self.epoch, start=False)
        return plan.steps_left(session.state.counters.step) * session.accum * self.order.block_size
