"""Warm spares for real: agents started with ``--spares 1`` (and a ``--standby`` node), a real etcd,
real gloo workers. A crashed worker's place goes to the spare that was already waiting, the crashed
slot comes back as a spare; then, in the same job, a frozen (hung) worker is replaced the same way; waiting spares change
no generation; a standby node replaces a lost one. Every run ends with the audit checker.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from elasticd.testing.audit import check_dir, read_lines
from tests.integration.test_node_agent import (  # noqa: F401 (fixture)
    AgentJob,
    AgentProcess,
    agent_job,
)
from tests.integration.test_ops import status_json

STEPS = 700  # ~18 s at 40 steps/s: long enough for each fault and its replacement
QUIET_S = 5.0  # waiting spares must change no generation over this long (a flood would be several a second)
QUIET_STEPS = 800  # the standby test: the quiet phase, then a node loss (~400 steps left for it)
CRASH_HANG_STEPS = (
    800  # ~20 s: a spare's restart, a crash and its spare's restart, then a hang (done by step ~160 here: 5x)
)


def _program(job: AgentJob, node: str, steps: int = STEPS) -> list[str]:
    return [
        sys.executable,
        "agents/mlp.py",
        "--step-sleep",
        "0.02",
        "--steps",
        str(steps),
        "--audit",
        str(job.audit_path(node)),
    ]


def _started(agent: AgentProcess, spare: bool) -> list[int]:
    """Pids of the workers the agent started as spares (or not), in order."""
    return [int(e["pid"]) for e in agent.events("worker_started") if bool(e.get("spare")) is spare]  # type: ignore[call-overload]


def _members_of(pid: int, agent: AgentProcess) -> set[str]:
    """Member ids of ``pid`` seen in the generations its agent's workers logged (``<node>.<rank>.<pid>``)."""
    return {m for e in agent.events("recovered") for m in e.get("members", []) if m.endswith(f".{pid}")}  # type: ignore[union-attr]


def _waiting(pid: int, agent: AgentProcess) -> bool:
    """The spare ``pid`` of ``agent`` registered and waits for a generation that needs it."""
    return any(str(e.get("member", "")).endswith(f".{pid}") for e in agent.events("standby_waiting"))


def _generations(job: AgentJob, node: str, since: float) -> set[int]:
    return {int(r["generation"]) for r in job.commits(node) if float(r["t"]) > since}  # type: ignore[arg-type, call-overload]


def _at_full_size(job: AgentJob, node: str, world: int, since: float) -> bool:
    return any(float(r["t"]) > since and r["world_size"] == world for r in job.commits(node))  # type: ignore[arg-type]


@pytest.mark.timeout(240)
def test_a_crashed_and_then_a_hung_worker_are_each_replaced_by_a_waiting_spare(agent_job):
    # A 10 s lease (a survivor that waited for the crashed worker's lease would show it) and a
    # frozen worker's lease revoked by its agent (stopped_worker_s), killed as hung once the job
    # went on without it for hang_timeout_s; both places go to spares at the next step boundary.
    job = agent_job(lease_ttl_s=10, hang_timeout_s=3)
    # max_workers 4: the job runs at 2, below it; the spares must still wait (the job is at its full size)
    a = job.start("a", "--nnodes", "1:4", "--spares", "1", program=_program(job, "a", CRASH_HANG_STEPS))
    b = job.start("b", "--nnodes", "1:4", "--spares", "1", program=_program(job, "b", CRASH_HANG_STEPS))
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 90, "both workers to train together")
    job.wait_for(lambda: len(_started(a, True)) == 1 and len(_started(b, True)) == 1, 10, "a spare on each node")
    # elasticctl status shows them: a spare on each node, the job healthy
    job.wait_for(lambda: [n["spares"] for n in status_json(job)["nodes"]] == [1, 1], 20, "status to show the spares")
    st = status_json(job)
    assert st["health"] == "healthy" and sorted(m["state"] for m in st["members"]) == [
        "spare",
        "spare",
        "training",
        "training",
    ], st
    # a spare that dies is restarted without touching the job
    quiet_from = time.time()
    os.kill(_started(a, True)[0], signal.SIGKILL)
    job.wait_for(lambda: len(_started(a, True)) == 2, 20, "the dead spare restarted")
    assert len(_generations(job, "a", quiet_from)) == 1, job.logs_tail()
    # a crash: b's spare, already running before the kill, is in the generation after it
    (victim,) = _started(b, False)
    (spare,) = _started(b, True)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    job.wait_for(lambda: _at_full_size(job, "a", 2, killed_at), 30, "the job back at 2 workers")
    job.wait_for(lambda: bool(_members_of(spare, b)), 10, "the spare's recovered line")
    back = min(float(r["t"]) for r in job.commits("a") if float(r["t"]) > killed_at and r["world_size"] == 2)  # type: ignore[arg-type]
    print(f"full size again {back - killed_at:.3f} s after the SIGKILL")
    # the crashed slot came back as a spare, and the job stays at 2 while it waits
    job.wait_for(lambda: len(_started(b, True)) == 2, 30, "the crashed slot restarted as a spare")
    # a hang: a's worker frozen; a waiting spare takes its place (a's restarted one or b's crashed
    # slot: which registered first, on a loaded machine either)
    (frozen,) = _started(a, False)
    a_spare, b_spare = _started(a, True)[-1], _started(b, True)[-1]
    # both waiting (a worker's start takes seconds on a loaded machine): the place goes to one at once
    job.wait_for(lambda: _waiting(a_spare, a) and _waiting(b_spare, b), 60, "the restarted spares waiting")
    frozen_at = time.time()
    os.kill(frozen, signal.SIGSTOP)
    try:
        job.wait_for(
            lambda: (
                _at_full_size(job, "b", 2, frozen_at + 0.1) and (_members_of(a_spare, a) or _members_of(b_spare, b))
            ),
            30,
            "a spare in the frozen worker's place",
        )
        job.wait_for(lambda: bool(a.events("worker_hung")), 20, "the agent to find the frozen worker hung")
    finally:
        try:
            os.kill(frozen, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert int(a.events("worker_hung")[0]["pid"]) == frozen  # type: ignore[call-overload]
    assert a.wait(150) == 0, job.logs_tail()
    assert b.wait(30) == 0, job.logs_tail()
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == CRASH_HANG_STEPS
    assert not [r for r in job.commits("a") if r["world_size"] > 2]  # never past its full size
    audits = read_lines([job.audit_path("a"), job.audit_path("b")])
    synced = sorted(
        (r for r in audits if r["event"] == "sync" and float(r["t"]) > frozen_at), key=lambda r: float(r["t"])
    )  # type: ignore[arg-type]
    assert synced and synced[0]["world_size"] == 2  # the spare came in at once: no step at world 1


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(200)
def test_spares_beyond_max_workers_wait_quietly_and_a_standby_node_replaces_a_lost_node(agent_job):
    job = agent_job(lease_ttl_s=4)
    a = job.start("a", "--nnodes", "1:2", "--spares", "1", program=_program(job, "a", QUIET_STEPS))
    b = job.start("b", "--nnodes", "1:2", program=_program(job, "b", QUIET_STEPS))
    s = job.start("s", "--nnodes", "1:2", "--standby", program=_program(job, "s", QUIET_STEPS))
    job.wait_for(
        lambda: job.commits_at_world("a", 2) >= 5 and len(_started(s, True)) == 1 and len(_started(a, True)) == 1,
        90,
        "two nodes training at max_workers, two spares waiting",
    )
    quiet_from = time.time()
    time.sleep(QUIET_S)
    assert len(_generations(job, "a", quiet_from)) == 1, job.logs_tail()
    assert not job.commits("s")  # the standby node's worker waits
    lost_at = time.time()
    b.kill_group()  # the node is lost: its agent and worker SIGKILLed
    # a's own spare is on a node with a member left; the standby node's worker takes the place
    job.wait_for(
        lambda: _at_full_size(job, "a", 2, lost_at) and bool(job.commits("s")),
        30,
        "the standby node in the lost node's place",
    )
    assert a.wait(150) == 0, job.logs_tail()
    assert s.wait(30) == 0, job.logs_tail()
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == QUIET_STEPS
