"""The checkpoint filesystem of a chaos run: a small tmpfs of its own that the checkpoint kinds turn
read-only or fill up, and restore.

Owns whether such a filesystem can be had here (``mount_unusable``, ``unusable_here``: root, a
``mount`` binary, and a probe mount that works), and ``CheckpointFs``: the tmpfs the agents save
their checkpoints on, ``set_read_only`` (a remount of the filesystem itself, so that every mount
namespace sees it, a netns host's too; back to read-write also in the mount namespaces of the
given processes: one copied while the filesystem was read-only keeps that copy read-only),
``fill`` and ``free`` (a filler file beside the job's
directory, never in it), and ``remove``. It touches only the mount point it was given, and never
decides when a fault begins or ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

MOUNT_TIMEOUT_S = 10.0  # bound on one `mount` or `umount` command
CHECKPOINT_FS_BYTES = 16 * 1024 * 1024  # room for the kept checkpoints of the workload (~180 KB each)
FILLER = ".chaos-filler"  # the file that fills the filesystem, at its root (beside the job's directory)
FILL_CHUNKS = (1024 * 1024, 4096)  # written until ENOSPC: big chunks, then pages for the rest
# A checkpoint's manifest, as durable_format names it (``<seq:08d>-step<step:012d>.json``).
MANIFEST = re.compile(r"^(\d{8})-step\d{12}\.json$")


def complete_checkpoints(job_dir: Path) -> tuple[int, ...]:
    """The seqs of the complete checkpoints in a job's directory (a manifest in place beside its
    data file, or a sharded checkpoint's directory), oldest first; () when the directory cannot be read."""
    try:
        names = set(os.listdir(job_dir))
    except OSError:
        return ()
    seqs = [
        int(m.group(1))
        for n in names
        if (m := MANIFEST.match(n)) and {n.removesuffix(".json") + s for s in (".ckpt", ".dcp")} & names
    ]
    return tuple(sorted(seqs))


def mount_unusable(euid: int, mount_binary: str | None, probe_error: str) -> str:
    """Why a checkpoint filesystem cannot be mounted here ("" when it can)."""
    if euid != 0:
        return "not root"
    if mount_binary is None:
        return "no `mount` binary"
    if probe_error:
        return f"`mount -t tmpfs` does not work here: {probe_error}"
    return ""


def _run(*argv: str) -> str:
    """Run one mount command; its error ("" when it succeeded)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{' '.join(argv)}: {exc}"
    return "" if done.returncode == 0 else f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()[:200]}"


def _mount_ns(pid: int) -> str | None:
    """The mount namespace of ``pid`` (None: it ended)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None


def probe_mount() -> str:
    """Mount a tiny tmpfs on a temporary directory and unmount it; the error ("" when it worked)."""
    with tempfile.TemporaryDirectory(prefix="elasticd-chaos-probe-") as d:
        error = _run("mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", d)
        if not error:
            error = _run("umount", d)
        return error


def unusable_here() -> str:
    """Why a checkpoint filesystem cannot be had on this machine ("" when it can); probes as root."""
    binary = shutil.which("mount")
    if os.geteuid() != 0 or binary is None:
        return mount_unusable(os.geteuid(), binary, "")
    return mount_unusable(0, binary, probe_mount())


class CheckpointFs:
    """A tmpfs of ``CHECKPOINT_FS_BYTES`` at ``path`` (made by ``mount``, gone after ``remove``)."""

    def __init__(self, path: Path, say: Callable[[str], None]) -> None:
        self.path = path
        self._say = say
        self.mounted = False

    def mount(self) -> None:
        """Raises:
        RuntimeError: the mount failed."""
        self.path.mkdir(parents=True, exist_ok=True)
        error = _run("mount", "-t", "tmpfs", "-o", f"size={CHECKPOINT_FS_BYTES},mode=0750", "tmpfs", str(self.path))
        if error:
            raise RuntimeError(error)
        self.mounted = True

    def set_read_only(self, read_only: bool, namespaces_of: Collection[int] = ()) -> None:
        """Remount the filesystem read-only (or read-write again). Back to read-write, also in the
        mount namespace of each pid in ``namespaces_of`` that is not this one's: ``ip netns exec``
        copies the mounts, and a copy made while the filesystem was read-only stays read-only when
        the original is remounted (best effort: a process that ended is skipped).

        Raises:
            RuntimeError: the remount failed (here).
        """
        error = _run("mount", "-o", f"remount,{'ro' if read_only else 'rw'}", str(self.path))
        if error:
            raise RuntimeError(error)
        if read_only:
            return
        mine = _mount_ns(os.getpid())
        seen = {mine}
        for pid in namespaces_of:
            ns = _mount_ns(pid)
            if ns is None or ns in seen:
                continue
            seen.add(ns)
            _run("nsenter", "-t", str(pid), "-m", "mount", "-o", "remount,rw", str(self.path))

    def fill(self) -> int:
        """Write the filler until the filesystem is full (ENOSPC); the bytes it took.

        Raises:
            OSError: a write failed otherwise than with ENOSPC.
        """
        written = 0
        with (self.path / FILLER).open("ab", buffering=0) as f:
            for chunk in FILL_CHUNKS:
                data = bytes(chunk)
                for _ in range(CHECKPOINT_FS_BYTES // chunk + 1):  # bounded: the filesystem is that big
                    try:
                        written += f.write(data) or 0
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        return written

    def free(self) -> None:
        """Delete the filler (idempotent)."""
        (self.path / FILLER).unlink(missing_ok=True)

    def remove(self) -> None:
        """Make it writable, delete the filler and unmount it (idempotent; after every process
        that used it has ended)."""
        if not self.mounted:
            return
        self.set_read_only_quietly(False)
        with contextlib.suppress(OSError):
            self.free()
        error = _run("umount", str(self.path))
        if error:
            error = _run("umount", "-l", str(self.path))  # a process still inside: detach it
        if error:
            self._say(f"could not unmount the checkpoint filesystem {self.path}: {error}")
            return
        self.mounted = False

    def set_read_only_quietly(self, read_only: bool) -> None:
        """``set_read_only`` that reports a failure instead of raising (on the way out)."""
        try:
            self.set_read_only(read_only)
        except RuntimeError as exc:
            self._say(f"checkpoint filesystem: {exc}")
