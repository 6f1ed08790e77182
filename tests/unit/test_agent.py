"""The node agent: its pure transition function, the restart budget and backoff, lease lookup, the
executor on real (tiny) processes, and the hang and stop detection. Its configuration is tested in
test_settings.py."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

import pytest
import structlog

from elasticd.agent.daemon import restart_backoff_s, restarts_in_window
from elasticd.agent.elastic import Agent
from elasticd.agent.elastic_decide import (
    Action,
    ActionKind,
    AgentSnapshot,
    AgentState,
    Slot,
    SlotState,
    decide,
    member_leases,
)
from elasticd.agent.health import HealthResult, run_check
from elasticd.agent.jobview import JobView, ProgressMark, job_read_interval_s
from elasticd.agent.supervisor import ExitKind, WorkerExit
from elasticd.errors import EXIT_NO_RESTART, EXIT_REJOIN
from elasticd.wire.failures import FailureRecord
from elasticd.config import AgentConfig, Timeouts, WorldConfig
from elasticd.errors import ConfigError, EtcdUnavailable
from elasticd.store.kv import KeyValue, RangeQuery, RangeResult
from elasticd.wire.keys import Keys
from elasticd.wire.records import CommittedRecord, FinishedRecord, MemberRecord, encode
from tests.fakes import FakeKeyValueStore

pytestmark = pytest.mark.timeout(60)

NOW = 1000.0
CFG = AgentConfig(
    program=("worker",),
    node_id="n",
    nproc_per_node=2,
    max_restarts=2,
    restart_window_s=60.0,
    restart_backoff_initial_s=1.0,
    restart_backoff_max_s=3.0,
    kill_wait_s=5.0,
    timeouts=Timeouts(shutdown_grace_s=10.0),
)


def running(lr: int) -> Slot:
    return Slot(lr, SlotState.RUNNING, pid=100 + lr, starts=1)


def ended(lr: int, kind: ExitKind, code: int | None = None, sig: int | None = None) -> Slot:
    return Slot(lr, SlotState.EXITED, pid=100 + lr, exit=WorkerExit(lr, 100 + lr, kind, code, sig), starts=1)


BUG_A = FailureRecord("a.0.1", "a", 0, 1, 7, "ValueError", "bad sample N", "", 1.0)
BUG_B = FailureRecord("b.0.2", "b", 0, 1, 7, "ValueError", "bad sample N", "", 1.0)


def exit0(at: float) -> Slot:
    return replace(ended(0, ExitKind.SUCCEEDED, 0), exited_at=at)


FAILED = ExitKind.FAILED
OK = ExitKind.SUCCEEDED


def snap(state: AgentState, *slots: Slot, **kw: object) -> AgentSnapshot:
    return AgentSnapshot(state, slots, **kw)  # type: ignore[arg-type]


R, D, S = AgentState.RUNNING, AgentState.DRAINING, AgentState.STOPPING
EXHAUSTED = "restarts_exhausted: worker 0 exited with code 1"

# (id, snapshot, expected action fields). Only the fields named are compared.
CASES: list[tuple[str, AgentSnapshot, dict[str, object]]] = [
    ("start spawns rank 0", AgentSnapshot.initial(2), dict(kind=ActionKind.SPAWN, local_rank=0, next_state=R)),
    ("then the next pending rank", snap(R, running(0), Slot(1)), dict(kind=ActionKind.SPAWN, local_rank=1)),
    (
        "all running: wait for something to happen",
        snap(R, running(0), running(1)),
        dict(kind=ActionKind.WAIT, until=None),
    ),
    (
        "a crash within the budget: restart after the initial backoff",
        snap(R, ended(0, FAILED, 1), running(1)),
        dict(
            kind=ActionKind.RELEASE, local_rank=0, slot_state=SlotState.BACKOFF, restart_at=NOW + 1.0, next_state=None
        ),
    ),
    (
        "a worker that exits EXIT_REJOIN (it missed steps) restarts now, outside the budget",
        snap(R, ended(0, FAILED, EXIT_REJOIN), running(1), restarts=(NOW - 10, NOW - 5)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.BACKOFF, restart_at=NOW, budgeted=False, next_state=None),
    ),
    (
        "a death by signal is a failure too",
        snap(R, ended(0, ExitKind.SIGNALED, sig=9), running(1)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.BACKOFF, restart_at=NOW + 1.0),
    ),
    (
        "a worker that could not start is a failure too",
        snap(R, ended(0, ExitKind.SPAWN_FAILED), running(1)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.BACKOFF),
    ),
    (
        "the second restart in the window waits twice as long",
        snap(R, ended(0, FAILED, 1), running(1), restarts=(NOW - 10,)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.BACKOFF, restart_at=NOW + 2.0),
    ),
    (
        "restarts older than the window do not count",
        snap(R, ended(0, FAILED, 1), running(1), restarts=(NOW - 60.0, NOW - 70.0)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.BACKOFF, restart_at=NOW + 1.0),
    ),
    (
        "the budget is spent: stop, exit 1 later",
        snap(R, ended(0, FAILED, 1), running(1), restarts=(NOW - 10, NOW - 5)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.STOPPED, next_state=S),
    ),
    (
        "exit 0 with no time of exit (nothing to compare a read with): done, not restarted",
        snap(R, ended(0, OK, 0), running(1)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.DONE, next_state=None),
    ),
    (
        "the failure records show a bug: the job failed, stop (exit 3)",
        snap(R, running(0), running(1), view=JobView(read_at=NOW, failures=(BUG_A, BUG_B))),
        dict(kind=ActionKind.JOB_FAILED, next_state=S, exit_code=3),
    ),
    (
        "one failure record is no bug: supervise on",
        snap(R, running(0), running(1), view=JobView(read_at=NOW, failures=(BUG_A,))),
        dict(kind=ActionKind.WAIT),
    ),
    (
        "a bug while draining: the drain goes on",
        snap(D, running(0), running(1), view=JobView(read_at=NOW, failures=(BUG_A, BUG_B)), terminate_deadline=NOW + 5),
        dict(kind=ActionKind.WAIT),
    ),
    (
        "stopped for a bug, every worker gone: exit 3",
        snap(S, Slot(0, SlotState.STOPPED), Slot(1, SlotState.STOPPED), exit_code=3, reason="job_failed: x"),
        dict(kind=ActionKind.EXIT, exit_code=3, reason="job_failed: x"),
    ),
    (
        "a worker that exits EXIT_NO_RESTART is not restarted: stop, exit 3",
        snap(R, ended(0, FAILED, EXIT_NO_RESTART), running(1)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.STOPPED, next_state=S, exit_code=3),
    ),
    (
        "exit 0 and the job finished: done",
        snap(R, exit0(NOW - 1), running(1), view=JobView(read_at=NOW - 5, finished=True)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.DONE, next_state=None),
    ),
    (
        "exit 0 and no read since: wait for one, at most etcd_outage_s after the exit",
        snap(R, exit0(NOW - 1), running(1), view=JobView(read_at=NOW - 2)),
        dict(kind=ActionKind.WAIT, until=NOW - 1 + 600.0),
    ),
    (
        "exit 0 and a read since without a finished record: a failure, restarted within the budget",
        snap(R, exit0(NOW - 1), running(1), view=JobView(read_at=NOW - 0.5)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.BACKOFF, restart_at=NOW + 1.0, budgeted=True),
    ),
    (
        "exit 0 before the job finished with the budget spent: stop, exit 1 later",
        snap(R, exit0(NOW - 1), running(1), view=JobView(read_at=NOW), restarts=(NOW - 10, NOW - 5)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.STOPPED, next_state=S),
    ),
    (
        "exit 0 and no read within etcd_outage_s: taken as done",
        snap(R, exit0(NOW - 601), running(1), view=JobView(read_at=NOW - 700)),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.DONE),
    ),
    (
        "exit 0 while draining: done, no read needed",
        snap(D, exit0(NOW - 1), running(1), view=JobView(read_at=NOW - 2), terminate_deadline=NOW + 5),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.DONE),
    ),
    (
        "a stop request arrived meanwhile: done, no read needed",
        snap(R, exit0(NOW - 1), running(1), stop_requests=1),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.DONE),
    ),
    ("one done, one running: wait", snap(R, Slot(0, SlotState.DONE), running(1)), dict(kind=ActionKind.WAIT)),
    (
        "all done: exit 0",
        snap(R, Slot(0, SlotState.DONE), Slot(1, SlotState.DONE)),
        dict(kind=ActionKind.EXIT, exit_code=0, reason="workers_finished"),
    ),
    (
        "a restart that is due",
        snap(R, Slot(0, SlotState.BACKOFF, restart_at=NOW - 0.1), running(1)),
        dict(kind=ActionKind.SPAWN, local_rank=0, reason="restart"),
    ),
    (
        "a restart that is not due yet: wait until then",
        snap(R, Slot(0, SlotState.BACKOFF, restart_at=NOW + 2), running(1)),
        dict(kind=ActionKind.WAIT, until=NOW + 2),
    ),
    (
        "SIGTERM: forward it, drain",
        snap(R, running(0), running(1), stop_requests=1),
        dict(kind=ActionKind.TERMINATE, next_state=D, until=NOW + 10.0),
    ),
    (
        "SIGTERM before anything ran",
        snap(AgentState.STARTING, Slot(0), Slot(1), stop_requests=1),
        dict(kind=ActionKind.TERMINATE, next_state=D),
    ),
    (
        "draining: wait for the workers until the grace ends",
        snap(D, running(0), stop_requests=1, terminate_deadline=NOW + 3),
        dict(kind=ActionKind.WAIT, until=NOW + 3),
    ),
    (
        "draining: the grace is over, kill",
        snap(D, running(0), stop_requests=1, terminate_deadline=NOW - 0.1),
        dict(kind=ActionKind.KILL, until=NOW + 5.0),
    ),
    (
        "a second SIGTERM kills at once",
        snap(D, running(0), stop_requests=2, terminate_deadline=NOW + 3),
        dict(kind=ActionKind.KILL),
    ),
    (
        "draining: a failed worker is not restarted",
        snap(D, ended(0, FAILED, 1), running(1), stop_requests=1, terminate_deadline=NOW + 3),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.STOPPED, next_state=None),
    ),
    (
        "a crash seen together with a stop request is not restarted (Ctrl-C reaches the workers too)",
        snap(R, ended(0, ExitKind.SIGNALED, sig=2), running(1), stop_requests=1),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.STOPPED, next_state=None),
    ),
    (
        "draining: a worker that left cleanly is done",
        snap(D, ended(0, OK, 0), stop_requests=1, terminate_deadline=NOW + 3),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.DONE),
    ),
    (
        "drained: exit 0",
        snap(D, Slot(0, SlotState.DONE), Slot(1, SlotState.STOPPED), stop_requests=1, terminate_deadline=NOW + 3),
        dict(kind=ActionKind.EXIT, exit_code=0, reason="drained"),
    ),
    (
        "draining with a restart pending and nothing running: exit 0",
        snap(D, Slot(0, SlotState.BACKOFF, restart_at=NOW - 1), stop_requests=1, terminate_deadline=NOW + 3),
        dict(kind=ActionKind.EXIT, exit_code=0),
    ),
    (
        "stopping: SIGTERM to the other workers",
        snap(S, Slot(0, SlotState.STOPPED), running(1), reason=EXHAUSTED),
        dict(kind=ActionKind.TERMINATE, until=NOW + 10.0, next_state=None),
    ),
    (
        "stopping: all gone, exit 1 with the reason",
        snap(S, Slot(0, SlotState.STOPPED), reason=EXHAUSTED),
        dict(kind=ActionKind.EXIT, exit_code=1, reason=EXHAUSTED),
    ),
    (
        "killed workers not reaped within kill_wait_s: exit 1",
        snap(D, running(0), stop_requests=1, terminate_deadline=NOW - 6, kill_deadline=NOW - 0.1),
        dict(kind=ActionKind.EXIT, exit_code=1),
    ),
    (
        "waiting for killed workers to be reaped",
        snap(D, running(0), stop_requests=1, terminate_deadline=NOW - 6, kill_deadline=NOW + 1),
        dict(kind=ActionKind.WAIT, until=NOW + 1),
    ),
]


@pytest.mark.parametrize(("snapshot", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decide(snapshot: AgentSnapshot, expected: dict[str, object]) -> None:
    action = decide(snapshot, NOW, CFG)
    got = {name: getattr(action, name) for name in expected}
    assert got == expected, action


def test_exhausted_reason_says_why() -> None:
    action = decide(snap(R, ended(0, FAILED, 1), running(1), restarts=(NOW - 10, NOW - 5)), NOW, CFG)
    assert action.reason == (
        "restarts_exhausted: worker 0 (pid 100) exited with code 1; 2 restarts in the last 60 s (max_restarts 2)"
    )


def test_max_restarts_zero_means_the_first_failure_is_fatal() -> None:
    cfg = AgentConfig(program=("w",), node_id="n", max_restarts=0)
    action = decide(snap(R, ended(0, ExitKind.SIGNALED, sig=9)), NOW, cfg)
    assert (action.kind, action.next_state) == (ActionKind.RELEASE, S)
    assert "was killed by SIGKILL" in action.reason


def test_decide_is_pure() -> None:
    s = snap(R, ended(0, FAILED, 1), running(1), restarts=(NOW - 10,))
    assert decide(s, NOW, CFG) == decide(s, NOW, CFG)
    assert s == snap(R, ended(0, FAILED, 1), running(1), restarts=(NOW - 10,))


@pytest.mark.parametrize(
    ("times", "now", "window", "count"),
    [((), 10.0, 5.0, 0), ((1.0, 6.0, 9.0), 10.0, 5.0, 2), ((5.0,), 10.0, 5.0, 0), ((9.99,), 10.0, 5.0, 1)],
)
def test_restarts_in_window(times: tuple[float, ...], now: float, window: float, count: int) -> None:
    assert restarts_in_window(times, now, window) == count


@pytest.mark.parametrize(
    ("recent", "initial", "cap", "wait"),
    [
        (0, 0.5, 30.0, 0.5),
        (1, 0.5, 30.0, 1.0),
        (3, 0.5, 30.0, 4.0),
        (6, 0.5, 30.0, 30.0),
        (10_000, 0.5, 30.0, 30.0),
        (2, 1.0, 1.0, 1.0),
    ],
)
def test_restart_backoff(recent: int, initial: float, cap: float, wait: float) -> None:
    assert restart_backoff_s(recent, initial, cap) == wait


def test_member_leases_match_node_and_pid_and_skip_garbage() -> None:
    keys = Keys("/elasticd", "j")

    def member(mid: str, node: str, pid: int, lease: int) -> KeyValue:
        rec = MemberRecord(mid, node, 0, pid, "127.0.0.1", 1, "sig")
        return KeyValue(keys.member(mid), encode(rec), 1, 1, lease)

    kvs = [
        member("n.0.7", "n", 7, 70),
        member("m.0.7", "m", 7, 71),  # another node, same pid
        member("n.1.8", "n", 8, 80),  # another pid
        member("n.0.9", "n", 9, 0),  # not leased
        KeyValue(keys.member("junk"), b"not json", 1, 1, 99),
        KeyValue(keys.ready("n.0.7"), b"{}", 1, 1, 70),
    ]
    assert member_leases(kvs, keys, "n", {7}) == [("n.0.7", 70)]
    assert member_leases(kvs, keys, "n", {7, 8}) == [("n.0.7", 70), ("n.1.8", 80)]
    assert member_leases(kvs, keys, "n", {42}) == []


# -- the executor on real, tiny processes ---------------------------------------------------------


def _agent(program: list[str], **settings: object) -> tuple[Agent, FakeKeyValueStore]:
    store = FakeKeyValueStore()
    fields: dict[str, object] = dict(
        program=tuple(program),
        node_id="n",
        world=WorldConfig(job_id="j"),
        restart_backoff_initial_s=0.01,
        restart_backoff_max_s=0.02,
        poll_interval_s=0.02,
        kill_wait_s=2.0,
        timeouts=Timeouts(shutdown_grace_s=0.5),
    )
    fields.update(settings)
    return Agent(AgentConfig(**fields), store), store  # type: ignore[arg-type]


def _events(logs: list[dict[str, object]], name: str) -> list[dict[str, object]]:
    return [e for e in logs if e["event"] == name]


def test_a_worker_that_always_fails_exhausts_the_restarts() -> None:
    agent, _ = _agent([sys.executable, "-c", "import sys; sys.exit(3)"], max_restarts=2)
    started = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        outcome = agent.run(install_signals=False)
    assert time.monotonic() - started < 20
    assert outcome.exit_code == 1 and outcome.reason.startswith("restarts_exhausted: worker 0"), outcome
    assert len(_events(logs, "worker_started")) == 3  # the first start and two restarts
    assert [e["code"] for e in _events(logs, "worker_exited")] == [3, 3, 3]
    assert len(_events(logs, "restarts_exhausted")) == 1
    assert _events(logs, "agent_stopped")[-1]["exit_code"] == 1


def test_workers_that_exit_0_once_the_job_finished_are_done_and_the_agent_exits_0() -> None:
    agent, store = _agent([sys.executable, "-c", "pass"], nproc_per_node=2)
    store.put(Keys("/elasticd", "j").finished, encode(FinishedRecord(generation=1, step=10)))
    with structlog.testing.capture_logs() as logs:
        outcome = agent.run(install_signals=False)
    assert (outcome.exit_code, outcome.reason) == (0, "workers_finished")
    assert sorted(e["local_rank"] for e in _events(logs, "worker_started")) == [0, 1]
    assert not _events(logs, "worker_restart_scheduled")


def test_a_worker_that_exits_0_before_the_job_finished_is_a_failure() -> None:
    agent, _ = _agent([sys.executable, "-c", "pass"], max_restarts=1)
    with structlog.testing.capture_logs() as logs:
        outcome = agent.run(install_signals=False)
    assert outcome.exit_code == 1 and outcome.reason.startswith("restarts_exhausted: worker 0"), outcome
    assert "exited with code 0 before the job finished" in outcome.reason, outcome.reason
    assert len(_events(logs, "worker_started")) == 2


def test_a_program_that_cannot_start_is_a_failure_with_a_clear_reason() -> None:
    agent, _ = _agent(["/nonexistent/program"], max_restarts=1)
    outcome = agent.run(install_signals=False)
    assert outcome.exit_code == 1
    assert "could not be started: /nonexistent/program" in outcome.reason, outcome.reason


@pytest.mark.parametrize("obeys_sigterm", [True, False], ids=["drains", "ignores SIGTERM: killed"])
def test_stop_request_drains_then_kills_and_exits_0(obeys_sigterm: bool) -> None:
    handler = "lambda *_: sys.exit(0)" if obeys_sigterm else "signal.SIG_IGN"
    code = (
        f"import signal, sys, time; signal.signal(signal.SIGTERM, {handler}); print('up', flush=True); time.sleep(60)"
    )
    agent, _ = _agent([sys.executable, "-c", code])
    timer = threading.Timer(0.5, agent.request_stop)
    timer.start()
    started = time.monotonic()
    try:
        with structlog.testing.capture_logs() as logs:
            outcome = agent.run(install_signals=False)
    finally:
        timer.cancel()
    assert (outcome.exit_code, outcome.reason) == (0, "drained")
    assert time.monotonic() - started < 10
    assert len(_events(logs, "workers_signalled")) == 1
    assert bool(_events(logs, "workers_killed")) is not obeys_sigterm
    (exit_line,) = _events(logs, "worker_exited")
    assert exit_line["kind"] == ("succeeded" if obeys_sigterm else "signaled")


def test_the_lease_of_a_dead_workers_record_is_revoked() -> None:
    # The test writes the worker's member record (with its pid) under a lease, then SIGKILLs it.
    agent, store = _agent([sys.executable, "-c", "import time; time.sleep(30)"], max_restarts=0)
    keys = Keys("/elasticd", "j")
    lease = store.grant_lease(30)

    def register_then_kill() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not agent.snapshot.slots[0].pid:
            time.sleep(0.01)
        pid = agent.snapshot.slots[0].pid
        store.put(keys.member("n.0.x"), encode(MemberRecord("n.0.x", "n", 0, pid, "h", 1, "s")), lease=lease)
        os.kill(pid, signal.SIGKILL)

    t = threading.Thread(target=register_then_kill)
    t.start()
    with structlog.testing.capture_logs() as logs:
        outcome = agent.run(install_signals=False)
    t.join(10)
    assert outcome.exit_code == 1
    (revoked,) = _events(logs, "worker_lease_revoked")
    assert (revoked["lease"], revoked["member"]) == (lease, "n.0.x")
    assert store.get(keys.member("n.0.x")) is None


def test_action_defaults_are_inert() -> None:
    a = Action(ActionKind.WAIT, "x")
    assert (a.next_state, a.slot_state, a.until, a.exit_code) == (None, None, None, 0)


# -- the health check -----------------------------------------------------------------------------

HEALTH_CFG = replace(CFG, health_check="true")
OK_CHECK = HealthResult(True, "", NOW - 1, 0.1)
BAD_CHECK = HealthResult(False, "exit code 1: disk full", NOW - 1, 0.1)
U = AgentState.UNHEALTHY

HEALTH_CASES: list[tuple[str, AgentSnapshot, dict[str, object]]] = [
    ("no result yet: nothing starts", AgentSnapshot.initial(2), dict(kind=ActionKind.WAIT)),
    (
        "a passing check: the first worker starts",
        replace(AgentSnapshot.initial(2), health=OK_CHECK),
        dict(kind=ActionKind.SPAWN, local_rank=0),
    ),
    (
        "a failing check before any start: stay out",
        replace(AgentSnapshot.initial(2), health=BAD_CHECK),
        dict(kind=ActionKind.TERMINATE, next_state=U),
    ),
    (
        "a check fails while the workers run: stop them (UNHEALTHY)",
        snap(R, running(0), running(1), health=BAD_CHECK),
        dict(kind=ActionKind.TERMINATE, next_state=U, until=NOW + 10.0),
    ),
    (
        "unhealthy, workers still stopping: wait for them",
        snap(U, running(0), Slot(1), health=BAD_CHECK, terminate_deadline=NOW + 5),
        dict(kind=ActionKind.WAIT, until=NOW + 5),
    ),
    (
        "unhealthy, a worker ignores SIGTERM past the grace: killed",
        snap(U, running(0), Slot(1), health=BAD_CHECK, terminate_deadline=NOW - 1),
        dict(kind=ActionKind.KILL),
    ),
    (
        "unhealthy, a worker's exit: its slot waits to start again, no budget spent",
        snap(U, ended(0, OK, 0), Slot(1), health=BAD_CHECK, terminate_deadline=NOW + 5),
        dict(kind=ActionKind.RELEASE, slot_state=SlotState.PENDING, budgeted=False),
    ),
    (
        "unhealthy, nothing runs: wait for a passing check",
        snap(U, Slot(0), Slot(1), health=BAD_CHECK, terminate_deadline=NOW - 9),
        dict(kind=ActionKind.WAIT, until=None),
    ),
    (
        "unhealthy, nothing runs, and the job finished: exit 0",
        snap(U, Slot(0), Slot(1), health=BAD_CHECK, view=JobView(read_at=NOW, finished=True)),
        dict(kind=ActionKind.EXIT, exit_code=0),
    ),
    (
        "the check passes again: the node starts its workers (RUNNING)",
        snap(U, Slot(0), Slot(1), health=OK_CHECK, terminate_deadline=NOW - 9),
        dict(kind=ActionKind.SPAWN, local_rank=0, next_state=R),
    ),
    (
        "a restart waits for a check that ended after the exit",
        snap(R, Slot(0, SlotState.BACKOFF, restart_at=NOW - 0.1), running(1), health=OK_CHECK, health_after=NOW - 0.5),
        dict(kind=ActionKind.WAIT),
    ),
    (
        "a check after the exit passed: the restart goes",
        snap(R, Slot(0, SlotState.BACKOFF, restart_at=NOW - 0.1), running(1), health=OK_CHECK, health_after=NOW - 2),
        dict(kind=ActionKind.SPAWN, local_rank=0, reason="restart"),
    ),
    (
        "cordoned (no health check needed): stop the workers",
        snap(R, running(0), running(1), view=JobView(read_at=NOW, cordoned={"n": "6 crashes"})),
        dict(kind=ActionKind.TERMINATE, next_state=U),
    ),
    (
        "uncordoned, the check passing: the node starts its workers",
        snap(U, Slot(0), Slot(1), health=OK_CHECK, view=JobView(read_at=NOW), terminate_deadline=NOW - 9),
        dict(kind=ActionKind.SPAWN, local_rank=0, next_state=R),
    ),
    (
        "another node cordoned: nothing to do here",
        snap(R, running(0), running(1), health=OK_CHECK, view=JobView(read_at=NOW, cordoned={"m": "x"})),
        dict(kind=ActionKind.WAIT),
    ),
    (
        "a stop request while unhealthy: drain",
        snap(U, Slot(0), Slot(1), health=BAD_CHECK, stop_requests=1),
        dict(kind=ActionKind.TERMINATE, next_state=D),
    ),
]


@pytest.mark.parametrize(("s", "expected"), [c[1:] for c in HEALTH_CASES], ids=[c[0] for c in HEALTH_CASES])
def test_decide_with_a_health_check(s: AgentSnapshot, expected: dict[str, object]) -> None:
    action = decide(s, NOW, HEALTH_CFG)
    assert {k: getattr(action, k) for k in expected} == expected, action


def test_a_cordon_holds_a_node_without_a_health_check() -> None:
    s = snap(R, running(0), running(1), view=JobView(read_at=NOW, cordoned={"n": "6 crashes"}))
    action = decide(s, NOW, CFG)  # CFG has no health check
    assert (action.kind, action.next_state) == (ActionKind.TERMINATE, U)
    assert action.reason == "cordoned: 6 crashes (elasticctl uncordon n)"


def test_a_health_check_passes_on_exit_0_and_fails_on_an_error_or_its_timeout() -> None:
    ok = run_check("echo fine", 5.0, time.monotonic)
    assert ok.passed and ok.output == "fine"
    bad = run_check("echo 'disk full' >&2; exit 3", 5.0, time.monotonic)
    assert not bad.passed and bad.output == "exit code 3: disk full"
    started = time.monotonic()
    slow = run_check("echo begun; sleep 30", 0.5, time.monotonic)
    assert not slow.passed and slow.output.startswith("no answer within health_check_timeout_s (0.5 s)")
    assert "begun" in slow.output and time.monotonic() - started < 5


# -- stragglers -------------------------------------------------------------------------------


STRAGGLER_CASES: list[tuple[str, Slot, dict[str, object]]] = [
    (
        "slow for straggler_s: a straggler",
        replace(running(0), score=2.0, slow_since=NOW - 10.0),
        dict(kind=ActionKind.STRAGGLER, local_rank=0),
    ),
    ("slow, not for long enough yet", replace(running(0), score=2.0, slow_since=NOW - 9.0), dict(kind=ActionKind.WAIT)),
    (
        "this episode was acted on",
        replace(running(0), score=2.0, slow_since=NOW - 30.0, straggler_acted=True),
        dict(kind=ActionKind.WAIT),
    ),
    ("not slow", replace(running(0), score=1.1), dict(kind=ActionKind.WAIT)),
]


@pytest.mark.parametrize(("slot", "expected"), [c[1:] for c in STRAGGLER_CASES], ids=[c[0] for c in STRAGGLER_CASES])
def test_decide_reports_a_straggler_once_per_episode(slot: Slot, expected: dict[str, object]) -> None:
    action = decide(snap(R, slot, running(1)), NOW, CFG)
    assert {k: getattr(action, k) for k in expected} == expected, action
    if action.kind is ActionKind.STRAGGLER:
        assert "scored 2.00 (straggler_score 1.5) for 10.0 s (straggler_s 10)" in action.reason


# -- hang detection -------------------------------------------------------------------------------

HANG_CFG = AgentConfig(
    program=("worker",),
    node_id="n",
    nproc_per_node=2,
    hang_timeout_s=3.0,
    max_restarts=2,
    restart_window_s=60.0,
    restart_backoff_initial_s=1.0,
)
STALLED = ProgressMark(("training", 1, 5), NOW - 4.0, 10)


def test_a_worker_stalled_while_the_job_advanced_is_killed_as_hung() -> None:
    s = snap(R, replace(running(0), mark=STALLED), running(1), view=JobView(read_at=NOW, job_step=30))
    a = decide(s, NOW, HANG_CFG)
    assert (a.kind, a.local_rank) == (ActionKind.KILL_HUNG, 0)
    assert "made no progress for 4.0 s" in a.reason and "from 10 to 30" in a.reason
    # once killed, it is not killed again while its exit is on the way
    s2 = replace(s, slots=(replace(s.slots[0], hang_killed=True), s.slots[1]))
    assert decide(s2, NOW, HANG_CFG).kind is ActionKind.WAIT


@pytest.mark.parametrize(
    ("view", "state", "why"),
    [
        (JobView(read_at=NOW, job_step=10), R, "the whole job stalled"),
        (JobView(read_at=NOW - 1.5, job_step=30), R, "the newest read is too close to the last advance"),
        (None, R, "no read of etcd succeeded (etcd down)"),
        (JobView(read_at=NOW, job_step=30), D, "draining: no hang kills"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_no_hang_kill_without_evidence(view: JobView | None, state: AgentState, why: str) -> None:
    s = snap(
        state,
        replace(running(0), mark=STALLED),
        view=view,
        stop_requests=1 if state is D else 0,
        terminate_deadline=NOW + 5 if state is D else None,
    )
    assert decide(s, NOW, HANG_CFG).kind is not ActionKind.KILL_HUNG, why


# -- a stopped worker (SIGSTOP) ------------------------------------------------------------------

STOP_CFG = replace(CFG, stopped_worker_s=0.5)


@pytest.mark.parametrize(
    ("slot", "cfg", "expected", "why"),
    [
        (replace(running(0), stopped_at=NOW - 0.5), STOP_CFG, ActionKind.REVOKE_STOPPED, "stopped for the bound"),
        (replace(running(0), stopped_at=NOW - 3.0), STOP_CFG, ActionKind.REVOKE_STOPPED, "stopped long ago"),
        (replace(running(0), stopped_at=NOW - 0.4), STOP_CFG, ActionKind.WAIT, "not yet stopped long enough"),
        (
            replace(running(0), stopped_at=NOW - 3.0, stop_revoked=True),
            STOP_CFG,
            ActionKind.WAIT,
            "already revoked: once per stop",
        ),
        (replace(running(0), stopped_at=NOW - 3.0), replace(CFG, stopped_worker_s=0.0), ActionKind.WAIT, "0: off"),
        (running(0), STOP_CFG, ActionKind.WAIT, "not stopped"),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_a_worker_stopped_past_stopped_worker_s_has_its_lease_revoked(
    slot: Slot, cfg: AgentConfig, expected: ActionKind, why: str
) -> None:
    a = decide(snap(R, slot, running(1)), NOW, cfg)
    assert a.kind is expected, why
    if expected is ActionKind.REVOKE_STOPPED:
        assert a.local_rank == 0 and "stopped for" in a.reason and "stopped_worker_s 0.5" in a.reason


def test_the_agent_wakes_when_a_stopped_worker_reaches_the_bound() -> None:
    a = decide(snap(R, replace(running(0), stopped_at=NOW - 0.2), running(1)), NOW, STOP_CFG)
    assert a.kind is ActionKind.WAIT and a.until == pytest.approx(NOW + 0.3)


def test_stopped_worker_s_must_be_a_finite_number_at_least_0() -> None:
    for bad in (-1.0, float("inf"), float("nan"), True, "1"):
        with pytest.raises(ConfigError, match="stopped_worker_s"):
            replace(CFG, stopped_worker_s=bad)


def test_a_worker_killed_as_hung_is_restarted_like_a_crashed_one() -> None:
    slot = replace(ended(0, ExitKind.SIGNALED, sig=9), hang_killed=True)
    a = decide(snap(R, slot, running(1)), NOW, HANG_CFG)
    assert (a.kind, a.slot_state, a.restart_at) == (ActionKind.RELEASE, SlotState.BACKOFF, NOW + 1.0)
    assert "was killed by SIGKILL as hung" in a.reason


def test_hang_timeout_is_validated() -> None:
    with pytest.raises(ConfigError, match="hang_timeout_s: must be a finite number"):
        AgentConfig(program=("w",), hang_timeout_s=-1.0)
    with pytest.raises(ConfigError, match="at least twice keepalive_s"):
        AgentConfig(program=("w",), hang_timeout_s=1.0)
    assert AgentConfig(program=("w",), hang_timeout_s=0.0).hang_timeout_s == 0.0
    with pytest.raises(ConfigError, match="metrics_port"):
        AgentConfig(program=("w",), metrics_port=70000)


class _OutageStore(FakeKeyValueStore):
    """A fake etcd that stops answering reads of the job when told (an etcd outage)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = threading.Event()

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        if self.down.is_set():
            raise EtcdUnavailable("etcd at fake did not answer get_prefix")
        return super().get_prefix(prefix)

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        if self.down.is_set():
            raise EtcdUnavailable("etcd at fake did not answer get_prefixes")
        return super().get_prefixes(prefixes)

    def read_ranges(self, queries: Sequence[RangeQuery]) -> tuple[int, list[RangeResult]]:
        if self.down.is_set():
            raise EtcdUnavailable("etcd at fake did not answer read_ranges")
        return super().read_ranges(queries)


def _progress(store: FakeKeyValueStore, member: str, step: int, rank: int = 1) -> None:
    """``member``'s progress record; rank 0's also sets the job's committed step, as its keepalive does."""
    keys = Keys("/elasticd", "j")
    rec = {"step": step, "generation": 1, "rank": rank, "step_time_s": 0.01, "recoveries": 0, "time": 1.0}
    store.put(keys.progress(member), json.dumps(rec).encode())
    if rank == 0:
        store.put(keys.committed, encode(CommittedRecord(generation=1, step=step)))


@pytest.mark.parametrize("etcd_down", [False, True], ids=["stalled: killed as hung", "etcd down: left alone"])
def test_the_executor_kills_a_stalled_worker_but_not_on_an_etcd_outage(etcd_down: bool) -> None:
    """A real process registered under this node (by the test) stops advancing while another member's
    progress grows. With the reads answered, it is killed as hung and restarted; with etcd not
    answering, the agent has no evidence and leaves it alone."""
    store = _OutageStore()
    agent = Agent(
        AgentConfig(
            program=(sys.executable, "-c", "import time; time.sleep(30)"),
            node_id="n",
            world=WorldConfig(job_id="j"),
            timeouts=Timeouts(lease_ttl_s=1.0, keepalive_s=0.1, shutdown_grace_s=0.5),
            hang_timeout_s=0.5,
            max_restarts=0,
            poll_interval_s=0.02,
            kill_wait_s=2.0,
        ),
        store,
    )
    keys = Keys("/elasticd", "j")
    done = threading.Event()

    def job() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not agent.snapshot.slots[0].pid:
            time.sleep(0.01)
        pid = agent.snapshot.slots[0].pid
        store.put(keys.member("n.0.x"), encode(MemberRecord("n.0.x", "n", 0, pid, "h", 1, "s")))
        store.put(keys.member("m.0.y"), encode(MemberRecord("m.0.y", "m", 0, 1, "h", 1, "s")))
        _progress(store, "n.0.x", 5)
        _progress(store, "m.0.y", 5, rank=0)
        time.sleep(0.3)  # the agent sees the worker at step 5
        if etcd_down:
            store.down.set()
        step = 5
        while not done.wait(0.05) and time.monotonic() < deadline:
            step += 1
            _progress(store, "m.0.y", step, rank=0)  # the rest of the job advances
        agent.request_stop()

    t = threading.Thread(target=job)
    t.start()
    try:
        with structlog.testing.capture_logs() as logs:
            timer = threading.Timer(3.0, done.set)
            timer.start()
            outcome = agent.run(install_signals=False)
    finally:
        done.set()
        t.join(15)
    hung = _events(logs, "worker_hung")
    if etcd_down:
        assert not hung and _events(logs, "job_read_failed"), logs
        assert outcome.reason == "drained"
    else:
        assert len(hung) == 1 and hung[0]["job_step_then"] == 5 and hung[0]["job_step_now"] > 5, hung
        assert outcome.exit_code == 1 and "as hung" in outcome.reason  # max_restarts 0: the kill is a failure


def test_job_read_interval() -> None:
    base = dict(program=("w",), timeouts=Timeouts(keepalive_s=0.75))
    # straggler_s 10 s (the default): 4 reads per bound; hang detection asks for fewer
    assert job_read_interval_s(AgentConfig(**base, hang_timeout_s=60.0), live_consumers=False) == 2.5  # type: ignore[arg-type]
    far = AgentConfig(**base, hang_timeout_s=60.0, straggler_s=120.0)  # type: ignore[arg-type]
    assert job_read_interval_s(far, live_consumers=False) == 6.0
    assert job_read_interval_s(AgentConfig(**base, hang_timeout_s=60.0), live_consumers=True) == 0.75  # type: ignore[arg-type]
    assert job_read_interval_s(AgentConfig(**base, hang_timeout_s=3.0), live_consumers=False) == 0.75  # type: ignore[arg-type]
