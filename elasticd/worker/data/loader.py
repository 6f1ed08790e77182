"""Elastic data loading: the trainer's batches, fetched and collated by a torch DataLoader.

Owns ``ElasticLoader``: a ``torch.utils.data.DataLoader`` over a map-style dataset whose order is
the ``ElasticSampler``'s, never the DataLoader's; and the check of the DataLoader arguments that
``ElasticTrainer.loader`` takes (``loader_arguments``: each one passed on, taken at the value that
means what elasticd does, or refused with the reason). For each ``Batch`` the trainer yields, ``iterate``
yields ``(batch, collate_fn([dataset[i] for i in batch.indices]))``. Never decides the order, the
split or the step (that is ``sampler.py`` and the trainer), and never talks to the other ranks.

Prefetching: worker processes fetch the next batches ahead, predicted under "no change"
(``ElasticSampler.next_batch``: the next micro-batch of the step, or the next step with the
position advanced by the global batch, the same rank and world). Each request carries a ``Tag``
(step, epoch, position, rank, world size, micro-batch) through the worker and back with its data.
When the trainer yields a batch other than the predicted one (a retry of the same step, a new rank
or world after a regroup), the prefetched batches are discarded and prefetching restarts from that
batch; nothing is lost, because a discarded batch's samples are fetched again as part of whatever
the trainer asks for next.

Torch behaviours relied on (torch 2.13):

- The DataLoader hands each item of its ``batch_sampler`` to a worker, which calls the dataset's
  ``__getitems__`` with it (or ``dataset[k]`` for each key) and then ``collate_fn`` on the result;
  results come back in request order (``in_order=True``, the default). A request is the list
  ``[tag, *indices]``, so the tag survives an empty share.
- ``iter()`` on a DataLoader with persistent workers resets its one iterator: the workers finish the
  requests already queued (their results are dropped while the reset waits, each wait bounded by
  ``timeout``), then fetch from a fresh ``iter(batch_sampler)``. Without persistent workers a new
  iterator starts new workers; the old ones are shut down at once.
- ``pin_memory`` pins the tensors inside the ``(tag, data)`` tuple and leaves the tag as it is. With
  no accelerator torch warns and does not pin.

Settings (``timeout``): every wait for a batch from the workers is bounded; ``None`` takes
``DEFAULT_TIMEOUT_S``. A batch with no indices (more ranks than samples left in the epoch) yields
``collate_fn([])`` if the collate function accepts an empty list and ``None`` otherwise (torch's
default collate does not).
"""

from __future__ import annotations

import difflib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any, Protocol, cast

import structlog
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    default_collate,
    default_convert,
)

from elasticd.errors import ConfigError
from elasticd.worker.data.sampler import Batch, ElasticSampler

log = structlog.get_logger(__name__)

DEFAULT_TIMEOUT_S = 300.0

# What a collate function may raise on an empty list (default_collate: IndexError; torch.stack:
# RuntimeError); the empty share then yields None instead.
_EMPTY_COLLATE_ERRORS = (IndexError, KeyError, TypeError, ValueError, RuntimeError)

_PORTING = (
    "elasticd chooses the order of the samples and splits each global batch over whoever is present, "
    "so a sampler or batch_sampler cannot be honoured. To port: pass the dataset and drop the sampler, "
    "e.g. ElasticTrainer.loader(dataset, batch_size=..., num_workers=...); the order comes from "
    "ElasticTrainer(seed=...)"
)

# The DataLoader arguments that ElasticTrainer.loader passes on as they are (ElasticLoader's keywords).
LOADER_ARGUMENTS = (
    "num_workers",
    "collate_fn",
    "pin_memory",
    "prefetch_factor",
    "persistent_workers",
    "worker_init_fn",
    "timeout",
    "multiprocessing_context",
    "generator",
)


@dataclass(frozen=True)
class _Fixed:
    """A DataLoader argument whose job elasticd does itself: the values that mean what elasticd does
    are taken (and dropped); another is refused, with ``why`` and what to do."""

    takes: tuple[object, ...]
    why: str


# Every other argument of torch 2.13's DataLoader (dataset and batch_size are ElasticTrainer.loader's own).
_FIXED: dict[str, _Fixed] = {
    "shuffle": _Fixed(
        (None, True),
        "elasticd reads every epoch in a seeded random order (ElasticTrainer(seed=...)), "
        "the same on every rank at any world size; remove shuffle (shuffle=True is "
        "what elasticd does)",
    ),
    "drop_last": _Fixed(
        (False,),
        "elasticd keeps an epoch's short last global batch and splits it over the ranks "
        "present, so that every sample of an epoch is used once at any world size; remove "
        "drop_last (drop_last=False is what elasticd does)",
    ),
    "sampler": _Fixed(
        (None,),
        "elasticd chooses which samples each rank reads (a seeded order per epoch, each "
        "global batch split over the ranks present); remove it and pass the dataset (the "
        "order comes from ElasticTrainer(seed=...))",
    ),
    "batch_sampler": _Fixed(
        (None,),
        "elasticd chooses which samples each rank reads and how many (batch_size here, "
        "or ElasticTrainer(global_batch_size=...)); remove it and pass the dataset",
    ),
    "in_order": _Fixed(
        (True,),
        "elasticd matches each prefetched batch to its step by the order of its requests; "
        "remove in_order (in_order=True is what elasticd does)",
    ),
    "pin_memory_device": _Fixed(
        ("",), "torch deprecates it and pins on the current accelerator; remove it (pin_memory=True pins)"
    ),
}


def _shown(value: object) -> str:
    return repr(value) if value is None or isinstance(value, (bool, int, float, str)) else type(value).__name__


def loader_arguments(given: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``ElasticTrainer.loader`` checked, as ``ElasticLoader`` takes them. Pure.

    ``LOADER_ARGUMENTS`` pass as they are. A DataLoader argument whose job elasticd does itself
    (``_FIXED``: the order, the split, the epoch's end) is dropped at a value that means what elasticd
    does (``shuffle=True``, ``drop_last=False``, ``sampler=None``, ``in_order=True``, ...).

    Raises:
        ConfigError: an unknown name (the message lists the accepted ones), or a value elasticd
            cannot honour (the message says why and what to do).
    """
    unknown = sorted(set(given) - set(LOADER_ARGUMENTS) - set(_FIXED))
    if unknown:
        close = [m for name in unknown for m in difflib.get_close_matches(name, [*LOADER_ARGUMENTS, *_FIXED], n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        own = ", ".join(f"{name}={_shown(fixed.takes[-1])}" for name, fixed in _FIXED.items())
        raise ConfigError(
            f"ElasticTrainer.loader: unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}{hint}; "
            f"it takes batch_size, {', '.join(LOADER_ARGUMENTS)} (and {own}: what elasticd does)"
        )
    for name, value in given.items():
        fixed = _FIXED.get(name)
        if fixed is not None and not any(value is v or (type(value) is type(v) and value == v) for v in fixed.takes):
            raise ConfigError(f"ElasticTrainer.loader: {name}={_shown(value)} cannot be honoured: {fixed.why}")
    return {name: value for name, value in given.items() if name in LOADER_ARGUMENTS}


class MapDataset(Protocol):
    """A map-style dataset: sample ``i`` is ``dataset[i]`` (a torch ``Dataset``, a list, a tensor)."""

    def __getitem__(self, index: int, /) -> Any: ...


@dataclass(frozen=True)
class Tag:
    """Which batch a prefetched request is for; it travels with the request and its data."""

    step: int
    epoch: int
    position: int
    rank: int
    world_size: int
    micro: int

    @classmethod
    def of(cls, batch: Batch) -> Tag:
        return cls(batch.step, batch.epoch, batch.position, batch.rank, batch.world_size, batch.micro)


class _TaggedDataset:
    """Worker side: a request ``[tag, *indices]`` becomes ``[tag, *samples]``."""

    def __init__(self, dataset: MapDataset) -> None:
        self.dataset = dataset

    def __getitem__(self, key: object) -> Any:
        return key if isinstance(key, Tag) else self.dataset[key]  # type: ignore[index]

    def __getitems__(self, keys: list[Any]) -> list[Any]:
        tag, indices = keys[0], keys[1:]
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None and indices:  # the user's batched fetch (e.g. a Hugging Face dataset)
            return [tag, *getitems(indices)]
        return [tag, *(self.dataset[i] for i in indices)]


class _TaggedCollate:
    """Worker side: ``[tag, *samples]`` becomes ``(tag, collate_fn(samples))``."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, data: list[Any]) -> tuple[Tag, Any]:
        tag, samples = data[0], list(data[1:])
        assert isinstance(tag, Tag), f"a request without its tag: {type(tag).__name__}"
        if samples:
            return tag, self.collate_fn(samples)
        try:
            return tag, self.collate_fn([])
        except _EMPTY_COLLATE_ERRORS:
            return tag, None


class _Requests:
    """Main process: the DataLoader's batch_sampler.

    Yields the request of the batch at ``start`` and then of its predicted successors, without end
    (the trainer decides when to stop); remembers the batches handed to the workers and not yet
    consumed, in order.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler
        self.start: Batch | None = None
        self.in_flight: deque[Batch] = deque()

    def __iter__(self) -> Iterator[list[Any]]:
        self.in_flight.clear()
        batch = self.start
        assert batch is not None, "set start before iter()"
        while True:
            self.in_flight.append(batch)
            yield [Tag.of(batch), *batch.indices]
            batch = self.sampler.next_batch(batch)


def _shutdown(iterator: Iterator[Any] | None) -> None:
    # torch has no public call to stop a DataLoader iterator's workers (its __del__ does it, whenever
    # the iterator is collected); _MultiProcessingDataLoaderIter._shutdown_workers is that call.
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


def _length(dataset: object) -> int | None:
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:  # no __len__ (a generated dataset for an endless stream)
        return None


class ElasticLoader:
    """The trainer's batches, fetched and collated by DataLoader workers that prefetch ahead.

    Args:
        dataset: a map-style dataset; sample ``i`` is ``dataset[i]``.
        sampler: the trainer's ``ElasticSampler`` (it predicts the batches to prefetch).
        num_workers: worker processes; 0 fetches in this process, without prefetching.
        collate_fn: turns a list of samples into the batch's data; torch's default collate if None.
        pin_memory: pin the collated tensors (torch warns and skips it without an accelerator).
        prefetch_factor: requests in flight per worker (torch's default, 2, if None).
        persistent_workers: keep the workers between restarts of the prefetch (True if None and
            ``num_workers > 0``): a restart then costs the queued requests, not new processes.
        worker_init_fn: as the DataLoader's.
        timeout: seconds to wait for one batch from the workers; None is ``DEFAULT_TIMEOUT_S``.
        multiprocessing_context: as the DataLoader's (e.g. "fork", "spawn", "forkserver").
        generator: as the DataLoader's (it seeds the workers' base seed).

    Raises:
        ConfigError: an IterableDataset, a dataset whose length is not the sampler's dataset size, or
            a DataLoader setting that torch rejects; the message names it.
    """

    def __init__(
        self,
        dataset: MapDataset,
        sampler: ElasticSampler,
        *,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        worker_init_fn: Callable[[int], None] | None = None,
        timeout: float | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise ConfigError(
                f"dataset: {type(dataset).__name__} is an IterableDataset; ElasticTrainer.loader needs a "
                "map-style dataset (sample i is dataset[i]) because elasticd chooses which samples each rank "
                "reads. For generated data use the endless source: ElasticTrainer(dataset_size=None, ...) "
                "and trainer.batches(), whose batches carry the global sample numbers (generate sample i "
                "from seed + i)"
            )
        if not callable(getattr(dataset, "__getitem__", None)):
            raise ConfigError(f"dataset: {type(dataset).__name__} has no __getitem__ (a map-style dataset is needed)")
        n = _length(dataset)
        if sampler.dataset_size is not None and n is not None and n != sampler.dataset_size:
            raise ConfigError(f"dataset_size: the sampler reads {sampler.dataset_size} samples, the dataset has {n}")
        if timeout is None:
            timeout = DEFAULT_TIMEOUT_S
        if not timeout > 0:
            raise ConfigError(
                f"timeout: must be > 0 seconds (every wait is bounded; None is {DEFAULT_TIMEOUT_S:g}), got {timeout}"
            )
        self.sampler = sampler
        self.timeout_s = float(timeout)
        self.persistent_workers = num_workers > 0 if persistent_workers is None else persistent_workers
        self._requests = _Requests(sampler)
        try:
            self._loader: DataLoader[Any] = DataLoader(
                _TaggedDataset(dataset),  # type: ignore[arg-type]
                batch_sampler=self._requests,
                num_workers=num_workers,
                collate_fn=_TaggedCollate(collate_fn or default_collate),
                pin_memory=pin_memory,
                timeout=self.timeout_s if num_workers > 0 else 0,  # torch bounds only waits on workers
                worker_init_fn=worker_init_fn,
                multiprocessing_context=multiprocessing_context,
                # its own generator: a new iterator draws the workers' base seed from it, and the
                # global one is synced state (each prefetch restart would move it)
                generator=generator if generator is not None else torch.Generator().manual_seed(sampler.seed),
                prefetch_factor=prefetch_factor,
                persistent_workers=self.persistent_workers,
            )
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"ElasticTrainer.loader: {exc}") from exc
        self._iterator: Iterator[tuple[Tag, Any]] | None = None
        self._expected: Batch | None = None  # the batch the current iterator yields next
        self._closed = False
        self.discarded = 0  # prefetched batches thrown away because the trainer asked for another
        self.restarts = 0  # times the prefetch restarted from a batch it had not predicted

    @classmethod
    def from_dataloader(cls, loader: DataLoader[Any], sampler: ElasticSampler) -> ElasticLoader:
        """An ElasticLoader with the settings of an existing DataLoader.

        Reuses its dataset, num_workers, collate_fn, pin_memory, prefetch_factor, persistent_workers,
        worker_init_fn, timeout (0, torch's "wait forever", becomes ``DEFAULT_TIMEOUT_S``),
        multiprocessing_context and generator. Its batch_size, shuffle and drop_last are ignored:
        the global batch, the order and the epoch's end are the trainer's.

        Raises:
            ConfigError: the DataLoader has its own sampler or batch_sampler (a DistributedSampler,
                say), or an IterableDataset, or a setting ElasticLoader rejects.
        """
        dataset = loader.dataset
        if not isinstance(dataset, IterableDataset):
            _check_default_order(loader)
        collate: Callable[[list[Any]], Any] | None = loader.collate_fn
        if collate is default_collate or collate is default_convert:  # torch's defaults (batch_size None: convert)
            collate = None
        return cls(
            dataset,
            sampler,
            num_workers=loader.num_workers,
            collate_fn=collate,
            pin_memory=loader.pin_memory,
            prefetch_factor=loader.prefetch_factor,
            persistent_workers=loader.persistent_workers,
            worker_init_fn=loader.worker_init_fn,
            timeout=loader.timeout or None,
            multiprocessing_context=loader.multiprocessing_context,
            generator=loader.generator,
        )

    def iterate(self, batches: Iterable[Batch]) -> Iterator[tuple[Batch, Any]]:
        """For each batch the trainer yields, yield it with its collated data.

        Args:
            batches: the trainer's batches, e.g. ``trainer.batches(max_steps)``, taken as they come.

        Yields:
            ``(batch, collate_fn([dataset[i] for i in batch.indices]))``; ``None`` as the data of a
            batch with no indices whose collate function rejects an empty list.

        Raises:
            ValueError: the loader is closed.
            RuntimeError: a worker died, or no batch came within ``timeout`` (torch's errors); an
                error raised by the dataset or collate_fn in a worker is raised here as itself.
        """
        for batch in batches:
            yield batch, self.fetch(batch)

    def fetch(self, batch: Batch) -> Any:
        """The collated data of ``batch``: prefetched if it was predicted, fetched now otherwise.

        Raises:
            ValueError: the loader is closed.
            RuntimeError: a worker died, or no batch came within ``timeout`` (torch's errors).
        """
        if self._closed:
            raise ValueError("ElasticLoader is closed")
        if self._iterator is None or batch != self._expected:
            self._restart(batch)
        assert self._iterator is not None
        self._expected = None  # if the fetch fails, the next one starts over
        tag, data = next(self._iterator)
        done = self._requests.in_flight.popleft()
        assert tag == Tag.of(batch) and done == batch, f"prefetch out of step: got {tag}, wanted {Tag.of(batch)}"
        self._expected = self.sampler.next_batch(batch)
        return data

    def _restart(self, batch: Batch) -> None:
        if self._iterator is not None:
            dropped = len(self._requests.in_flight)
            self.discarded += dropped
            self.restarts += 1
            log.debug(
                "prefetch_restarted",
                step=batch.step,
                epoch=batch.epoch,
                position=batch.position,
                rank=batch.rank,
                world_size=batch.world_size,
                discarded=dropped,
            )
            if not self.persistent_workers:
                _shutdown(self._iterator)
        self._requests.start = batch
        self._iterator = iter(self._loader)  # persistent workers: the same iterator, reset

    def close(self) -> None:
        """Shut the worker processes down; the loader cannot be used afterwards."""
        self._closed = True
        iterator, self._iterator = self._iterator, None
        self._expected = None
        _shutdown(iterator)

    def __enter__(self) -> ElasticLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_default_order(loader: DataLoader[Any]) -> None:
    """Raise unless the DataLoader's sampler and batch_sampler are the ones torch made by default."""
    s, bs, dataset = loader.sampler, loader.batch_sampler, cast(object, loader.dataset)
    default_sampler = (type(s) is SequentialSampler and s.data_source is dataset) or (
        type(s) is RandomSampler
        and s.data_source is dataset
        and not s.replacement
        and s.num_samples == _length(dataset)
        and s.generator is loader.generator
    )
    default_batches = bs is None or (type(bs) is BatchSampler and bs.sampler is s)
    if not default_sampler:
        raise ConfigError(f"ElasticTrainer.loader: the DataLoader has its own sampler ({type(s).__name__}); {_PORTING}")
    if not default_batches:
        raise ConfigError(
            f"ElasticTrainer.loader: the DataLoader has its own batch_sampler ({type(bs).__name__}); {_PORTING}"
        )
