"""Helpers shared by the job fixtures: a bounded wait, a factory that stops every job it made, and
the stop-after-the-sum scenario that two test modules play (``stop_one_and_lose_the_others``)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

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


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def audit_commits(job: Any, worker: int) -> list[dict[str, Any]]:
    """The commit lines of the ``worker``-th worker's audit log."""
    p = job.dir / f"audit{worker}.jsonl"
    if not p.exists():
        return []
    return [r for r in map(json.loads, p.read_text().splitlines()) if r["event"] == "commit"]


def stop_one_and_lose_the_others(job: Any, spawn: Callable[..., Any], step: int) -> Any:
    """Of three workers (``spawn()`` starts one), worker 1 stops itself right after the gradient sum
    of ``step`` arrives, before it applies the step (``ELASTICD_STOP_AFTER_SUM``); workers 0 and 2
    apply the step and SIGKILL themselves as they begin the next one (``ELASTICD_KILL_AFTER_APPLY``:
    before any regroup, and before anything confirmed the step, so it is not their commit); worker
    1's lease (2 s) runs out while it is stopped; continued, it applies the sum it holds, rejoins as
    the holder of the newest state and two newcomers join it. Returns worker 1."""
    spawn(kill_after_apply=step)
    victim = spawn(stop_after_sum=step)
    spawn(kill_after_apply=step)
    job.wait_for(lambda: _stopped(victim.pid), 90, f"worker 1 stopped after the sum of step {step}")
    job.wait_for(
        lambda: not job.workers[0].alive() and not job.workers[2].alive(),
        10,
        f"workers 0 and 2 to apply step {step} and end",
    )
    assert [job.workers[w].proc.returncode for w in (0, 2)] == [-9, -9], job.logs_tail()
    assert not any(r["step"] >= step for w in range(3) for r in audit_commits(job, w))
    # worker 1's lease ends while it is stopped (etcd removes its member key)
    from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
    from elasticd.store.etcd import EtcdClient
    from elasticd.wire.keys import Keys

    store = EtcdClient(EtcdConfig(endpoints=(job.etcd.endpoint,)), Timeouts(), RetryPolicy())
    try:
        gone = Keys("/elasticd", job.job_id).member("")
        job.wait_for(lambda: not store.get_prefix(gone), 15, "every member's lease to end")
    finally:
        store.close()
    victim.signal(signal.SIGCONT)
    spawn()
    spawn()
    return victim


def assert_committed_once(job: Any, step: int) -> None:
    """``step``, applied in its generation by all three (workers 0 and 2 lost before anything
    confirmed it), is committed once: by worker 1 alone, in that generation (the sync that made it
    rank 0 of the next one confirmed it), never done again."""
    rows = [r for w in range(len(job.workers)) for r in audit_commits(job, w) if r["step"] == step]
    mine = [r for r in audit_commits(job, 1) if r["step"] in (step - 1, step)]
    assert len(rows) == 1 and [r["step"] for r in mine] == [step - 1, step], (rows, mine)
    assert mine[0]["generation"] == mine[1]["generation"], mine
