"""The worker-side API and the per-step protocol.

Owns ``ElasticTrainer``: it turns a training loop into an elastic one. Each step: the rank's share
of the global batch is computed from the synced data position; ``step(loss)`` runs backward, the
bucketed gradient all_reduce (with the commit vote in its last bucket) and, only if every member's
vote arrived, ``optimizer.step()`` and the counters. A failed or abandoned collective commits
nothing on this rank: the generation is aborted, the members re-rendezvous, rank 0 syncs the newest
state, and the same batch position is retried in the new group. Never spawns processes, and
keeps no records itself (``journal`` does).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from elasticd.config import CheckpointConfig, WorkerEnv
from elasticd.errors import (
    CheckpointTransferError,
    CollectiveError,
    JobFinished,
    RestartsExhausted,
)
from elasticd.log import bind_context
from elasticd.rendezvous import continued
from elasticd.rendezvous.membership import Joined, Membership, new_member_id
from elasticd.retry import Clock, Deadline
from elasticd.settings import worker_env_from_environ
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord
from elasticd.worker.collectives import GradientReducer, barrier
from elasticd.worker.commit import Fence, Outcome, Tally, Verdict, Vote, commit_outcome
from elasticd.worker.durable import (
    CheckpointWriter,
    LoadedCheckpoint,
    load_latest,
    refuse_new_model,
)
from elasticd.worker.durable_format import job_dir
from elasticd.worker.journal import Journal
from elasticd.worker.process_group import Group, GroupFactory, StoreServer
from elasticd.worker.sampler import Batch, BatchMode, ElasticSampler
from elasticd.worker.state import ChecksumAhead, TrainingState
from elasticd.worker.sync import sync_state

log = structlog.get_logger(__name__)

LOG_INTERVAL_S = 1.0  # default of ElasticTrainer(log_interval_s=): step_committed lines at most once a second

# Lineages of state loaded from disk (DISK_LINEAGE_BASE + the checkpoint's seq): above any
# generation number, so they never match the lineage of live state.
DISK_LINEAGE_BASE = 1 << 48


@dataclass(frozen=True)
class StepResult:
    """A committed step, as every member of the generation committed it."""

    step: int
    loss: float          # the global-batch mean loss
    generation: int
    world_size: int
    duration_s: float


class ElasticTrainer:
    """Elastic data-parallel training of ``model`` with ``optimizer``.

    Example::

        trainer = ElasticTrainer(model, optimizer, dataset_size=len(x), global_batch_size=64)
        with trainer:
            for batch in trainer.batches(max_steps=1000):
                loss = F.cross_entropy(model(x[batch.indices]), y[batch.indices])
                trainer.step(loss)
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dataset_size: int,
        global_batch_size: int,
        seed: int = 0,
        batch_mode: BatchMode | str = BatchMode.CONSTANT_GLOBAL,
        reference_world_size: int = 1,
        env: WorkerEnv | None = None,
        store: KeyValueStore | None = None,
        audit_path: str | Path | None = None,
        audit_in_memory: bool = False,
        log_interval_s: float = LOG_INTERVAL_S,
        checkpoint: CheckpointConfig | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """
        Args:
            model: the model; every member must build the same architecture.
            optimizer: its optimizer.
            dataset_size: number of samples; batches carry indices into ``range(dataset_size)``.
            global_batch_size: samples per step over all ranks (``constant_global``), or per rank
                (``linear_scaling``, where the learning rate is scaled by
                ``world_size / reference_world_size``).
            seed: seed of the per-epoch global order.
            batch_mode: ``constant_global`` (default) or ``linear_scaling``.
            reference_world_size: the world size the learning rate was tuned for (linear scaling).
            env: settings; by default read from ``ELASTICD_*`` variables.
            store: the key-value store; by default an etcd client for ``env.etcd``.
            audit_path: if set, one JSON line per committed step and per sync is appended here, as
                it happens (a worker killed with SIGKILL keeps every line it wrote; see ``Journal``).
            audit_in_memory: keep the audit lines in memory and write them at ``close()`` instead:
                for fault-free measurements only (a killed worker loses its lines).
            log_interval_s: log a ``step_committed`` line at most this often (0: every step; the
                audit file, when set, has every step).
            checkpoint: durable checkpoints (directory, schedule, retention); by default
                ``env.checkpoint`` (the ``ELASTICD_CHECKPOINT_*`` variables). Rank 0 saves in the
                background; a member that finds no live state resumes from the directory.
            clock: the monotonic clock of the commit rule, step times and recovery bounds.
        """
        self.env, self._clock = env or worker_env_from_environ(), clock
        continued.install()  # the commit rule must know of a SIGSTOP during a step (see continued.py)
        self.checkpoint = checkpoint if checkpoint is not None else self.env.checkpoint
        self._writer: CheckpointWriter | None = None
        self._from_disk = False
        self.resumed_from: LoadedCheckpoint | None = None
        self.model = model
        self.optimizer = optimizer
        self.state = TrainingState(model, optimizer)
        self.sampler = ElasticSampler(dataset_size, global_batch_size, seed, BatchMode(batch_mode))
        self._reference_world = reference_world_size
        self._base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self._store = store
        self._journal = Journal(self.env, store, audit_path, audit_in_memory, log_interval_s, clock)
        self._membership: Membership | None = None
        self._factory: GroupFactory | None = None
        self._server: StoreServer | None = None
        self._reducer: GradientReducer | None = None
        self.group: Group | None = None
        self.joined: Joined | None = None
        self._has_state = False
        self._need_rendezvous, self._cause, self._cause_detail = True, "start", ""
        self._failed_at, self._failures_this_step = 0.0, 0
        self._pending: Batch | None = None
        self._retrying_since: float | None = None  # monotonic: the step is being deferred since then
        self._draining = False
        # drain() sets both; the vote closure holds only the event (a closure holding the trainer
        # kept retired groups alive until a garbage collection: fds grew by one per generation).
        self._drain_requested = threading.Event()
        self._drained = False
        self._finished_together = False
        self.last_result: StepResult | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> ElasticTrainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(clean=exc[0] is None)

    def start(self) -> None:
        """Connect to etcd and register; the first rendezvous happens at the first batch.

        Raises:
            EtcdUnavailable: etcd could not be reached within the retry bound.
        """
        started_wall = time.time()
        env = self.env
        if env.backend != "nccl":
            torch.set_num_threads(1)  # workers share the node's cores; see README
        if self._store is None:
            from elasticd.store.etcd import EtcdClient

            self._store = EtcdClient(env.etcd, env.timeouts, env.retry)
        self._server = StoreServer(env.advertise_addr, env.timeouts)
        self._factory = GroupFactory(self._server, env.advertise_addr, env.backend, env.local_rank, env.timeouts)
        record = MemberRecord(
            member_id=new_member_id(env.node_id, env.local_rank),
            node=env.node_id,
            local_rank=env.local_rank,
            pid=os.getpid(),
            host=env.advertise_addr,
            store_port=self._server.port,
            signature=self.state.signature,
        )
        keys = Keys(env.etcd.prefix, env.world.job_id)
        self._membership = Membership(self._store, keys, record, env.world, env.timeouts)
        bind_context(node=env.node_id, member=record.member_id)
        self._membership.start()
        self._reducer = GradientReducer(list(self.model.parameters()), self._factory.device)
        self._journal.open(self._membership, self._store, record.member_id, started_wall)
        self._failed_at = self._clock()

    def close(self, clean: bool = True) -> None:
        """Leave the job: a short goodbye barrier (so no peer mistakes a finished member for a lost
        one), then revoke the lease, drop the group and stop the background threads."""
        # Only when every rank stopped at the same max_steps is a collective sure to be matched.
        if (self.group is not None and clean and self._finished_together and self._membership is not None
                and not self._membership.must_abandon()):
            try:
                barrier(self.group, Deadline.after(self.env.timeouts.td("collective")),
                        self._membership.must_abandon, self.env.timeouts.abort_poll_s)
                if self.group.rank == 0:
                    self._membership.mark_finished(self.group.generation, self.state.counters.step)
            except CollectiveError as exc:
                log.warning("goodbye_barrier_failed", error=str(exc))
        if self._writer is not None:
            self._writer.close()  # the write in flight finishes (bounded) and is published
        if self._membership is not None:
            self._membership.close()
        self._journal.close_events(self.env.timeouts.etcd_request_s)
        if self._reducer is not None:
            self._reducer.close()
        if self._factory is not None:
            self._factory.retire(self.group)
            self._factory.drain(Deadline.after(self.env.timeouts.collective_s + 1.0))
        self.group = None
        self._journal.close(self.state.counters.step, self.state.checksum)

    # -- the loop ---------------------------------------------------------------------------

    @property
    def step_count(self) -> int:
        """Committed steps so far (the job's step counter, synced from rank 0)."""
        return self.state.counters.step

    @property
    def recoveries(self) -> int:
        """Recoveries of this member so far (its first join is not one)."""
        return self._journal.recoveries

    @property
    def rank(self) -> int:
        return self.group.rank if self.group else -1

    @property
    def world_size(self) -> int:
        return self.group.world_size if self.group else 0

    def batches(self, max_steps: int) -> Iterator[Batch]:
        """Yield this rank's batch for each step until ``max_steps`` steps are committed.

        After a failed step the same global position is yielded again (split over the new group).
        """
        assert self._membership is not None, "call start() (or use the trainer as a context manager)"
        while self.state.counters.step < max_steps:
            if self._drained:
                return
            if self._need_rendezvous or self._membership.must_abandon():
                if not self._need_rendezvous:
                    self._fail(CollectiveError(self._membership.abandon_reason or "generation abandoned"))
                try:
                    self._recover()
                except JobFinished as exc:
                    log.info("job_already_finished", reason=str(exc))
                    return
            assert self.group is not None
            c = self.state.counters
            batch = self.sampler.batch(c.step + 1, c.epoch, c.position, self.group.rank, self.group.world_size)
            self._pending = batch
            yield batch
            if self._pending is not None:
                raise RuntimeError("trainer.step(loss) must be called once for every batch")
        self._finished_together = True

    def drain(self) -> None:
        """Leave the job gracefully after the next committed step.

        The next step's vote asks every member to regroup; once it is committed everywhere,
        ``batches()`` stops here and ``close()`` revokes the lease, so the others form the next
        generation without this member at once, losing nothing. Safe to call from a signal handler.
        """
        self._draining = True
        self._drain_requested.set()

    @property
    def drained(self) -> bool:
        """True once this member committed its last step after ``drain()``."""
        return self._drained

    def step(self, loss: torch.Tensor) -> StepResult | None:
        """Backward, average gradients over the generation, and commit if every member voted.

        Args:
            loss: this rank's loss on its batch, averaged over its own samples.

        Returns:
            The committed step, or None if the step failed here (it will be retried).

        Raises:
            RestartsExhausted: the same step failed more often than ``retry.step_retries``.
        """
        batch, self._pending = self._pending, None
        assert batch is not None, "step() called without a batch from batches()"
        assert self.group is not None and self._reducer is not None and self._membership is not None
        started = self._clock()
        group = self.group
        n_local = len(batch.indices)
        weighted_loss = float(loss.detach()) * batch.weight if n_local else 0.0
        membership, draining = self._membership, self._drain_requested  # not self (see _drain_requested)

        def vote() -> list[float]:  # called right before the last bucket goes out
            veto, stale, reached = membership.vote()
            regroup = membership.join_pending() or draining.is_set()
            return Vote(weighted_loss, veto, regroup, stale, reached).slots()

        timeouts = self.env.timeouts  # begin() zeroes the gradients: they are views into its buckets
        try:
            self._reducer.begin(group, batch.weight, vote)
            if n_local:
                loss.backward()  # type: ignore[no-untyped-call]
            summed = self._reducer.finish(
                Deadline.after(timeouts.td("collective")), self._membership.must_abandon, timeouts.abort_poll_s
            )
        except CollectiveError as exc:
            self._reducer.cancel()
            self._fail(exc)
            return None
        tally = Tally.from_slots(summed)
        st = membership.standing()
        fence = Fence(fenced=st.fenced, lease_lost=st.lease_lost, renewed_at=st.renewed_at,
                      lease_ttl_s=st.lease_ttl_s, continued=st.continued)
        verdict = commit_outcome(tally, group.world_size, fence, self._clock())
        if verdict.outcome is Outcome.RETRY:
            self._retry_step(batch, verdict)
            return None
        if verdict.outcome is Outcome.ABORT:
            self._fail(CollectiveError(f"step {batch.step} not committed: {verdict.reason}"))
            return None
        self._retrying_since = None
        self.optimizer.step()
        c = self.state.counters
        c.step = batch.step
        c.epoch, c.position = self.sampler.after(batch)
        c.epoch, c.position = self.sampler.normalize(c.epoch, c.position, group.world_size)
        self._failures_this_step = 0
        duration = self._clock() - started
        result = StepResult(c.step, tally.loss, group.generation, group.world_size, duration)
        self.last_result = result
        if self._draining:
            self._drained = True
            log.info("drained", generation=group.generation, rank=group.rank, step=c.step)
        elif verdict.regroup:
            self._need_rendezvous, self._cause = True, "regroup"
            self._cause_detail = ""
            self._failed_at = self._clock()
        self._journal.committed(batch, result.step, result.loss, result.generation, result.world_size,
                                result.duration_s)
        if group.rank == 0 and self.checkpoint.saves:
            self._maybe_save(group.generation)
        return result

    # -- failure and recovery ---------------------------------------------------------------

    def _retry_step(self, batch: Batch, verdict: Verdict) -> None:
        """Every member agreed to apply nothing and do the step again in this group (a lease
        renewal is pending). Bounded: a lease that neither renews nor expires within twice the
        lease TTL makes the step fail, and the members regroup."""
        now = self._clock()
        if self._retrying_since is None:
            self._retrying_since = now
            log.info("step_deferred", generation=self.group.generation if self.group else 0, rank=self.rank,
                     step=batch.step, reason=verdict.reason)
        elif now - self._retrying_since > 2 * self.env.timeouts.lease_ttl_s:
            self._retrying_since = None
            self._fail(CollectiveError(f"step {batch.step} deferred for over 2 x lease_ttl_s: {verdict.reason}"))

    def _fail(self, exc: BaseException) -> None:
        assert self._membership is not None
        gen = self.group.generation if self.group else 0
        self._retrying_since = None
        self._failures_this_step += 1
        log.warning("step_failed", generation=gen, rank=self.rank, step=self.state.counters.step + 1,
                    error=str(exc)[:300], attempt=self._failures_this_step)
        if self.group is not None:
            self._membership.abort(gen, str(exc))
        if not self._need_rendezvous:
            self._failed_at = self._clock()
        self._need_rendezvous, self._cause = True, type(exc).__name__
        self._cause_detail = str(exc)[:200]
        if self._failures_this_step > self.env.retry.step_retries:
            raise RestartsExhausted(
                f"step {self.state.counters.step + 1} failed {self._failures_this_step} times "
                f"(retry.step_retries={self.env.retry.step_retries}); last error: {exc}"
            ) from exc

    def _subgroup(self, parent: Group, ranks: Sequence[int], name: str) -> Group:
        """The group in which rank 0 sends the state to only the members that lack it."""
        assert self._factory is not None and self._membership is not None
        return self._factory.build_subgroup(parent, ranks, name, Deadline.after(self.env.timeouts.group_build_s),
                                            self._membership.must_abandon)

    def _recover(self) -> None:
        """Rendezvous, rebuild the group in-process, and sync the state from rank 0."""
        assert self._membership is not None and self._factory is not None
        timeouts = self.env.timeouts
        self._factory.retire(self.group)
        self.group = None
        deadline = Deadline.after(timeouts.td("join"))
        previous = self.joined.record if self.joined is not None and self._has_state else None
        # Hash our state while we rendezvous (nothing changes it until the sync): rank 0 and the
        # survivors that receive nothing then have their checksum ready when the transfer starts.
        ahead = ChecksumAhead(self.state) if self._has_state else None
        while True:
            committed = self.state.counters.step if self._has_state else -1
            joined = self._membership.join(committed, deadline,
                                           resume=self._resume if self.checkpoint.enabled else None)
            # Time the rendezvous spent waiting for etcd or as a standby did not count against it.
            deadline = Deadline(deadline.at + joined.excused_s, deadline.clock)
            rec = joined.record
            bind_context(generation=rec.generation, rank=joined.rank)
            try:
                group = self._factory.build(
                    rec.generation, joined.rank, rec.world_size, rec.store_host, rec.store_port,
                    Deadline.after(min(timeouts.group_build_s, deadline.remaining_s())),
                    self._membership.must_abandon,
                )
                self.group = group
                # Survivors of the last generation at rank 0's step already hold its state, and so
                # do members that all loaded the same checkpoint (its seq names that lineage).
                if previous is not None:
                    lineage = previous.generation
                elif self._from_disk and self.resumed_from is not None:
                    lineage = DISK_LINEAGE_BASE + self.resumed_from.manifest.seq
                else:
                    lineage = -1
                sync_deadline = Deadline.after(timeouts.td("checkpoint_transfer"))
                own = ahead.result(sync_deadline) if ahead is not None else None
                ahead = None  # a failed attempt may have changed the state: a retry hashes it anew
                report = sync_state(group, self.state, sync_deadline, self._membership.must_abandon,
                                    timeouts.abort_poll_s, lineage, subgroup=self._subgroup,
                                    retire=self._factory.retire, own_checksum=own)
                break
            except (CollectiveError, CheckpointTransferError) as exc:
                log.warning("generation_join_failed", generation=rec.generation, rank=joined.rank, error=str(exc)[:300])
                self._membership.abort(rec.generation, str(exc))
                self._factory.retire(self.group)
                self.group = None
                if deadline.expired():
                    raise
        self.joined = joined
        self._has_state = True
        self._need_rendezvous = False
        if self.sampler.mode is BatchMode.LINEAR_SCALING:
            for g, base in zip(self.optimizer.param_groups, self._base_lrs, strict=True):
                g["lr"] = base * group.world_size / self._reference_world
        self._journal.recovered(group=group, record=rec, rendezvous_s=joined.duration_s, cause=self._cause,
                                cause_detail=self._cause_detail, failed_at=self._failed_at,
                                counters=self.state.counters, report=report,
                                step_time_s=self.last_result.duration_s if self.last_result else None)

    # -- durable checkpoints ----------------------------------------------------------------

    def _checkpoint_dir(self) -> Path:
        return job_dir(self.checkpoint.checkpoint_dir, self.env.world.job_id)

    def _maybe_save(self, generation: int) -> None:
        c = self.checkpoint
        if self._writer is None:
            self._writer = CheckpointWriter(
                self._checkpoint_dir(), job_id=self.env.world.job_id, node=self.env.node_id,
                signature=self.state.signature, every_steps=c.checkpoint_every_steps,
                every_s=c.checkpoint_every_s, keep=c.checkpoint_keep, wait_s=c.checkpoint_wait_s,
                on_saved=self._journal.checkpoint_saved, on_failed=self._on_checkpoint_failed,
            )
        if self._writer.due(self.state.counters.step):
            self._writer.save(self.state, generation)

    def _on_checkpoint_failed(self, step: int, exc: Exception) -> None:
        """On the writer thread: record the failed save (``Journal.save_failed``)."""
        gen = self.group.generation if self.group is not None else 0
        self._journal.save_failed(step, exc, gen, self._checkpoint_dir())

    def _resume(self, held_step: int) -> int:
        """Called by the rendezvous when no live member holds the job's state: load the newest good
        checkpoint newer than ``held_step`` from the directory; return the step now held.

        Raises:
            CheckpointModelChanged: nothing of this model is there, another model's checkpoints
                are, and ``checkpoint_allow_new_model`` is off.
        """
        loaded = load_latest(self._checkpoint_dir(), self.state, newer_than=held_step)
        if loaded is None:
            if held_step < 0:  # it would start over from step 1 (holding state, it would not)
                refuse_new_model(self._checkpoint_dir(), self.state.signature,
                                 self.checkpoint.checkpoint_allow_new_model)
            return held_step
        self._has_state, self._from_disk, self.resumed_from = True, True, loaded
        self._journal.resumed(loaded)
        return loaded.manifest.step
