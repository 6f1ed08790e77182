"""Faults under real agents: a frozen worker (hang detection) and a lost node (agent and workers
SIGKILLed, then the node comes back). Real etcd, agents as separate processes, real gloo workers;
every run ends with the audit checker."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from elasticd.testing.audit import check_dir, read_lines
from tests.integration.test_node_agent import (  # noqa: F401 (fixture)
    AgentJob,
    _worker_pid,
    agent_job,
)

STEPS = 700  # long enough that a replacement started under load (torch import ~10 s) joins before the end
SLOW_MLP = [sys.executable, "agents/mlp.py", "--step-sleep", "0.02", "--steps", str(STEPS)]
KILL_WAIT_S = 10.0  # bound on a SIGKILLed process to disappear


def _program(job: AgentJob, node: str) -> list[str]:
    return [*SLOW_MLP, "--audit", str(job.audit_path(node))]


def _syncs_after(job: AgentJob, node: str, t: float) -> list[dict[str, object]]:
    return [r for r in read_lines([job.audit_path(node)]) if r["event"] == "sync" and float(r["t"]) > t]


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(150)
def test_a_frozen_worker_is_detected_as_hung_killed_and_replaced(agent_job):
    # lease 2 s: the frozen worker drops out of the job after 2 s; hang_timeout 3 s: then it is replaced.
    job = agent_job(lease_ttl_s=2, keepalive_s=0.5, hang_timeout_s=3)
    a = job.start("a", "--nnodes", "1:2", program=_program(job, "a"))
    b = job.start("b", "--nnodes", "1:2", program=_program(job, "b"))
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 60, "both workers to train together")
    victim = _worker_pid(b)
    frozen_at = time.time()
    os.kill(victim, signal.SIGSTOP)
    try:
        job.wait_for(
            lambda: any(r["t"] > frozen_at + 2 and r["world_size"] == 1 for r in job.commits("a")),
            20,
            "the survivor to go on alone after the lease TTL",
        )
        job.wait_for(lambda: bool(b.events("worker_hung")), 20, "the agent to find the frozen worker hung")
    finally:
        try:
            os.kill(victim, signal.SIGCONT)  # harmless after the SIGKILL; frees it if the agent did not act
        except ProcessLookupError:
            pass
    (hung,) = b.events("worker_hung")
    assert hung["pid"] == victim and victim in hung["killed"], hung
    assert float(hung["stalled_s"]) >= 3.0  # type: ignore[arg-type]
    assert int(hung["job_step_now"]) > int(hung["job_step_then"])  # type: ignore[call-overload]
    job.wait_for(lambda: bool(b.events("worker_restart_scheduled")), 10, "the hung worker's restart")
    exited = [e for e in b.events("worker_exited") if e["pid"] == victim]
    assert exited and exited[0]["signal"] == signal.SIGKILL, b.log_text()[-3000:]
    assert "as hung" in str(b.events("worker_restart_scheduled")[0]["reason"])
    # the replacement rejoins as a newcomer: it syncs into a world of 2
    job.wait_for(
        lambda: any(r["world_size"] == 2 for r in _syncs_after(job, "b", frozen_at)), 60, "the replacement to join"
    )
    assert a.wait(90) == 0, job.logs_tail()
    assert b.wait(30) == 0, job.logs_tail()
    assert len(b.events("worker_started")) == 2
    assert len(b.events("worker_hung")) == 1  # the replacement, finishing and leaving, was not taken for hung
    assert not a.events("worker_hung")  # nor was the survivor
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == STEPS
    assert len(set(rep.final_checksums)) == 1


def _kill_node(agent_pid: int, worker_pids: list[int]) -> None:
    """SIGKILL an agent and its workers (as a power loss would), and wait until they are gone."""
    procs = []
    for pid in [agent_pid, *worker_pids]:
        try:
            procs.append(psutil.Process(pid))
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, psutil.NoSuchProcess):
            pass
    _, alive = psutil.wait_procs(procs, timeout=KILL_WAIT_S)
    assert not alive, f"still alive {KILL_WAIT_S} s after SIGKILL: {alive}"


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(150)
def test_node_loss_the_job_goes_on_smaller_and_the_node_rejoins_when_its_agent_is_back(agent_job):
    job = agent_job(lease_ttl_s=2, keepalive_s=0.5)
    a = job.start("a", "--nnodes", "1:2", program=_program(job, "a"))
    b = job.start("b", "--nnodes", "1:2", program=_program(job, "b"))
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 60, "both nodes to train together")
    lost_at = time.time()
    _kill_node(b.pid, [_worker_pid(b)])
    job.wait_for(lambda: job.commits_at_world("a", 1) >= 5, 20, "the job to go on at world 1")
    first_alone = min(float(r["t"]) for r in job.commits("a") if r["world_size"] == 1)  # type: ignore[arg-type]
    assert first_alone - lost_at < 2 + 3, f"the survivor went on {first_alone - lost_at:.1f} s after the loss"
    step_at_return = max(int(r["step"]) for r in job.commits("a"))  # type: ignore[call-overload]
    assert step_at_return < STEPS, "the job finished before the node came back: make it longer"
    back_at = time.time()
    b2 = job.start("b", "--nnodes", "1:2", program=_program(job, "b"))  # the same node id, a new agent
    job.wait_for(
        lambda: any(r["t"] > back_at and r["world_size"] == 2 for r in job.commits("a")),
        60,
        "the world to grow back to 2",
    )
    assert a.wait(90) == 0, job.logs_tail()
    assert b2.wait(30) == 0, job.logs_tail()
    assert any(r["world_size"] == 2 for r in _syncs_after(job, "b", back_at))
    assert b2.events("agent_stopped")[-1]["reason"] == "workers_finished"
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == STEPS
    assert len(set(rep.final_checksums)) == 1
