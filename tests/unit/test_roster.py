"""``wire.roster``: a large generation's member list in buckets by node; what a full reader and a
member each get back (pure, and through the parsing of a snapshot)."""

from __future__ import annotations

import json

import pytest

from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import GenerationRecord, decode_generation
from elasticd.wire.roster import (
    ROSTER_BUCKETS_MAX,
    ROSTER_INLINE,
    bucket_of,
    buckets_for,
    encode_generation,
    fill,
    is_sparse,
)
from elasticd.wire.snapshot import parse_snapshot

pytestmark = pytest.mark.timeout(30)
KEYS = Keys("/elasticd", "j")


def _gen(n: int, per_node: int = 8) -> GenerationRecord:
    members = tuple(f"node{i // per_node:05d}.{i % per_node}.{1000 + i}" for i in range(n))
    return GenerationRecord(7, members, "10.0.0.1", 29500, "sig", 41, "join")


def _node(member: str) -> str:
    return member.split(".")[0]


@pytest.mark.parametrize(
    ("n", "buckets"),
    [
        (1, 0),
        (ROSTER_INLINE, 0),
        (ROSTER_INLINE + 1, 2),
        (1000, 16),
        (4000, 63),
        (16000, ROSTER_BUCKETS_MAX),
        (10**6, ROSTER_BUCKETS_MAX),
    ],
)
def test_buckets_grow_with_the_world_up_to_a_bound(n: int, buckets: int) -> None:
    assert buckets_for(n) == buckets


def test_a_small_generation_is_stored_as_it_always_was() -> None:
    g = _gen(ROSTER_INLINE)
    pointer, buckets = encode_generation(g, _node)
    assert buckets == {} and decode_generation(pointer) == g


@pytest.mark.parametrize("n", [ROSTER_INLINE + 1, 1000, 16000])
def test_a_large_generation_round_trips_and_a_member_reads_only_its_nodes_bucket(n: int) -> None:
    g = _gen(n)
    pointer, buckets = encode_generation(g, _node)
    assert len(pointer) < 400  # the pointer every member reads stays small at any N
    assert len(buckets) == buckets_for(n) and 1 + len(buckets) + 2 <= 128  # one publish txn, stock etcd
    sparse = decode_generation(pointer)
    assert is_sparse(sparse) and sparse.world_size == n and set(sparse.members) == {""}
    assert fill(sparse, buckets.values()) == g  # a full reader gets it all back
    me = g.members[n // 2]
    mine = fill(sparse, [buckets[bucket_of(_node(me), len(buckets))]])
    assert mine.rank_of(me) == n // 2 and mine.world_size == n
    assert all(m in mine.members for m in g.members if _node(m) == _node(me))  # the whole node
    assert sum(1 for m in mine.members if m) < max(2 * n / len(buckets), 64)  # a bucket, not the job


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ({"ranks": {"a": 5000}}, "out of range"),
        ({"ranks": {"a": 0, "b": 0}}, "taken"),
        ({"ranks": {"a": True}}, "out of range"),
        ({"ranks": []}, "ranks"),
        ({"other": 1}, "ranks"),
        ([], "ranks"),
        ({"ranks": {"": 1}}, "out of range"),
    ],
)
def test_a_bad_bucket_is_refused(bad: object, why: str) -> None:
    sparse = decode_generation(encode_generation(_gen(100), _node)[0])
    with pytest.raises(ValueError, match=why):
        fill(sparse, [json.dumps(bad).encode()])


@pytest.mark.parametrize("world", [0, -1, True, "100", 10**8])
def test_a_bad_pointer_is_refused(world: object) -> None:
    data = json.loads(encode_generation(_gen(100), _node)[0]) | {"world_size": world}
    with pytest.raises(ValueError):
        decode_generation(json.dumps(data).encode())


def _kvs(g: GenerationRecord, drop: int | None = None) -> list[KeyValue]:
    pointer, buckets = encode_generation(g, _node)
    rows = [KeyValue(KEYS.generation, pointer, 50, 50)]
    rows += [KeyValue(KEYS.roster(g.generation, b), v, 50, 50) for b, v in buckets.items() if b != drop]
    rows += [KeyValue(KEYS.roster(g.generation - 1, 0), b'{"ranks": {"old": 0}}', 40, 40)]  # older: ignored
    return rows


def test_a_full_snapshot_assembles_the_roster_and_reports_a_missing_bucket() -> None:
    g = _gen(300)
    snap = parse_snapshot(KEYS, _kvs(g))
    assert snap.generation == g and not snap.malformed
    broken = parse_snapshot(KEYS, _kvs(g, drop=0))
    assert broken.generation is not None and is_sparse(broken.generation)
    assert any("ranks missing" in m for m in broken.malformed)


def test_roster_keys_sort_by_generation_and_parse_back() -> None:
    start, end = KEYS.rosters_before(10)
    assert start <= KEYS.roster(9, 99) < end <= KEYS.roster(10, 0) < KEYS.roster(11, 0)
    assert KEYS.roster_of(KEYS.roster(12, 3)) == (12, 3)
    with pytest.raises(ValueError):
        KEYS.roster_of(KEYS.generation)
