"""One trainer's use of durable checkpoints: rank 0's saves, a member's resume, a starting file.

Owns ``Checkpoints``: when rank 0 saves (``CheckpointWriter.due``) after applying a step, and that
the save becomes visible only once the ``Journal`` confirms its step (and is deleted when the journal
discards it: a branch the job left, never published nor resumed from), what a member
loads when the rendezvous finds no live state (``resume``: the newest good checkpoint of this
model, or a refusal to start over when only another model's checkpoints are there), and
``load_initial``, which loads weights (and optionally optimizer, scheduler and other registered
state) from a plain ``torch.save`` file with ``weights_only=True`` before the first rendezvous. Never
decides who is rank 0 or when a job resumes (the membership does), and never writes a file itself
(``durable`` does).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog
import torch

from elasticd.config import CheckpointConfig
from elasticd.errors import CheckpointModelChanged, ConfigError
from elasticd.worker.durable import CheckpointWriter
from elasticd.worker.durable_format import LoadedCheckpoint, job_dir, load_latest, refuse_new_model, scan, signature_of
from elasticd.worker.journal import Journal
from elasticd.worker.state import TrainingState

log = structlog.get_logger(__name__)


class Checkpoints:
    """Durable checkpoints of one trainer (``CheckpointConfig``; off without a directory)."""

    def __init__(self, config: CheckpointConfig, job_id: str, node: str, state: TrainingState, journal: Journal) -> None:
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
            self._writer = CheckpointWriter(
                self.directory, job_id=self._job_id, node=self._node, signature=self._state.signature,
                every_steps=c.checkpoint_every_steps, every_s=c.checkpoint_every_s, keep=c.checkpoint_keep,
                wait_s=c.checkpoint_wait_s, on_saved=self._journal.checkpoint_saved, on_failed=self.on_failed,
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
        loaded = load_latest(self.directory, self._state, newer_than=held_step)
        if loaded is None:
            if held_step < 0:  # it would start over from step 1 (holding state, it would not)
                refuse_new_model(self.directory, self._state.signature, self.config.checkpoint_allow_new_model)
                self._refuse_unloadable()
            return held_step
        self.resumed_from = loaded
        self._journal.resumed(loaded)
        return loaded.manifest.step

    def _refuse_unloadable(self) -> None:
        """Checkpoints of this model are there but none loads (damaged, or the registered state
        differs: a scheduler or an EMA added since): starting over from step 1 would silently drop
        their progress, so stop unless ``checkpoint_allow_new_model``. Nothing is deleted. A data
        file without its manifest is no checkpoint (a save never confirmed, or cut off) and counts
        for nothing here.

        Raises:
            CheckpointModelChanged: such checkpoints exist and the setting is off.
        """
        try:
            steps = [e.step for e in scan(self.directory)
                     if e.manifest_path is not None and signature_of(e) == self._state.signature]
        except OSError:
            return
        if not steps:
            return
        if self.config.checkpoint_allow_new_model:
            log.warning("checkpoint_none_usable_started_over", directory=str(self.directory), steps=steps[:5])
            return
        raise CheckpointModelChanged(
            f"{self.directory} holds {len(steps)} checkpoint(s) of this model (newest step {steps[0]}) and none "
            f"loads (see checkpoint_rejected: damaged, or registered state that differs from this worker's "
            f"register() calls); refusing to start over from step 1. Fix the registrations, or set "
            f"checkpoint_allow_new_model to start over (nothing is deleted)")

    def close(self) -> None:
        """Stop the writer: the work queued finishes (at most ``checkpoint_wait_s``); a save whose
        step the journal has not confirmed by now is deleted, never published (settle the last
        steps in the journal first)."""
        if self._writer is not None:
            self._writer.close()


def _failure_recorder(journal: Journal, directory: Path, generation: list[int]) -> Callable[[int, Exception], None]:
    def on_failed(step: int, exc: Exception) -> None:
        journal.save_failed(step, exc, generation[0], directory)

    return on_failed


def load_initial(path: str | Path, model: torch.nn.Module, others: Mapping[str, object]) -> list[str]:
    """Load a plain ``torch.save`` file into ``model`` (and the objects of ``others`` that it names),
    with ``weights_only=True``: tensors and plain containers only, nothing is executed.

    The file is either a model ``state_dict`` or a dict with a ``"model"`` entry and, optionally,
    entries named like ``others`` (``"optimizer"``, ``"scheduler"``, any registered name), each
    loaded with that object's ``load_state_dict``. Returns the names loaded.

    Raises:
        ConfigError: the file is missing, not loadable with ``weights_only``, or does not fit.
    """
    p = Path(path)
    try:
        data = torch.load(p, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ConfigError(f"init_from: {p} does not exist") from exc
    except (pickle.UnpicklingError, RuntimeError, OSError, ValueError, EOFError) as exc:
        # weights_only refuses anything but tensors and plain containers with UnpicklingError
        raise ConfigError(f"init_from: {p} cannot be loaded with weights_only=True: {type(exc).__name__}: "
                          f"{str(exc)[:300]}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"init_from: {p} holds a {type(data).__name__}, not a state_dict or a dict of them")
    model_sd = data["model"] if "model" in data else data
    loaded: list[str] = []
    try:
        model.load_state_dict(model_sd)
        loaded.append("model")
        if "model" in data:
            for name, obj in others.items():
                if name in data:
                    obj.load_state_dict(data[name])  # type: ignore[attr-defined]
                    loaded.append(name)
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise ConfigError(f"init_from: {p} does not fit this model: {str(exc)[:400]}") from exc
    log.info("initial_state_loaded", path=str(p), parts=loaded)
    return loaded
