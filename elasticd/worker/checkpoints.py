"""One trainer's use of durable checkpoints: rank 0's saves, a member's resume, a starting file.

Owns ``Checkpoints``: when rank 0 saves (``CheckpointWriter.due``) after applying a step, and that
the save becomes visible only once the ``Journal`` confirms its step (and is deleted when the journal
discards it: a branch the job left, never published nor resumed from), what a member
loads when the rendezvous finds no live state (``resume``: the newest good checkpoint of this
model, or a refusal to start over when only another model's checkpoints are there), and
``load_initial``, which maps the keys of a plain ``torch.save`` file (read with ``weights_only=True``)
to the model, the optimizers, the registered objects and the step count before the first rendezvous. Never
decides who is rank 0 or when a job resumes (the membership does), and never writes a file itself
(``durable`` does).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch

from elasticd.config import CheckpointConfig
from elasticd.errors import CheckpointModelChanged, ConfigError
from elasticd.worker.shard.replica import Replica
from elasticd.worker.state.durable import CheckpointWriter
from elasticd.worker.state.durable_format import (
    Entry,
    LoadedCheckpoint,
    Manifest,
    job_dir,
    load_latest,
    read_manifest,
    refuse_new_model,
    scan,
    verify,
)
from elasticd.worker.state.extras import load_in_place
from elasticd.worker.step.journal import Journal
from elasticd.worker.state.training import TrainingState

log = structlog.get_logger(__name__)

# The spellings of a torch.save checkpoint's keys that load_initial maps (a registered name wins over them).
MODEL_KEYS = ("model", "model_state_dict", "state_dict", "module")
OPTIMIZER_KEYS = ("optimizer", "opt", "optim", "optimizer_state_dict")
OPTIMIZERS_KEY = "optimizers"  # a list of state dicts: the trainer's optimizers in order
SCHEDULER_KEYS = ("scheduler", "sched", "lr_scheduler", "scheduler_state_dict")
STEP_KEYS = ("step", "global_step", "iteration", "steps")  # an "epoch" is no step count
_SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_FIT_ERRORS = (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError)


class Checkpoints:
    """Durable checkpoints of one trainer (``CheckpointConfig``; off without a directory)."""

    def __init__(
        self, config: CheckpointConfig, job_id: str, node: str, state: TrainingState, journal: Journal
    ) -> None:
        """
        Args:
            config: where, how often, how many are kept.
            job_id: the job (its checkpoints live in ``<checkpoint_dir>/<job_id>/``).
            node: this worker's node id (written into each manifest).
            state: the state saved and loaded.
            journal: told of every save, failed save and resume; tells which steps are confirmed
                (a pending save is published) or discarded (a pending save is deleted).
        """
        self.config = config
        self._job_id, self._node = job_id, node
        self._state, self._journal = state, journal
        self._generation = [0]  # of the last save started (recorded with a failed save)
        # Record a failed save (on the writer thread). A plain function, not a method: the writer
        # holding self kept the journal, the store client and the membership alive after close.
        self.on_failed = _failure_recorder(journal, self.directory, self._generation)
        self._writer: CheckpointWriter | None = None
        self._verdicts_wired = False  # the journal's confirm/discard reach the writer
        self.resumed_from: LoadedCheckpoint | None = None  # the checkpoint this member's state came from
        self._replica: Replica | None = None  # a sharded model's: saves and loads are its shard's

    def shard_over(self, replica: Replica) -> None:
        """A sharded model: save and load in the sharded format (``shard.checkpoint``), this
        rank's shard of it; saves are made by the ranks of rank 0's replica together.

        Raises:
            ConfigError: ``checkpoint_every_s`` is set (the K ranks must save at the same steps).
            ReplicaBroken: the replica's checkpoint group could not be made.
        """
        if self.config.checkpoint_every_s > 0:
            raise ConfigError(
                "checkpoint_every_s: a sharded model (replica_size > 1) saves by steps only "
                "(checkpoint_every_steps): the ranks of a replica write one checkpoint together, "
                "at the same steps"
            )
        self._replica = replica
        if self.config.saves:  # made now, at the start, by every rank of the replica alike
            replica.checkpoint_group(self.config.checkpoint_wait_s)

    @property
    def directory(self) -> Path:
        return job_dir(self.config.checkpoint_dir, self._job_id)

    def maybe_save(self, step: int, generation: int) -> None:
        """Rank 0, after applying ``step``: start a background save if one is due.

        The save confirms nothing: rank 0 may hold ``step`` alone (its peers never got the sum), so
        the checkpoint is written now and becomes visible (manifest, ``checkpoint`` record, event,
        retention) once the journal confirms a step at least ``step``; if the journal discards
        ``step`` first, its files are deleted.
        """
        if not self.config.saves:
            return
        writer = self._writer_for_saves()
        if writer.due(step):
            self._generation[0] = generation
            writer.save(self._state, generation, pending=self._journal.confirmed_step < step)

    def _writer_for_saves(self) -> CheckpointWriter:
        if self._writer is None:
            c = self.config
            sharded = {}
            writer = CheckpointWriter
            if self._replica is not None:
                # torch.distributed.checkpoint is imported by sharded training alone (a second of
                # a data-parallel worker's start)
                from elasticd.worker.shard.checkpoint import ShardedCheckpointWriter

                group = self._replica.checkpoint_group(c.checkpoint_wait_s)
                sharded, writer = {"replica": self._replica, "group": group}, ShardedCheckpointWriter
            self._writer = writer(
                self.directory,
                **sharded,  # type: ignore[arg-type]
                job_id=self._job_id,
                node=self._node,
                signature=self._state.signature,
                every_steps=c.checkpoint_every_steps,
                every_s=c.checkpoint_every_s,
                keep=c.checkpoint_keep,
                wait_s=c.checkpoint_wait_s,
                on_saved=self._journal.checkpoint_saved,
                on_failed=self.on_failed,
            )
        if not self._verdicts_wired:  # the journal keeps its listeners: wired once, to this writer
            self._verdicts_wired = True
            self._journal.on_confirm(self._writer.confirm)
            self._journal.on_discard(self._writer.discard)
        return self._writer

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no save is being written or settled (True), at most ``timeout_s``."""
        return self._writer is None or self._writer.wait_idle(timeout_s)

    def resume(self, held_step: int) -> int:
        """Called by the rendezvous when no live member holds the job's state: load the newest good
        checkpoint newer than ``held_step`` from the directory; return the step now held.

        Raises:
            CheckpointModelChanged: nothing of this model is there, another model's checkpoints
                are, and ``checkpoint_allow_new_model`` is off.
        """
        r, state = self._replica, self._state
        read = verify
        if r is not None:
            from elasticd.worker.shard.checkpoint import read_shard  # see _writer_for_saves

            read = lambda entry: read_shard(entry, state, r.shard, r.size)  # noqa: E731
        loaded = load_latest(self.directory, state, newer_than=held_step, read=read)
        if loaded is None:
            if held_step < 0:  # it would start over from step 1 (holding state, it would not)
                refuse_new_model(self.directory, self._state.signature, self.config.checkpoint_allow_new_model)
                self._refuse_unloadable()
            return held_step
        self.resumed_from = loaded
        self._journal.resumed(loaded)
        return loaded.manifest.step

    def _refuse_unloadable(self) -> None:
        """Checkpoints of this model are there but none loads (damaged, the registered state
        differs: a scheduler or an EMA added since, or saved at another replica size): starting
        over from step 1 would silently drop their progress, so stop unless
        ``checkpoint_allow_new_model``. Nothing is deleted. A data file without its manifest is no
        checkpoint (a save never confirmed, or cut off) and counts for nothing here.

        Raises:
            CheckpointModelChanged: such checkpoints exist and the setting is off.
        """
        try:
            found = [m for m in map(_manifest, scan(self.directory)) if m and m.signature == self._state.signature]
        except OSError:
            return
        if not found:
            return
        steps = [m.step for m in found]
        if self.config.checkpoint_allow_new_model:
            log.warning("checkpoint_none_usable_started_over", directory=str(self.directory), steps=steps[:5])
            return
        sizes, mine = sorted({m.shards for m in found}), self._replica.size if self._replica else 1
        why, fix = (
            ("damaged, or registered state that differs from this worker's register() calls", "Fix the registrations")
            if mine in sizes
            else (
                f"saved at replica_size {', '.join(map(str, sizes))}, and this worker's is {mine}",
                f"Start the agents with --replica-size {sizes[-1]}",
            )
        )
        raise CheckpointModelChanged(
            f"{self.directory} holds {len(steps)} checkpoint(s) of this model (newest step {steps[0]}) and none "
            f"loads (see checkpoint_rejected: {why}); refusing to start over from step 1. {fix}, or set "
            f"checkpoint_allow_new_model to start over (nothing is deleted)"
        )

    def close(self) -> None:
        """Stop the writer: the work queued finishes (at most ``checkpoint_wait_s``); a save whose
        step the journal has not confirmed by now is deleted, never published (settle the last
        steps in the journal first)."""
        if self._writer is not None:
            self._writer.close()


def _manifest(entry: Entry) -> Manifest | None:
    """A checkpoint's manifest, read once; None without a readable one (a data file without a
    manifest is no checkpoint: a save never confirmed, or cut off)."""
    if entry.manifest_path is None:
        return None
    try:
        return read_manifest(entry.manifest_path)
    except (OSError, ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError):
        return None


def _failure_recorder(journal: Journal, directory: Path, generation: list[int]) -> Callable[[int, Exception], None]:
    def on_failed(step: int, exc: Exception) -> None:
        journal.save_failed(step, exc, generation[0], directory)

    return on_failed


@dataclass(frozen=True)
class InitialLoad:
    """What ``load_initial`` took from a file."""

    loaded: tuple[str, ...]  # "model", "optimizer" and registered names ("optimizer_1", "scheduler", ...)
    unused: tuple[str, ...]  # the file's keys nothing was loaded from
    step: int | None  # the file's step count; None: it holds none


@dataclass
class _Part:
    """One object a file may load, and where the file holds its state: (key, index in the list
    under that key, or None); the key "" is the whole file (a bare model state_dict)."""

    name: str
    obj: object
    sources: list[tuple[str, int | None]] = field(default_factory=list)


def load_initial(
    path: str | Path,
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    registered: Mapping[str, object],
) -> InitialLoad:
    """Load a plain ``torch.save`` file into the trainer's objects, with ``weights_only=True``:
    tensors and plain containers only, nothing is executed.

    The file is a model ``state_dict``, or a dict whose keys are mapped as follows (a registered
    name wins over every other spelling):

    - the model: ``model``, ``model_state_dict``, ``state_dict`` or ``module``;
    - the first optimizer: ``optimizer``, ``opt``, ``optim`` or ``optimizer_state_dict``; the
      further ones by the names the trainer registers them under (``optimizer_1``, ...); or all of
      them as a list under ``optimizers``, in the trainer's order;
    - each registered object (or plain value) by its registered name; the one registered LR
      scheduler, when exactly one is, also from ``scheduler``, ``sched``, ``lr_scheduler`` or
      ``scheduler_state_dict``;
    - the step count: ``step``, ``global_step``, ``iteration`` or ``steps``, an int (``epoch`` is
      not read as one).

    Each object is loaded with its ``load_state_dict`` (a registered plain value in place), the
    model first, then the optimizers and the registered objects in the order of registration.
    Every key not used is logged (``init_from_keys_unused``) and returned. The step is returned,
    not applied: the trainer makes it its committed step count, and the data order starts at its
    beginning (epoch 0, position 0), since such a file does not say where in the data it was.

    Args:
        optimizers: the trainer's optimizers, the first one first; the others are registered too.
        registered: the registered objects by name (``TrainingState.registered``).

    Raises:
        ConfigError: the file is missing, not loadable with ``weights_only``, holds no model
            weights, holds two keys for one object (both ``optimizer`` and ``opt``) or two
            different step counts, holds a step that is not an int >= 0, or does not fit.
    """
    p = Path(path)
    data = _read(p)
    parts = _parts(p, data, model, optimizers, registered)
    step, step_keys = _step(p, data, set(registered))
    loaded: list[str] = []
    for part in parts:
        if not part.sources:
            continue
        key, index = part.sources[0]
        state = data if key == "" else data[key] if index is None else data[key][index]
        if part.obj is model:
            state = unwrapped(state, model)
        try:
            if callable(getattr(part.obj, "load_state_dict", None)):
                part.obj.load_state_dict(state)  # type: ignore[attr-defined]
            else:
                load_in_place(part.obj, state)  # a registered plain value
        except _FIT_ERRORS as exc:
            raise ConfigError(
                f"init_from: {p}: {_where(key, index)} does not fit the {_what(part)}: {str(exc)[:400]}"
            ) from exc
        loaded.append(part.name)
    used = set(data) if parts[0].sources == [("", None)] else {k for part in parts for k, _ in part.sources}
    unused = tuple(str(k) for k in data if k not in used and k not in step_keys)
    log.info("initial_state_loaded", path=str(p), parts=loaded, step=step)
    if unused:
        log.warning("init_from_keys_unused", path=str(p), keys=list(unused))
    return InitialLoad(tuple(loaded), unused, step)


def unwrapped(state: object, model: torch.nn.Module) -> object:
    """A model state_dict saved from a ``DistributedDataParallel`` wrapper (every key ``module.``-
    prefixed, as ``ddp.state_dict()`` writes it), with the prefix taken off when ``model`` itself
    has no such keys; any other value as it is."""
    if not isinstance(state, dict) or not state:
        return state
    keys = [k for k in state if isinstance(k, str)]
    if len(keys) != len(state) or not all(k.startswith("module.") for k in keys):
        return state
    if any(k.startswith("module.") for k in model.state_dict()):
        return state
    return {k[len("module.") :]: v for k, v in state.items()}


def _read(p: Path) -> dict[object, object]:
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ConfigError(f"init_from: {p} does not exist") from exc
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError) as exc:
        # weights_only refuses anything but tensors and plain containers with UnpicklingError
        raise ConfigError(
            f"init_from: {p} cannot be loaded with weights_only=True: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"init_from: {p} holds a {type(data).__name__}, not a state_dict or a dict of them")
    return data


def _parts(
    p: Path,
    data: dict[object, object],
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    registered: Mapping[str, object],
) -> list[_Part]:
    """The model, the optimizers and the registered objects, each with the keys of ``data`` that
    hold its state.

    Raises:
        ConfigError: no model weights, an ``optimizers`` list of another length, or two keys for one object.
    """

    def present(keys: Sequence[str]) -> list[tuple[str, int | None]]:
        return [(k, None) for k in keys if k in data and k not in registered]

    head = _Part("model", model, present(MODEL_KEYS))
    if not head.sources:
        if not data or not all(isinstance(v, torch.Tensor) for v in data.values()):
            raise ConfigError(
                f"init_from: {p} holds no model weights: none of the keys {list(MODEL_KEYS)} is "
                f"there, and it is no model state_dict itself (its keys: {[str(k) for k in data][:8]})"
            )
        return [_Part("model", model, [("", None)])]  # a bare model state_dict: nothing else is in it
    parts = [head, _Part("optimizer", optimizers[0], present(OPTIMIZER_KEYS))]
    schedulers = [n for n, obj in registered.items() if isinstance(obj, _SCHEDULERS)]
    for name, obj in registered.items():
        keys = [name, *(k for k in SCHEDULER_KEYS if k != name)] if schedulers == [name] else [name]
        parts.append(_Part(name, obj, [(k, None) for k in keys if k in data and (k == name or k not in registered)]))
    if OPTIMIZERS_KEY in data and OPTIMIZERS_KEY not in registered:
        listed = data[OPTIMIZERS_KEY]
        if not isinstance(listed, (list, tuple)) or len(listed) != len(optimizers):
            raise ConfigError(
                f"init_from: {p}: {OPTIMIZERS_KEY!r} holds {_count(listed)}, and the trainer has "
                f"{len(optimizers)} optimizer(s): it must be a list of their state dicts, in order"
            )
        for i, opt in enumerate(optimizers):
            part = next((x for x in parts[1:] if x.obj is opt), None)
            if part is None:
                part = _Part(f"optimizer_{i}", opt)
                parts.append(part)
            part.sources.append((OPTIMIZERS_KEY, i))
    for part in parts:
        if len(part.sources) > 1:
            both = " and ".join(_where(*s) for s in part.sources)
            raise ConfigError(
                f"init_from: {p} holds both {both}, which would both load the {_what(part)}: "
                f"keep one of them in the file (or rename the other)"
            )
    return parts


def _step(p: Path, data: dict[object, object], registered: set[str]) -> tuple[int | None, set[str]]:
    """The file's step count and the keys it came from (several keys must agree).

    Raises:
        ConfigError: a step that is not an int >= 0, or two keys holding different steps.
    """
    found: dict[str, int] = {}
    for key in STEP_KEYS:
        if key not in data or key in registered:
            continue
        value = data[key]
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype in _INT_DTYPES:
            value = int(value.item())
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"init_from: {p}: {key!r} holds {value!r:.80}, which is no step count (an int >= 0)")
        found[key] = value
    if len(set(found.values())) > 1:
        shown = " and ".join(f"{k!r} = {v}" for k, v in found.items())
        raise ConfigError(
            f"init_from: {p} holds both {shown}, two different step counts: keep one of them in the "
            f"file (or rename the other)"
        )
    return next(iter(found.values()), None), set(found)


def _where(key: str, index: int | None) -> str:
    """How messages name a place in the file: 'opt', 'optimizers[1]', the file (a bare state_dict)."""
    return "the file" if key == "" else repr(key) if index is None else f"'{key}[{index}]'"


def _what(part: _Part) -> str:
    return (
        part.name
        if part.name in ("model", "optimizer")
        else f"registered {part.name!r} ({type(part.obj).__qualname__})"
    )


def _count(value: object) -> str:
    return f"{len(value)} entries" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
