"""The worker-side API and the per-step protocol.

Owns ``ElasticTrainer``: it turns a training loop into an elastic one. Each step: the rank's share
of the global batch is computed from the synced data position (split into ``accumulation_steps``
micro-batches); ``backward(loss)`` accumulates each micro-batch's gradient and, at the last one,
runs the bucketed gradient all_reduce with the commit vote in its last bucket, leaving the averaged
gradients in ``.grad`` for user code (clipping, unscaling); ``commit()`` applies the step
(``optimizer.step()``, the counters) only if every member's vote arrived and the commit rule agrees.
``step(loss)`` is both. A failed or abandoned collective commits nothing on this rank: the generation
is aborted, the members re-rendezvous (``rejoin``), rank 0 syncs the newest state, and the same
batch position is retried in the new group. Never spawns processes, keeps no records itself
(``journal`` does), and never touches the disk itself (``checkpoints`` does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
import torch

from elasticd.config import CheckpointConfig, WorkerEnv
from elasticd.errors import CollectiveError, ConfigError, GradientsNotFinite, JobFinished, RestartsExhausted
from elasticd.rendezvous.membership import Joined, Membership
from elasticd.retry import Bound, Clock, Deadline
from elasticd.settings import worker_env_from_environ
from elasticd.store.kv import KeyValueStore
from elasticd.wire.ops import EventKind
from elasticd.worker import failure
from elasticd.worker.checkpoints import Checkpoints, load_initial
from elasticd.worker.shard import replica
from elasticd.worker.shard.reducer import ShardReducer
from elasticd.worker.shard.replica import Replica
from elasticd.worker.step.reducer import GradientReducer
from elasticd.worker.data.plan import DataPlan, collated
from elasticd.worker.step.commit import Outcome, Verdict
from elasticd.worker.step.faults import injecting
from elasticd.worker.state.durable import LoadedCheckpoint
from elasticd.worker.step.journal import Journal
from elasticd.worker.data.loader import ElasticLoader, loader_arguments
from elasticd.worker.step.optimizers import Optimizers
from elasticd.worker.group.collectives import barrier
from elasticd.worker.group.process_group import Group, GroupFactory
from elasticd.worker.rejoin import connect, goodbye, rejoin
from elasticd.worker.data.sampler import Batch, BatchMode, ElasticSampler, split_micro
from elasticd.worker.state.training import TrainingState
from elasticd.worker.step.protocol import OpenStep, StepProtocol, StepResult

log = structlog.get_logger(__name__)

LOG_INTERVAL_S = 1.0  # default of ElasticTrainer(log_interval_s=): step_committed lines at most once a second


class ElasticTrainer:
    """Elastic data-parallel training of ``model`` with ``optimizer``.

    Example::

        trainer = ElasticTrainer(model, optimizer, global_batch_size=64)
        trainer.register("scheduler", scheduler)
        with trainer:
            for x, y in trainer.loader(dataset, max_steps=1000, num_workers=2):
                if trainer.backward(F.cross_entropy(model(x), y)):  # averaged gradients in .grad
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    if trainer.commit():
                        scheduler.step()
    """

    _factory: GroupFactory | None
    _replica: Replica | None  # sharded training: this rank's replica (``shard.replica``)
    _shards: Group | None  # sharded training: this rank's shard group of ``group``

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        *,
        dataset_size: int | None = None,
        global_batch_size: int | None = None,
        seed: int = 0,
        batch_mode: BatchMode | str = BatchMode.CONSTANT_GLOBAL,
        reference_world_size: int | None = None,
        accumulation_steps: int = 1,
        scaler: Any = None,
        init_from: str | Path | None = None,
        state: Mapping[str, object] | None = None,
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
            optimizer: its optimizer, or several (each is stepped at a commit, and their state
                travels and persists).
            dataset_size: number of samples; batches carry indices into ``range(dataset_size)``.
                None: set by ``loader(dataset)``, or an endless generated source whose batches
                carry global sample numbers (no epochs).
            global_batch_size: samples per step over all ranks (``constant_global``), or per rank
                (``linear_scaling``). None: set by ``loader(batch_size=...)``.
            seed: seed of the per-epoch global order.
            batch_mode: ``constant_global`` (default) or ``linear_scaling`` (the learning rate is
                multiplied by ``world_size / reference_world_size`` at each optimizer step).
            reference_world_size: the world size the learning rate and a per-rank batch size were
                tuned for. None: the first generation's size, kept in the synced state.
            accumulation_steps: micro-batches per step: ``batches()`` yields this many per step
                (this rank's share split in near-equal parts), and one all_reduce runs per step.
            scaler: a ``torch.amp.GradScaler``: its state travels and persists, and ``commit()``
                steps the optimizers through it (then ``update()``).
            init_from: a plain ``torch.save`` file loaded with ``weights_only=True`` at ``start()``,
                before the first rendezvous: a model state_dict, or a dict whose keys are mapped
                (``load_initial``): the model (``model``, ``model_state_dict``, ``state_dict``,
                ``module``), the optimizer (``optimizer``, ``opt``, ``optim``,
                ``optimizer_state_dict``; further ones as ``optimizer_1``, ... or all as a list
                under ``optimizers``), the registered objects by name (the one registered LR
                scheduler also from ``scheduler``, ``sched``, ``lr_scheduler``,
                ``scheduler_state_dict``), and the step count (``step``, ``global_step``,
                ``iteration``, ``steps``; not ``epoch``), which becomes ``step_count``, so the job
                counts on from it; the data order starts at its beginning (epoch 0, position 0).
                Keys it does not use are logged (``init_from_keys_unused``); two keys for one
                object are a ``ConfigError``. Live state or a durable checkpoint, when there is
                one, wins.
            state: objects to ``register`` by name (schedulers, an EMA, user counters), or plain
                values (a dict or list of tensors, numbers, strings), loaded in place.
            env, store: settings (by default the ``ELASTICD_*`` variables), the key-value store
                (by default an etcd client for ``env.etcd``).
            audit_path: one JSON line per committed step and per sync appended here as it happens
                (a worker killed with SIGKILL keeps every line it wrote; see ``Journal``). None: the
                file ``env.audit_dir`` (``ELASTICD_AUDIT_DIR``) names, if set.
            audit_in_memory: keep the audit lines in memory until ``close()`` (fault-free runs only).
            log_interval_s: log ``step_committed`` at most this often (0: every step).
            checkpoint: durable checkpoints (directory, schedule, retention); by default the
                ``ELASTICD_CHECKPOINT_*`` variables. A job with no live state resumes from them.
            clock: the monotonic clock of the commit rule, step times and recovery bounds.

        Raises:
            ConfigError: a value is invalid.
        """
        self.env, self._clock = env or worker_env_from_environ(), clock
        failure.install(self.env)  # an exception that ends the script is recorded for the job
        self._optimizers = Optimizers(optimizer, scaler)
        optimizers = self._optimizers.all
        if accumulation_steps < 1:
            raise ConfigError(f"accumulation_steps: must be >= 1, got {accumulation_steps}")
        self.model, self.optimizer, self.optimizers = model, optimizers[0], list(optimizers)
        self.state = TrainingState(model, self.optimizer)
        for i, extra in enumerate(optimizers[1:], start=1):
            self.state.register(f"optimizer_{i}", extra)
        self.scaler = scaler  # its state travels and persists
        if scaler is not None:
            self.state.register("grad_scaler", scaler)
        for name, obj in (state or {}).items():
            self.state.register(name, obj)
        self._mode, self.accumulation_steps = BatchMode(batch_mode), accumulation_steps
        self.data = DataPlan(
            dataset_size, global_batch_size, seed, self._mode, reference_world_size, accumulation_steps
        )
        self._init_from, self._store = init_from, store
        audit_path = audit_path if audit_path is not None else self.env.audit_file  # ELASTICD_AUDIT_DIR
        self._journal = Journal(self.env, store, audit_path, audit_in_memory, log_interval_s, clock)
        # no callback into the trainer: a reference cycle kept closed trainers (and their store
        # connections) alive until a garbage collection
        self.checkpoints = Checkpoints(
            checkpoint if checkpoint is not None else self.env.checkpoint,
            self.env.world.job_id,
            self.env.node_id,
            self.state,
            self._journal,
        )
        self.checkpoint = self.checkpoints.config
        self._membership: Membership | None = None
        self._factory = self._replica = self._shards = None
        self._reducer: GradientReducer | ShardReducer | None = None
        self.group: Group | None = None
        self.joined: Joined | None = None
        self._has_state = False
        self._need_rendezvous, self._cause, self._cause_detail = True, "start", ""
        self._failed_at, self._failures_this_step = 0.0, 0
        self._pending: Batch | None = None  # the micro-batch yielded, awaiting backward()
        self._open: OpenStep | None = None
        self._protocol: StepProtocol | None = None
        self._save_due = False  # rank 0 committed a step: save (if due) at the next batch
        # drain() sets it; the vote closure holds only the event (a closure holding the trainer
        # kept retired groups alive until a garbage collection: fds grew by one per generation).
        self._drain_requested = threading.Event()
        self._drained = self._job_finished = self._finished_together = self._closed = self._auto = False
        self._last_rank, self._last_world, self._nonfinite_in_a_row = -1, 0, 0  # last rank, world; bad steps in a row
        self.last_result: StepResult | None = None
        failure.attach(self._failure_context)

    def __enter__(self) -> ElasticTrainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(clean=exc[0] is None)

    def register(self, name: str, obj: object) -> None:
        """Make ``obj`` part of the state newcomers receive and checkpoints keep; the same names on
        every member, before ``start()``. ``obj`` has ``state_dict()``/``load_state_dict()`` (a
        scheduler, an EMA class), or is plain data updated in place: a dict, a list or a tensor
        of tensors, numbers, strings, bools and None (an EMA as ``{name: tensor}``, ``{"tokens": 0}``).

        Raises:
            ConfigError: after ``start()``, a duplicate name, an immutable value (an int: wrap it in a
                dict), or a value neither tensor nor plain data.
        """
        if self._membership is not None:
            raise ConfigError(f"register({name!r}): register state before start(), on every member alike")
        self.state.register(name, obj)

    def start(self) -> None:
        """Connect to etcd and register (``batches``/``loader`` call it if the script did not); the
        first rendezvous happens at the first batch (or when ``rank``/``world_size`` are read).

        Raises:
            EtcdUnavailable: etcd could not be reached within the retry bound.
            ConfigError: ``init_from`` cannot be loaded.
        """
        started_wall = time.time()
        env = self.env
        if env.backend != "nccl":
            torch.set_num_threads(1)  # workers share the node's cores; see README
        if env.replica_size > 1:
            self._replica = replica.join(env)
            if self.checkpoint.enabled:
                self.checkpoints.shard_over(self._replica)
        if self._init_from is not None:
            initial = load_initial(self._init_from, self.model, self.optimizers, self.state.registered())
            if initial.step is not None:
                self.state.counters.step = initial.step
        self._store, self._factory, self._membership = connect(env, self.state.signature, self._store)
        self._reducer = injecting(self._make_reducer(self._factory.device), env)
        self._protocol = StepProtocol(
            self._reducer, self._membership, self._drain_requested, env.timeouts, self._replica
        )
        self._journal.open(self._membership, self._store, self._membership.member_id, started_wall)
        self._failed_at = self._clock()

    def _failure_context(self) -> failure.Context:
        """Where this worker stands, for the record of an exception that ends its script."""
        joined, membership = self.joined, self._membership
        return failure.Context(
            member=membership.member_id if membership is not None else "",
            generation=joined.record.generation if joined is not None else 0,
            step=self.state.counters.step + 1,
            store=self._store,
        )

    def _make_reducer(self, device: torch.device) -> GradientReducer | ShardReducer:
        if self._replica is not None:
            return ShardReducer(
                list(self.model.parameters()), device, self._replica.size, check_finite=self.scaler is None
            )
        return GradientReducer(list(self.model.parameters()), device, check_finite=self.scaler is None)

    def _note_verdict(self, step: int, verdict: Verdict) -> None:
        """An APPLY verdict on ``step``. A skip (the sum is not finite: ``Verdict.skip``): every
        member drops its gradients, so the optimizers update no parameter and the step still counts;
        a member whose own gradients were not finite names itself and its node
        (``gradients_not_finite``, also an event) and counts the skips in a row."""
        mine = verdict.skip and self._reducer is not None and self._reducer.local_nonfinite()
        self._nonfinite_in_a_row = self._nonfinite_in_a_row + 1 if mine else 0
        if not verdict.skip:
            return
        for p in self.model.parameters():
            p.grad = None
        log.warning("step_skipped", step=step, reason=verdict.reason, own_gradients_not_finite=mine)
        if mine:
            assert self._membership is not None and self.group is not None
            detail = dict(
                step=step,
                member=self._membership.member_id,
                node=self.env.node_id,
                rank=self.group.rank,
                in_a_row=self._nonfinite_in_a_row,
            )
            log.error("gradients_not_finite", **detail)
            self._journal.event(EventKind.GRADIENTS_NOT_FINITE, **detail)

    def _leave_if_unhealthy(self) -> None:
        """After a step is applied: a member whose own gradients were not finite at
        ``retry.nonfinite_steps`` steps in a row leaves (its node is taken as bad).

        Raises:
            GradientsNotFinite: that many in a row (the worker exits ``EXIT_NO_RESTART``).
        """
        limit = self.env.retry.nonfinite_steps
        if self._nonfinite_in_a_row >= limit:
            raise GradientsNotFinite(
                f"the gradients of this member (node {self.env.node_id}) were not finite at "
                f"{self._nonfinite_in_a_row} steps in a row (nonfinite_steps {limit}): its node is taken as bad; "
                f"the job goes on without it"
            )

    def _state_replaced(self, reason: str) -> None:  # the sync replaced this member's state (another lineage)
        self._journal.discard(reason)

    def close(self, clean: bool = True) -> None:
        """Leave the job: a due save, then revoke the lease, drop the group, stop the threads
        (``rank`` keeps the last rank). Steps applied here and never confirmed (a drain, a failure,
        a loop left early) are discarded: they are not this member's commits. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if clean:
            self._save_if_due()  # a save due after the last commit (the loop was left with break)
        self._last_rank, self._last_world = (self.group.rank, self.group.world_size) if self.group else (-1, 0)
        self._journal.discard("left the job before a later collective or sync confirmed them")
        self.checkpoints.close()
        if self._membership is not None:
            self._membership.close()
        self._journal.close_events(self.env.timeouts.etcd_request_s)
        if self._reducer is not None:
            self._reducer.close()
        if self._factory is not None:
            self._factory.retire(self._shards)
            self._factory.retire(self.group)
            self._factory.drain(Deadline.after(self.env.timeouts.collective_s + 1.0))
        self.group = self._shards = None
        self._journal.close(self.state.counters.step, self.state.checksum, joined=self._has_state)

    @property
    def step_count(self) -> int:
        """Committed steps (synced): 0 before the first, like a torchrun script's count of
        ``optimizer.step()`` calls; the next batch carries ``step_count + 1``."""
        return self.state.counters.step

    @property
    def recoveries(self) -> int:  # of this member so far (its first join is not one)
        return self._journal.recoveries

    @property
    def rank(self) -> int:
        """This member's rank now; read before the loop, it waits for the first rendezvous (bounded
        by ``join_s``; reading it starts the generation's clock); -1 if the job was finished."""
        self._ensure_joined()
        return self.group.rank if self.group else self._last_rank

    @property
    def world_size(self) -> int:
        """The current generation's size (read before the loop, it waits for the first rendezvous)."""
        self._ensure_joined()
        return self.group.world_size if self.group else self._last_world

    @property
    def lr_factor(self) -> float:  # linear_scaling multiplies every learning rate by this at a step
        return self._optimizers.factor

    def _started(self) -> Membership:
        if self._closed:
            raise RuntimeError("this trainer was closed (its loop ended): make a new one to train again")
        if self._membership is None:  # not started by the script: started here, and closed at the end
            self.start()
            self._auto = True
        assert self._membership is not None
        return self._membership

    def _save_if_due(self) -> None:  # a durable save due since the last commit starts now
        if self._save_due and self.group is not None:
            self.checkpoints.maybe_save(self.state.counters.step, self.group.generation)
        self._save_due = False

    def _ensure_joined(self) -> None:
        if self.group is None and self._need_rendezvous and not self._closed:
            self._started()
            self._join_or_finish()

    def _join_or_finish(self) -> None:
        if self._job_finished:
            return
        try:
            self._recover()
        except JobFinished as exc:
            log.info("job_already_finished", reason=str(exc))
            self._job_finished = True
            # a barrier of my generation completed somewhere: every member applied its last step
            self._journal.finished(exc.generation, exc.step)

    def _finish(self, max_steps: int) -> bool:
        """The job's end at ``max_steps``: the goodbye barrier confirms the last step. Where it does
        not complete, this member rejoins holding its applied step (the newest, so the next
        generation adopts it) and the job finishes there; a ``finished`` record read at the rejoin
        settles it too. True when the job is finished; False when the state rank 0 sent is short of
        ``max_steps`` (training goes on). Bounded by ``retry.step_retries``.
        """
        assert self._membership is not None
        while not self._job_finished:
            if goodbye(self.group, self._membership, self.env.timeouts, self.state.counters.step, self._goodbye):
                self._journal.confirm()
                return True
            self._fail(CollectiveError(f"the goodbye barrier at step {self.state.counters.step} did not complete"))
            self._join_or_finish()
            if not self._job_finished and self.state.counters.step < max_steps:
                return False
        return True

    def _goodbye(self, group: Group, bound: Bound) -> None:
        """The goodbye's collective: a barrier (every member's loop knows the last step)."""
        barrier(group, bound)

    def batches(self, max_steps: int) -> Iterator[Batch]:
        """Yield this rank's batch for each step until ``max_steps`` steps are committed: one per
        step, or ``accumulation_steps`` micro-batches per step, each followed by ``step(loss)`` or
        ``backward(loss)`` (and ``commit()`` once ``backward`` returned True). After a failed step
        the same global position is yielded again (split over the new group).
        """
        self.data.check_ready()
        membership = self._started()
        try:
            while True:
                yield from self._steps(membership, max_steps)
                if self._drained or self._job_finished:
                    break
                if self._finish(max_steps):
                    self._finished_together = True
                    break
        except GeneratorExit:  # the script left its loop (a ``break``)
            if self._at_the_end(max_steps):  # right after the last step: the job ends as if it had not
                self._finished_together = self._finish(max_steps)
            raise
        finally:
            if self._auto:
                self.close(clean=self._finished_together)

    def _at_the_end(self, max_steps: int) -> bool:
        """This member applied step ``max_steps`` and has no step open: a loop left here (a
        ``break`` after the last step) ends the job like a loop that ran out."""
        return (
            self.state.counters.step >= max_steps
            and self._open is None
            and self._pending is None
            and self.group is not None
            and not (self._drained or self._job_finished or self._closed)
        )

    def _steps(self, membership: Membership, max_steps: int) -> Iterator[Batch]:
        """This rank's batches until its state holds ``max_steps`` steps (or it drained, or the job
        finished without it)."""
        while self.state.counters.step < max_steps:
            self._save_if_due()
            if self._drained or self._job_finished:
                return
            # A replica's ranks leave a generation together, through a step's sums (``Replica.agree``):
            # one that left on its own would leave the others waiting for it there.
            if self._need_rendezvous or (self._replica is None and membership.must_abandon()):
                if not self._need_rendezvous:
                    self._fail(CollectiveError(membership.abandon_reason or "generation abandoned"))
                if self._drain_requested.is_set():  # leaving: the others regroup without it
                    self._drained = True
                    return
                self._join_or_finish()
                continue  # the state rank 0 sent may hold every step already
            assert self.group is not None
            c, sampler = self.state.counters, self._sampler()
            whole = sampler.batch(c.step + 1, c.epoch, c.position, self.group.rank, self.group.world_size)
            self._open = OpenStep(whole, self._clock())
            for micro in split_micro(whole, self.accumulation_steps):
                self._pending = micro
                yield micro
                if self._pending is not None:
                    raise RuntimeError("call trainer.step(loss) or trainer.backward(loss) for every batch")
                if self._open is None:
                    break  # the step failed (its all_reduce) or was applied
            if self._open is not None and self._open.tally is not None:
                raise RuntimeError("trainer.commit() must follow a backward(loss) that returned True")
            self._open = None
        self._save_if_due()

    def loader(
        self, data: Any, *, max_steps: int, batch_size: int | None = None, **dataloader_kwargs: Any
    ) -> Iterator[Any]:
        """Yield this rank's collated data for each step (or micro-batch) until ``max_steps`` steps
        are committed, fetched by a ``DataLoader`` (worker processes, pinned memory, your collate
        function): exactly once per epoch across any number of resizes (``loader.ElasticLoader``).

        Args:
            data: a map-style dataset or a DataLoader over one.
            max_steps: train until this many steps are committed.
            batch_size: samples per rank and micro-batch at ``reference_world_size`` (with
                ``linear_scaling``, at any size); not needed with ``global_batch_size``.
            dataloader_kwargs: ``num_workers``, ``collate_fn``, ``pin_memory``, ``prefetch_factor``,
                ``persistent_workers``, ``worker_init_fn``, ``timeout``, ``multiprocessing_context``.

        Raises:
            ConfigError: a DataLoader with its own sampler, an iterable dataset, no batch size, or a
                dataset size that differs from the trainer's.
        """
        dataloader_kwargs = loader_arguments(dataloader_kwargs)  # ConfigError before joining the job
        dataset = data.dataset if isinstance(data, torch.utils.data.DataLoader) else data
        self.data.use_dataset(dataset, batch_size)
        self._started()
        if self.data.needs_first_generation:
            self._ensure_joined()
        if isinstance(data, torch.utils.data.DataLoader):
            if dataloader_kwargs:
                raise ConfigError(
                    f"loader: {sorted(dataloader_kwargs)} given with a DataLoader, whose settings are used"
                )
            el = ElasticLoader.from_dataloader(data, self._sampler())
        else:
            el = ElasticLoader(data, self._sampler(), **dataloader_kwargs)
        return collated(el, self.batches(max_steps))

    @property
    def sampler(self) -> ElasticSampler | None:  # the data order (None until the batch size is known)
        return self.data.sampler

    def _sampler(self) -> ElasticSampler:
        return self.data.make_sampler(self.state.counters, self.group.world_size if self.group else 1)

    def drain(self) -> None:
        """Leave the job gracefully: the next step's vote asks every member to regroup; once that step is
        committed everywhere (or at a regroup), ``batches()`` stops and ``close()`` revokes the lease, so
        the others go on without it, losing nothing. Safe to call from a signal handler."""
        self._drain_requested.set()

    @property
    def drained(self) -> bool:  # this member committed its last step after drain()
        return self._drained

    def step(self, loss: torch.Tensor) -> StepResult | None:
        """``backward(loss)``, then ``commit()`` once the gradients are averaged: the committed step,
        or None (a micro-batch before the last, or a step that failed here and will be retried).

        Raises:
            RestartsExhausted: the same step failed more often than ``retry.step_retries``.
        """
        return self.commit() if self.backward(loss) else None

    def backward(self, loss: torch.Tensor) -> bool:
        """Backward of this (micro-)batch's mean loss; at the step's last micro-batch, average the
        gradients over the generation (each rank weighted by its share of the global batch).

        Returns:
            True when the averaged gradients are in ``.grad`` and the commit rule says this member
            applies them (clip or unscale them now, then call ``commit()``); False for a micro-batch
            before the last, or if the all_reduce failed or the rule refused (nothing is applied;
            the step is taken again, in this group or the next).

        Raises:
            RestartsExhausted: the same step failed more often than ``retry.step_retries``.
        """
        micro, self._pending = self._pending, None
        op = self._open
        assert micro is not None and op is not None, "backward() called without a batch from batches()"
        assert self.group is not None and self._protocol is not None
        try:
            if not self._protocol.backward(self.group, op, micro, loss, self._shards):
                return False
            self._journal.confirm()  # the whole group summed this step: each applied the one before
        except CollectiveError as exc:
            self._open = None
            self._fail(exc)
            return False
        if op.verdict is None or op.verdict.outcome is Outcome.APPLY:
            if op.verdict is not None:
                self._note_verdict(op.batch.step, op.verdict)
            return True
        self._open = None  # nobody applies it: the same step is taken again in the next generation
        self._optimizers.skip()
        self._fail(CollectiveError(f"step {op.batch.step} not applied: {op.verdict.reason}"))
        return False

    def commit(self) -> StepResult | None:
        """Apply the step whose gradients ``backward`` averaged (the verdict of every member's vote,
        ``commit.commit_outcome``, was APPLY): the optimizers step (through the ``scaler``, with the
        ``linear_scaling`` factor), then the counters. The step is applied, and committed once a
        later collective of this group confirms it (``confirmed_step``, ``on_commit``). Returns
        the applied step, or None (its backward failed; the step is taken again)."""
        op, self._open = self._open, None
        if op is None:
            return None  # its backward failed: nothing to apply, the step is retried
        if op.tally is None:
            raise RuntimeError("commit() must follow a backward(loss) that returned True")
        assert self.group is not None and self._reducer is not None and op.verdict is not None
        group, batch, verdict = self.group, op.batch, op.verdict
        self._optimizers.step()
        self._reducer.applied(batch.step)
        c, sampler = self.state.counters, self._sampler()
        c.step = batch.step
        c.epoch, c.position = sampler.after(batch)
        c.epoch, c.position = sampler.normalize(c.epoch, c.position, group.world_size)
        self._failures_this_step = 0
        result = StepResult(c.step, op.tally.loss, group.generation, group.world_size, self._clock() - op.started)
        self.last_result = result
        if op.voted_drain[0]:  # a drain asked for after the vote waits for the next step's vote
            self._drained = True
            log.info("drained", generation=group.generation, rank=group.rank, step=c.step)
        elif verdict.regroup:
            self._need_rendezvous, self._cause, self._cause_detail = True, "regroup", ""
            self._failed_at = self._clock()
        sent = self._reducer.vote_sent_at  # its contribution: the compute of the step ends there
        compute_s = sent - op.started if sent >= op.started else None
        self._journal.committed(
            batch, result.step, result.loss, result.generation, result.world_size, result.duration_s, compute_s
        )
        # rank 0 (a sharded model: rank 0's replica) saves at the next batch, after the script's
        # own post-step code (scheduler, EMA)
        self._save_due = group.rank < (self._replica.size if self._replica is not None else 1)
        self._leave_if_unhealthy()
        return result

    @property
    def confirmed_step(self) -> int:
        """The newest step this member knows is committed: every member of its generation applied
        it (a later collective of the group completed, a sync adopted it, or the job's goodbye
        barrier completed). ``step_count`` may be one ahead: applied here, not yet confirmed."""
        return self._journal.confirmed_step

    def on_commit(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(step)`` each time steps are confirmed (``step``: the newest of them), on
        the training thread. For a script's own side effects that must never act on a step the
        job may still drop (publishing a metric, an evaluation, an export)."""
        self._journal.on_confirm(callback)

    def _fail(self, exc: BaseException) -> None:
        assert self._membership is not None
        gen = self.group.generation if self.group else 0
        self._failures_this_step += 1
        log.warning(
            "step_failed",
            generation=gen,
            rank=self.group.rank if self.group else -1,
            step=self.state.counters.step + 1,
            error=str(exc)[:300],
            attempt=self._failures_this_step,
        )
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

    def _recover(self) -> None:
        """Rendezvous, rebuild the group in-process, and sync the state from rank 0 (``rejoin``)."""
        assert self._membership is not None and self._factory is not None and self._protocol is not None
        self._factory.retire(self._shards)
        self._factory.retire(self.group)
        self.group = self._shards = None
        ck = self.checkpoints
        done = rejoin(
            self._membership,
            self._factory,
            self.state,
            self.env.timeouts,
            has_state=lambda: self._has_state or ck.resumed_from is not None,
            disk_seq=lambda: (
                ck.resumed_from.manifest.seq if ck.resumed_from is not None and not self._has_state else None
            ),
            resume=ck.resume if self.checkpoint.enabled else None,
            discard=self._state_replaced,
            replica=self._replica,
        )
        self.group, self.joined, self._shards = done.group, done.joined, done.shard_group
        self._has_state, self._need_rendezvous = True, False
        if self._mode is BatchMode.LINEAR_SCALING:
            reference = self.data.reference(self.state.counters, done.group.world_size)
            self._optimizers.rescale(done.group.world_size, reference, done.group.generation)
        self._journal.recovered(
            group=done.group,
            record=done.joined.record,
            rendezvous_s=done.joined.duration_s,
            cause=self._cause,
            cause_detail=self._cause_detail,
            failed_at=self._failed_at,
            counters=self.state.counters,
            report=done.report,
            step_time_s=self.last_result.duration_s if self.last_result else None,
        )

    @property
    def resumed_from(self) -> LoadedCheckpoint | None:  # the durable checkpoint this state came from
        return self.checkpoints.resumed_from
