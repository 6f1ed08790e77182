"""A worker hung with every thread (a C call that holds the GIL) behind its agent's relay: its
process runs, its socket to the relay stays open and its kernel accepts connects, so neither its
lease nor a connect says it is gone. The survivors' reach check asks its Python for an answer
(``rendezvous.answer``), gets none within ``unresponsive_s``, and regroups without it, long before
``collective_s`` or the lease TTL; its agent kills it as hung once the job moved on, restarts it,
and the job ends with every step once."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from elasticd.testing.audit import check_dir
from tests.integration.test_node_agent import agent_job  # noqa: F401
from tests.integration.test_spares import _started

pytestmark = pytest.mark.timeout(180)

STEPS = 600
LEASE_TTL_S = 10.0  # survivors that waited for the hung worker's lease would show it
UNRESPONSIVE_S = 2.0


def test_a_worker_hung_holding_the_gil_behind_the_relay_is_left_out_within_unresponsive_s(agent_job) -> None:
    job = agent_job(lease_ttl_s=LEASE_TTL_S, unresponsive_s=UNRESPONSIVE_S, hang_timeout_s=3)

    def program(node: str) -> list[str]:
        return [sys.executable, "agents/mlp.py", "--hang-on-sigusr1", "--step-sleep", "0.02", "--steps", str(STEPS),
                "--audit", str(job.audit_path(node))]  # fmt: skip

    a = job.start("a", "--nnodes", "1:2", program=program("a"))
    b = job.start("b", "--nnodes", "1:2", program=program("b"))
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 20, 90, "both workers to train together")
    assert b.events("relay_started"), b.log_text()[-2000:]
    victim = _started(b, False)[0]
    hung_at = time.time()
    os.kill(victim, signal.SIGUSR1)
    job.wait_for(
        lambda: any(r["t"] > hung_at and r["world_size"] == 1 for r in job.commits("a")),
        LEASE_TTL_S + 10,
        "the other worker to commit alone",
    )
    alone = min(float(r["t"]) for r in job.commits("a") if r["t"] > hung_at and r["world_size"] == 1)  # type: ignore[arg-type]
    # unresponsive_s after the reach check asked (reach_check_s into the stuck step at most), then a
    # regroup: well before the 10 s lease or collective_s (30 s)
    assert alone - hung_at < LEASE_TTL_S, f"the survivor went on alone only {alone - hung_at:.2f} s after the hang"
    assert "members unresponsive" in a.log_text(), job.logs_tail()
    job.wait_for(lambda: bool(b.events("worker_hung")), 60, "b's agent to end its hung worker")
    assert int(b.events("worker_hung")[0]["pid"]) == victim  # type: ignore[call-overload]
    assert a.wait(150) == 0 and b.wait(60) == 0, job.logs_tail()
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == STEPS and len(set(rep.final_checksums)) == 1
