"""Operators' records and what reads and writes them: node records, drain requests, events.

Pure parts (encoders/decoders, event names, pruning, the status/events read model, the drain
progress test) on hand-built keys; the event writer, the agent's presence thread and the drain
request against the fake store (``tests/fakes.py``), which has etcd's revision and lease semantics.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import pytest

from elasticd.agent.presence import NodePresence
from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable
from elasticd.events import MAX_PENDING_EVENTS, EventLog
from elasticd.ops.drain import drain_progress, request_drain
from elasticd.ops.render import (
    render_events_json,
    render_events_table,
    render_json,
    render_table,
)
from elasticd.ops.status import build_status, job_events
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.ops import (
    DrainRecord,
    EventRecord,
    NodeRecord,
    WorkerRecord,
    decode_drain,
    decode_event,
    decode_node,
    encode_drain,
    encode_event,
    encode_node,
    event_name,
    prune_plan,
)
from elasticd.wire.records import GenerationRecord, MemberRecord, encode
from tests.fakes import FakeKeyValueStore, GuardedStore

pytestmark = pytest.mark.timeout(60)

KEYS = Keys("/elasticd", "job")
NOW = 1_700_000_000.0
SIG = "s" * 64


def worker(
    lr: int, pid: int, restarts: int = 0, rss: int | None = 50 * 2**20, cpu: float | None = 12.5
) -> WorkerRecord:
    return WorkerRecord(
        local_rank=lr,
        pid=pid,
        state="running",
        starts=restarts + 1,
        restarts=restarts,
        last_exit="was killed by SIGKILL" if restarts else None,
        rss_bytes=rss,
        cpu_percent=cpu,
    )


def node(name: str, *workers: WorkerRecord, state: str = "running", age_s: float = 1.0) -> NodeRecord:
    return NodeRecord(node=name, host="10.0.0.9", agent_pid=4242, state=state, time=NOW - age_s, workers=workers)


def event(t: float, kind: str, source: str = "m0", **detail: object) -> tuple[str, bytes]:
    ns = int(t * 1e9)
    return KEYS.event(event_name(ns, source)), encode_event(
        EventRecord(time=ns / 1e9, kind=kind, source=source, detail=detail)
    )


def member(mid: str, node_id: str, pid: int) -> tuple[str, bytes]:
    return KEYS.member(mid), encode(MemberRecord(mid, node_id, 0, pid, "10.0.0.9", 29500, SIG))


def generation(number: int, members: Sequence[str]) -> tuple[str, bytes]:
    return KEYS.generation, encode(GenerationRecord(number, tuple(members), "10.0.0.9", 29500, SIG, 10, "start"))


def kvs(*rows: tuple[str, bytes], lease: int = 0) -> list[KeyValue]:
    return [KeyValue(k, v, 10 + i, 10 + i, lease) for i, (k, v) in enumerate(rows)]


# -- records ------------------------------------------------------------------------------------


def test_records_round_trip() -> None:
    n = node("a", worker(0, 11), worker(1, 12, restarts=2, rss=None, cpu=None))
    assert decode_node(encode_node(n)) == n
    assert n.restarts == 2
    d = DrainRecord("a", "ops@host", NOW)
    assert decode_drain(encode_drain(d)) == d
    e = EventRecord(NOW, "recovered", "m0", {"cause": "PeerLost", "duration_s": 0.4})
    assert decode_event(encode_event(e)) == e


GOOD_NODE = json.loads(encode_node(node("a", worker(0, 11))))


def _with(path: Sequence[object], value: object) -> bytes:
    data = json.loads(json.dumps(GOOD_NODE))
    target = data
    for p in path[:-1]:
        target = target[p]  # type: ignore[index]
    if value is KeyError:
        del target[path[-1]]  # type: ignore[arg-type]
    else:
        target[path[-1]] = value  # type: ignore[index]
    return json.dumps(data).encode()


@pytest.mark.parametrize(
    "raw",
    [
        b"garbage",
        b"[]",
        b"\xff",
        b"{}",
        _with(["agent_pid"], "12"),
        _with(["agent_pid"], True),
        _with(["time"], None),
        _with(["workers"], {}),
        _with(["workers", 0], 5),
        _with(["workers", 0, "pid"], KeyError),
        _with(["workers", 0, "cpu_percent"], "x"),
        _with(["node"], KeyError),
        b'{"node": "a", "host": "h", "agent_pid": 1, "state": "s", "time": NaN, "workers": []}',
    ],
)
def test_decode_node_rejects_garbage(raw: bytes) -> None:
    with pytest.raises((ValueError, TypeError, UnicodeDecodeError)):
        decode_node(raw)


def test_decode_node_allows_extra_fields_and_nulls_where_optional() -> None:
    raw = _with(["workers", 0, "rss_bytes"], None)
    assert decode_node(raw).workers[0].rss_bytes is None
    assert decode_node(_with(["extra"], 1)).node == "a"


@pytest.mark.parametrize(
    "raw",
    [
        b"nope",
        b'{"time": 1, "kind": "", "source": "x", "detail": {}}',
        b'{"time": 1, "kind": "k", "source": "x"}',
        b'{"time": "1", "kind": "k", "source": "x", "detail": {}}',
        b'{"time": 1, "kind": "k", "source": "x", "detail": []}',
    ],
)
def test_decode_event_rejects_garbage(raw: bytes) -> None:
    with pytest.raises(ValueError):
        decode_event(raw)


def test_event_names_sort_by_time_and_never_collide() -> None:
    names = [event_name(5, "b"), event_name(5, "b"), event_name(5, "a"), event_name(4, "z"), event_name(10**12, "a")]
    assert len(set(names)) == len(names)
    assert sorted(names)[0] == names[3] and sorted(names)[-1] == names[4]
    with pytest.raises(ValueError):
        event_name(1, "a/b")


@pytest.mark.parametrize(("n", "keep", "deleted"), [(0, 3, 0), (3, 3, 0), (5, 3, 2), (5, 1, 4)])
def test_prune_plan_deletes_the_oldest_beyond_keep(n: int, keep: int, deleted: int) -> None:
    names = [f"{i:020d}.x.{i}" for i in range(n)]
    plan = prune_plan(list(reversed(names)), keep)
    assert plan == names[:deleted]


# -- status: nodes, per-member resources, recoveries, malformed ---------------------------------


def _job() -> list[KeyValue]:
    return kvs(
        member("a.0.11", "a", 11),
        member("b.0.21", "b", 21),
        generation(3, ["a.0.11", "b.0.21"]),
        (KEYS.node("a"), encode_node(node("a", worker(0, 11, restarts=1)))),
        (KEYS.node("b"), encode_node(node("b", worker(0, 21), state="draining"))),
        (KEYS.drain("b"), encode_drain(DrainRecord("b", "ops", NOW))),
        event(NOW - 30, "generation_published", generation=1),
        *[
            event(
                NOW - 20 + i,
                "recovered",
                generation=i + 2,
                cause="PeerLost",
                generation_reason="aborted",
                duration_s=0.25 * i,
            )
            for i in range(7)
        ],
        (KEYS.node("x"), b"garbage"),
        (KEYS.event("zzz"), b"{not json"),
    )


def test_status_joins_node_records_and_reports_nodes_recoveries_and_malformed() -> None:
    st = build_status(KEYS, _job(), now=NOW, max_workers=2)
    rows = {m.member_id: m for m in st.members}
    assert (rows["a.0.11"].restarts, rows["a.0.11"].rss_bytes, rows["a.0.11"].cpu_percent) == (1, 50 * 2**20, 12.5)
    assert rows["b.0.21"].restarts == 0
    assert [(n.node, n.state, n.restarts, n.drain_requested, n.workers_running) for n in st.nodes] == [
        ("a", "running", 1, False, 1),
        ("b", "draining", 0, True, 1),
    ]
    assert len(st.recoveries) == 5 and [r.generation for r in st.recoveries] == [4, 5, 6, 7, 8]
    assert st.recoveries[-1].cause == "PeerLost (aborted)" and st.recoveries[-1].duration_s == 1.5
    bad = sorted(m.split(":")[0] for m in st.malformed)
    assert bad == [KEYS.event("zzz"), KEYS.node("x")]
    data = json.loads(render_json(st))
    assert data["nodes"][1]["drain_requested"] is True and data["drains"] == ["b"]
    assert data["members"][0]["rss_bytes"] == 50 * 2**20
    text = render_table(st)
    assert "AGENT_STATE" in text and "draining" in text and "50MiB" in text and "12%" in text
    assert "last recoveries (newest last" in text and "PeerLost (aborted)  1.500s" in text


def test_a_member_whose_pid_is_not_in_its_node_record_has_no_resources() -> None:
    rows = kvs(
        member("a.0.99", "a", 99), generation(1, ["a.0.99"]), (KEYS.node("a"), encode_node(node("a", worker(0, 11))))
    )
    (m,) = build_status(KEYS, rows, now=NOW).members
    assert (m.restarts, m.rss_bytes, m.cpu_percent) == (None, None, None)


def test_a_node_record_under_another_nodes_key_is_malformed() -> None:
    st = build_status(KEYS, kvs((KEYS.node("b"), encode_node(node("a")))), now=NOW)
    assert st.nodes == () and st.malformed[0].startswith(KEYS.node("b") + ": node does not match")


def test_events_listing_newest_last_with_limit_and_malformed() -> None:
    ev = job_events(KEYS, _job(), limit=3)
    assert ev.total == 8 and [e.detail["generation"] for _, e in ev.events] == [6, 7, 8]
    assert ev.malformed == (f"{KEYS.event('zzz')}: " + ev.malformed[0].split(": ", 1)[1],)
    data = json.loads(render_events_json(ev))
    assert list(data) == ["job", "prefix", "total", "events", "malformed"]
    assert [e["kind"] for e in data["events"]] == ["recovered"] * 3
    text = render_events_table(ev)
    assert "3 of 8 event(s), newest last" in text and "cause=PeerLost" in text and "malformed events (1" in text
    everything = job_events(KEYS, _job())
    assert [e.kind for _, e in everything.events][0] == "generation_published"


def test_events_of_an_empty_job() -> None:
    ev = job_events(KEYS, [])
    assert not ev.exists and ev.events == () and "0 of 0" in render_events_table(ev)


# -- drain --------------------------------------------------------------------------------------


def test_drain_of_an_unknown_node_writes_nothing_and_names_the_known_ones() -> None:
    store = FakeKeyValueStore()
    store.put(KEYS.node("a"), encode_node(node("a")))
    before = store.revision
    req = request_drain(store, KEYS, "zz", "ops", NOW)
    assert not req.accepted and "unknown node 'zz'" in req.message and "known nodes: a" in req.message
    assert store.revision == before


def test_drain_request_is_written_under_the_agents_lease() -> None:
    store = FakeKeyValueStore()
    lease = store.grant_lease(5)
    store.put(KEYS.node("a"), encode_node(node("a")), lease=lease)
    for k, v in (member("a.0.11", "a", 11), member("b.0.21", "b", 21)):
        store.put(k, v)
    req = request_drain(store, KEYS, "a", "ops@h", NOW)
    assert req.accepted and req.members == ("a.0.11",)
    kv = store.get(KEYS.drain("a"))
    assert kv is not None and kv.lease == lease and decode_drain(kv.value).requested_by == "ops@h"
    store.revoke_lease(lease)
    assert store.get(KEYS.drain("a")) is None  # it cannot outlive the agent


@pytest.mark.parametrize(
    ("rows", "done", "why"),
    [
        ([member("a.0.11", "a", 11), generation(2, ["a.0.11", "b.0.21"])], False, "still has a.0.11"),
        ([generation(2, ["a.0.11", "b.0.21"])], False, "still has a.0.11"),  # gone, but in the generation
        ([generation(2, ["a.0.77", "b.0.21"])], False, "still has a.0.77"),  # never seen, named like a's
        ([generation(3, ["b.0.21"]), member("ab.0.5", "ab", 5)], True, "world size 1"),
        ([generation(3, ["ab.0.5"])], True, "no member of node 'a'"),  # another node whose id starts with a
        ([], False, "no generation yet"),
    ],
)
def test_drain_progress(rows: list[tuple[str, bytes]], done: bool, why: str) -> None:
    tracked = {"a.0.11"}
    assert drain_progress(KEYS, kvs(*rows), "a", tracked)[0] is done
    assert why in drain_progress(KEYS, kvs(*rows), "a", tracked)[1]


# -- the event writer ---------------------------------------------------------------------------


class FlakyStore(FakeKeyValueStore):
    """The fake store, with puts that fail while ``down`` is set (like an etcd outage)."""

    down = False

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        if self.down:
            raise EtcdUnavailable("etcd is down (test)")
        return super().put(key, value, lease)

    def compare_and_put(
        self,
        key: str,
        expected_mod_revision: int,
        value: bytes,
        delete_keys: Iterable[str] = (),
        put_keys: Mapping[str, bytes] | None = None,
        lease: int = 0,
        delete_ranges: Iterable[tuple[str, str]] = (),
    ) -> bool:
        if self.down:
            raise EtcdUnavailable("etcd is down (test)")
        return super().compare_and_put(key, expected_mod_revision, value, delete_keys, put_keys, lease, delete_ranges)


def _events_in(store: FakeKeyValueStore) -> list[EventRecord]:
    return [decode_event(kv.value) for kv in sorted(store.get_prefix(KEYS.events), key=lambda kv: kv.key)]


def test_event_log_writes_in_order_and_prunes_to_keep() -> None:
    store = FakeKeyValueStore()
    log = EventLog(store, KEYS, "agent.a.1", keep=4)
    for i in range(10):
        log.record("worker_exited", i=i)
    assert log.flush(10)
    log.close(5)
    assert [e.detail["i"] for e in _events_in(store)] == [6, 7, 8, 9]
    assert all(e.source == "agent.a.1" for e in _events_in(store))


def test_event_log_never_raises_retries_after_an_outage_and_bounds_its_queue() -> None:
    store = FlakyStore()
    store.down = True
    log = EventLog(store, KEYS, "m0", keep=1000)
    started = time.monotonic()
    for i in range(MAX_PENDING_EVENTS + 5):
        log.record("recovered", i=i)  # never blocks, never raises
    assert time.monotonic() - started < 1.0
    assert log.dropped == 5
    assert not log.flush(0.2)
    store.down = False
    assert log.flush(10)
    got = [e.detail["i"] for e in _events_in(store)]
    assert got == list(range(5, MAX_PENDING_EVENTS + 5))
    log.close(5)


# -- the agent's presence thread ----------------------------------------------------------------

FAST = Timeouts(lease_ttl_s=1.0, keepalive_s=0.05)


def test_presence_registers_under_a_lease_updates_sees_a_drain_once_and_cleans_up() -> None:
    store = FakeKeyValueStore()
    drains: list[DrainRecord | None] = []
    p = NodePresence(store, KEYS, "a", FAST, stats_interval_s=60, events_keep=10, on_drain=drains.append)
    p.start()
    try:
        p.update(node("a", worker(0, 11)))
        _until(lambda: store.get(KEYS.node("a")) is not None)
        kv = store.get(KEYS.node("a"))
        assert kv is not None and kv.lease and decode_node(kv.value).workers[0].pid == 11
        p.update(node("a", worker(0, 12)))
        _until(lambda: decode_node(store.get(KEYS.node("a")).value).workers[0].pid == 12)  # type: ignore[union-attr]
        store.put(KEYS.drain("a"), b"garbage by hand")  # any value there is a request
        _until(lambda: bool(drains))
        time.sleep(0.2)
        assert drains == [None]  # once
        p.event("node_draining", cause="test")
    finally:
        p.close(5)
    assert store.get(KEYS.drain("a")) is None and store.get(KEYS.node("a")) is None
    assert [e.kind for e in _events_in(store)] == ["node_draining"]


def test_presence_survives_an_outage_and_registers_again_after_losing_its_lease() -> None:
    store = FlakyStore()
    p = NodePresence(store, KEYS, "a", FAST, stats_interval_s=60, events_keep=10, on_drain=lambda _: None)
    p.start()
    try:
        p.update(node("a", worker(0, 11)))
        _until(lambda: store.get(KEYS.node("a")) is not None)
        store.down = True
        first = store.get(KEYS.node("a"))
        assert first is not None
        store.clock.advance(5)  # the lease runs out during the outage
        time.sleep(0.2)
        assert store.get(KEYS.node("a")) is None
        store.down = False
        _until(lambda: store.get(KEYS.node("a")) is not None)
        again = store.get(KEYS.node("a"))
        assert again is not None and again.lease and again.lease != first.lease
    finally:
        p.close(5)


def _until(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached")


# -- the drain command on a store -----------------------------------------------------------------


def test_drain_wait_times_out_with_exit_2_while_the_nodes_member_stays_in_the_generation() -> None:
    import io

    from elasticd.cli import DrainQuery, execute_drain
    from elasticd.config import EtcdConfig

    store = FakeKeyValueStore()
    for k, v in (member("a.0.11", "a", 11), generation(2, ["a.0.11"]), (KEYS.node("a"), encode_node(node("a")))):
        store.put(k, v)
    out, err = io.StringIO(), io.StringIO()
    query = DrainQuery(etcd=EtcdConfig(), job_id="job", node="a", wait=True, timeout_s=0.3)
    started = time.monotonic()
    assert execute_drain(store, KEYS, query, out, err, time.sleep) == 2
    assert 0.3 <= time.monotonic() - started < 5
    assert "drain of node 'a' requested" in out.getvalue()
    assert err.getvalue().startswith("elasticctl: node 'a' not drained after 0.3 s: generation 2 still has a.0.11")
    # once the member is gone and a generation without it is published, --wait returns 0
    store.delete(KEYS.member("a.0.11"))
    store.put(*generation(3, ["b.0.21"]))
    out = io.StringIO()
    assert execute_drain(store, KEYS, query, out, err, time.sleep) == 0
    assert "node 'a' drained: generation 3 (world size 1)" in out.getvalue()


# -- the agent: node record, events, and a drain request through the store -----------------------


def test_agent_publishes_its_node_record_and_drains_on_a_drain_request() -> None:
    import sys
    import threading

    from elasticd.agent.elastic import Agent
    from elasticd.config import AgentConfig, WorldConfig

    code = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); time.sleep(60)"
    store = FakeKeyValueStore()
    keys = Keys("/elasticd", "j")
    config = AgentConfig(
        program=(sys.executable, "-c", code),
        node_id="n",
        nproc_per_node=2,
        world=WorldConfig(job_id="j"),
        poll_interval_s=0.02,
        stats_interval_s=0.1,
        timeouts=Timeouts(shutdown_grace_s=5.0, keepalive_s=0.1, lease_ttl_s=1.0),
    )
    agent = Agent(config, store)
    seen: list[NodeRecord] = []

    def drain_once_running() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            kv = store.get(keys.node("n"))
            rec = decode_node(kv.value) if kv is not None else None
            if rec is not None and all(w.pid and w.rss_bytes for w in rec.workers):
                seen.append(rec)
                assert request_drain(store, keys, "n", "ops@test", time.time()).accepted
                return
            time.sleep(0.02)

    t = threading.Thread(target=drain_once_running)
    t.start()
    outcome = agent.run(install_signals=False)
    t.join(10)
    assert (outcome.exit_code, outcome.reason) == (0, "drained")
    (rec,) = seen
    assert rec.state == "running" and [w.local_rank for w in rec.workers] == [0, 1] and rec.restarts == 0
    assert store.get(keys.drain("n")) is None and store.get(keys.node("n")) is None
    events = [decode_event(kv.value) for kv in sorted(store.get_prefix(keys.events), key=lambda kv: kv.key)]
    kinds = [e.kind for e in events]
    assert kinds[0] == "node_draining" and kinds[-1] == "node_drained"
    assert kinds.count("worker_exited") == 2 and "worker_restarted" not in kinds
    assert events[0].detail["cause"] == "elasticctl drain by ops@test"
    assert all(e.source.startswith("agent.n.") for e in events)


class DownStore(GuardedStore):
    """The fake store where every call fails while ``down`` is set (etcd unreachable)."""

    down = False

    def guard(self, call: str) -> None:
        if self.down:
            raise EtcdUnavailable("etcd is down (test)")


def test_an_etcd_outage_does_not_stop_the_agent_or_its_workers(tmp_path: Path) -> None:
    import sys
    import threading

    from elasticd.agent.elastic import Agent
    from elasticd.config import AgentConfig, WorldConfig

    store = DownStore()
    keys = Keys("/elasticd", "j")
    # Each worker runs 1.5 s and exits 0; one fails once first, so the agent also restarts it.
    code = (
        "import os, sys, time; time.sleep(1.5); rank = os.environ['ELASTICD_LOCAL_RANK']; "
        "flag = sys.argv[1] + rank; first = not os.path.exists(flag); open(flag, 'a').close(); "
        "sys.exit(3 if first and rank == '0' else 0)"
    )
    flag = str(tmp_path / "failed-once")
    config = AgentConfig(
        program=(sys.executable, "-c", code, flag),
        node_id="n",
        nproc_per_node=2,
        world=WorldConfig(job_id="j"),
        poll_interval_s=0.02,
        stats_interval_s=0.1,
        restart_backoff_initial_s=0.05,
        restart_backoff_max_s=0.1,
        # an exit 0 is taken as done once no read of the job said otherwise for etcd_outage_s
        timeouts=Timeouts(keepalive_s=0.1, lease_ttl_s=1.0, etcd_request_s=0.5, etcd_outage_s=1.0),
    )
    agent = Agent(config, store)

    def outage() -> None:
        _until(lambda: store.get(keys.node("n")) is not None)
        store.down = True  # from now on until the agent is done

    t = threading.Thread(target=outage)
    t.start()
    started = time.monotonic()
    outcome = agent.run(install_signals=False)
    t.join(10)
    assert (outcome.exit_code, outcome.reason) == (0, "workers_finished")
    assert agent.snapshot.slots[0].starts == 2 and agent.snapshot.slots[1].starts == 1
    assert time.monotonic() - started < 15
