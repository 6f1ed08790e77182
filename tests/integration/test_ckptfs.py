"""The chaos run's checkpoint filesystem, for real (as root): a process started in a mount namespace
of its own while the filesystem is read-only (as ``ip netns exec`` starts a netns host's agent
during a ``checkpoint_readonly`` fault) writes to it again once the fault ends."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from elasticd.chaos.ckptfs import CheckpointFs, unusable_here

pytestmark = pytest.mark.timeout(60)


def _touch_in(pid: int, path: Path) -> int:
    return subprocess.run(["nsenter", "-t", str(pid), "-m", "touch", str(path)], capture_output=True).returncode


@pytest.mark.skipif(
    bool(unusable_here()) or shutil.which("unshare") is None or shutil.which("nsenter") is None,
    reason=f"needs root, mount, unshare and nsenter ({unusable_here() or 'unshare or nsenter missing'})",
)
def test_a_mount_namespace_copied_while_read_only_is_writable_after_the_fault(tmp_path: Path) -> None:
    fs = CheckpointFs(tmp_path / "ckpt", lambda _: None)
    fs.mount()
    late = None
    try:
        fs.set_read_only(True)
        late = subprocess.Popen(["unshare", "-m", "--propagation", "slave", "sleep", "30"])
        mine = os.readlink("/proc/self/ns/mnt")
        for _ in range(100):  # until unshare made its namespace and exec'd sleep
            if (
                os.readlink(f"/proc/{late.pid}/ns/mnt") != mine
                and Path(f"/proc/{late.pid}/exe").resolve().name == "sleep"
            ):
                break
            time.sleep(0.02)
        fs.set_read_only(False)  # the original only: the late namespace keeps a read-only copy
        assert _touch_in(late.pid, tmp_path / "ckpt" / "a") != 0
        fs.set_read_only(True)
        fs.set_read_only(False, [late.pid])
        assert _touch_in(late.pid, tmp_path / "ckpt" / "b") == 0
        assert (tmp_path / "ckpt" / "b").exists()
    finally:
        if late is not None:
            late.kill()
            late.wait(10)
        fs.remove()
