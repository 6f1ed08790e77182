"""A bug is not a fault: real agents stop the job on the same exception at the same step, and on a
worker that exits EXIT_NO_RESTART, instead of restarting until the budget is spent; a worker that
exits 0 before the job finished is restarted; a new run after the fix starts clean."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_node_agent import AgentJob, agent_job  # noqa: F401
from tests.integration.test_ops import status_json

pytestmark = pytest.mark.timeout(150)

RAISES = [sys.executable, "tests/programs/raises.py"]
LEASE_TTL_S = 2.0  # etcd's minimum here: what the agents' workers get


def _stderr_reason(agent_log: str) -> str:
    return [line for line in agent_log.splitlines() if line.startswith("elasticd: ")][-1]


def test_the_same_exception_at_the_same_step_on_every_rank_stops_every_agent_with_exit_3(agent_job) -> None:
    job = agent_job(lease_ttl_s=LEASE_TTL_S)
    prog = [*RAISES, "--raise-at", "12", "--steps", "200"]
    agents = [job.start(node, "--max-restarts", "5", program=prog) for node in ("a", "b")]
    codes = [a.wait(90) for a in agents]
    assert codes == [3, 3], job.logs_tail()
    for a in agents:
        reason = _stderr_reason(a.log_text())
        assert reason.startswith("elasticd: job_failed: step 12: ValueError: bad sample N in shard N"), reason
        # stopped within one restart of each worker, not after the budget of five
        assert len(a.events("worker_started")) <= 2, a.log_text()[-3000:]
        (failed,) = a.events("job_failed")
        assert failed["step"] == 12 and sorted(failed["nodes"]) == ["a", "b"]  # type: ignore[arg-type]
    # the failure ended training within 2 x lease TTL + one restart of its first record
    status = status_json(job)
    assert status["health"] == "failed", status
    bug = status["bug"]
    assert isinstance(bug, dict) and bug["step"] == 12 and bug["exception"].startswith("ValueError: bad sample")
    assert "raises.py" in bug["detail"]
    stopped = max(a.events("agent_stopped")[-1]["timestamp"] for a in agents)  # type: ignore[type-var]
    first = min(f["time"] for f in status["failures"])  # type: ignore[union-attr, index]
    elapsed = _iso(str(stopped)) - float(first)
    print(f"job_failed: every agent stopped {elapsed:.2f} s after the first failure record")
    assert elapsed < 2 * LEASE_TTL_S + 3.0, elapsed  # one restart: the backoff, a start, the step


def _first_run_differs(flag: Path, first_run: str, *args: str) -> list[str]:
    """A worker program: ``tests/programs/raises.py`` with ``args``; on its first run (no ``flag``
    file yet: the agent's first start of it) the Python expression ``first_run`` is evaluated
    before it (one that adds arguments, or exits)."""
    code = (
        "import os, sys, runpy; f = sys.argv.pop(1); first = not os.path.exists(f); open(f, 'a').close(); "
        "sys.argv[0] = 'tests/programs/raises.py'; "
        f"({first_run}) if first else None; "
        "runpy.run_path('tests/programs/raises.py', run_name='__main__')"
    )
    return [sys.executable, "-c", code, str(flag), *args]


def _iso(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def test_one_rank_raising_once_is_restarted_and_the_job_finishes(agent_job, tmp_path: Path) -> None:
    """An exception on one rank at one step, once, is no bug: the worker restarts, rejoins, and the
    job finishes. Two nodes at least (``--nnodes 2:2``): both are in the job when step 8 comes,
    however late one of them starts on a loaded machine, and the other waits for the restarted one,
    which does not raise again (each node's first worker raises, as rank 1 only)."""
    raise_once = "sys.argv.extend(['--raise-at', '8', '--ranks', '1'])"
    job = agent_job(lease_ttl_s=LEASE_TTL_S)
    agents = [
        job.start(node, "--nnodes", "2:2", program=_first_run_differs(tmp_path / node, raise_once, "--steps", "120"))
        for node in ("a", "b")
    ]
    assert [a.wait(120) for a in agents] == [0, 0], job.logs_tail()
    assert sum(len(a.events("worker_started")) for a in agents) == 3
    assert status_json(job)["health"] == "finished"


def test_a_worker_exiting_no_restart_stops_its_agent_at_once_with_exit_3(agent_job) -> None:
    job = agent_job(lease_ttl_s=LEASE_TTL_S)
    agent = job.start("a", "--max-restarts", "5", program=[*RAISES, "--config-error"])
    assert agent.wait(60) == 3, job.logs_tail()
    assert len(agent.events("worker_started")) == 1
    reason = _stderr_reason(agent.log_text())
    assert reason.startswith("elasticd: worker_fatal: worker 0") and "exited with code 78" in reason, reason
    assert "ConfigError: data_path: /no/such/dataset does not exist" in agent.log_text()


def test_a_worker_raising_again_after_its_restart_stops_the_job_and_a_new_run_after_the_fix_is_clean(
    agent_job,
) -> None:
    """World 1: the first exception is restarted (it could be a fault); the same one at the same
    step after the restart is a bug. The job started again with the bug fixed is not stopped by the
    last run's records."""
    job = agent_job(lease_ttl_s=LEASE_TTL_S)
    agent = job.start("a", "--max-restarts", "5", program=[*RAISES, "--raise-at", "4", "--steps", "30"])
    assert agent.wait(90) == 3, job.logs_tail()
    assert len(agent.events("worker_started")) == 2  # the first start and one restart
    assert _stderr_reason(agent.log_text()).startswith("elasticd: job_failed: step 4: ValueError")
    assert status_json(job)["health"] == "failed"
    fixed = job.start("a", program=[*RAISES, "--steps", "30"])  # the same job, the bug fixed
    assert fixed.wait(90) == 0, job.logs_tail()
    assert fixed.events("failures_of_a_past_run_cleared")
    assert status_json(job)["health"] == "finished"


def test_a_worker_that_exits_0_before_the_job_finished_is_restarted(agent_job, tmp_path: Path) -> None:
    """A script that leaves its loop early (here: one rank, once) ends with 0 while the job goes on:
    the agent says so and restarts it like a failed worker; the job finishes with both nodes."""
    job = agent_job(lease_ttl_s=LEASE_TTL_S)
    a = job.start("a", program=[*RAISES, "--steps", "150"])
    time.sleep(1.0)
    b = job.start("b", program=_first_run_differs(tmp_path / "left-once", "sys.exit(0)", "--steps", "150"))
    assert [a.wait(120), b.wait(120)] == [0, 0], job.logs_tail()
    (scheduled,) = b.events("worker_restart_scheduled")
    assert "exited with code 0 before the job finished" in str(scheduled["reason"]), scheduled
    assert status_json(job)["health"] == "finished"


def _finals(job: AgentJob, nodes: tuple[str, ...]) -> list[str]:
    return [
        line.split("final ", 1)[1] for n in nodes for line in job.agents[n].log_text().splitlines() if " final " in line
    ]


def test_nan_gradients_from_one_rank_are_never_applied_and_the_rank_is_named(agent_job) -> None:
    job = agent_job(lease_ttl_s=LEASE_TTL_S)
    prog = [*RAISES, "--steps", "60", "--nan-at", "20", "--nan-steps", "2", "--nan-rank", "1"]
    agents = {node: job.start(node, "--nnodes", "2", program=prog) for node in ("a", "b")}
    assert [a.wait(120) for a in agents.values()] == [0, 0], job.logs_tail()
    finals = _finals(job, ("a", "b"))
    assert len(finals) == 2 and finals[0] == finals[1] and finals[0].endswith("finite True"), finals
    named = [e for a in agents.values() for e in a.events("gradients_not_finite")]
    assert [e["step"] for e in named] == [20, 21] and len({e["node"] for e in named}) == 1, named
    assert all(e["rank"] == 1 for e in named)
    skipped = [e["step"] for a in agents.values() for e in a.events("step_skipped")]
    assert sorted(skipped) == [20, 20, 21, 21], skipped  # on every member
    assert len([e for a in agents.values() for e in a.events("worker_started")]) == 2  # nobody restarted


def test_a_rank_whose_gradients_stay_nan_leaves_and_its_node_is_out(agent_job) -> None:
    """At nonfinite_steps (3) in a row its worker exits 78: its agent stops (exit 3, not restarted),
    and the other node finishes the job alone, its parameters finite."""
    job = agent_job(lease_ttl_s=LEASE_TTL_S)
    prog = [
        *RAISES,
        "--steps",
        "200",
        "--nan-at",
        "15",
        "--nan-steps",
        "1000",
        "--nan-rank",
        "1",
        "--step-sleep",
        "0.03",
    ]
    a = job.start("a", "--nnodes", "1:2", program=prog)
    job.wait_for(lambda: bool(a.events("worker_started")), 60, "a's worker")
    time.sleep(0.5)  # rank 0 on node a, rank 1 on node b (it joins at a regroup)
    b = job.start("b", "--nnodes", "1:2", program=prog)
    assert b.wait(120) == 3, job.logs_tail()
    assert "GradientsNotFinite" in b.log_text() and "worker_fatal" in _stderr_reason(b.log_text())
    assert a.wait(120) == 0, job.logs_tail()
    (final,) = _finals(job, ("a",))
    assert final.endswith("finite True"), final
    steps = [e["step"] for e in b.events("gradients_not_finite")]
    assert len(steps) == 3 and steps == list(range(steps[0], steps[0] + 3)), steps
    assert len(b.events("worker_started")) == 1  # not restarted
