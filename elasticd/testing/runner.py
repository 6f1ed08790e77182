"""The shell of a local-cluster program's ``main`` (``python -m elasticd.demo`` and ``python -m
elasticd.chaos``): its work directory, SIGTERM, its exit code and its cleanup.

Owns ``make_workdir`` (an empty ``--workdir``, or a temporary one), ``sigterm_raises`` (SIGTERM
leaves through the same cleanup as Ctrl-C) and ``run_to_exit`` (how a run ended -> the exit code,
then every process stopped and the work dir removed or kept). It never starts a process itself and
never decides what a run does or whether it passed: its caller's ``body`` says so.
"""

from __future__ import annotations

import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from elasticd.errors import ConfigError


def make_workdir(workdir: Path | None, keep: bool, prefix: str) -> tuple[Path, bool]:
    """The work directory of a demo or chaos run: ``workdir`` (created; it must be empty), or a new
    temporary one. Returns it and whether to remove it at the end (a temporary one, unless ``keep``).

    Raises:
        ConfigError: ``workdir`` is not empty.
    """
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix=prefix)), not keep
    workdir = workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        raise ConfigError(f"--workdir: {workdir} is not empty")
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir, False


class Terminated(Exception):
    """SIGTERM arrived (inside ``sigterm_raises``): leave through the same cleanup as Ctrl-C."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` in the main thread, so that a runner of a
    local cluster stops every process it started on that way out too."""

    def handler(_signum: int, _frame: FrameType | None) -> None:
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_to_exit(
    name: str,
    body: Callable[[], int],
    stop: Callable[[], None],
    workdir: Path,
    remove: bool,
    say: Callable[[str], None],
) -> int:
    """Run ``body`` (the run; it returns 0 when it passed, 1 when it failed) with SIGTERM raising
    ``Terminated``, and return the exit code of how it ended: ``body``'s, 2 on ``ConfigError`` (no
    etcd binary), 1 on ``RuntimeError`` (etcd did not start, an ``ip`` command failed), 130 on Ctrl-C
    or SIGTERM. On every way out ``stop`` ends every process the run started; then ``workdir`` is
    removed when ``remove`` and the run passed, else kept, and ``say`` tells where.

    ``name`` prefixes the messages printed to stderr (``elasticd.demo``, ``elasticd.chaos``).
    """
    code = 1
    try:
        with sigterm_raises():
            code = body()
    except ConfigError as exc:  # no etcd binary
        print(f"{name}: {exc}", file=sys.stderr)
        code = 2
    except RuntimeError as exc:  # etcd did not start, or an `ip` command failed
        print(f"{name}: {exc}", file=sys.stderr)
        code = 1
    except (KeyboardInterrupt, Terminated):
        print(f"\n{name}: interrupted; stopping every process it started", file=sys.stderr)
        code = 130
    finally:
        stop()
        if remove and code == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"work dir kept: {workdir}")
    return code
