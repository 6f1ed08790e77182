"""What each step's global batch is made of: the dataset size, the global batch size, the sampler.

Owns ``DataPlan``: the trainer's data settings as given (a dataset size or none, a global batch
size, or a per-rank one from ``loader(batch_size=...)``), the reference world size (given, or the
first generation's, kept in the synced counters so that newcomers and resumed jobs agree), and the
``ElasticSampler`` built from them once they are known. Never fetches data (``loader`` does) and
never decides membership.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import structlog

from elasticd.errors import ConfigError
from elasticd.worker.data.loader import ElasticLoader
from elasticd.worker.data.sampler import Batch, BatchMode, ElasticSampler
from elasticd.worker.state.training import Counters

log = structlog.get_logger(__name__)


class DataPlan:
    """The data settings of one trainer and the sampler they make."""

    def __init__(
        self,
        dataset_size: int | None,
        global_batch_size: int | None,
        seed: int,
        mode: BatchMode,
        reference_world_size: int | None,
        accumulation_steps: int = 1,
    ) -> None:
        """
        Raises:
            ConfigError: a value is invalid.
        """
        if reference_world_size is not None and reference_world_size < 1:
            raise ConfigError(f"reference_world_size: must be >= 1, got {reference_world_size}")
        self.dataset_size, self.global_batch, self.seed, self.mode = dataset_size, global_batch_size, seed, mode
        self.per_rank_batch: int | None = None  # loader(batch_size=): per rank and micro-batch
        self.accumulation = accumulation_steps
        self.reference_world = reference_world_size
        self.sampler = ElasticSampler(dataset_size, global_batch_size, seed, mode) if global_batch_size else None

    def use_dataset(self, dataset: object, batch_size: int | None) -> None:
        """``loader(dataset, batch_size=...)``: the dataset defines the size; ``batch_size`` is per
        rank and micro-batch, as a DataLoader's under DDP (a step's global batch is ``batch_size x
        accumulation_steps x`` the reference world size).

        Raises:
            ConfigError: the dataset has no length (an IterableDataset: use the endless source,
                ``dataset_size=None`` and ``batches()``), its size differs from a ``dataset_size``
                given to the trainer, or no batch size is known.
        """
        try:
            size = len(dataset)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(
                f"loader: {type(dataset).__name__} has no length: a map-style dataset is needed (for "
                f"generated data, leave dataset_size unset and index it with batches())"
            ) from exc
        if self.dataset_size is not None and self.dataset_size != size:
            raise ConfigError(
                f"loader: the dataset has {size} samples, the trainer was given dataset_size={self.dataset_size}"
            )
        if batch_size is None and self.global_batch is None:
            raise ConfigError("loader: give batch_size (per rank) here or global_batch_size to the trainer")
        if batch_size is not None and batch_size < 1:
            raise ConfigError(f"loader: batch_size must be >= 1, got {batch_size}")
        if self.sampler is not None and self.sampler.dataset_size != size:
            self.sampler = None
        self.dataset_size = size
        if batch_size is not None and self.global_batch is None:
            self.per_rank_batch = batch_size

    def check_ready(self) -> None:
        """Before the first batch: the batch size is known.

        Raises:
            ConfigError: neither ``global_batch_size`` nor ``loader(batch_size=...)`` gave one.
        """
        if self.global_batch is None and self.per_rank_batch is None:
            raise ConfigError("no batch size: give global_batch_size to the trainer, or batch_size to loader()")

    @property
    def needs_first_generation(self) -> bool:
        """The global batch is a per-rank size times the first generation's size (not known yet)."""
        return (
            self.sampler is None
            and self.global_batch is None
            and self.reference_world is None
            and self.mode is BatchMode.CONSTANT_GLOBAL
        )

    def reference(self, counters: Counters, world_size: int) -> int:
        """The reference world size: given, or the first generation's (``world_size`` when the
        synced counters hold none yet; they keep it from then on)."""
        if self.reference_world is not None:
            return self.reference_world
        if not counters.reference_world:
            counters.reference_world = world_size
        return counters.reference_world

    def make_sampler(self, counters: Counters, world_size: int) -> ElasticSampler:
        """The sampler, built at the first call once the batch size is known; the global batch
        is stated then (``global_batch`` log line)."""
        if self.sampler is None:
            source = "global_batch_size"
            if self.global_batch is None:
                assert self.per_rank_batch is not None, "loader() or global_batch_size sets the batch size"
                per_rank = self.per_rank_batch * self.accumulation  # a step's share of one rank
                if self.mode is BatchMode.LINEAR_SCALING:
                    self.global_batch, source = per_rank, "per rank (linear_scaling)"
                else:
                    chose = self.reference_world is None and not counters.reference_world
                    self.global_batch = per_rank * self.reference(counters, world_size)
                    source = (
                        "reference_world_size"
                        if self.reference_world is not None
                        else "first generation"
                        if chose
                        else "the job's first generation (synced)"
                    )
            self._state_global_batch(source, self.reference_world or counters.reference_world or world_size)
            self.sampler = ElasticSampler(self.dataset_size, self.global_batch, self.seed, self.mode)
        return self.sampler

    def _state_global_batch(self, source: str, reference: int) -> None:
        """One line with the global batch and where it comes from; a warning when it is the first
        generation's size times the per-rank batch (a job that starts with other workers trains
        with another global batch)."""
        fields = {
            "global_batch_size": self.global_batch,
            "per_rank_batch": self.per_rank_batch,
            "accumulation_steps": self.accumulation,
            "reference_world_size": reference,
            "batch_mode": str(self.mode),
            "source": source,
        }
        if source == "first generation":
            log.warning(
                "global_batch_from_first_generation",
                **fields,
                fix="set ElasticTrainer(reference_world_size=...) or global_batch_size=... so that "
                "the global batch does not depend on how many workers joined first",
            )
        else:
            log.info("global_batch", **fields)


def collated(loader: ElasticLoader, batches: Iterator[Batch]) -> Iterator[Any]:
    """The collated data of each batch the trainer yields (``ElasticTrainer.loader``); the
    loader's workers stop when the iteration ends, however it ends."""
    try:
        for _batch, data in loader.iterate(batches):
            yield data
    finally:
        loader.close()
        if isinstance(batches, Generator):
            batches.close()  # a loop left early: the trainer's batches end here, not at a garbage collection
