"""How a generation's member list is stored so that no member reads all of it. Pure.

A generation of at most ``ROSTER_INLINE`` members lists them in its ``generation`` record, as it
always did. A larger one keeps the record small (its members list empty, ``world_size`` given) and
puts the ranks in ``roster/<generation>/<bucket>`` records, one per bucket of nodes (``bucket_of``:
a hash of the node id, so every worker of a node is in its node's bucket): a member reads the
pointer and its own bucket, about ``ROSTER_BUCKET`` members (at most ``ROSTER_BUCKETS_MAX``
buckets, so that the publish stays one transaction under etcd's default ``--max-txn-ops`` of 128:
the pointer, the buckets, one range delete of older rosters, the event). Full readers (the
coordinator, ``elasticctl status``, the agents) read them all and get the whole list back.

A record a member assembled from its own bucket is *sparse*: its ``members`` has ``""`` at the
ranks it did not read (``is_sparse``); ``world_size``, ``rank_of`` and ``in`` for its own node's
members work as on a whole one.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Iterable
from dataclasses import replace

from elasticd.wire.records import GenerationRecord, as_dict

ROSTER_INLINE = 64  # members a generation record lists itself (a few kB at most)
ROSTER_BUCKET = 64  # members per roster bucket, on average, beyond it
ROSTER_BUCKETS_MAX = 100  # roster keys at most (the publish: pointer + buckets + delete + event <= 128 ops)


def buckets_for(world_size: int) -> int:
    """The number of roster buckets of a generation of ``world_size`` (0: it lists its members)."""
    if world_size <= ROSTER_INLINE:
        return 0
    return min(ROSTER_BUCKETS_MAX, math.ceil(world_size / ROSTER_BUCKET))


def bucket_of(node: str, buckets: int) -> int:
    """The bucket of a node's members (stable across processes: crc32, not ``hash``)."""
    return zlib.crc32(node.encode()) % buckets


def is_sparse(record: GenerationRecord) -> bool:
    return "" in record.members


def encode_generation(record: GenerationRecord, node_of: Callable[[str], str]) -> tuple[bytes, dict[int, bytes]]:
    """The ``generation`` record's bytes and, for a large generation, each bucket's (by number)."""
    n = buckets_for(record.world_size)
    if n == 0:
        return json.dumps(as_dict(record), sort_keys=True).encode(), {}
    ranks: dict[int, dict[str, int]] = {b: {} for b in range(n)}
    for rank, member in enumerate(record.members):
        ranks[bucket_of(node_of(member), n)][member] = rank
    pointer = as_dict(replace(record, members=())) | {"world_size": record.world_size}
    return (
        json.dumps(pointer, sort_keys=True).encode(),
        {b: json.dumps({"ranks": r}, sort_keys=True).encode() for b, r in ranks.items()},
    )


def fill(record: GenerationRecord, buckets: Iterable[bytes]) -> GenerationRecord:
    """``record`` with the ranks of ``buckets`` (roster records) filled in.

    Raises:
        ValueError, TypeError, UnicodeDecodeError, RecursionError: a bucket is not a roster record,
            names a rank outside the generation or one already taken.
    """
    members = list(record.members)
    for raw in buckets:
        data = json.loads(raw)
        if not isinstance(data, dict) or set(data) != {"ranks"} or not isinstance(data["ranks"], dict):
            raise ValueError('a roster record is {"ranks": {member: rank}}')
        for member, rank in data["ranks"].items():
            if (
                not isinstance(rank, int)
                or isinstance(rank, bool)
                or not 0 <= rank < len(members)
                or members[rank] not in ("", member)
                or not member
            ):
                raise ValueError(f"roster rank {rank!r} of {member!r} is out of range or taken")
            members[rank] = member
    return replace(record, members=tuple(members))
