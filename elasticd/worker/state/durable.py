"""Durable checkpoints on disk: the background writer and its retention.

Owns the on-disk store of one job (``<checkpoint_dir>/<job_id>/``, files in the ``durable_format``).
``CheckpointWriter.save`` is called by rank 0 at a step boundary: it copies the state's arena into a
spare buffer and hands it to a writer thread (O_DIRECT where the filesystem allows it; checksums on a
helper thread while the bytes are written), so training goes on; a new save waits only while the
previous write runs (at most ``checkpoint_wait_s``, then it is skipped). A save writes a temp file,
fsyncs and renames it, then writes and fsyncs the manifest under a temp name; the manifest is renamed
into place, and the directory fsynced, once the saved step is confirmed committed
(``CheckpointWriter.confirm``); a save of a discarded step is deleted (``discard``). A crash at any
point leaves the previous checkpoints intact and no half file that looks complete. The reading side
(``load_latest``, retention's choice ``removable``, ``refuse_new_model``) lives in
``durable_format`` and is importable from here too. Never decides who saves, whether a step is
committed or when a job resumes (the trainer, the ``Journal`` and ``membership`` do), never defines
what a file holds (``durable_format`` does), and never talks to etcd (the callbacks do).
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import queue
import shutil
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
import torch

from elasticd.worker.state.checksum import checksum_key, state_checksum
from elasticd.worker.state.durable_format import (
    CHUNK_BYTES,
    FORMAT,
    VERSION,
    LoadedCheckpoint,
    Manifest,
    checkpoint_name,
    encode_prefix,
    load_latest,
    new_model_refusal,
    refuse_new_model,
    removable,
    scan,
    signature_of,
)
from elasticd.worker.state.training import TrainingState

__all__ = [
    "DIRECT_ALIGN",
    "CheckpointWriter",
    "LoadedCheckpoint",
    "SavedCheckpoint",
    "aligned_bytes",
    "describe_failure",
    "load_latest",
    "new_model_refusal",
    "refuse_new_model",
    "removable",
]

log = structlog.get_logger(__name__)

DIRECT_ALIGN = 4096  # O_DIRECT: memory address, file offset and length are multiples of this
WRITER_NICE = 10  # niceness of the writer and checksum threads: training threads win a contended core
STALE_TMP_S = 3600.0  # a temporary file this old was left by a writer that died; retention removes it


@dataclass(frozen=True)
class SavedCheckpoint:
    """A checkpoint whose files are written and fsynced (visible once its manifest is in place)."""

    path: Path  # the data file
    manifest: Manifest
    duration_s: float  # from the writer thread picking it up to the fsync of its manifest


def describe_failure(exc: Exception) -> tuple[str | None, str]:
    """(symbolic errno or None, message) of a failed save: ``("EROFS", "[Errno 30] ...")`` for an
    OSError, ``(None, "<type>: <message>")`` for anything else."""
    if isinstance(exc, OSError):
        return errno.errorcode.get(exc.errno or 0, str(exc.errno)), str(exc)
    return None, f"{type(exc).__name__}: {exc}"


def remove_path(path: Path) -> None:
    """Delete a file, or a directory with what it holds (a sharded checkpoint's); gone already: fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


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


def write_parts(tmp: Path, parts: list[memoryview], size: int | None) -> None:
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


def tmp_path(directory: Path, name: str) -> Path:
    """The temp name ``name`` is written under before it is renamed into place (``.*.tmp.*``)."""
    return directory / f".{name}.tmp.{os.getpid()}"


def _write_durably(
    directory: Path,
    name: str,
    parts: list[memoryview],
    crc_job: Callable[[], None] | None = None,
    sync_dir: bool = True,
    direct_size: int | None = None,
) -> None:
    """Write ``parts`` to ``directory/name`` atomically: temp file, fsync, rename, and (with
    ``sync_dir``) fsync the directory.

    ``crc_job`` runs on a helper thread while the bytes are written (both release the GIL).
    ``direct_size``: see ``write_parts``.
    """
    tmp = tmp_path(directory, name)
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
        write_parts(tmp, parts, direct_size)
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
class SaveJob:
    step: int
    generation: int
    epoch: int
    position: int
    layout: bytes
    payload: torch.Tensor  # the snapshot (the writer's spare buffer), not the live arena
    padded: memoryview  # the same bytes and zeros to a DIRECT_ALIGN multiple, page-aligned
    pending: bool  # the step is not known committed: the checkpoint waits for ``confirm``
    seq: int = -1  # the save's seq when it was chosen before the write (a sharded save), else -1
    places: object = None  # what a subclass's ``_write`` needs besides the bytes (a sharded save's)


@dataclass(frozen=True)
class PendingSave:
    """A save whose files are written and fsynced, its manifest under a temp name (invisible)."""

    step: int
    saved: SavedCheckpoint
    manifest_tmp: Path
    data_tmp: Path | None = None  # data written under a temp name, renamed to ``saved.path`` at publish


class CheckpointWriter:
    """Background saves of one member's state into ``directory`` (one job's directory).

    A save of a step not known committed (``save(..., pending=True)``) keeps its manifest under a
    temp name, unseen by ``scan``: ``confirm`` of a step at least its own renames it into place and
    publishes it (``on_saved``, retention); ``discard`` of its step or an earlier one deletes its
    files, as does ``close``. The writer thread takes saves and verdicts in the order given, so a
    verdict may come before or after the write ends.

    Thread-safety: ``due``, ``save``, ``confirm``, ``discard`` and ``close`` are called from the
    training thread; the writer thread owns the files. ``on_saved``/``on_failed`` are called on the
    writer thread.
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
        self._idle = threading.Event()  # nothing queued or running (``_outstanding`` is 0)
        self._idle.set()
        self._lock = threading.Lock()
        self._outstanding = 0  # saves and verdicts queued or running
        self._queue: queue.Queue[SaveJob | Callable[[], None] | None] = queue.Queue()
        self._unsettled: list[int] = []  # the training thread's: steps of pending saves without a verdict
        self._pending: list[PendingSave] = []  # the writer thread's: written, waiting for their verdict
        self._seq = -1  # the last seq used; read from the directory at the first save
        self._thread: threading.Thread | None = None
        self.saved: list[SavedCheckpoint] = []  # published, oldest first
        self.failures = 0

    def due(self, step: int) -> bool:
        """A save is due after committing ``step`` (by steps or by time)."""
        if self._every_steps and step % self._every_steps == 0:
            return True
        return bool(self._every_s) and self._clock() - self._last_save_at >= self._every_s

    @property
    def busy(self) -> bool:
        return not self._idle.is_set()

    def save(self, state: TrainingState, generation: int, pending: bool = False) -> bool:
        """Snapshot ``state`` now (at a step boundary) and write it in the background; published
        once written, or with ``pending`` (its step not known committed) once confirmed (see the class).

        Waits for the previous write if it still runs, at most ``wait_s``.

        Returns:
            True if the snapshot was taken and queued; False if it was skipped (previous write stuck).
        """
        if not self._idle.wait(self._wait_s):
            return self._skip(state, "the previous write still runs")
        return self._enqueue(state, generation, pending)

    def _skip(self, state: TrainingState, why: str) -> bool:
        """Skip the save due now (``checkpoint_skipped``); False."""
        log.warning(
            "checkpoint_skipped", step=state.counters.step, reason=f"{why} after checkpoint_wait_s={self._wait_s}"
        )
        self._last_save_at = self._clock()
        return False

    def _enqueue(
        self,
        state: TrainingState,
        generation: int,
        pending: bool,
        seq: int = -1,
        describe: Callable[[dict[str, object]], object] | None = None,
    ) -> bool:
        """Snapshot ``state`` into the spare buffer and queue its write; True. ``describe``: what
        a subclass's ``_write`` needs of the layout packed (``SaveJob.places``)."""
        layout, arena = state.pack()
        places = describe(json.loads(layout)) if describe is not None else None
        n = arena.numel()
        if self._spare is None or self._spare.numel() != n:
            self._spare_map = aligned_bytes(n)  # past n it stays zero: written, then truncated away
            self._spare = torch.frombuffer(self._spare_map, dtype=torch.uint8)[:n]
        self._spare.copy_(arena)  # the only work on the training thread: one memcpy
        c = state.counters
        assert self._spare_map is not None
        job = SaveJob(
            c.step,
            generation,
            c.epoch,
            c.position,
            layout,
            self._spare,
            memoryview(self._spare_map),
            pending,
            seq,
            places,
        )
        self._last_save_at = self._clock()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="elasticd-ckpt-writer", daemon=True)
            self._thread.start()
        if pending:
            self._unsettled.append(job.step)
        self._submit(job)
        return True

    def confirm(self, step: int) -> None:
        """Every step up to ``step`` is committed: publish the pending saves of those steps (on the
        writer thread, once written). Cheap when none is pending (called at every step)."""
        if any(s <= step for s in self._unsettled):
            self._unsettled = [s for s in self._unsettled if s > step]
            self._submit(lambda: self._settle(step, confirmed=True))

    def discard(self, steps: list[int]) -> None:
        """``steps`` are a branch the job left: delete the pending saves of them and of any later
        step (a state derived from a discarded one), on the writer thread, once written."""
        first = min(steps, default=None)
        if first is not None and any(s >= first for s in self._unsettled):
            self._unsettled = [s for s in self._unsettled if s < first]
            self._submit(lambda: self._settle(first, confirmed=False))

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no save or verdict is queued or running (True), at most ``timeout_s``."""
        return self._idle.wait(timeout_s)

    def close(self) -> None:
        """Let the work queued finish (at most ``wait_s``; past it the thread goes on alone, a daemon),
        then delete the saves still pending (never published) and stop the thread."""
        if self._thread is None:
            return
        finished = self._idle.wait(self._wait_s)
        if not finished:
            log.warning("checkpoint_write_abandoned", reason=f"still writing after checkpoint_wait_s={self._wait_s}")
        self._unsettled.clear()
        self._queue.put(None)
        self._thread.join(self._wait_s if finished else 0.0)
        if not self._thread.is_alive():
            self._thread = None

    def _submit(self, item: SaveJob | Callable[[], None]) -> None:
        with self._lock:
            self._outstanding += 1
            self._idle.clear()
        self._queue.put(item)

    # -- the writer thread ------------------------------------------------------------------

    def _loop(self) -> None:
        _lower_priority()
        while True:
            item = self._queue.get()
            if item is None:
                for p in self._pending:
                    self._drop(p, "not confirmed when the writer closed")
                return
            try:
                if isinstance(item, SaveJob):
                    self._run(item)
                else:
                    item()  # a verdict (``_settle``)
            except Exception as exc:  # the writer thread's top level (a callback raised): stay alive
                log.error("checkpoint_writer_error", error=f"{type(exc).__name__}: {exc}", exc_info=True)
            finally:
                with self._lock:
                    self._outstanding -= 1
                    if not self._outstanding:
                        self._idle.set()

    def _run(self, job: SaveJob) -> None:
        try:
            pending = self._write(job)
        except Exception as exc:  # any failure of the write: report it, and stay alive
            self._failed(job.step, exc)
            return
        if pending is None:  # another rank publishes this save
            return
        if not job.pending:
            self._publish(pending)
            return
        self._pending.append(pending)
        log.info(
            "checkpoint_written",
            step=job.step,
            path=str(pending.saved.path),
            seq=pending.saved.manifest.seq,
            duration_s=round(pending.saved.duration_s, 4),
            visible="once its step is confirmed",
        )

    def _settle(self, step: int, confirmed: bool) -> None:
        """Publish the pending saves of steps up to ``step``, or (not ``confirmed``) drop those from it."""
        settled = [p for p in self._pending if (p.step <= step if confirmed else p.step >= step)]
        self._pending = [p for p in self._pending if p not in settled]
        for p in settled:
            if confirmed:
                self._publish(p)
            else:
                self._drop(p, f"step {step} was discarded: a branch the job left")

    def _failed(self, step: int, exc: Exception) -> None:
        self.failures += 1
        code, text = describe_failure(exc)
        log.error(
            "checkpoint_save_failed",
            step=step,
            directory=str(self.directory),
            errno=code,
            error=text,
            exc_info=code is None,
            consequence="training goes on; the previous checkpoint is intact; the next save tries again",
        )
        if self._on_failed is not None:
            self._on_failed(step, exc)

    def _publish(self, pending: PendingSave) -> None:
        """Rename the manifest into place and fsync the directory (it exists now); ``on_saved``; retention."""
        saved = pending.saved
        try:
            if pending.data_tmp is not None:
                os.rename(pending.data_tmp, saved.path)
            os.rename(pending.manifest_tmp, saved.path.with_suffix(".json"))
            _fsync_dir(self.directory)
        except OSError as exc:
            self._drop(pending, "its manifest could not be renamed into place")
            self._failed(saved.manifest.step, exc)
            return
        self.saved.append(saved)
        log.info(
            "checkpoint_saved",
            step=saved.manifest.step,
            path=str(saved.path),
            seq=saved.manifest.seq,
            bytes=saved.manifest.file_bytes,
            duration_s=round(saved.duration_s, 4),
        )
        if self._on_saved is not None:
            self._on_saved(saved)
        try:
            self._retain()
        except OSError as exc:
            log.warning("checkpoint_retention_failed", directory=str(self.directory), error=str(exc))

    def _drop(self, pending: PendingSave, why: str) -> None:
        """Delete a pending save's files (its manifest first: never a manifest without data; one
        that cannot be deleted stays unseen, and retention removes it later)."""
        for path in (pending.manifest_tmp, pending.data_tmp, pending.saved.path):
            if path is not None:
                with contextlib.suppress(OSError):
                    remove_path(path)
        log.info("checkpoint_discarded", step=pending.step, seq=pending.saved.manifest.seq, reason=why)

    def _peek_seq(self) -> int:
        """The seq the next save takes (the directory's highest, read at the first save, plus one)."""
        if self._seq < 0:
            self._seq = max((e.seq for e in scan(self.directory)), default=0)
        return self._seq + 1

    def _next_seq(self) -> int:
        self._seq = self._peek_seq()
        return self._seq

    def _write(self, job: SaveJob) -> PendingSave:
        """Write the data file (renamed into place) and the manifest (fsynced under its temp name)."""
        started = time.monotonic()
        self.directory.mkdir(mode=0o750, parents=True, exist_ok=True)  # as its files: not for other users
        seq = self._next_seq()
        name = checkpoint_name(seq, job.step)
        layout = json.loads(job.layout)
        total = int(layout["total"])
        payload = job.payload
        payload_bytes = payload.numel()
        prefix, header_bytes = encode_prefix(
            job=self._job_id,
            step=job.step,
            generation=job.generation,
            node=self._node,
            signature=self._signature,
            payload_bytes=payload_bytes,
            layout=layout,
            align=DIRECT_ALIGN,
        )
        payload_offset = len(prefix)
        prefix_map = aligned_bytes(payload_offset)
        prefix_map[:payload_offset] = prefix
        data = memoryview(payload.numpy()).cast("B")  # type: ignore[arg-type]
        key = checksum_key(layout)
        sums: dict[str, int] = {}

        def crc_job() -> None:  # on a helper thread, while the bytes are written
            sums["state"] = state_checksum(key, data[:total], total)
            sums["rest"] = zlib.crc32(data[total:], zlib.crc32(prefix))

        # The directory is fsynced once, when the manifest is renamed into place (``_publish``): until
        # then a crash may keep the data file or not, and without its manifest it is never loaded.
        _write_durably(
            self.directory,
            name + ".ckpt",
            [memoryview(prefix_map), job.padded[: _round_up(payload_bytes)]],
            crc_job,
            sync_dir=False,
            direct_size=payload_offset + payload_bytes,
        )
        manifest = Manifest(
            format=FORMAT,
            version=VERSION,
            job=self._job_id,
            seq=seq,
            step=job.step,
            generation=job.generation,
            node=self._node,
            signature=self._signature,
            file=name + ".ckpt",
            file_bytes=payload_offset + payload_bytes,
            header_bytes=header_bytes,
            payload_offset=payload_offset,
            payload_bytes=payload_bytes,
            state_bytes=total,
            state_checksum=sums["state"],
            crc32=sums["rest"],
            epoch=job.epoch,
            position=job.position,
            created=time.time(),
        )
        tmp = tmp_path(self.directory, name + ".json")
        write_parts(tmp, [memoryview(json.dumps(asdict(manifest), indent=1).encode())], None)
        saved = SavedCheckpoint(self.directory / (name + ".ckpt"), manifest, time.monotonic() - started)
        return PendingSave(job.step, saved, tmp)

    def _retain(self) -> None:
        """Keep the ``keep`` newest complete checkpoints of this model; remove its older ones, orphans
        and stale temps (``removable``); never another model's, nor this writer's pending saves."""
        pending = {p.saved.manifest.seq for p in self._pending}
        entries = [e for e in scan(self.directory) if e.seq not in pending]
        for e in removable([(e, signature_of(e)) for e in entries], self._signature, self._keep):
            for path in (e.manifest_path, e.data_path):  # manifest first: never a manifest without data
                if path is not None:
                    remove_path(path)
            log.info("checkpoint_removed", seq=e.seq, step=e.step, directory=str(self.directory))
        now = time.time()
        pending_tmps = {p.manifest_tmp.name for p in self._pending} | {
            p.data_tmp.name for p in self._pending if p.data_tmp is not None
        }
        for tmp in self.directory.glob(".*.tmp.*"):
            try:
                if tmp.name not in pending_tmps and now - tmp.stat().st_mtime > STALE_TMP_S:
                    remove_path(tmp)
            except FileNotFoundError:
                pass
