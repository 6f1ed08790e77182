"""``elasticctl drain``: ask a node's agent, through etcd, to drain; and tell when its members left.

Owns writing ``drain/<node>`` (``oprecords.DrainRecord``: who asked, when) and the pure test of
whether a node's members have left the current generation. The request goes only to a node that
has a live agent (a ``nodes/<node>`` record), and under that agent's lease, so a request can never
outlive the agent it was meant for. The agent (``presence.NodePresence``) sees the key within
``keepalive_s``, drains exactly as on SIGTERM, and deletes the key before it exits 0.

Never imports etcd3 or torch (the caller wires the store).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from elasticd.errors import LeaseLost
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.ops import DrainRecord, encode_drain
from elasticd.wire.snapshot import parse_snapshot

# How often ``elasticctl drain --wait`` looks at the generation again.
DRAIN_POLL_S = 0.25
# ``elasticctl drain --wait`` gives up after this many seconds unless --timeout says otherwise.
DEFAULT_DRAIN_WAIT_S = 120.0


class DrainStore(Protocol):
    """What a drain request needs from etcd (``etcd.EtcdClient`` satisfies it)."""

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    def put(self, key: str, value: bytes, lease: int = 0) -> int: ...


@dataclass(frozen=True)
class DrainRequest:
    """The outcome of asking for a drain."""

    accepted: bool
    message: str  # what to tell the operator
    members: tuple[str, ...] = ()  # the node's live members when it was asked


def _node_members(keys: Keys, rows: Iterable[KeyValue], node: str) -> set[str]:
    snap = parse_snapshot(keys, rows)
    return {mid for mid, rec in snap.members.items() if rec.node == node}


def request_drain(store: DrainStore, keys: Keys, node: str, requested_by: str, now: float) -> DrainRequest:
    """Write ``drain/<node>`` under the lease of that node's agent record.

    Args:
        now: the wall clock (``time.time()``), recorded in the request.

    Returns:
        Not accepted (and nothing written) when no agent record of ``node`` exists.

    Raises:
        EtcdUnavailable: etcd could not be reached within the store's retry bound.
    """
    rows = store.get_prefix(keys.prefix)
    record = next((kv for kv in rows if kv.key == keys.node(node)), None)
    if record is None:
        known = sorted(kv.key[len(keys.node("")) :] for kv in rows if kv.key.startswith(keys.node("")))
        where = f"known nodes: {', '.join(known)}" if known else "no node agent is registered in this job"
        return DrainRequest(
            False,
            f"unknown node {node!r} in job {keys.job.rpartition('/')[2]!r}: "
            f"no agent record at {keys.node(node)} ({where})",
        )
    value = encode_drain(DrainRecord(node=node, requested_by=requested_by, time=now))
    try:
        store.put(keys.drain(node), value, lease=record.lease)
    except LeaseLost:
        return DrainRequest(
            False, f"the agent of node {node!r} went away (its lease ended) while the drain was being requested"
        )
    members = tuple(sorted(_node_members(keys, rows, node)))
    return DrainRequest(True, f"drain of node {node!r} requested ({len(members)} live member(s) there)", members)


def drain_progress(keys: Keys, rows: Iterable[KeyValue], node: str, tracked: set[str]) -> tuple[bool, str]:
    """Whether ``node``'s members have left the current generation, and why (pure).

    ``tracked`` holds the node's member ids seen so far (updated here): a member that is already gone
    but still listed in the generation counts as the node's, and so does an id of the form
    ``<node>.<local_rank>.<pid>`` (how member ids are made) never seen alive.
    """
    rows = list(rows)
    snap = parse_snapshot(keys, rows)
    tracked |= {mid for mid, rec in snap.members.items() if rec.node == node}
    own = re.compile(re.escape(node) + r"\.\d+\.\d+(\.\d+)?")
    g = snap.generation
    if snap.finished is not None and (g is None or snap.finished.generation >= g.generation):
        return True, f"the job finished at step {snap.finished.step}"
    if g is None:
        return False, "no generation yet"
    inside = [m for m in g.members if m in tracked or own.fullmatch(m)]
    if inside:
        return False, f"generation {g.generation} still has {', '.join(inside)}"
    return True, f"generation {g.generation} (world size {g.world_size}) has no member of node {node!r}"
