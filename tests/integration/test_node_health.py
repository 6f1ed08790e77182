"""A node's health check and its cordon with real agents: a failing check keeps the node out of the
job (no worker started), a passing one admits it, and a check that fails later takes its workers
out while the job goes on with the other node; a node that keeps crashing is cordoned until
``elasticctl uncordon``, as one an operator cordons."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_node_agent import AgentJob, agent_job  # noqa: F401
from tests.integration.test_ops import elasticctl, status_json

pytestmark = pytest.mark.timeout(150)


def _node(job: AgentJob, node: str) -> dict[str, object]:
    return next((n for n in status_json(job)["nodes"] if n["node"] == node), {})


def test_a_failing_check_keeps_a_node_out_and_a_passing_one_admits_it(agent_job, tmp_path: Path) -> None:
    healthy = tmp_path / "healthy"
    check = f"test -e {healthy} || {{ echo 'no {healthy.name} file'; exit 1; }}"
    job = agent_job(lease_ttl_s=2.0)
    steps = 100000  # the job runs until the test ends it
    job.start("a", "--nnodes", "1:2", steps=steps)
    b = job.start("b", "--nnodes", "1:2", "--health-check", check, "--health-check-interval-s", "0.5", steps=steps)
    job.wait_for(lambda: bool(b.events("health_check_failed")), 60, "b's failing check")
    job.wait_for(
        lambda: str(_node(job, "b").get("health", "")).startswith("failing: exit code 1: no healthy file"), 30, "status"
    )
    assert _node(job, "b")["state"] == "unhealthy"
    job.wait_for(lambda: job.commits_at_world("a", 1) > 20, 60, "a training alone")
    assert not b.events("worker_started")  # kept out: no worker of b ever started
    healthy.touch()  # the node is fixed
    job.wait_for(lambda: job.commits_at_world("b", 2) > 10, 60, "b admitted: a world of 2")
    assert _node(job, "b")["health"] == "passing"
    healthy.unlink()  # it goes bad again: its worker leaves, the job goes on with a
    job.wait_for(lambda: len(b.events("health_check_failed")) >= 2, 30, "b's second failing check")
    job.wait_for(lambda: _node(job, "b").get("workers_running") == 0, 30, "b's worker stopped")
    at_one = job.commits_at_world("a", 1)
    job.wait_for(lambda: job.commits_at_world("a", 1) > at_one + 20, 60, "a training alone again")
    assert b.proc.poll() is None  # b waits for its check to pass, its agent up
    assert len(b.events("worker_started")) == 1 and not b.events("restarts_exhausted")
    b.proc.send_signal(signal.SIGTERM)  # a drain of an unhealthy node ends its agent with 0
    assert b.wait(30) == 0, b.log_text()[-3000:]


def test_a_node_that_keeps_crashing_is_cordoned_until_uncordon(agent_job) -> None:
    """More than cordon_crashes (2) crashes: the agent cordons its node and starts no worker; status
    counts its faults; elasticctl uncordon lets it start again; an operator's cordon holds it too."""
    job = agent_job(lease_ttl_s=2.0, cordon_crashes=2, max_restarts=20, restart_backoff_initial_s=0.05)
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    b = job.start("b", program=crash)
    job.wait_for(lambda: bool(b.events("node_cordoned")), 60, "b cordoned")
    job.wait_for(lambda: _node(job, "b").get("state") == "unhealthy", 30, "b out of service")
    time.sleep(1.0)
    starts = len(b.events("worker_started"))
    assert starts == 3, b.log_text()[-3000:]  # the third crash is more than 2: no fourth start
    node = _node(job, "b")
    assert node["faults_last_hour"] == {"crash": 3} and "3 crashes within cordon_window_s" in str(node["cordoned"])
    assert elasticctl(job, "uncordon", "b").returncode == 0
    job.wait_for(lambda: len(b.events("worker_started")) > starts, 30, "b starting workers again")
    job.wait_for(lambda: len(b.events("node_cordoned")) >= 2, 30, "b cordoned again (its crashes still count)")
    b.kill_group()
    ok = job.start("c", program=[sys.executable, "-c", "import time; time.sleep(60)"])
    job.wait_for(lambda: bool(ok.events("worker_started")), 30, "c's worker")
    assert elasticctl(job, "cordon", "c", "--reason", "disk swap").returncode == 0  # an operator's cordon
    job.wait_for(lambda: _node(job, "c").get("workers_running") == 0, 30, "c's worker stopped")
    assert "disk swap" in str(_node(job, "c")["cordoned"]) and len(ok.events("worker_started")) == 1
    assert elasticctl(job, "uncordon", "c").returncode == 0
    job.wait_for(lambda: len(ok.events("worker_started")) == 2, 30, "c's worker started again")
