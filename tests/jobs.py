"""Helpers shared by the job fixtures: a bounded wait, and a factory that stops every job it made."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol, TypeVar

POLL_S = 0.05  # how often a bounded wait looks again


class Stoppable(Protocol):
    def stop(self) -> None: ...


J = TypeVar("J", bound=Stoppable)


def wait_until(cond: Callable[[], bool], timeout: float, what: str, tail: Callable[[], str]) -> None:
    """Poll ``cond`` until it holds; after ``timeout`` seconds fail with ``tail()`` (logs) attached."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(POLL_S)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{tail()}")


@contextmanager
def job_factory(build: Callable[[Path, dict[str, object]], J], root: Path) -> Iterator[Callable[..., J]]:
    """Yield ``make(**settings)``, which builds a job in its own folder under ``root``; every job
    made is stopped (its processes killed by PID) when the block ends."""
    jobs: list[J] = []

    def make(**settings: object) -> J:
        job = build(root / f"job{len(jobs)}", settings)
        jobs.append(job)
        return job

    try:
        yield make
    finally:
        for job in jobs:
            job.stop()
