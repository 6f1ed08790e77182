"""The job digest (``wire.digest``) and the agents' reads of a job (``agent.jobview.JobReader``): one
agent, the coordinator's node's, reads the whole job and writes the digest; every other agent reads
its own node's records and the digest, and scores its workers as a whole read would."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import pytest

from elasticd.agent.jobview import JobReader, digest_of, node_prefixes, read_job_view
from elasticd.wire.snapshot import DecodedRecords
from elasticd.store.kv import KeyValue, RangeQuery, RangeResult
from elasticd.wire.digest import JobDigest, decode_digest, encode_digest, middle_of, score
from elasticd.wire.keys import Keys
from elasticd.wire.progress import ProgressRecord, encode_progress
from elasticd.wire.records import CoordinatorRecord, GenerationRecord, MemberRecord, ReadyRecord, encode
from elasticd.wire.roster import encode_generation
from elasticd.wire.stragglers import straggler_scores
from tests.fakes import FakeKeyValueStore

KEYS = Keys("/elasticd", "j")


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 7, 16, 33, 100])
def test_a_score_from_the_digest_is_the_score_of_a_whole_read(n: int) -> None:
    rng = random.Random(n)
    compute = {f"m{i}": rng.choice([0.2, 0.2, 0.3, round(rng.uniform(0.05, 2.0), 3)]) for i in range(n)}
    count, start, middle = middle_of(compute)
    d = JobDigest(1, count, start, middle)
    whole = straggler_scores(compute)
    assert {m: score(t, d) for m, t in compute.items()} == pytest.approx(whole)


@pytest.mark.parametrize(
    ("compute", "expected"),
    [
        ({}, (0, 0, ())),
        ({"a": 0.5}, (1, 0, (0.5,))),
        ({"a": 0.5, "b": 0.1}, (2, 0, (0.1, 0.5))),
        ({f"m{i}": float(i) for i in range(10)}, (10, 3, (3.0, 4.0, 5.0, 6.0))),
        ({f"m{i}": float(i) for i in range(11)}, (11, 3, (3.0, 4.0, 5.0, 6.0))),
    ],
)
def test_the_digest_keeps_the_four_times_around_the_median(
    compute: dict[str, float], expected: tuple[int, int, tuple[float, ...]]
) -> None:
    assert middle_of(compute) == expected


def test_no_score_below_two_members_or_at_a_median_of_zero() -> None:
    assert score(1.0, JobDigest(1, 1, 0, (1.0,))) is None
    assert score(1.0, JobDigest(1, 2, 0, (0.0, 1.0))) is None


def test_a_digest_round_trips_and_anything_else_is_refused() -> None:
    d = JobDigest(7, 10, 3, (0.1, 0.2, 0.2, 0.3), 0.25, {"n1": 2})
    assert decode_digest(encode_digest(d)) == d
    for bad in (
        b"[]",
        b'{"generation": -1, "computed": 0, "start": 0, "middle": [], "rank0_step_time_s": null, "spares": {}}',
        b'{"generation": 1, "computed": 2, "start": 0, "middle": [0.3, 0.1], "rank0_step_time_s": null, "spares": {}}',
        b'{"generation": 1, "computed": 1, "start": 0, "middle": [0.1, 0.2], "rank0_step_time_s": null, "spares": {}}',
        b'{"generation": 1, "computed": 0, "start": 0, "middle": [], "rank0_step_time_s": "x", "spares": {}}',
        b'{"generation": 1, "computed": 0, "start": 0, "middle": [], "rank0_step_time_s": null, "spares": []}',
    ):
        with pytest.raises((ValueError, TypeError)):
            decode_digest(bad)


def _kv(key: str, value: bytes, revision: int = 2) -> KeyValue:
    return KeyValue(key, value, revision, revision, 0)


def _progress(member: str, compute_s: float, rank: int) -> KeyValue:
    p = ProgressRecord(10, 3, rank, step_time_s=0.4 + rank, compute_s=compute_s, time=1.0)
    return _kv(KEYS.progress(member), encode_progress(p))


def _job(nodes: int, per_node: int, slow: str) -> tuple[list[KeyValue], list[str]]:
    """A generation of ``nodes`` x ``per_node`` members (``slow`` at 3x the others' compute time), a
    warm spare waiting on node ``spare``, as the rows of a whole read."""
    members = [f"n{i}.{j}.{100 + j}" for i in range(nodes) for j in range(per_node)]
    rows = []
    for rank, m in enumerate(members):
        node = m.split(".")[0]
        rows.append(_kv(KEYS.member(m), encode(MemberRecord(m, node, 0, 100, "h", 1, "s"))))
        rows.append(_progress(m, 0.9 if m == slow else 0.3 + 0.001 * rank, rank))
    spare = "spare.0.9"
    rows.append(_kv(KEYS.member(spare), encode(MemberRecord(spare, "spare", 0, 9, "h", 1, "s", spare=1))))
    rows.append(_kv(KEYS.ready(spare), encode(ReadyRecord(spare, 0, 0, 0, "s")), revision=5))  # after the generation
    g = GenerationRecord(3, tuple(members), "h", 1, "s", 10, "r")
    pointer, buckets = encode_generation(g, lambda m: m.split(".")[0])
    rows.append(_kv(KEYS.generation, pointer))
    rows += [_kv(KEYS.roster(3, b), raw) for b, raw in buckets.items()]
    return rows, members


def test_a_node_read_with_the_digest_scores_its_workers_as_the_whole_read_does() -> None:
    rows, members = _job(nodes=20, per_node=4, slow="n7.2.102")  # 80 members: a sparse generation
    whole = read_job_view(KEYS, rows, 1.0)
    d = digest_of(whole)
    assert d.spares == {"spare": 1} and d.rank0_step_time_s == pytest.approx(0.4)
    mine = [kv for kv in rows if any(kv.key.startswith(p) for p in node_prefixes(KEYS, "n7"))]
    bucket = [kv.value for kv in rows if kv.key.startswith(KEYS.roster_prefix) and b'"n7.' in kv.value]
    node = read_job_view(KEYS, mine, 1.0, full=False, digest=d, roster=bucket)
    assert node.world_size == 80 and {m for m in members if m.startswith("n7.")} <= node.in_generation
    assert set(node.scores) == {m for m in members if m.startswith("n7.")}
    assert node.scores == pytest.approx({m: whole.scores[m] for m in node.scores})
    assert node.scores["n7.2.102"] > 2.5
    assert node.spares_waiting(other_than="n7") == whole.spares_waiting(other_than="n7") == 1
    assert node.spares_waiting(other_than="spare") == 0
    assert node.rank0_step_time_s == whole.rank0_step_time_s
    stale = read_job_view(KEYS, mine, 1.0, full=False, digest=JobDigest(2, *middle_of(whole.compute)), roster=bucket)
    assert stale.scores == {} and stale.spares_waiting("n7") == 0 and stale.rank0_step_time_s is None


def test_a_whole_read_with_the_records_held_decoded_is_the_same_view() -> None:
    rows, _ = _job(nodes=20, per_node=4, slow="n7.2.102")
    decoded = DecodedRecords()
    first = read_job_view(KEYS, rows, 1.0, decoded=decoded)
    count = decoded.decoded
    again = read_job_view(KEYS, rows, 1.0, decoded=decoded)
    assert first == again == read_job_view(KEYS, rows, 1.0)
    assert count >= 81 and decoded.decoded == count  # the second read decoded nothing


class _Reads:
    """One agent's store: the shared one, its reads recorded."""

    def __init__(self, inner: FakeKeyValueStore) -> None:
        self.inner = inner
        self.read: list[tuple[str, ...]] = []

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        self.read.append(tuple(prefixes))
        return self.inner.get_prefixes(prefixes)

    def read_ranges(self, queries: Sequence[RangeQuery]) -> tuple[int, list[RangeResult]]:
        self.read.append(tuple(q.prefix for q in queries))
        return self.inner.read_ranges(queries)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)


def test_one_agent_reads_the_whole_job_and_writes_the_digest_the_others_read_their_node() -> None:
    store = FakeKeyValueStore()
    rows, _ = _job(nodes=20, per_node=4, slow="n7.2.102")
    for kv in rows:
        store.put(kv.key, kv.value)
    store.put(KEYS.coordinator, encode(CoordinatorRecord("n0.0.100", "n0")))
    on_n0, on_n7 = _Reads(store), _Reads(store)
    writer = JobReader(on_n0, KEYS, time.monotonic, 0.05, node="n0")  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 5
        while store.get(KEYS.digest) is None:
            assert time.monotonic() < deadline, "no digest written"
            time.sleep(0.01)
        reader = JobReader(on_n7, KEYS, time.monotonic, 0.05, node="n7")  # type: ignore[arg-type]
        try:
            while (v := reader.latest()) is None or not v.scores:
                assert time.monotonic() < deadline, "no scores on node n7"
                time.sleep(0.01)
            assert not v.full and v.scores["n7.2.102"] > 2.5
            w = writer.latest()
            assert w is not None and w.full
        finally:
            reader.stop()
    finally:
        writer.stop()
    assert on_n7.read and all(p == node_prefixes(KEYS, "n7") for p in on_n7.read)
    assert any(KEYS.progress("") in p for p in on_n0.read)  # the whole job's progress
