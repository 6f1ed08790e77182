"""Helpers shared by the job fixtures: a bounded wait, a factory that stops every job it made, and
the roll-forward scenario that two test modules play (``refuse_and_lose_appliers``)."""

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


def refuse_and_lose_appliers(job: Any, spawn: Callable[..., Any], step: int) -> Any:
    """The roll-forward scenario (``worker.rollforward``), with real faults: of three workers
    (``spawn()`` starts one), worker 1 stops itself right after the gradient sum of ``step`` arrives,
    before it reads its fence (``ELASTICD_STOP_AFTER_SUM``); workers 0 and 2 apply the step and
    SIGKILL themselves as they begin the next one (``ELASTICD_KILL_AFTER_APPLY``: before any regroup,
    and before anything confirmed the step, so it is not their commit); worker 1's lease (2 s) runs
    out while it is stopped, so continued, it cannot confirm it and refuses the step; two newcomers
    join it. Returns worker 1."""
    spawn(kill_after_apply=step)
    victim = spawn(stop_after_sum=step)
    spawn(kill_after_apply=step)
    job.wait_for(lambda: _stopped(victim.pid), 90, f"worker 1 stopped after the sum of step {step}")
    job.wait_for(lambda: not job.workers[0].alive() and not job.workers[2].alive(), 10,
                 f"workers 0 and 2 to apply step {step} and end")
    assert [job.workers[w].proc.returncode for w in (0, 2)] == [-9, -9], job.logs_tail()
    assert not any(r["step"] >= step for w in range(3) for r in audit_commits(job, w))
    # worker 1's lease ends while it is stopped (etcd removes its member key), so it cannot confirm it
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


def assert_rolled_once(job: Any, step: int, log: str) -> None:
    """``step``, applied by workers 0 and 2 in its generation (who were lost before it was confirmed),
    was rolled forward by a later generation's three (``sum_generation`` naming the first: that
    generation's commit), never done again; the log says so."""
    rows = [r for w in range(len(job.workers)) for r in audit_commits(job, w) if r["step"] == step]
    before = [r for w in range(len(job.workers)) for r in audit_commits(job, w) if r["step"] == step - 1]
    rolled = [r for r in rows if "sum_generation" in r]
    assert len(rolled) == 3 == len(rows), rows
    assert {r["sum_generation"] for r in rolled} == {r["generation"] for r in before}, (rows, before)
    assert all(r["generation"] > r["sum_generation"] for r in rolled)
    assert "step_sum_kept" in log and "step_rolled_forward" in log
