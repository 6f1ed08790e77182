"""The rendezvous bench's pure parts: the walls, the protocol's counts, the cost model, the report
arithmetic, and the counting proxy (over the in-memory store)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import threading
from collections import Counter

import pytest

from elasticd.bench.common import host_stolen_s
from elasticd.bench.rendezvous_members import CountingStore, bench_record
from elasticd.bench.rendezvous_model import (
    DEFAULT_READS_PER_MEMBER,
    MODEL_N,
    Costs,
    RoundCounts,
    Sizes,
    COORDINATOR_READS,
    coordinated_protocol,
    current_protocol,
    difference,
    first_n,
    model_rows,
    parse_metrics,
    predict,
    publish_ops,
    round_times,
    wall_thresholds,
    walls,
)
from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from tests.fakes import FakeKeyValueStore

pytestmark = pytest.mark.timeout(30)

KEYS = Keys("/elasticd", "bench")
SIZES = Sizes.of(bench_record(7, 123456), KEYS)
ZERO = Costs(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
ZERO_BUT_EVENTS = Costs(0.0, 0.0, 0.0, 1e-6, 0.0, 0.0, 0.0, 0.0)  # etcd CPU per watch event only


def test_sizes_count_keys_values_and_framing() -> None:
    rec = bench_record(7, 123456)
    assert rec.member_id == "node00007.0.123456"
    assert SIZES.member_id == len(rec.member_id)
    assert SIZES.member_kv > len(KEYS.member(rec.member_id)) + 64  # the signature alone is 64 bytes
    assert SIZES.full_read(10) == 10 * SIZES.full_read(1)
    assert SIZES.publish_request(100) - SIZES.publish_request(0) == 100 * 2 * (SIZES.member_id + 4)
    assert SIZES.publish_request(100, deletes=True) - SIZES.publish_request(100) == 100 * (SIZES.ready_key + 4)


@pytest.mark.parametrize(("n", "txn_wall"), [(1, False), (126, False), (127, True), (1000, True)])
def test_the_publish_txn_wall_was_at_127_members_while_the_publish_deleted_the_ready_keys(
    n: int, txn_wall: bool
) -> None:
    assert publish_ops(n) == 2 and publish_ops(n, deletes=True) == n + 2
    assert any("--max-txn-ops 128" in w for w in walls(n, SIZES, deletes=True)) is txn_wall
    assert not any("--max-txn-ops" in w for w in walls(n, SIZES))


def test_wall_thresholds_are_the_first_n_over_each_limit() -> None:
    at = wall_thresholds(SIZES)
    assert at["publish_txn_ops"] is None and at["publish_txn_ops_deleting_ready"] == 127
    for name, limit, size in (
        ("publish_request_bytes", 1536 * 1024, SIZES.publish_request),
        ("publish_request_bytes_deleting_ready", 1536 * 1024, lambda n: SIZES.publish_request(n, deletes=True)),
        ("full_read_grpc_message", 4 * 1024 * 1024, SIZES.full_read),
    ):
        n = at[name]
        assert n is not None and size(n) > limit >= size(n - 1), name
    # the read wall comes before the publish's bytes (a read carries whole records, the publish ids)
    assert at["full_read_grpc_message"] < at["publish_request_bytes"]  # type: ignore[operator]


@pytest.mark.parametrize(("threshold", "expected"), [(0, 1), (1, 2), (999, 1000), (10**6, None)])
def test_first_n_bisects(threshold: int, expected: int | None) -> None:
    assert first_n(lambda n: n > threshold) == expected


@pytest.mark.parametrize(
    ("n", "deletes", "join_events", "leave_events"),
    [
        (50, True, 5_050, 2 * 49 * 49 + 2 * 49),  # 5,050 events at 50 members with the deletes
        (200, True, 80_200, 2 * 199 * 199 + 2 * 199),  # and 80,200 at 200
        (50, False, 2_550, 49 * 49 + 2 * 49),  # the ready records are not deleted
    ],
)
def test_current_protocol_events_are_quadratic(n: int, deletes: bool, join_events: int, leave_events: int) -> None:
    t = Timeouts()
    join = current_protocol(n, 3.0, SIZES, t, leave=False, deletes=deletes)
    leave = current_protocol(n, 3.0, SIZES, t, leave=True, deletes=deletes)
    assert (join.events, leave.events) == (join_events, leave_events)
    assert (join.members, leave.members) == (n, n - 1)
    assert join.requests == n * 4 and leave.requests == n - 1
    assert join.read_bytes == leave.read_bytes == SIZES.full_read(n)
    assert (join.sweeps, leave.sweeps) == (4.0, 6.0)
    assert (join.fixed_wait_s, leave.fixed_wait_s) == (0.0, t.abort_poll_s)


@pytest.mark.parametrize("n", [50, 1000, 4000, 16000])
def test_coordinated_protocol_events_are_linear_and_reads_small(n: int) -> None:
    t = Timeouts()
    join = coordinated_protocol(n, 3.0, SIZES, t, leave=False)
    leave = coordinated_protocol(n, 3.0, SIZES, t, leave=True)
    assert (join.events, leave.events) == (2 * n, (n - 1) + 2)  # at most 3N per change
    assert leave.requests == 0 and leave.sweeps == join.sweeps  # a leave: no ready round (rendezvous.survivors)
    assert join.read_bytes == leave.read_bytes == SIZES.view(n) < 8 * 1024  # a member's read stays small
    assert join.coordinator_reads == leave.coordinator_reads == COORDINATOR_READS
    # the coordinator reads what changed (store.mirror): at a join each ready record, after a leave the keys alone
    assert join.full_bytes == SIZES.join_read(n) < SIZES.full_read(n)
    assert leave.full_bytes == SIZES.listing(n) < SIZES.full_read(n) / 3
    before = current_protocol(n, 3.0, SIZES, t, leave=False)
    assert predict(join, ZERO_BUT_EVENTS, 2).etcd_cpu_s < predict(before, ZERO_BUT_EVENTS, 2).etcd_cpu_s


@pytest.mark.parametrize("n", [16, 1000, 16000])
def test_node_relays_read_once_per_node_and_cut_the_events_to_the_nodes(n: int) -> None:
    t = Timeouts()
    join = coordinated_protocol(n, 3.0, SIZES, t, leave=False, per_node=8)
    leave = coordinated_protocol(n, 3.0, SIZES, t, leave=True, per_node=8)
    nodes, survivors = -(-n // 8), -(-(n - 1) // 8)
    assert (join.readers, leave.readers) == (nodes, survivors)
    assert (join.events, leave.events) == (n + nodes, survivors + 2)  # a join's ready puts: one each still
    alone = coordinated_protocol(n, 3.0, SIZES, t, leave=False)
    assert alone.readers == 0
    c = Costs(
        request_rtt_s=0.001,
        write_rtt_s=0.001,
        etcd_per_request_s=3e-4,
        etcd_per_event_s=5e-6,
        etcd_per_byte_s=1e-8,
        member_per_request_s=4e-4,
        member_per_event_s=4e-5,
        member_per_byte_s=5e-8,
    )
    assert predict(join, c, 2).here_s < predict(alone, c, 2).here_s
    assert predict(join, c, 2).fleet_s < predict(alone, c, 2).fleet_s


def test_predict_adds_waits_writes_events_and_sweeps_of_reads() -> None:
    r = RoundCounts(
        members=10,
        requests=100,
        events=1000,
        read_bytes=10_000,
        reads_per_member=5,
        sweeps=2,
        seq_writes=4,
        fixed_wait_s=0.25,
    )
    c = Costs(
        request_rtt_s=0.5,
        write_rtt_s=0.001,
        etcd_per_request_s=1e-4,
        etcd_per_event_s=1e-5,
        etcd_per_byte_s=1e-8,
        member_per_request_s=2e-4,
        member_per_event_s=2e-5,
        member_per_byte_s=2e-8,
    )
    p = predict(r, c, cores=2)
    read_etcd, read_member = 1e-4 + 1e-4, 2e-4 + 2e-4  # one request and 10 kB, on each side
    base = 0.25 + 4 * 0.001
    assert p.here_s == pytest.approx(base + 2 * 10 * (read_etcd + read_member) / 2 + (0.01 + 0.02 + 0.01 + 0.02) / 2)
    assert p.fleet_s == pytest.approx(base + 2 * (10 * read_etcd / 2 + read_member) + (0.01 + 0.01) / 2 + 0.02 / 10)
    assert p.etcd_cpu_s == pytest.approx(0.01 + 0.01 + 50 * read_etcd)  # the whole round's 50 reads
    assert p.bytes_sent == 50 * 10_000


def test_model_rows_use_the_measured_reads_and_name_the_walls() -> None:
    phases = {"join": {"member_reads": 200.0}, "leave": {"member_reads": 49.0}}
    rows = model_rows(ZERO, SIZES, Timeouts(), phases, 50, 2.0)
    assert [r["members"] for r in rows] == [50, *MODEL_N]
    assert rows[0]["reads_per_member"] == (4.0, 1.0)
    assert rows[0]["walls"] == rows[1]["walls"] == [] and "gRPC" in str(rows[3]["walls"])  # 16,000: the read
    assert rows[0]["join_here_s"] == 0.0 and rows[0]["leave_here_s"] == pytest.approx(Timeouts().abort_poll_s)
    # coordinated: every member reads its view, the coordinator the job (twice on the critical path)
    assert rows[0]["join_bytes_sent"] == 50 * 4.0 * SIZES.view(50) + COORDINATOR_READS * SIZES.join_read(50)
    assert model_rows(ZERO, SIZES, Timeouts(), {}, 50, 2.0)[0]["reads_per_member"] == (DEFAULT_READS_PER_MEMBER,) * 2


def test_parse_metrics_sums_counters_and_skips_watch_and_health_calls() -> None:
    text = "\n".join(
        [
            "# HELP etcd_mvcc_put_total Total number of puts seen by this member.",
            "etcd_mvcc_put_total 12",
            "etcd_debugging_mvcc_events_total 5050",
            'grpc_server_handled_total{grpc_code="OK",grpc_method="Range",grpc_service="etcdserverpb.KV",grpc_type="unary"} 7',
            'grpc_server_handled_total{grpc_code="OK",grpc_method="Txn",grpc_service="etcdserverpb.KV",grpc_type="unary"} 3',
            'grpc_server_handled_total{grpc_code="OK",grpc_method="Watch",grpc_service="etcdserverpb.Watch",grpc_type="bidi_stream"} 9',
            'grpc_server_handled_total{grpc_code="OK",grpc_method="Check",grpc_service="grpc.health.v1.Health",grpc_type="unary"} 4',
            "etcd_network_client_grpc_sent_bytes_total 1.5e+06",
        ]
    )
    m = parse_metrics(text)
    assert (m["puts"], m["watch_events"], m["requests"], m["bytes_sent"], m["txns"]) == (12, 5050, 10, 1.5e6, 0)


def test_difference_and_round_times() -> None:
    assert difference({"a": 1.0, "b": 2.0}, {"a": 4.0, "b": 2.5, "c": 1.0}) == {"a": 3.0, "b": 0.5, "c": 1.0}
    assert round_times(100.0, 100.5, [101.0, 103.25, 102.0]) == {
        "published_s": 0.5,
        "first_learned_s": 1.0,
        "median_learned_s": 2.0,
        "all_learned_s": 3.25,
    }
    assert round_times(100.0, None, []) == {
        "published_s": None,
        "first_learned_s": None,
        "median_learned_s": None,
        "all_learned_s": None,
    }


def test_counting_store_counts_reads_bytes_publishes_and_watch_notifications() -> None:
    fake, counts, errors = FakeKeyValueStore(), Counter[str](), list[str]()
    store = CountingStore(fake, counts, threading.Lock(), KEYS.generation, errors.append)
    seen: list[int] = []
    store.watch_prefix(KEYS.ready(""), lambda: seen.append(1))
    store.put(KEYS.ready("a"), b"12345")
    kvs: list[KeyValue] = store.get_prefixes([KEYS.ready("")])
    assert store.compare_and_put(KEYS.generation, 0, b"g") is True
    assert store.compare_and_put(KEYS.generation, 0, b"g") is False  # lost the race
    lease = store.grant_lease(2.0)
    assert store.refresh_lease(lease) > 0
    store.revoke_lease(lease)
    assert seen == [1]
    assert counts == Counter(
        watches=1,
        watch_notifications=1,
        put=1,
        reads=1,
        bytes_read=len(kvs[0].key) + 5,
        publish_attempts=2,
        publish_wins=1,
        grant_lease=1,
        refresh_lease=1,
        revoke_lease=1,
    )
    assert errors == []


@pytest.mark.parametrize(
    ("why", "reported"),
    [
        ("etcd rejected compare_and_put: too many operations in txn request", True),  # a limit: forever
        ("etcd at 127.0.0.1:2379 did not answer compare_and_put after 6 attempts", False),  # load: retried
    ],
)
def test_counting_store_reports_a_refused_publish_and_counts_an_unanswered_one(why: str, reported: bool) -> None:
    class Failing(FakeKeyValueStore):
        def compare_and_put(self, *args: object, **kwargs: object) -> bool:
            raise EtcdUnavailable(why)

    errors: list[str] = []
    counts: Counter[str] = Counter()
    store = CountingStore(Failing(), counts, threading.Lock(), KEYS.generation, errors.append)
    with pytest.raises(EtcdUnavailable):
        store.compare_and_put(KEYS.generation, 0, b"g")
    assert errors == ([f"publish: {why}"] if reported else [])
    assert counts["unanswered"] == (0 if reported else 1) and counts["publish_attempts"] == 1


@pytest.mark.parametrize(
    ("members", "per_node", "per_s"),
    [
        (16384, 8, 2048 / 0.75),  # node relays: one renewal per node per keepalive_s
        (16384, 1, 16384 / 0.75),  # no relay: one per member
        (10, 4, 3 / 0.75),  # a last node of 2
    ],
)
def test_renewals_follow_the_nodes_with_relays_and_the_members_without(
    members: int, per_node: int, per_s: float
) -> None:
    from elasticd.bench.rendezvous_model import renewals_per_s

    assert renewals_per_s(members, per_node, Timeouts()) == pytest.approx(per_s)


def test_idle_etcd_load_is_the_renewals_one_view_read_per_node_and_the_coordinators_read_per_view_poll() -> None:
    from elasticd.bench.rendezvous_model import Costs, Sizes, idle_etcd_cores

    t = Timeouts()
    sizes = Sizes(member_kv=300, ready_kv=200, member_id=20, ready_key=40)
    per_request = Costs(*(0.0 for _ in Costs.__dataclass_fields__))
    per_request = replace(per_request, etcd_per_request_s=1e-3)
    per_byte = replace(per_request, etcd_per_request_s=0.0, etcd_per_byte_s=1e-9)
    relayed = (2048 / t.keepalive_s + (2048 + 1) / t.view_poll_s) * 1e-3
    assert idle_etcd_cores(16384, 8, sizes, per_request, t) == pytest.approx(relayed)
    alone = (16384 / t.keepalive_s + (16384 + 1) / t.view_poll_s) * 1e-3
    assert idle_etcd_cores(16384, 1, sizes, per_request, t) == pytest.approx(alone)
    # the idle coordinator's read: nothing changed, nothing of the job's size sent (store.mirror)
    assert idle_etcd_cores(16384, 8, sizes, per_byte, t) == pytest.approx(1024 / t.view_poll_s * 1e-9)


def _node_read(per_node: int) -> int:
    return 1024 + 256 + per_node * (300 + 200 + 250)


@pytest.mark.parametrize(
    ("n", "per_node", "puts", "reads"),
    [
        # progress puts: one per node (relayed) or per worker per keepalive_s (0.75 s), 1 ms each;
        # reads every 2.5 s: one request per node, each node its own records, one node the whole job
        # (what changed since its last read: every progress record, store.mirror)
        (
            1024,
            8,
            128 / 0.75 * 1e-3,
            (128e-3 + (127 * _node_read(8) + 1024 + 1024 * 250) * 1e-9) / 2.5,
        ),
        (16384, 8, 2048 / 0.75 * 1e-3, (2048e-3 + (2047 * _node_read(8) + 1024 + 16384 * 250) * 1e-9) / 2.5),
        (16, 1, 16 / 0.75 * 1e-3, (16e-3 + (15 * _node_read(1) + 1024 + 16 * 250) * 1e-9) / 2.5),
    ],
)
def test_training_load_is_each_workers_progress_put_and_each_agents_read(
    n: int, per_node: int, puts: float, reads: float
) -> None:
    from elasticd.bench.rendezvous_model import Costs, Sizes, load_walls, training_etcd_cores

    sizes = Sizes(member_kv=300, ready_kv=200, member_id=20, ready_key=40, progress_kv=250)
    costs = replace(Costs(*(0.0 for _ in Costs.__dataclass_fields__)), etcd_per_request_s=1e-3, etcd_per_byte_s=1e-9)
    assert training_etcd_cores(n, per_node, sizes, costs, Timeouts(), 2.5) == pytest.approx((puts, reads))
    walls = load_walls(sizes, costs, Timeouts(), per_node, 2.5)
    for name, which in (("progress_puts_one_core", 0), ("agent_reads_one_core", 1)):
        at = walls[name]
        assert at is not None
        assert training_etcd_cores(at, per_node, sizes, costs, Timeouts(), 2.5)[which] > 1.0
        assert training_etcd_cores(at - 1, per_node, sizes, costs, Timeouts(), 2.5)[which] <= 1.0


@pytest.mark.parametrize(
    ("first_line", "stolen"),
    [
        ("cpu  233277 20933 95246 1213049 924 0 2600 36706 0 0", 36706),
        ("cpu  1 2 3 4 5 6 7 0 0 0", 0),
        ("cpu  1 2 3 4", None),  # an old kernel's line without steal
        ("intr 12 3", None),
    ],
)
def test_host_stolen_s_reads_the_steal_field_of_proc_stat(tmp_path: Path, first_line: str, stolen: int | None) -> None:
    stat = tmp_path / "stat"
    stat.write_text(first_line + "\ncpu0 1 2 3 4 5 6 7 8 0 0\n")
    expected = 0.0 if stolen is None else stolen / os.sysconf("SC_CLK_TCK")
    assert host_stolen_s(str(stat)) == expected
    assert host_stolen_s(str(tmp_path / "none")) == 0.0
