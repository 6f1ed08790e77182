"""Restart mode: the pure decision (hand-built views, a fixed ``now``), the worker environment, record
parsing, the ``mode`` setting, and the executor on real tiny processes against the fake store."""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from elasticd.agent.restart import GroupRestartAgent
from elasticd.agent.restart_decide import (
    Action,
    ActionKind,
    Local,
    Phase,
    decide,
    node_bounds,
    worker_environ,
)
from elasticd.config import AgentConfig, Timeouts, WorldConfig
from elasticd.errors import ConfigError
from elasticd.settings import load_agent_config
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import encode
from elasticd.wire.restart import (
    AgentRecord,
    Cause,
    FailedRecord,
    RoundRecord,
    RoundView,
    WaitingRecord,
    parse_view,
)
from tests.fakes import FakeKeyValueStore

pytestmark = pytest.mark.timeout(60)

NOW = 1000.0
CFG = AgentConfig(
    program=("worker",),
    node_id="a",
    nproc_per_node=1,
    max_restarts=2,
    restart_window_s=60.0,
    restart_backoff_initial_s=1.0,
    restart_backoff_max_s=3.0,
    kill_wait_s=5.0,
    mode="restart",
    world=WorldConfig(min_workers=2, max_workers=3),
    timeouts=Timeouts(shutdown_grace_s=10.0, join_window_s=0.25, join_s=120.0),
)


def agent(node: str) -> AgentRecord:
    return AgentRecord(node, 1, "127.0.0.1")


def waiting(node: str, nproc: int = 1, last_round: int = 0) -> WaitingRecord:
    return WaitingRecord(node, nproc, f"host-{node}", 7000 + ord(node[0]), last_round)


def view(
    alive: str = "",
    wait: str = "",
    rnd: RoundRecord | None = None,
    failed: FailedRecord | None = None,
    done: dict[str, int] | None = None,
    finished: int = 0,
    nproc: dict[str, int] | None = None,
) -> RoundView:
    """Nodes are one letter each: ``alive="ab"`` means the agents of a and b hold their leases;
    ``wait`` lists the waiting nodes in arrival order."""
    nproc = nproc or {}
    return RoundView(
        round=rnd,
        round_revision=7 if rnd else 0,
        agents={n: agent(n) for n in alive},
        waiting={n: waiting(n, nproc.get(n, 1)) for n in wait},
        waiting_order={n: 100 + i for i, n in enumerate(wait)},
        failed=failed,
        failed_revision=9 if failed else 0,
        done=done or {},
        finished=finished,
    )


def rnd(number: int, nodes: str, restart_count: int = 0, reason: str = "start") -> RoundRecord:
    return RoundRecord(number, tuple(nodes), 1, f"host-{nodes[0]}", 7000 + ord(nodes[0]), restart_count, reason)


def failed(number: int, cause: Cause = Cause.WORKER_FAILED, node: str = "b") -> FailedRecord:
    return FailedRecord(number, node, str(cause), "worker 0 (pid 5) was killed by SIGKILL")


def joining(since: float = NOW - 1, changed: float = NOW - 1, last: int = 0) -> Local:
    return Local(
        "a", Phase.JOINING, round=last, phase_since=since, candidates_changed_at=changed, view_changed_at=since
    )


def running(r: int = 1, nodes: str = "ab", **kw: object) -> Local:
    return replace(Local("a", Phase.RUNNING, round=r, nodes=tuple(nodes), running=1, phase_since=NOW - 5), **kw)


# -- joining -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local", "v", "kind", "reason"),
    [
        (joining(), view("ab", "a"), ActionKind.WAIT, "1 node(s) waiting < 2"),
        (joining(since=NOW - 121), view("ab", "a"), ActionKind.EXIT, "rendezvous_closed: 1 node(s) waiting < 2"),
        (joining(changed=NOW - 0.1), view("ab", "ab"), ActionKind.WAIT, "join window open"),
        (joining(), view("ab", "b"), ActionKind.REGISTER, "my waiting record is gone"),
        (joining(), view("b", "ab"), ActionKind.REGISTER, "my waiting record is gone"),  # my lease is gone
        (joining(), view("abc", "c", rnd(1, "bc")), ActionKind.REGISTER, "my waiting record is gone"),
        (joining(), view("abc", "a", rnd(1, "bc")), ActionKind.WAIT, "round 1 is running"),
        (joining(), view("ab", "ab", finished=1, rnd=rnd(1, "ab")), ActionKind.EXIT, "job_already_finished"),
        (joining(), view("ab", "ab", nproc={"b": 2}), ActionKind.WAIT, "1 node(s) waiting < 2"),
        (joining(), view("ab", "ba", nproc={"b": 2}), ActionKind.EXIT, "nproc_mismatch"),
        # after a failure: b is alive and stopping its workers; a waits for it (last call)
        (joining(last=1), view("ab", "a", rnd(1, "ab"), failed(1)), ActionKind.WAIT, "last call for ['b']"),
    ],
    ids=[
        "below min",
        "below min past join_s",
        "join window",
        "record gone",
        "lease gone",
        "spare gone",
        "healthy round",
        "finished",
        "other nproc",
        "my nproc differs",
        "last call",
    ],
)
def test_joining_waits_registers_or_exits(local: Local, v: RoundView, kind: ActionKind, reason: str) -> None:
    action = decide(local, v, NOW, CFG)
    assert action.kind is kind, action
    assert action.reason.startswith(reason), action.reason
    if kind is ActionKind.EXIT:
        assert action.exit_code == (0 if reason == "job_already_finished" else 1)


def test_first_round_takes_the_waiting_nodes_in_arrival_order_with_node_rank_0_as_master() -> None:
    action = decide(joining(), view("abc", "bac"), NOW, CFG)
    assert action.kind is ActionKind.PUBLISH
    assert action.record == RoundRecord(1, ("b", "a", "c"), 1, "host-b", 7000 + ord("b"), 0, "start")
    assert action.expected_revision == 0 and action.consumed == ("b", "a", "c")


def test_a_failed_round_is_restarted_at_once_with_the_same_order_and_one_more_restart() -> None:
    # no newcomers, so no join window: the round forms as soon as every live member is back
    v = view("ab", "ba", rnd(3, "ab", restart_count=2), failed(3))
    action = decide(joining(changed=NOW, last=3), v, NOW, CFG)
    assert action.kind is ActionKind.PUBLISH, action
    assert action.record is not None
    assert (action.record.round, action.record.nodes, action.record.restart_count) == (4, ("a", "b"), 3)
    assert action.record.reason == "worker_failed" and action.expected_revision == 7


def test_a_join_restart_does_not_count_as_a_restart() -> None:
    v = view("abc", "abc", rnd(1, "ab"), failed(1, Cause.JOIN, node="a"))
    action = decide(joining(last=1), v, NOW, CFG)
    assert action.kind is ActionKind.PUBLISH and action.record is not None
    assert action.record.nodes == ("a", "b", "c") and action.record.restart_count == 0
    assert action.record.reason == "join"


def test_a_lost_node_is_not_waited_for_and_the_round_shrinks_to_min() -> None:
    cfg = replace(CFG, world=WorldConfig(min_workers=1, max_workers=3))
    v = view("a", "a", rnd(1, "ab"))  # b's agent is gone, nobody wrote failed
    action = decide(joining(last=1), v, NOW, cfg)
    assert action.kind is ActionKind.PUBLISH and action.record is not None
    assert action.record.nodes == ("a",) and action.record.reason == "node_lost"
    assert action.record.restart_count == 0  # the failed record was not written: not counted here


def test_the_last_call_ends_after_shutdown_grace_and_kill_wait() -> None:
    cfg = replace(CFG, world=WorldConfig(min_workers=1, max_workers=3))
    v = view("ab", "a", rnd(1, "ab"), failed(1))
    assert decide(joining(since=NOW - 14.9, last=1), v, NOW, cfg).kind is ActionKind.WAIT
    action = decide(joining(since=NOW - 15.0, last=1), v, NOW, cfg)
    assert action.kind is ActionKind.PUBLISH and action.record is not None and action.record.nodes == ("a",)


def test_a_round_takes_at_most_max_workers() -> None:
    action = decide(joining(), view("abcd", "abcd"), NOW, CFG)
    assert action.kind is ActionKind.PUBLISH and action.record is not None
    assert action.record.nodes == ("a", "b", "c")


def test_a_round_that_includes_me_starts_my_workers() -> None:
    r = rnd(2, "ba")
    action = decide(joining(last=1), view("ab", "", r), NOW, CFG)
    assert action.kind is ActionKind.START and action.record == r
    # ... but not a round it already ran in, nor one that failed before it started
    assert decide(joining(last=2), view("ab", "a", r), NOW, CFG).kind is not ActionKind.START
    assert decide(joining(last=1), view("ab", "", r, failed(2)), NOW, CFG).kind is ActionKind.REGISTER


def test_a_stop_request_while_joining_ends_a_round_that_already_includes_me_as_a_leave() -> None:
    stop = replace(joining(), stop_requests=1)
    action = decide(stop, view("ab", "", rnd(1, "ba")), NOW, CFG)
    assert (action.kind, action.cause, action.round) == (ActionKind.MARK_FAILED, "node_left", 1)
    assert decide(stop, view("ab", "", rnd(1, "ba"), failed(1, Cause.NODE_LEFT, "a")), NOW, CFG).kind is ActionKind.EXIT
    assert decide(stop, view("ab", "ab"), NOW, CFG).kind is ActionKind.EXIT  # no round yet: just leave
    # a finished node leaves at once: its done record is not leased, so the others do not lose it
    assert decide(replace(finishing(), stop_requests=1), view("ab", "", rnd(1, "ab")), NOW, CFG).kind is ActionKind.EXIT


def test_node_bounds_are_the_world_bounds_in_whole_nodes() -> None:
    cfg = replace(CFG, nproc_per_node=2, world=WorldConfig(min_workers=3, max_workers=5))
    assert node_bounds(cfg) == (2, 2)


# -- running -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local", "v", "kind", "cause"),
    [
        (
            running(failure="worker 0 (pid 5) exited with code 1"),
            view("ab", "", rnd(1, "ab")),
            ActionKind.MARK_FAILED,
            Cause.WORKER_FAILED,
        ),
        (
            running(failure="worker 0 (pid 5) exited with code 1"),
            view("ab", "", rnd(1, "ab"), failed(1)),
            ActionKind.TERMINATE,
            Cause.WORKER_FAILED,
        ),
        (running(), view("ab", "", rnd(1, "ab"), failed(1)), ActionKind.TERMINATE, Cause.WORKER_FAILED),
        (running(), view("ab", "", rnd(1, "ab"), failed(1, Cause.JOIN)), ActionKind.TERMINATE, Cause.JOIN),
        (running(), view("a", "", rnd(1, "ab")), ActionKind.MARK_FAILED, Cause.NODE_LOST),
        (running(), view("abc", "c", rnd(1, "ab")), ActionKind.MARK_FAILED, Cause.JOIN),
        (running(stop_requests=1), view("ab", "", rnd(1, "ab")), ActionKind.MARK_FAILED, Cause.NODE_LEFT),
        (running(), view("ab", "", rnd(2, "ab", reason="node_lost")), ActionKind.TERMINATE, Cause.NODE_LOST),
    ],
    ids=[
        "my worker failed",
        "already marked",
        "another node's failure",
        "a join",
        "a node lost",
        "a newcomer fits",
        "asked to stop",
        "superseded",
    ],
)
def test_running_ends_the_round_for_every_cause(local: Local, v: RoundView, kind: ActionKind, cause: Cause) -> None:
    action = decide(local, v, NOW, CFG)
    assert action.kind is kind, action
    assert action.cause == str(cause), action
    if kind is ActionKind.MARK_FAILED:
        assert action.round == 1 and action.expected_revision == v.failed_revision
    else:
        assert action.until == NOW + CFG.timeouts.shutdown_grace_s


def test_running_goes_on_when_nothing_is_wrong() -> None:
    assert decide(running(), view("ab", "", rnd(1, "ab")), NOW, CFG).kind is ActionKind.WAIT
    # a newcomer that does not fit (the round is at max_workers) waits as a spare
    assert decide(running(nodes="abc"), view("abcd", "d", rnd(1, "abc")), NOW, CFG).kind is ActionKind.WAIT
    # a round record that does not parse (garbage written by hand) is no reason to stop training
    assert decide(running(), replace(view("ab", ""), round_revision=12), NOW, CFG).kind is ActionKind.WAIT
    # a member that is done is not lost when its agent leaves
    assert decide(running(), view("a", "", rnd(1, "ab"), done={"b": 1}), NOW, CFG).kind is ActionKind.WAIT


def test_running_marks_the_node_done_when_every_worker_exited_0() -> None:
    action = decide(running(running=0, succeeded=1), view("ab", "", rnd(1, "ab")), NOW, CFG)
    assert action.kind is ActionKind.MARK_DONE and action.round == 1


# -- stopping ----------------------------------------------------------------------------------


def stopping(cause: Cause = Cause.WORKER_FAILED, **kw: object) -> Local:
    base = Local(
        "a", Phase.STOPPING, round=1, nodes=("a", "b"), cause=str(cause), running=0, terminate_deadline=NOW + 5
    )
    return replace(base, **kw)


@pytest.mark.parametrize(
    ("local", "kind", "reason"),
    [
        (stopping(running=1), ActionKind.WAIT, "waiting for the workers to stop"),
        (stopping(running=1, terminate_deadline=NOW), ActionKind.KILL, "workers still running after shutdown_grace_s"),
        (stopping(running=1, stop_requests=2), ActionKind.KILL, "a second stop request"),
        (stopping(running=1, kill_deadline=NOW + 1), ActionKind.WAIT, "waiting for killed workers"),
        (stopping(running=1, kill_deadline=NOW), ActionKind.EXIT, "workers_not_reaped"),
        (stopping(stop_requests=1), ActionKind.EXIT, "left the job"),
        (stopping(), ActionKind.RESTART, "round 1 ended (worker_failed): restart in 1 s"),
        (stopping(restarts=(NOW - 30,)), ActionKind.RESTART, "round 1 ended (worker_failed): restart in 2 s"),
        (
            stopping(restarts=(NOW - 30, NOW - 10)),
            ActionKind.EXIT,
            "restarts_exhausted: round 1 ended (worker_failed); 2 restarts in the last 60 s (max_restarts 2)",
        ),
        (stopping(restarts=(NOW - 90, NOW - 10)), ActionKind.RESTART, "round 1 ended (worker_failed): restart in 2 s"),
        (stopping(Cause.JOIN, restarts=(NOW - 30, NOW - 10)), ActionKind.RESTART, "round 1 ended (join): rejoin"),
        (stopping(Cause.NODE_LOST), ActionKind.RESTART, "round 1 ended (node_lost): restart in 1 s"),
    ],
    ids=[
        "grace",
        "grace over",
        "second stop",
        "reaping",
        "not reaped",
        "left",
        "first restart",
        "backoff doubles",
        "budget spent",
        "old restarts age out",
        "joins are free",
        "node lost counts",
    ],
)
def test_stopping_then_restart_within_the_budget(local: Local, kind: ActionKind, reason: str) -> None:
    action = decide(local, view("ab"), NOW, CFG)
    assert action.kind is kind, action
    assert action.reason.startswith(reason), action.reason
    if kind is ActionKind.RESTART:
        assert action.counted == (local.cause != "join")
        assert action.until == NOW + (0 if local.cause == "join" else float(reason.split("restart in ")[1][0]))
    if kind is ActionKind.EXIT:
        assert action.exit_code == (0 if reason == "left the job" else 1)


def test_rejoin_waits_for_its_backoff_then_registers() -> None:
    local = Local("a", Phase.REJOIN, restart_at=NOW + 1)
    assert decide(local, view(), NOW, CFG) == Action(ActionKind.WAIT, "restart backoff", until=NOW + 1)
    assert decide(local, view(), NOW + 1, CFG).kind is ActionKind.REGISTER
    assert decide(replace(local, stop_requests=1), view(), NOW, CFG).kind is ActionKind.EXIT


# -- finishing ---------------------------------------------------------------------------------


def finishing(**kw: object) -> Local:
    return replace(Local("a", Phase.FINISHING, round=1, nodes=("a", "b"), phase_since=NOW - 1), **kw)


@pytest.mark.parametrize(
    ("v", "kind", "reason"),
    [
        (view("ab", "", rnd(1, "ab"), done={"a": 1}), ActionKind.WAIT, "waiting for the other nodes"),
        (view("ab", "", rnd(1, "ab"), done={"a": 1, "b": 1}), ActionKind.MARK_FINISHED, "every node of round 1"),
        (view("a", "", rnd(1, "ab"), done={"a": 1}, finished=1), ActionKind.EXIT, "workers_finished"),
        (view("ab", "", rnd(1, "ab"), failed(1), done={"a": 1}), ActionKind.TERMINATE, "round 1 marked failed by b"),
        (view("a", "", rnd(1, "ab"), done={"a": 1}), ActionKind.MARK_FAILED, "the agent of b is gone"),
    ],
    ids=["others running", "all done", "finished", "failed after I finished", "other lost"],
)
def test_finishing(v: RoundView, kind: ActionKind, reason: str) -> None:
    action = decide(finishing(), v, NOW, CFG)
    assert action.kind is kind, action
    assert action.reason.startswith(reason), action.reason


def test_finishing_gives_up_waiting_after_join_s_with_exit_0() -> None:
    action = decide(finishing(phase_since=NOW - 120), view("ab", "", rnd(1, "ab"), done={"a": 1}), NOW, CFG)
    assert action.kind is ActionKind.EXIT and action.exit_code == 0


# -- the worker environment and the records ----------------------------------------------------


def test_worker_environ_is_what_torchrun_sets() -> None:
    r = RoundRecord(3, ("x", "y"), 2, "10.0.0.5", 29511, 2, "worker_failed")
    env = worker_environ(r, "y", 1, "job7", max_restarts=3)
    assert env == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_NAME": "default",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29511",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_RUN_ID": "job7",
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def test_parse_view_reports_garbage_and_keeps_the_rest() -> None:
    keys = Keys("/e", "j")
    kvs = [
        KeyValue(keys.restart_round, b"{not json", 5, 5),
        KeyValue(keys.restart_agent("a"), encode(agent("a")), 6, 6, lease=1),
        KeyValue(keys.restart_agent("b"), encode(agent("a")), 7, 7, lease=1),  # names another node
        KeyValue(keys.restart_waiting("a"), encode(waiting("a")), 8, 8, lease=1),
        KeyValue(keys.restart_failed, json.dumps({"round": "1"}).encode(), 9, 9),
    ]
    v = parse_view(keys, kvs)
    assert v.round is None and v.round_revision == 5
    assert set(v.agents) == {"a"} and set(v.waiting) == {"a"} and v.waiting_order == {"a": 8}
    assert v.failed is None and len(v.malformed) == 3


# -- the mode setting --------------------------------------------------------------------------


def test_mode_comes_from_flag_env_or_file(tmp_path: Path) -> None:
    assert load_agent_config(program=["true"], environ={}).mode == "elastic"
    assert load_agent_config(program=["true"], environ={"ELASTICD_MODE": "restart"}).mode == "restart"
    (tmp_path / "e.toml").write_text('mode = "restart"\n')
    assert load_agent_config(program=["true"], environ={}, config_file=tmp_path / "e.toml").mode == "restart"
    assert (
        load_agent_config({"mode": "elastic"}, program=["true"], config_file=tmp_path / "e.toml", environ={}).mode
        == "elastic"
    )


@pytest.mark.parametrize(("where", "suffix"), [("flag", "(from --mode)"), ("env", "(from ELASTICD_MODE)")])
def test_a_bogus_mode_is_one_clear_error(where: str, suffix: str) -> None:
    flags = {"mode": "bogus"} if where == "flag" else {}
    environ = {"ELASTICD_MODE": "bogus"} if where == "env" else {}
    with pytest.raises(ConfigError) as info:
        load_agent_config(flags, program=["true"], environ=environ)
    assert str(info.value) == f"mode: must be one of elastic, restart, got 'bogus' {suffix}"


# -- the executor, on real tiny processes against the fake store -----------------------------

# A "training script" that records its torchrun variables. In the first round rank 1 fails after a
# moment and rank 0 "trains" until it is stopped; in the next round both finish at once.
SCRIPT = """
import json, os, sys, time
out = sys.argv[1]
env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "MASTER_ADDR",
                                  "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID")}
with open(os.path.join(out, "env.jsonl"), "a") as f:
    f.write(json.dumps(env) + "\\n")
if env["TORCHELASTIC_RESTART_COUNT"] == "0":
    time.sleep(0.5 if env["RANK"] == "1" else 30)
    sys.exit(1)
"""


def test_two_agents_restart_the_whole_group_once_and_finish(tmp_path: Path) -> None:
    store = FakeKeyValueStore()
    cfg = replace(
        CFG,
        program=(sys.executable, "-c", SCRIPT, str(tmp_path)),
        restart_backoff_initial_s=0.05,
        poll_interval_s=0.02,
        world=WorldConfig(job_id="j", min_workers=2, max_workers=2),
    )
    agents = [GroupRestartAgent(replace(cfg, node_id=n), store) for n in ("a", "b")]
    outcomes: dict[str, object] = {}
    threads = [
        threading.Thread(target=lambda g=g, n=n: outcomes.__setitem__(n, g.run(install_signals=False)))
        for g, n in zip(agents, "ab")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=40)
    assert not any(t.is_alive() for t in threads), "agents still running"
    assert {n: (o.exit_code, o.reason) for n, o in outcomes.items()} == {
        "a": (0, "workers_finished"),
        "b": (0, "workers_finished"),
    }
    runs = [json.loads(line) for line in (tmp_path / "env.jsonl").read_text().splitlines()]
    assert len(runs) == 4  # both workers of round 1, then both again
    first, second = runs[:2], runs[2:]
    assert sorted(r["RANK"] for r in first) == sorted(r["RANK"] for r in second) == ["0", "1"]
    assert {r["WORLD_SIZE"] for r in runs} == {"2"} and {r["TORCHELASTIC_RUN_ID"] for r in runs} == {"j"}
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in first} == {"0"}
    assert {r["TORCHELASTIC_RESTART_COUNT"] for r in second} == {"1"}
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in first}) == 1  # one master per round
    assert len({(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in second}) == 1
    keys = Keys(cfg.etcd.prefix, "j")
    assert store.get(keys.restart_agent("a")) is None and store.get(keys.restart_agent("b")) is None  # leases revoked


# A script that "trains" until stopped while the world has 2 workers, and finishes at once alone.
SCRIPT_UNTIL_ALONE = """
import os, sys, time
if os.environ["WORLD_SIZE"] != "1":
    time.sleep(30)
"""


def test_a_node_that_is_asked_to_stop_leaves_and_the_other_goes_on_alone(tmp_path: Path) -> None:
    store = FakeKeyValueStore()
    cfg = replace(
        CFG,
        program=(sys.executable, "-c", SCRIPT_UNTIL_ALONE),
        max_restarts=0,
        poll_interval_s=0.02,
        world=WorldConfig(job_id="j", min_workers=1, max_workers=2),
        timeouts=Timeouts(join_window_s=2.0),
    )  # a and b surely start together
    agents = {n: GroupRestartAgent(replace(cfg, node_id=n), store) for n in "ab"}
    outcomes: dict[str, object] = {}
    threads = {n: threading.Thread(target=lambda n=n: outcomes.__setitem__(n, agents[n].run(False))) for n in "ab"}
    for t in threads.values():
        t.start()
    keys = Keys(cfg.etcd.prefix, "j")

    def world() -> int:
        kv = store.get(keys.restart_round)
        return len(json.loads(kv.value)["nodes"]) if kv else 0

    deadline = time.monotonic() + 20
    while world() < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert world() == 2, "a and b never formed a round together"
    agents["b"].request_stop()
    for t in threads.values():
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads.values()), "agents still running"
    assert outcomes["b"].exit_code == 0 and outcomes["b"].reason == "left the job (stop requested)"
    # the leave used none of a's restart budget (max_restarts 0): a finished alone
    assert outcomes["a"].exit_code == 0 and outcomes["a"].reason == "workers_finished"
    failed = json.loads(store.get(keys.restart_failed).value)
    assert (failed["cause"], failed["node"]) == ("node_left", "b")
    assert json.loads(store.get(keys.restart_round).value)["nodes"] == ["a"]
