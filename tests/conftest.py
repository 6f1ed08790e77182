"""Shared fixtures: a real etcd per test module, and a local job whose workers are tracked by PID."""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import structlog

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.store.etcd import EtcdClient
from elasticd.testing.audit import AuditReport, check_dir
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import WorkerProcess, python_program
from tests.jobs import job_factory, wait_until

_job_ids = itertools.count()


@pytest.fixture(autouse=True)
def _fresh_structlog() -> Iterator[None]:
    """A test that configures logging (e.g. the CLI in-process) must not leak it into the next."""
    yield
    structlog.reset_defaults()


@pytest.fixture
def client(etcd_server: EtcdServer) -> Iterator[EtcdClient]:
    """A client of the module's etcd server, closed after the test."""
    c = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), Timeouts(), RetryPolicy())
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    server = EtcdServer().start()
    try:
        yield server
    finally:
        server.stop()


class LocalJob:
    """Workers of the default workload (or any program) in one job, with their audit logs."""

    def __init__(self, etcd: EtcdServer, workdir: Path, **settings: object) -> None:
        self.etcd = etcd
        self.dir = workdir
        self.job_id = f"job{os.getpid()}x{next(_job_ids)}"
        self.settings = {k.upper(): str(v) for k, v in settings.items()}
        self.workers: list[WorkerProcess] = []

    def env(self, local_rank: int, **extra: object) -> dict[str, str]:
        env = {
            "ELASTICD_ETCD_ENDPOINTS": self.etcd.endpoint,
            "ELASTICD_JOB_ID": self.job_id,
            "ELASTICD_NODE_ID": "testnode",
            "ELASTICD_LOCAL_RANK": str(local_rank),
            "ELASTICD_LEASE_TTL_S": "2",
            "ELASTICD_KEEPALIVE_S": "0.5",
            # a whole-job restart here has nothing cut off from etcd: no need to hold its resume
            "ELASTICD_RESUME_HOLD_S": "1",
        }
        env.update({"ELASTICD_" + k: v for k, v in self.settings.items()})
        env.update({"ELASTICD_" + k.upper(): str(v) for k, v in extra.items()})
        return env

    def spawn(self, *args: str, program: str = "agents/mlp.py", audit: bool = True, **extra: object) -> WorkerProcess:
        i = len(self.workers)
        argv = list(args) + (["--audit", str(self.dir / f"audit{i}.jsonl")] if audit else [])
        w = WorkerProcess(python_program(program, *argv), self.env(i, **extra), self.dir / f"worker{i}.log")
        self.workers.append(w.start())
        return w

    def audit(self, dataset_size: int = 2048) -> AuditReport:
        return check_dir(self.dir, dataset_size)

    def committed(self, worker: int | None = None) -> int:
        """The highest step committed so far (read from the audit logs), by any worker or by the
        ``worker``-th one spawned (0 while it has committed nothing)."""
        best = 0
        for p in self.dir.glob("*.jsonl" if worker is None else f"audit{worker}.jsonl"):
            for line in reversed(p.read_text().splitlines()):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if rec.get("event") == "commit":
                    best = max(best, int(rec["step"]))
                    break
        return best

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        wait_until(cond, timeout, what, self.logs_tail)

    def wait_all(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        return [w.wait(max(0.1, deadline - time.monotonic())) for w in self.workers]

    def logs_tail(self, n: int = 15) -> str:
        return "\n".join(
            f"--- worker {i}\n" + "\n".join(w.log_text().splitlines()[-n:]) for i, w in enumerate(self.workers)
        )

    def stop(self) -> None:
        for w in self.workers:
            w.stop()


@pytest.fixture
def local_job(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[Callable[..., LocalJob]]:
    with job_factory(lambda d, settings: LocalJob(etcd_server, d, **settings), tmp_path) as make:
        yield make
