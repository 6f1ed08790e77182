"""Durable checkpoints of a sharded model, in the ``torch.distributed.checkpoint`` (DCP) format.

Owns ``ShardedCheckpointWriter``, which the K ranks of rank 0's replica run together, and
``reader``, with which each rank of any replica loads its shard. A save is one DCP checkpoint,
``<seq:08d>-step<step:012d>.dcp/``, that the K ranks write at the same step boundary, each its own
shard, in the background over a group of their own (``Replica.checkpoint_group``), with a manifest
``<name>.json`` beside it (``durable_format.FORMAT_SHARDED``). Shard 0 chooses the seq and
publishes: the directory is written under a temp name and renamed into place, with its manifest,
once the saved step is confirmed committed (deleted if the step is discarded), as a data-parallel
checkpoint's file is (``durable.CheckpointWriter``).

What the directory holds, by DCP key (``sharded_state``):

* ``model.<fqn>``: the model's state dict, a sharded parameter as a ``DTensor`` of its global
  shape (each rank writes its shard), anything else as a plain tensor;
* ``optim.state.<fqn>.<name>``: the optimizer's state tensors, keyed by parameter name as
  ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` keys them (moments sharded
  like their parameter);
* ``elasticd.shard-<i>.layout``, ``.rest`` and ``.checksum``, per shard index: the state's layout
  (``TrainingState.pack``, UTF-8 JSON as uint8), the bytes of everything else of the state (the
  registered objects, the counters, the RNG states) and the state checksum of shard ``i``.

So a plain script loads the model (and the optimizer's tensors) with ``dcp.load`` into a model
of any sharding, or none; and a replica of the same K of any later job loads shard ``i`` into
rank ``i``, checks its checksum, and unpacks it (``TrainingState.unpack``) as if rank 0 had sent it.
A save's K ranks must agree to write it, on what seq, and when the previous write is still running
to skip it: ``save`` takes the replica's ``agree`` for that, so the saves are collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from elasticd.worker.shard.replica import Replica
from elasticd.worker.state.checksum import checksum_key, state_checksum
from elasticd.worker.state.durable import (
    CheckpointWriter,
    SavedCheckpoint,
    SaveJob,
    PendingSave,
    remove_path,
    tmp_path,
    write_parts,
)
from elasticd.worker.state.durable_format import (
    FORMAT_SHARDED,
    Entry,
    Manifest,
    checkpoint_name,
    manifest_of,
)
from elasticd.worker.state.training import TrainingState, local_shard


VERSION = 1
# What reading a damaged or foreign DCP directory raises (a bad file, a bad pickle, a bad zip)
_DCP_ERRORS = (CheckpointException, RuntimeError, EOFError, pickle.UnpicklingError, UnicodeDecodeError, TypeError)
DATA_SUFFIX = ".dcp"


@dataclass(frozen=True)
class Place:
    """Where one tensor of the state's layout goes in the DCP state dict: its key path, and the
    sharded tensor it is the local shard of (None: a plain tensor)."""

    path: tuple[str, ...]
    like: DTensor | None


def places(layout: dict[str, object], state: TrainingState) -> dict[str, Place]:
    """The model's and the optimizer's tensors of ``layout`` by name, and where each goes
    (``sharded_state``). Reads the model's state dict and the optimizer's params; changes nothing.

    Raises:
        ValueError: a layout entry names a model tensor this model lacks, or a shard of another shape.
    """
    ours = state.model.state_dict()
    names = {id(p): n for n, p in state.model.named_parameters()}
    params = [p for g in state.optimizer.param_groups for p in g["params"]]
    out: dict[str, Place] = {}
    for entry in layout["tensors"]:  # type: ignore[attr-defined]
        name, shape = str(entry[0]), [int(d) for d in entry[2]]
        if name.startswith("model."):
            fqn = name[len("model.") :]
            mine = ours.get(fqn)
            if mine is None or list(local_shard(mine).shape) != shape:
                raise ValueError(f"{name} {shape} does not match this worker's model")
            out[name] = Place(("model", fqn), mine if isinstance(mine, DTensor) else None)
        elif name.startswith("optim."):
            _, idx, key = name.split(".", 2)
            p = params[int(idx)] if 0 <= int(idx) < len(params) else None
            fqn = names.get(id(p), f"param{idx}")
            like = p if isinstance(p, DTensor) and shape and shape == list(p.to_local().shape) else None
            out[name] = Place(("optim", "state", fqn, key), like)
    return out


def rest_start(layout: dict[str, object], placed: dict[str, Place]) -> int:
    """Where the bytes that are neither the model's nor the optimizer's begin in the arena (they
    run to its end; ``TrainingState`` puts the model and the optimizer first). Pure.

    Raises:
        ValueError: a placed tensor lies past that point.
    """
    entries = layout["tensors"]  # type: ignore[assignment]
    start = min((int(e[3]) for e in entries if e[0] not in placed), default=int(layout["total"]))  # type: ignore[call-overload]
    for e in entries:
        if e[0] in placed and int(e[3]) + int(e[4]) > start:
            raise ValueError(f"{e[0]} lies among the registered objects' bytes")
    return start


def sharded_state(
    layout_bytes: bytes, arena: torch.Tensor, placed: dict[str, Place], shard: int, checksum: torch.Tensor
) -> dict[str, object]:
    """The DCP state dict over ``arena`` (views, no copy): see the module's docstring."""
    layout = json.loads(layout_bytes)
    sd: dict[str, object] = {}
    for name, dtype_s, shape, offset, nbytes in layout["tensors"]:
        place = placed.get(name)
        if place is None:
            continue
        dtype = getattr(torch, dtype_s.removeprefix("torch."))
        view = arena[offset : offset + nbytes].view(dtype).reshape(shape)
        if place.like is not None:
            like = place.like
            view = DTensor.from_local(
                view, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
            )
        node = sd
        for part in place.path[:-1]:
            node = node.setdefault(part, {})  # type: ignore[assignment]
        node[place.path[-1]] = view
    start = rest_start(layout, placed)
    sd["elasticd"] = {
        f"shard-{shard}": {
            "layout": torch.frombuffer(bytearray(layout_bytes), dtype=torch.uint8),
            "rest": arena[start:],
            "checksum": checksum,
        }
    }
    return sd


class ShardedCheckpointWriter(CheckpointWriter):
    """The background saves of one rank of rank 0's replica (see the module's docstring).

    ``due`` counts steps only (``checkpoint_every_s`` is refused for a sharded model: the K ranks
    must choose the same steps). Shard 0 publishes; the others write their shard and publish nothing.
    """

    def __init__(self, directory: Path, *, replica: Replica, group: dist.ProcessGroup, **kwargs: object) -> None:
        super().__init__(directory, **kwargs)  # type: ignore[arg-type]
        self._replica, self._group = replica, group

    def save(self, state: TrainingState, generation: int, pending: bool = False) -> bool:
        """Snapshot this rank's shard of ``state`` and write it with the replica's other ranks.

        Every rank of the replica calls it at the same step. They agree (``Replica.agree``) on the
        seq (shard 0's) and on whether every rank's previous write has ended within ``wait_s``;
        if one has not, none saves (``checkpoint_skipped``).

        Raises:
            ReplicaBroken: the replica's ranks could not agree (a rank is gone).
        """
        idle = self._idle.wait(self._wait_s)
        seq = self._peek_seq() if self._replica.shard == 0 else 0
        busy, seq_sum = self._replica.agree([0.0 if idle else 1.0, float(seq)], "a checkpoint save")
        if busy:
            return self._skip(state, "a rank of the replica still writes the previous save")
        self._seq = round(seq_sum)
        return self._enqueue(state, generation, pending, seq=self._seq, describe=lambda layout: places(layout, state))

    def _write(self, job: SaveJob) -> PendingSave | None:
        """Write this rank's shard into the save's temp directory (DCP, over the replica's
        checkpoint group); shard 0 then writes the manifest under its temp name."""
        started = time.monotonic()
        self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)
        name = checkpoint_name(job.seq, job.step)
        tmp = self.directory / f".{name}{DATA_SUFFIX}.tmp.shards"
        layout = json.loads(job.layout)
        total = int(layout["total"])
        data = memoryview(job.payload.numpy()).cast("B")  # type: ignore[arg-type]
        checksum = state_checksum(checksum_key(layout), data[:total], total)
        placed: dict[str, Place] = job.places  # type: ignore[assignment]
        sd = sharded_state(job.layout, job.payload, placed, self._replica.shard, torch.tensor([checksum]))
        try:
            dcp.save(sd, storage_writer=FileSystemWriter(tmp), process_group=self._group)
        except BaseException as exc:
            if self._replica.shard == 0:
                with contextlib.suppress(OSError):
                    remove_path(tmp)
            if isinstance(exc, CheckpointException):  # a BaseException: say what failed, as an Exception
                raise cause_of(exc) from exc
            raise
        if self._replica.shard != 0:
            return None
        private(tmp)
        final = self.directory / (name + DATA_SUFFIX)
        manifest = Manifest(
            format=FORMAT_SHARDED,
            version=VERSION,
            job=self._job_id,
            seq=job.seq,
            step=job.step,
            generation=job.generation,
            node=self._node,
            signature=self._signature,
            file=final.name,
            file_bytes=sum(f.stat().st_size for f in tmp.iterdir()),
            header_bytes=0,
            payload_offset=0,
            payload_bytes=job.payload.numel(),
            state_bytes=total,
            state_checksum=checksum,
            crc32=0,
            epoch=job.epoch,
            position=job.position,
            created=time.time(),
            shards=self._replica.size,
        )
        manifest_tmp = tmp_path(self.directory, name + ".json")
        write_parts(manifest_tmp, [memoryview(json.dumps(manifest.__dict__, indent=1).encode())], None)
        saved = SavedCheckpoint(final, manifest, time.monotonic() - started)
        return PendingSave(job.step, saved, manifest_tmp, data_tmp=tmp)


def private(directory: Path) -> None:
    """The job's model is never world-readable: ``directory`` 0750 and its files 0640, as a
    data-parallel checkpoint's (DCP creates them with the process's umask)."""
    os.chmod(directory, 0o750)
    for f in directory.iterdir():
        os.chmod(f, 0o640)


def cause_of(exc: CheckpointException) -> Exception:
    """What failed in a DCP save or load, as the writer reports it: the first ``OSError`` of any
    rank (its errno names the cause: EROFS, ENOSPC), else the first exception, else a RuntimeError."""
    failures = [pair[0] for _, pair in sorted(exc.failures.items())]
    for failure in failures:
        if isinstance(failure, OSError):
            return failure
    first = next((f for f in failures if isinstance(f, Exception)), None)
    return first if first is not None else RuntimeError(str(exc)[:500])


def read_shard(entry: Entry, state: TrainingState, shard: int, size: int) -> tuple[Manifest, bytes, torch.Tensor]:
    """Check and read shard ``shard`` of a sharded checkpoint for ``state``'s model and optimizer
    (nothing of ``state`` changes): (manifest, layout JSON bytes, the arena to ``unpack``); the
    manifest's ``state_checksum`` is this shard's. ``durable_format.load_latest``'s ``read`` for
    rank ``shard`` of a replica of ``size`` ranks.

    The directory's ``.metadata`` is DCP's, a pickle: load checkpoints of a directory you trust.

    Raises:
        ValueError: not a sharded checkpoint of replicas of ``size`` ranks, incomplete, or its
            shard's bytes do not match their checksum.
        OSError: a file cannot be read.
    """
    man = manifest_of(entry, size)
    assert entry.data_path is not None
    try:
        layout_bytes, arena, saved_sum = _read_dcp(entry.data_path, state, shard)
    except _DCP_ERRORS as exc:
        raise ValueError(
            f"torch.distributed.checkpoint could not read it: {type(exc).__name__}: {str(exc)[:300]}"
        ) from exc
    layout = json.loads(layout_bytes)
    total = int(layout["total"])
    data = memoryview(arena.numpy()).cast("B")  # type: ignore[arg-type]
    checksum = state_checksum(checksum_key(layout), data[:total], total)
    if checksum != saved_sum:
        raise ValueError(
            f"checksum of shard {shard} ({checksum:016x}) does not match the one saved with it "
            f"({saved_sum:016x}) (corrupt bytes)"
        )
    return replace(man, state_checksum=checksum), layout_bytes, arena


def _read_dcp(path: Path, state: TrainingState, shard: int) -> tuple[bytes, torch.Tensor, int]:
    """(layout JSON bytes, arena, the checksum saved with them) of shard ``shard`` in ``path``."""
    keys = f"elasticd.shard-{shard}."
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        meta = FileSystemReader(path).read_metadata().state_dict_metadata
        try:
            layout_t = torch.zeros(meta[keys + "layout"].size, dtype=torch.uint8)  # type: ignore[union-attr]
            rest_n = int(meta[keys + "rest"].size[0])  # type: ignore[union-attr]
        except (KeyError, AttributeError, IndexError) as exc:
            raise ValueError(f"it holds no shard {shard} of this format: {exc}") from exc
        saved_sum = torch.zeros(1, dtype=torch.int64)
        head = {"elasticd": {f"shard-{shard}": {"layout": layout_t, "checksum": saved_sum}}}
        dcp.load(head, checkpoint_id=path, no_dist=True)
        layout_bytes = bytes(layout_t.numpy())
        layout = json.loads(layout_bytes)
        placed = places(layout, state)
        start = rest_start(layout, placed)
        arena = torch.zeros(start + rest_n, dtype=torch.uint8)  # the padding between tensors is zeros
        dcp.load(sharded_state(layout_bytes, arena, placed, shard, saved_sum), checkpoint_id=path, no_dist=True)
    return layout_bytes, arena, int(saved_sum.item())
