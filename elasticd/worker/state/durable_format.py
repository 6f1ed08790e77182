"""The durable checkpoint's file format and its reading: magic, header, manifest, the directory
scan, verification, loading, and which files retention removes.

Owns what a checkpoint on disk is, and the checks a file must pass before anything of it is loaded
(``verify``); ``load_latest``, which loads the newest checkpoint that passes them into a
``TrainingState``, falling back to older ones; ``removable``, retention's choice (the
``checkpoint_keep`` newest of the writer's model are kept, another model's are never deleted);
which models' checkpoints a directory holds (``signature_of``, ``other_models``), and
``refuse_new_model``, which stops a worker that finds only another model's checkpoints from
starting over. Never writes or deletes a file (``durable.CheckpointWriter`` does), and never
decides who saves or when a job resumes (the trainer and ``membership`` do).

Files of one checkpoint, in the directory of its job (``job_dir``: ``<checkpoint_dir>/<job_id>/``),
``<name> = <seq:08d>-step<step:012d>`` (``checkpoint_name``):

* ``<name>.ckpt``: the 16-byte ``MAGIC``; an 8-byte little-endian length H (``HEADER_LEN``); H
  bytes of a JSON header (format, version, job, step, generation, node, model signature, sizes,
  and the state layout of ``TrainingState.pack``: tensor names, dtypes, shapes, offsets, optimizer
  param groups and scalars, the registered objects' state); zero padding to a 4096-byte boundary
  (64 in files of earlier versions); the payload: the flat arena (model, optimizer and registered
  objects' tensors, the counters ``step, epoch, position, reference_world``, then the CPU RNG state and each CUDA
  device's).
* ``<name>.json``: the ``Manifest``, written after the data file is durable (under a temp name,
  and renamed to this one once the saved step is confirmed committed): step, seq, sizes, the
  state checksum (``checksum.state_checksum``: an XXH3 hash of the state tensors' bytes, seeded
  with ``checksum.checksum_key`` of the layout; in version 2 files, seeded with the tensor entries
  only, ``legacy_checksum_key``) and a CRC-32 of every other byte of the file; together they cover
  the whole file.

A sharded model's checkpoint (``FORMAT_SHARDED``, written by ``shard.checkpoint``) is a
torch.distributed.checkpoint directory ``<name>.dcp`` in place of ``<name>.ckpt``, with the same
manifest (its ``shards``: the replica size that wrote it); ``verify`` refuses one, naming the
``--replica-size`` it loads at.

A checkpoint exists only once its manifest and its data file both do (a manifest without its data
file is rejected as incomplete). ``seq`` grows with every save into the directory, so the newest
save wins even when a job was resumed from an older step. Reading parses JSON and raw bytes only:
nothing in a file is executed (no pickle, no ``torch.load``), and a file that does not start with
``MAGIC`` is refused before anything else is read from it.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from pathlib import Path

import structlog
import torch

from elasticd.errors import CheckpointModelChanged, ModelMismatch, StateCorrupt
from elasticd.worker.state.checksum import checksum_key, state_checksum
from elasticd.worker.state.training import TrainingState

log = structlog.get_logger(__name__)

FORMAT = "elasticd-checkpoint"
# A sharded model's checkpoint (replica_size K > 1): a torch.distributed.checkpoint directory
# ``<name>.dcp`` that the K ranks of one replica write together (``shard.checkpoint``)
FORMAT_SHARDED = "elasticd-dcp"
SHARDED_VERSIONS = (1,)
# 3: the checksum's seed covers the whole layout (param groups, optimizer scalars, registered
# objects), not only the tensor entries; 2: the state checksum is XXH3 (1 was CRC-32)
VERSION = 3
READABLE_VERSIONS = (2, 3)  # what this reader verifies and loads (2 with legacy_checksum_key)
MAGIC = b"ELASTICD-CKPT\x00\x01\n"  # 16 bytes: a pickle, a zip (torch.save) or text never starts so
HEADER_LEN = struct.Struct("<Q")
CHUNK_BYTES = 16 << 20  # write and read in pieces of this size (large sequential I/O, bounded syscalls)
MAX_HEADER_BYTES = 64 << 20  # a header claiming more is refused (a corrupt length must not allocate GBs)
_NAME = re.compile(r"^(\d{8,})-step(\d{12,})\.(ckpt|dcp|json)$")


@dataclass(frozen=True)
class Manifest:
    """What a checkpoint's ``.json`` says about its ``.ckpt`` (the loader trusts none of it blindly)."""

    format: str
    version: int
    job: str
    seq: int
    step: int
    generation: int
    node: str
    signature: str
    file: str  # the data file's name, in the same directory
    file_bytes: int
    header_bytes: int
    payload_offset: int
    payload_bytes: int
    state_bytes: int  # the payload's first state_bytes are the state tensors; the RNG state follows
    state_checksum: int  # state.state_checksum of those bytes, as the trainer's audit shows it
    crc32: int  # CRC-32 of every other byte of the file (magic, header, padding, RNG state)
    epoch: int
    position: int
    created: float  # wall clock
    shards: int = 1  # FORMAT_SHARDED: the replica size K of the replica that wrote it (1: FORMAT)


@dataclass(frozen=True)
class Entry:
    """The files of one checkpoint found in a directory (the manifest not yet trusted)."""

    seq: int
    step: int
    data_path: Path | None  # the .ckpt file, or a sharded checkpoint's .dcp directory
    manifest_path: Path | None


def job_dir(checkpoint_dir: str | Path, job_id: str) -> Path:
    """Where the checkpoints of ``job_id`` live."""
    return Path(checkpoint_dir) / job_id


def checkpoint_name(seq: int, step: int) -> str:
    """The name of a checkpoint's files, without their suffix (``.ckpt``, ``.json``)."""
    return f"{seq:08d}-step{step:012d}"


def encode_prefix(
    *,
    job: str,
    step: int,
    generation: int,
    node: str,
    signature: str,
    payload_bytes: int,
    layout: dict[str, object],
    align: int,
) -> tuple[bytes, int]:
    """The bytes of a data file before its payload: ``MAGIC``, the header's length, the JSON header,
    and zeros up to the next multiple of ``align`` (where the payload starts). Returns (those bytes,
    the header's length)."""
    header = json.dumps(
        {
            "format": FORMAT,
            "version": VERSION,
            "job": job,
            "step": step,
            "generation": generation,
            "node": node,
            "signature": signature,
            "payload_bytes": payload_bytes,
            "layout": layout,
        }
    ).encode()
    prefix_len = len(MAGIC) + HEADER_LEN.size + len(header)
    payload_offset = -(-prefix_len // align) * align
    return MAGIC + HEADER_LEN.pack(len(header)) + header + bytes(payload_offset - prefix_len), len(header)


def scan(directory: Path) -> list[Entry]:
    """Every checkpoint-named file group in ``directory``, newest (highest seq) first."""
    found: dict[tuple[int, int], dict[str, Path]] = {}
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for n in names:
        m = _NAME.match(n)
        if m:
            found.setdefault((int(m.group(1)), int(m.group(2))), {})[m.group(3)] = directory / n
    out = [
        Entry(seq, step, files.get("ckpt") or files.get("dcp"), files.get("json"))
        for (seq, step), files in found.items()
    ]
    return sorted(out, key=lambda e: (e.seq, e.step), reverse=True)


def read_manifest(path: Path) -> Manifest:
    """Parse and type-check a manifest.

    Raises:
        ValueError: it is not a manifest of this format and version.
        OSError: it cannot be read.
    """
    raw = path.read_bytes()
    if len(raw) > 1 << 20:
        raise ValueError(f"manifest of {len(raw)} bytes")
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("manifest is not a JSON object")
    kwargs: dict[str, object] = {}
    for name, f in Manifest.__dataclass_fields__.items():
        if name not in data and f.default is not MISSING:
            continue  # a field added since, with its default
        if name not in data:
            raise ValueError(f"manifest lacks {name}")
        value = data[name]
        kind = str(f.type)
        ok = {"int": isinstance(value, int), "str": isinstance(value, str), "float": isinstance(value, (int, float))}[
            kind
        ]
        if not ok or isinstance(value, bool):
            raise ValueError(f"manifest field {name} is not {kind}")
        kwargs[name] = float(value) if kind == "float" else value
    man = Manifest(**kwargs)  # type: ignore[arg-type]
    known = (man.format == FORMAT and man.version in READABLE_VERSIONS) or (
        man.format == FORMAT_SHARDED and man.version in SHARDED_VERSIONS and man.shards > 1
    )
    if not known:
        raise ValueError(
            f"format {man.format!r} version {man.version} is not {FORMAT!r} version "
            f"{' or '.join(map(str, READABLE_VERSIONS))}, nor {FORMAT_SHARDED!r} version "
            f"{' or '.join(map(str, SHARDED_VERSIONS))}"
        )
    if "/" in man.file or man.file.startswith("."):
        raise ValueError(f"manifest names a file outside its directory: {man.file!r}")
    return man


def manifest_of(entry: Entry, shards: int) -> Manifest:
    """``entry``'s manifest, checked to name its data, and to be one of a replica of ``shards``
    ranks (1: ``FORMAT``, more: ``FORMAT_SHARDED``).

    Raises:
        ValueError: a file is missing, or the manifest is of another entry or replica size.
        OSError: it cannot be read.
    """
    if entry.manifest_path is None:
        raise ValueError("no manifest (an incomplete save)")
    if entry.data_path is None:
        raise ValueError("the manifest's data file is missing")
    man = read_manifest(entry.manifest_path)
    if man.shards != shards or (man.format == FORMAT_SHARDED) != (shards > 1):
        raise ValueError(sharded_elsewhere(man.shards, shards))
    if man.file != entry.data_path.name or man.seq != entry.seq or man.step != entry.step:
        raise ValueError(f"manifest names {man.file} (seq {man.seq}, step {man.step}), not this checkpoint")
    return man


def verify(entry: Entry) -> tuple[Manifest, bytes, torch.Tensor]:
    """Check one checkpoint completely and read it: (manifest, layout JSON bytes, payload).

    The payload is a fresh 64-byte-aligned tensor, so ``TrainingState.unpack`` adopts it as the
    state's arena without a copy.

    Raises:
        ValueError: a check failed; the message says which (the caller logs it and falls back).
        OSError: a file cannot be read.
    """
    man = manifest_of(entry, 1)
    assert entry.data_path is not None
    size = entry.data_path.stat().st_size
    if size != man.file_bytes:
        raise ValueError(f"size {size} bytes, the manifest says {man.file_bytes} (truncated or overwritten)")
    if (
        not 0 <= man.header_bytes <= MAX_HEADER_BYTES
        or man.payload_offset + man.payload_bytes != size
        or not 0 <= man.state_bytes <= man.payload_bytes
    ):
        raise ValueError("manifest sizes are inconsistent")
    payload = torch.empty(man.payload_bytes, dtype=torch.uint8)
    with entry.data_path.open("rb", buffering=0) as f:
        magic = f.read(len(MAGIC))
        if magic != MAGIC:
            raise ValueError(
                f"not an elasticd checkpoint: the file starts with {magic[:8]!r}, not the "
                f"format's magic (nothing of it was loaded or executed)"
            )
        (hlen,) = HEADER_LEN.unpack(_read_exact(f, HEADER_LEN.size))
        if hlen != man.header_bytes:
            raise ValueError(f"header length {hlen}, the manifest says {man.header_bytes}")
        header = _read_exact(f, hlen)
        pad = _read_exact(f, man.payload_offset - len(MAGIC) - HEADER_LEN.size - hlen)
        view = memoryview(payload.numpy()).cast("B")  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            n = f.readinto(view[done : done + CHUNK_BYTES])
            if not n:
                raise ValueError(f"file ended after {done} payload bytes")
            done += n
    total = man.state_bytes
    crc = zlib.crc32(view[total:], zlib.crc32(pad, zlib.crc32(header, zlib.crc32(magic + HEADER_LEN.pack(hlen)))))
    if crc != man.crc32:
        raise ValueError(
            f"CRC-32 {crc:08x} of the header and RNG state does not match the manifest's "
            f"{man.crc32:08x} (corrupt bytes)"
        )
    head = json.loads(header)  # its bytes are verified now
    if not isinstance(head, dict) or head.get("format") != FORMAT or head.get("step") != man.step:
        raise ValueError("the header does not match the manifest")
    if head.get("version") != man.version:
        raise ValueError(f"the header says version {head.get('version')!r}, the manifest {man.version}")
    if head.get("signature") != man.signature or head.get("payload_bytes") != man.payload_bytes:
        raise ValueError("the header's signature or sizes do not match the manifest")
    layout = head.get("layout")
    if not isinstance(layout, dict) or layout.get("total") != total or not isinstance(layout.get("tensors"), list):
        raise ValueError("the header holds no state layout of the manifest's size")
    key = checksum_key(layout) if man.version >= 3 else legacy_checksum_key(layout)
    checksum = state_checksum(key, view[:total], total)
    if checksum != man.state_checksum:
        raise ValueError(
            f"checksum of the state tensors ({checksum:016x}) does not match the manifest's "
            f"{man.state_checksum:016x} (corrupt bytes)"
        )
    return man, json.dumps(layout).encode(), payload


def sharded_elsewhere(saved: int, mine: int) -> str:
    """Why a checkpoint written by replicas of ``saved`` ranks does not load in a worker of a
    replica of ``mine`` ranks (pure)."""
    what = "a sharded checkpoint" if saved > 1 else "a data-parallel checkpoint"
    return (
        f"{what} of replica_size {saved}, and this worker's replica_size is {mine}: it loads in a job "
        f"whose agents run with --replica-size {saved}"
    )


def legacy_checksum_key(layout: dict[str, object]) -> bytes:
    """The checksum's seed in version 2 files: the JSON of the layout's tensor entries only."""
    return json.dumps(layout["tensors"]).encode()


def _read_exact(f: object, n: int) -> bytes:
    data = f.read(n)  # type: ignore[attr-defined]
    if not isinstance(data, bytes) or len(data) != n:
        raise ValueError(f"file ended inside its header (wanted {n} bytes)")
    return data


def signature_of(entry: Entry) -> str | None:
    """The model signature that a checkpoint's manifest, else its data file's header, names; None
    when neither can be read."""
    if entry.manifest_path is not None:
        try:
            return read_manifest(entry.manifest_path).signature
        except (OSError, ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError):
            pass
    if entry.data_path is not None:
        try:
            with entry.data_path.open("rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return None
                (hlen,) = HEADER_LEN.unpack(_read_exact(f, HEADER_LEN.size))
                if hlen > 1 << 20:
                    return None
                head = json.loads(_read_exact(f, hlen))
        except (OSError, ValueError, struct.error, RecursionError, UnicodeDecodeError):
            return None
        sig = head.get("signature") if isinstance(head, dict) else None
        return sig if isinstance(sig, str) else None
    return None


def other_models(directory: Path, signature: str) -> dict[str, list[int]]:
    """Model signature -> steps (newest save first) of the checkpoints in ``directory`` whose files
    name a signature other than ``signature`` (an unreadable directory: none)."""
    out: dict[str, list[int]] = {}
    try:
        entries = scan(directory)
    except OSError:
        return out
    for e in entries:
        sig = signature_of(e)
        if sig is not None and sig != signature:
            out.setdefault(sig, []).append(e.step)
    return out


# ---------------------------------------------------------------------------------------------
# Retention, a changed model, loading


def removable(entries: list[tuple[Entry, str | None]], signature: str, keep: int) -> list[Entry]:
    """Which checkpoints retention deletes (pure): (entry, its model signature or None when no
    file of it says) for each file group in the directory, the writer's signature, and ``keep``.

    Of the writer's model (and of unknown ones: unreadable files, no checkpoint of anyone) the
    ``keep`` newest complete checkpoints are kept, the older ones removed. A data file without a
    manifest may be a save in progress by another writer: only one older than what is kept is
    surely abandoned. A checkpoint whose files say another model signature is never removed: it
    may be the only copy of another model's training (a job resumed with a changed model).
    """
    ours = [e for e, sig in entries if sig is None or sig == signature]
    complete = sorted(
        (e for e in ours if e.manifest_path is not None and e.data_path is not None), key=lambda e: e.seq, reverse=True
    )
    kept = complete[:keep]
    oldest_kept = min((e.seq for e in kept), default=0)
    return [e for e in ours if e not in kept and not (e.manifest_path is None and e.seq >= oldest_kept)]


def new_model_refusal(directory: Path, signature: str, others: dict[str, list[int]], allow: bool) -> str | None:
    """Why a worker that found no checkpoint of its own model must not start over from step 1, or
    None when it may (pure).

    It may when nothing of another model is in the directory, or when the user allowed it
    (``checkpoint_allow_new_model``). Otherwise the job would train a changed model from scratch
    next to another model's training, which is almost always a mistake (a changed layer, the
    wrong job id or directory).
    """
    if not others or allow:
        return None
    found = "; ".join(
        f"{sig[:12]}: {len(steps)} checkpoint(s), newest step {max(steps)}" for sig, steps in sorted(others.items())
    )
    return (
        f"{directory} holds checkpoints of another model ({found}) and none of this worker's model "
        f"{signature[:12]}; refusing to start over from step 1. Resume with the model that wrote them, "
        f"or use another job id or checkpoint_dir, or set checkpoint_allow_new_model = true "
        f"(ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL=1) to start this model from step 1 (the other "
        f"model's checkpoints are kept)"
    )


def refuse_new_model(directory: Path, signature: str, allow: bool) -> None:
    """A worker about to start from step 1 (it holds nothing and found no checkpoint of its model)
    stops if ``directory`` holds another model's checkpoints, unless ``allow`` (``new_model_refusal``).

    Raises:
        CheckpointModelChanged: it must not start over (nothing is deleted).
    """
    others = other_models(directory, signature)
    why = new_model_refusal(directory, signature, others, allow)
    if why is not None:
        log.error(
            "checkpoint_model_changed",
            directory=str(directory),
            signature=signature[:12],
            others={sig[:12]: len(steps) for sig, steps in others.items()},
            action="stopping; nothing was deleted",
        )
        raise CheckpointModelChanged(why)
    if others:
        log.warning(
            "checkpoint_new_model_started",
            directory=str(directory),
            signature=signature[:12],
            others={sig[:12]: len(steps) for sig, steps in others.items()},
            reason="checkpoint_allow_new_model is set; the other model's checkpoints are kept",
        )


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that passed every check and is now this worker's state."""

    path: Path
    manifest: Manifest
    rejected: tuple[str, ...]  # "<file>: <why>" for each newer one that failed a check
    duration_s: float


Reader = Callable[[Entry], tuple[Manifest, bytes, torch.Tensor]]
# What a checkpoint that cannot be read or loaded raises: it is rejected, and the one before it tried
_REJECTED = (ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError, OSError, ModelMismatch, StateCorrupt)


def load_latest(
    directory: Path, state: TrainingState, newer_than: int = -1, read: Reader = verify
) -> LoadedCheckpoint | None:
    """Load the newest good checkpoint of ``directory`` into ``state``, if it is newer than ``newer_than``.

    Checkpoints are tried newest (highest seq) first, each checked and read by ``read`` (a
    replica's rank: ``shard.checkpoint.read_shard``). One that fails a check, or does not fit this
    model, is logged (``checkpoint_rejected``, with the reason) and the previous one is tried.

    Returns:
        The checkpoint loaded, or None (no good checkpoint newer than ``newer_than``; ``state`` unchanged).
    """
    started = time.monotonic()
    rejected: list[str] = []
    try:
        entries = scan(directory)
    except OSError as exc:
        log.error("checkpoint_dir_unreadable", directory=str(directory), error=str(exc))
        return None
    for entry in entries:
        shown = entry.data_path or entry.manifest_path
        assert shown is not None
        if entry.step <= newer_than:
            log.info("checkpoint_not_newer", path=str(shown), step=entry.step, held_step=newer_than)
            return None
        try:
            man, layout, payload = read(entry)
            if man.signature != state.signature:
                raise ValueError(
                    f"model signature {man.signature[:12]} differs from this worker's {state.signature[:12]}"
                )
            state.unpack(layout, payload)
        except _REJECTED as exc:
            why = f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc)
            rejected.append(f"{shown.name}: {why}")
            log.warning(
                "checkpoint_rejected",
                path=str(shown),
                step=entry.step,
                seq=entry.seq,
                reason=why,
                action="trying the previous checkpoint",
            )
            continue
        loaded = LoadedCheckpoint(entry.data_path or shown, man, tuple(rejected), time.monotonic() - started)
        c = state.counters
        log.info(
            "checkpoint_loaded",
            path=str(loaded.path),
            step=c.step,
            epoch=c.epoch,
            position=c.position,
            seq=man.seq,
            state_checksum=f"{man.state_checksum:016x}",
            rejected=len(rejected),
            duration_s=round(loaded.duration_s, 4),
        )
        return loaded
    if rejected:
        log.error("checkpoint_none_usable", directory=str(directory), rejected=rejected)
    return None
