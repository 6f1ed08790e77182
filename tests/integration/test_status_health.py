"""``elasticctl status`` health from live records, against a real etcd and real workers:
a failed checkpoint save is shown and makes the job degraded; a generation record replaced by
garbage does not make a training job look down; a job that commits nothing for longer than the
stall bound is ``stalled``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.ops.health import Health
from elasticd.ops.status import JobStatus, WorkerState, read_status
from elasticd.store.etcd import EtcdClient
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import REPO_ROOT
from elasticd.wire.keys import Keys

pytestmark = pytest.mark.timeout(180)


def _status(etcd_server: EtcdServer, job_id: str, **kw: Any) -> JobStatus:
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), Timeouts(), RetryPolicy())
    try:
        return read_status(client, Keys("/elasticd", job_id), now=time.time(), **kw)
    finally:
        client.close()


def test_a_failed_save_and_a_garbage_generation_show_in_status_while_the_job_trains(
    local_job: Any, etcd_server: EtcdServer, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")  # the checkpoint directory cannot be created: every save fails
    job = local_job(min_workers=1)
    job.spawn(
        "--steps",
        "3000",
        "--step-sleep",
        "0.02",
        "--checkpoint-dir",
        str(blocker / "ckpt"),
        "--checkpoint-every-steps",
        "10",
    )
    job.wait_for(lambda: _status(etcd_server, job.job_id).save_failed is not None, 90, "a failed save in etcd")
    st = _status(etcd_server, job.job_id)
    assert st.health is Health.DEGRADED and "the last checkpoint save failed" in st.reason, st.reason
    assert st.save_failed is not None and st.save_failing and st.save_failed.step % 10 == 0
    assert st.save_failed.errno in ("ENOTDIR", "EEXIST") and str(blocker) in st.save_failed.directory

    clean = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    proc = subprocess.run(
        [sys.executable, "-m", "elasticd.cli", "--etcd", etcd_server.endpoint, "status", "--job", job.job_id, "--json"],
        cwd=REPO_ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["health"] == "degraded" and data["save_failed"]["failing"] is True, data
    assert data["save_failed"]["errno"] in ("ENOTDIR", "EEXIST")

    # Garbage replaces the generation record (by hand): the member goes on training, and status
    # says so from the live records instead of calling the job down.
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), Timeouts(), RetryPolicy())
    try:
        client.put(Keys("/elasticd", job.job_id).generation, b"[[[[")
    finally:
        client.close()
    at = job.committed()
    job.wait_for(lambda: job.committed() >= at + 20, 60, "20 more steps after the garbage")
    st = _status(etcd_server, job.job_id)
    assert st.health is Health.DEGRADED and "generation record is malformed" in st.reason, st.reason
    assert "1 live member(s) train in generation 1" in st.reason, st.reason
    assert [(m.state, m.rank) for m in st.members] == [(WorkerState.TRAINING, 0)]


def test_a_job_that_commits_nothing_for_longer_than_the_bound_is_stalled(
    local_job: Any, etcd_server: EtcdServer
) -> None:
    job = local_job(min_workers=1)
    job.spawn("--steps", "3000", "--step-sleep", "2.5")  # a slow step: the lease stays alive
    job.wait_for(lambda: _status(etcd_server, job.job_id).last_activity_age_s is not None, 90, "a generation")
    job.wait_for(
        lambda: _status(etcd_server, job.job_id, stall_after_s=1.0).health is Health.STALLED,
        30,
        "a stall of more than 1 s between commits",
    )
    st = _status(etcd_server, job.job_id, stall_after_s=1.0)
    assert "no step committed for" in st.reason and "(> 1s)" in st.reason, st.reason
    assert st.last_activity_age_s is not None and st.last_activity_age_s > 1.0
    assert st.exit_code == 2
    assert _status(etcd_server, job.job_id, stall_after_s=0).health is Health.HEALTHY  # checks off
    assert _status(etcd_server, job.job_id).health is Health.HEALTHY  # the default bound is far above 2.5 s
