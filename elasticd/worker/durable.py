"""Durable checkpoints on disk: the background writer, retention, verified loading.

Owns the on-disk store of one job (``<checkpoint_dir>/<job_id>/``, files in the ``durable_format``).
``CheckpointWriter.save`` is called by rank 0 at a step boundary: it copies the state's arena into a
spare buffer and hands it to a writer thread (O_DIRECT where the filesystem allows it; checksums on a
helper thread while the bytes are written), so training goes on; a new save waits only while the
previous write runs (at most ``checkpoint_wait_s``, then it is skipped). A save writes a temp file,
fsyncs and renames it, then the manifest, then fsyncs the directory: a crash at any point leaves the
previous checkpoints intact and no half file that looks complete. ``load_latest`` loads the newest
checkpoint that passes ``verify``, falling back to older ones. Retention (``removable``) keeps the
``checkpoint_keep`` newest of the writer's model and never deletes another model's;
``refuse_new_model`` stops a worker that finds only another model's checkpoints from starting over.
Never decides who saves or when a job resumes (the trainer and ``membership`` do), never defines
what a file holds (``durable_format`` does), and never talks to etcd (the callbacks do).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
import torch

from elasticd.errors import CheckpointModelChanged, ModelMismatch, StateCorrupt
from elasticd.worker.durable_format import (
    CHUNK_BYTES,
    FORMAT,
    VERSION,
    Entry,
    Manifest,
    checkpoint_name,
    encode_prefix,
    other_models,
    scan,
    signature_of,
    verify,
)
from elasticd.worker.checksum import checksum_key, state_checksum
from elasticd.worker.state import TrainingState

log = structlog.get_logger(__name__)

DIRECT_ALIGN = 4096  # O_DIRECT: memory address, file offset and length are multiples of this
WRITER_NICE = 10  # niceness of the writer and checksum threads: training threads win a contended core
STALE_TMP_S = 3600.0  # a temporary file this old was left by a writer that died; retention removes it


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint that is on disk and durable."""

    path: Path
    manifest: Manifest
    duration_s: float  # from the writer thread picking it up to the directory fsync after the manifest


@dataclass(frozen=True)
class LoadedCheckpoint:
    """A checkpoint that passed every check and is now this worker's state."""

    path: Path
    manifest: Manifest
    rejected: tuple[str, ...]  # "<file>: <why>" for each newer one that failed a check
    duration_s: float


def describe_failure(exc: Exception) -> tuple[str | None, str]:
    """(symbolic errno or None, message) of a failed save: ``("EROFS", "[Errno 30] ...")`` for an
    OSError, ``(None, "<type>: <message>")`` for anything else."""
    if isinstance(exc, OSError):
        return errno.errorcode.get(exc.errno or 0, str(exc.errno)), str(exc)
    return None, f"{type(exc).__name__}: {exc}"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _lower_priority() -> None:
    """Make the calling thread yield to the training threads (Linux niceness is per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (AttributeError, OSError):
        pass  # not Linux, or not permitted: the write still happens, at normal priority


def _round_up(n: int) -> int:
    return -(-n // DIRECT_ALIGN) * DIRECT_ALIGN


def aligned_bytes(n: int) -> mmap.mmap:
    """Zeroed, page-aligned memory of ``n`` bytes rounded up to ``DIRECT_ALIGN`` (an anonymous map)."""
    return mmap.mmap(-1, max(DIRECT_ALIGN, _round_up(n)))


def _write_all(fd: int, data: memoryview) -> None:
    view = data.cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done : done + CHUNK_BYTES])


def _write_parts(tmp: Path, parts: list[memoryview], size: int | None) -> None:
    """Create ``tmp`` and write ``parts`` into it, then fsync.

    With ``size``, every part is ``DIRECT_ALIGN``-aligned in memory and in length: the file is
    written with O_DIRECT, from the buffers straight to the device, which spares the CPU the copy
    into the page cache and the page cache its churn (on this machine a buffered 99 MB write spent
    0.3 s of CPU in the kernel, O_DIRECT almost none); then it is truncated to ``size``. A
    filesystem that refuses O_DIRECT (EINVAL, e.g. tmpfs) gets the same bytes through the page cache.
    """
    direct = size is not None and hasattr(os, "O_DIRECT")
    while True:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if direct else 0)
        try:
            fd = os.open(tmp, flags, 0o640)  # the model is the job's: never world-readable
        except OSError as exc:
            if direct and exc.errno == errno.EINVAL:
                direct = False
                continue
            raise
        try:
            for part in parts:
                _write_all(fd, part)
            if size is not None:
                os.ftruncate(fd, size)
            os.fsync(fd)
            return
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            direct = False  # opened, but writes refused: start over through the page cache
        finally:
            os.close(fd)
        tmp.unlink(missing_ok=True)


def _write_durably(directory: Path, name: str, parts: list[memoryview],
                   crc_job: Callable[[], None] | None = None, sync_dir: bool = True,
                   direct_size: int | None = None) -> None:
    """Write ``parts`` to ``directory/name`` atomically: temp file, fsync, rename, and (with
    ``sync_dir``) fsync the directory.

    ``crc_job`` runs on a helper thread while the bytes are written (both release the GIL).
    ``direct_size``: see ``_write_parts``.
    """
    tmp = directory / f".{name}.tmp.{os.getpid()}"
    helper: threading.Thread | None = None
    errors: list[BaseException] = []
    if crc_job is not None:
        def run() -> None:
            _lower_priority()
            try:
                crc_job()
            except Exception as exc:  # handed to the writer thread, which re-raises it
                errors.append(exc)
        helper = threading.Thread(target=run, name="elasticd-ckpt-crc", daemon=True)
        helper.start()
    try:
        _write_parts(tmp, parts, direct_size)
        os.rename(tmp, directory / name)
        if sync_dir:
            _fsync_dir(directory)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the directory may be gone or read-only; retention removes it later
        raise
    finally:
        if helper is not None:
            helper.join()
    if errors:
        raise errors[0]


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class _Job:
    step: int
    generation: int
    epoch: int
    position: int
    layout: bytes
    payload: torch.Tensor  # the snapshot (the writer's spare buffer), not the live arena
    padded: memoryview  # the same bytes and zeros to a DIRECT_ALIGN multiple, page-aligned


class CheckpointWriter:
    """Background saves of one member's state into ``directory`` (one job's directory).

    Thread-safety: ``due``, ``save`` and ``close`` are called from the training thread; the writer
    thread owns the files. ``on_saved``/``on_failed`` are called on the writer thread.
    """

    def __init__(
        self,
        directory: Path,
        *,
        job_id: str,
        node: str,
        signature: str,
        every_steps: int,
        every_s: float,
        keep: int,
        wait_s: float,
        on_saved: Callable[[SavedCheckpoint], None] | None = None,
        on_failed: Callable[[int, Exception], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self._job_id = job_id
        self._node = node
        self._signature = signature
        self._every_steps = every_steps
        self._every_s = every_s
        self._keep = keep
        self._wait_s = wait_s
        self._on_saved = on_saved
        self._on_failed = on_failed
        self._clock = clock
        self._last_save_at = clock()
        self._spare: torch.Tensor | None = None  # n bytes over page-aligned memory (see aligned_bytes)
        self._spare_map: mmap.mmap | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        self._seq = -1  # the last seq used; read from the directory at the first save
        self._thread: threading.Thread | None = None
        self.saved: list[SavedCheckpoint] = []
        self.failures = 0

    def due(self, step: int) -> bool:
        """A save is due after committing ``step`` (by steps or by time)."""
        if self._every_steps and step % self._every_steps == 0:
            return True
        return bool(self._every_s) and self._clock() - self._last_save_at >= self._every_s

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def save(self, state: TrainingState, generation: int) -> bool:
        """Snapshot ``state`` now (at a step boundary) and write it in the background.

        Waits for the previous write if it still runs, at most ``wait_s``.

        Returns:
            True if the snapshot was taken and queued; False if it was skipped (previous write stuck).
        """
        if not self._idle.wait(self._wait_s):
            log.warning("checkpoint_skipped", step=state.counters.step, reason=f"the previous write still "
                        f"runs after checkpoint_wait_s={self._wait_s}")
            self._last_save_at = self._clock()
            return False
        layout, arena = state.pack()
        n = arena.numel()
        if self._spare is None or self._spare.numel() != n:
            self._spare_map = aligned_bytes(n)  # past n it stays zero: written, then truncated away
            self._spare = torch.frombuffer(self._spare_map, dtype=torch.uint8)[:n]
        self._spare.copy_(arena)  # the only work on the training thread: one memcpy
        c = state.counters
        assert self._spare_map is not None
        job = _Job(c.step, generation, c.epoch, c.position, layout, self._spare, memoryview(self._spare_map))
        self._last_save_at = self._clock()
        self._idle.clear()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="elasticd-ckpt-writer", daemon=True)
            self._thread.start()
        self._queue.put(job)
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no write runs (True), at most ``timeout_s``."""
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        """Let the write in flight finish (at most ``wait_s``), then stop the thread."""
        if self._thread is None:
            return
        if not self._idle.wait(self._wait_s):
            log.warning("checkpoint_write_abandoned", reason=f"still writing after checkpoint_wait_s={self._wait_s}")
            return  # a daemon thread: the process may exit; the temp file never looks complete
        self._queue.put(None)
        self._thread.join(self._wait_s)
        self._thread = None

    # -- the writer thread ------------------------------------------------------------------

    def _loop(self) -> None:
        _lower_priority()
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                saved = self._write(job)
            except Exception as exc:  # the writer thread's top level: report it, and stay alive
                self.failures += 1
                code, text = describe_failure(exc)
                log.error("checkpoint_save_failed", step=job.step, directory=str(self.directory), errno=code,
                          error=text, exc_info=code is None,
                          consequence="training goes on; the previous checkpoint is intact; the next save tries again")
                if self._on_failed is not None:
                    self._on_failed(job.step, exc)
            else:
                self.saved.append(saved)
                log.info("checkpoint_saved", step=job.step, path=str(saved.path), seq=saved.manifest.seq,
                         bytes=saved.manifest.file_bytes, duration_s=round(saved.duration_s, 4))
                if self._on_saved is not None:
                    self._on_saved(saved)
                try:
                    self._retain()
                except OSError as exc:
                    log.warning("checkpoint_retention_failed", directory=str(self.directory), error=str(exc))
            finally:
                self._idle.set()

    def _next_seq(self) -> int:
        if self._seq < 0:
            self._seq = max((e.seq for e in scan(self.directory)), default=0)
        self._seq += 1
        return self._seq

    def _write(self, job: _Job) -> SavedCheckpoint:
        started = time.monotonic()
        self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)  # as its files: not for other users
        seq = self._next_seq()
        name = checkpoint_name(seq, job.step)
        layout = json.loads(job.layout)
        total = int(layout["total"])
        payload = job.payload
        payload_bytes = payload.numel()
        prefix, header_bytes = encode_prefix(job=self._job_id, step=job.step, generation=job.generation,
                                             node=self._node, signature=self._signature,
                                             payload_bytes=payload_bytes, layout=layout, align=DIRECT_ALIGN)
        payload_offset = len(prefix)
        prefix_map = aligned_bytes(payload_offset)
        prefix_map[:payload_offset] = prefix
        data = memoryview(payload.numpy()).cast("B")  # type: ignore[arg-type]
        key = checksum_key(layout)
        sums: dict[str, int] = {}

        def crc_job() -> None:  # on a helper thread, while the bytes are written
            sums["state"] = state_checksum(key, data[:total], total)
            sums["rest"] = zlib.crc32(data[total:], zlib.crc32(prefix))

        # The directory is fsynced once, after both renames: until then a crash may keep either
        # name or neither, and a manifest without its data file is rejected as incomplete.
        _write_durably(self.directory, name + ".ckpt", [memoryview(prefix_map), job.padded[: _round_up(payload_bytes)]],
                       crc_job, sync_dir=False, direct_size=payload_offset + payload_bytes)
        manifest = Manifest(
            format=FORMAT, version=VERSION, job=self._job_id, seq=seq, step=job.step,
            generation=job.generation, node=self._node, signature=self._signature, file=name + ".ckpt",
            file_bytes=payload_offset + payload_bytes, header_bytes=header_bytes, payload_offset=payload_offset,
            payload_bytes=payload_bytes, state_bytes=total, state_checksum=sums["state"], crc32=sums["rest"],
            epoch=job.epoch,
            position=job.position, created=time.time(),
        )
        _write_durably(self.directory, name + ".json", [memoryview(json.dumps(asdict(manifest), indent=1).encode())])
        return SavedCheckpoint(self.directory / (name + ".ckpt"), manifest, time.monotonic() - started)

    def _retain(self) -> None:
        """Keep the ``keep`` newest complete checkpoints of this model; remove its older ones, orphans
        and stale temps (``removable``). Checkpoints of another model are never removed."""
        entries = scan(self.directory)
        for e in removable([(e, signature_of(e)) for e in entries], self._signature, self._keep):
            for path in (e.manifest_path, e.data_path):  # manifest first: never a manifest without data
                if path is not None:
                    path.unlink(missing_ok=True)
            log.info("checkpoint_removed", seq=e.seq, step=e.step, directory=str(self.directory))
        now = time.time()
        for tmp in self.directory.glob(".*.tmp.*"):
            try:
                if now - tmp.stat().st_mtime > STALE_TMP_S:
                    tmp.unlink(missing_ok=True)
            except FileNotFoundError:
                pass


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
    complete = sorted((e for e in ours if e.manifest_path is not None and e.data_path is not None),
                      key=lambda e: e.seq, reverse=True)
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
    found = "; ".join(f"{sig[:12]}: {len(steps)} checkpoint(s), newest step {max(steps)}"
                      for sig, steps in sorted(others.items()))
    return (f"{directory} holds checkpoints of another model ({found}) and none of this worker's model "
            f"{signature[:12]}; refusing to start over from step 1. Resume with the model that wrote them, "
            f"or use another job id or checkpoint_dir, or set checkpoint_allow_new_model = true "
            f"(ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL=1) to start this model from step 1 (the other "
            f"model's checkpoints are kept)")


def refuse_new_model(directory: Path, signature: str, allow: bool) -> None:
    """A worker about to start from step 1 (it holds nothing and found no checkpoint of its model)
    stops if ``directory`` holds another model's checkpoints, unless ``allow`` (``new_model_refusal``).

    Raises:
        CheckpointModelChanged: it must not start over (nothing is deleted).
    """
    others = other_models(directory, signature)
    why = new_model_refusal(directory, signature, others, allow)
    if why is not None:
        log.error("checkpoint_model_changed", directory=str(directory), signature=signature[:12],
                  others={sig[:12]: len(steps) for sig, steps in others.items()},
                  action="stopping; nothing was deleted")
        raise CheckpointModelChanged(why)
    if others:
        log.warning("checkpoint_new_model_started", directory=str(directory), signature=signature[:12],
                    others={sig[:12]: len(steps) for sig, steps in others.items()},
                    reason="checkpoint_allow_new_model is set; the other model's checkpoints are kept")


def load_latest(directory: Path, state: TrainingState, newer_than: int = -1) -> LoadedCheckpoint | None:
    """Load the newest good checkpoint of ``directory`` into ``state``, if it is newer than ``newer_than``.

    Checkpoints are tried newest (highest seq) first. One that fails a check, or does not fit this
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
            man, layout, payload = verify(entry)
            if man.signature != state.signature:
                raise ValueError(f"model signature {man.signature[:12]} differs from this worker's "
                                 f"{state.signature[:12]}")
            state.unpack(layout, payload)
        except (ValueError, TypeError, KeyError, RecursionError, UnicodeDecodeError, OSError,
                ModelMismatch, StateCorrupt) as exc:
            why = f"{type(exc).__name__}: {exc}" if isinstance(exc, OSError) else str(exc)
            rejected.append(f"{shown.name}: {why}")
            log.warning("checkpoint_rejected", path=str(shown), step=entry.step, seq=entry.seq, reason=why,
                        action="trying the previous checkpoint")
            continue
        loaded = LoadedCheckpoint(entry.data_path or shown, man, tuple(rejected), time.monotonic() - started)
        c = state.counters
        log.info("checkpoint_loaded", path=str(loaded.path), step=c.step, epoch=c.epoch, position=c.position,
                 seq=man.seq, state_checksum=f"{man.state_checksum:016x}", rejected=len(rejected),
                 duration_s=round(loaded.duration_s, 4))
        return loaded
    if rejected:
        log.error("checkpoint_none_usable", directory=str(directory), rejected=rejected)
    return None
