"""The node agent's replicas (``replica_size`` > 1) in its pure transition function: a replica
starts whole, a worker that ends takes its replica's others with it (killed, not counted against
the restart budget), a stopped one ends its replica, and the replica starts again whole once the
failed worker's backoff ends. A table of hand-built snapshots; nothing runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from elasticd.agent.elastic_decide import ActionKind, AgentSnapshot, AgentState, Slot, SlotState, decide
from elasticd.agent.supervisor import ExitKind, WorkerExit
from elasticd.config import AgentConfig, Timeouts
from elasticd.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

NOW = 1000.0
CFG = AgentConfig(
    program=("worker",),
    node_id="n",
    nproc_per_node=4,
    replica_size=2,
    max_restarts=3,
    restart_window_s=60.0,
    restart_backoff_initial_s=1.0,
    restart_backoff_max_s=3.0,
    timeouts=Timeouts(shutdown_grace_s=10.0),
    stopped_worker_s=0.5,
)
R = AgentState.RUNNING


def running(lr: int, **kw: object) -> Slot:
    return Slot(lr, SlotState.RUNNING, pid=100 + lr, starts=1, **kw)  # type: ignore[arg-type]


def ended(lr: int, code: int = 1, **kw: object) -> Slot:
    e = WorkerExit(lr, 100 + lr, ExitKind.FAILED, code, None)
    return Slot(lr, SlotState.EXITED, pid=100 + lr, exit=e, starts=1, exited_at=NOW, **kw)  # type: ignore[arg-type]


def backoff(lr: int, at: float) -> Slot:
    return Slot(lr, SlotState.BACKOFF, starts=1, restart_at=at)


def snap(*slots: Slot, **kw: object) -> AgentSnapshot:
    return AgentSnapshot(R, slots, **kw)  # type: ignore[arg-type]


CASES: list[tuple[str, AgentSnapshot, dict[str, object]]] = [
    (
        "a replica starts whole: one spawn of both its ranks",
        AgentSnapshot.initial(4),
        dict(kind=ActionKind.SPAWN, local_ranks=(0, 1), next_state=R),
    ),
    (
        "then the next replica",
        snap(running(0), running(1), Slot(2), Slot(3)),
        dict(kind=ActionKind.SPAWN, local_ranks=(2, 3)),
    ),
    (
        "a worker that crashed waits for its restart, within the budget",
        snap(running(0), ended(1), running(2), running(3)),
        dict(kind=ActionKind.RELEASE, local_rank=1, slot_state=SlotState.BACKOFF, restart_at=NOW + 1.0, budgeted=True),
    ),
    (
        "its replica's other worker is killed with it (the other replica goes on)",
        snap(running(0), backoff(1, NOW + 1.0), running(2), running(3)),
        dict(kind=ActionKind.KILL_REPLICA, local_ranks=(0,), local_rank=-1),
    ),
    (
        "a worker killed with its replica waits with it, outside the budget",
        snap(ended(0, replica_killed=True), backoff(1, NOW + 1.0), running(2), running(3)),
        dict(kind=ActionKind.RELEASE, local_rank=0, slot_state=SlotState.BACKOFF, restart_at=NOW, budgeted=False),
    ),
    (
        "the replica starts again only once its last backoff ended",
        snap(backoff(0, NOW), backoff(1, NOW + 1.0), running(2), running(3)),
        dict(kind=ActionKind.WAIT, until=NOW + 1.0),
    ),
    (
        "then whole",
        snap(backoff(0, NOW - 1.0), backoff(1, NOW), running(2), running(3)),
        dict(kind=ActionKind.SPAWN, local_ranks=(0, 1), reason="restart"),
    ),
    (
        "a worker stopped past stopped_worker_s ends its replica (it is killed, the fault its own)",
        snap(running(0), running(1), running(2, stopped_at=NOW - 0.6), running(3)),
        dict(kind=ActionKind.KILL_REPLICA, local_rank=2, local_ranks=(2, 3)),
    ),
    (
        "a worker done at the job's end ends no one",
        snap(Slot(0, SlotState.DONE), running(1), running(2), running(3)),
        dict(kind=ActionKind.WAIT),
    ),
]


@pytest.mark.parametrize(("what", "snapshot", "expected"), CASES, ids=[c[0] for c in CASES])
def test_replica_rules(what: str, snapshot: AgentSnapshot, expected: dict[str, object]) -> None:
    action = decide(snapshot, NOW, CFG)
    got = {k: getattr(action, k) for k in expected}
    assert got == expected, (what, action)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(replica_size=3), "must divide nproc_per_node"),
        (dict(replica_size=0), "integer >= 1"),
        (dict(spares_per_node=2), "warm spares"),
    ],
)
def test_replica_size_settings_are_checked(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replace(CFG, **changes)  # type: ignore[arg-type]


def test_replica_ranks_and_the_worker_settings() -> None:
    assert CFG.replica_ranks(3) == (2, 3) and CFG.replica_ranks(0) == (0, 1)
    env = CFG.worker_env(3, replica="n.r1.1", replica_store="127.0.0.1:4000")
    assert (env.replica_size, env.shard, env.replica, env.replica_store) == (2, 1, "n.r1.1", "127.0.0.1:4000")
