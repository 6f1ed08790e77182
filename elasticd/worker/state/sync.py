"""Rank 0's transfer of the training state to the members that lack it, and the proof that all hold it.

Owns ``sync_state``: after each rendezvous the ranks compare (step, lineage); rank 0 (by
construction a member holding the newest committed step) sends the state to the ranks that lack it
as one JSON layout and one flat byte buffer (``TrainingState.pack``), never as pickled objects, and
then every rank proves it holds identical bytes. Owns the transfer plan (``plan_transfer``:
point-to-point sends or a broadcast, in the whole group or a subgroup) and the links that move the
bytes. Never decides who rank 0 is, never builds groups itself (the caller passes ``subgroup``),
and never changes what the state holds or how it is laid out (``state`` does).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import structlog
import torch
import torch.distributed as dist

from elasticd.errors import CheckpointTransferError, StateCorrupt
from elasticd.retry import Bound
from elasticd.worker.group.collectives import (
    all_reduce,
    start_broadcast,
    start_recv,
    start_send,
    wait,
    wait_each,
)
from elasticd.worker.group.process_group import Group
from elasticd.worker.state.checksum import checksum_key, state_hasher
from elasticd.worker.state.training import TrainingState

log = structlog.get_logger(__name__)

TRANSFER_CHUNKS = 2  # pieces of the state transfer: each is checksummed while the next arrives (4 or 8: no gain here)
# A transfer goes to a subgroup of rank 0 and the ranks that need the state only when that spares
# the others at least this many bytes in all: building the subgroup costs ~15 ms (a gloo group),
# about what moving 16-30 MB more costs on loopback; below it the whole group receives.
SUBGROUP_MIN_SAVED_BYTES = 64 << 20


@dataclass(frozen=True)
class SyncReport:
    transferred_bytes: int
    checksum: int
    step: int
    duration_s: float


SubgroupBuilder = Callable[[Group, Sequence[int], str], Group]
Discard = Callable[[str], None]
Retire = Callable[[Group], None]
_UNSET = -(1 << 62)  # an int64 slot no rank wrote (every real value is larger)


def sync_state(
    group: Group,
    state: TrainingState,
    bound: Bound,
    subgroup: SubgroupBuilder | None = None,
    retire: Retire | None = None,
    own_checksum: int | None = None,
    discard: Discard | None = None,
) -> SyncReport:
    """Make every rank of ``group`` hold rank 0's state, and prove it.

    1. One small all_reduce tells every rank each rank's (step, lineage) (``TrainingState.lineage``)
       and the sizes of rank 0's JSON layout and arena. A rank *needs* the state unless it holds
       rank 0's step from rank 0's lineage (the generation in which both last held the same
       state); a rank without state always needs it.
    2. If some rank needs it, rank 0 sends the layout and its arena in ``TRANSFER_CHUNKS`` pieces,
       all launched at once (the receivers know every size from step 1), only to those ranks where
       it can (``plan_transfer``): by point-to-point sends when they are few, else by a broadcast
       in a subgroup of rank 0 and them (``subgroup``) or in the whole group. A receiver checksums
       each piece while the next one arrives; rank 0, and every rank that receives nothing,
       checksums its own state meanwhile.
    3. One all_reduce tells every rank every rank's checksum. A rank that claimed rank 0's state
       but differs gets the state in one more round (logged as ``state_diverged``); a difference
       after that, or on a rank that just received the state, is ``StateCorrupt``.

    The lineage travels with the bytes: a rank that unpacks rank 0's state takes rank 0's lineage
    at once, and its steps applied and not yet confirmed are ``discard``-ed then if that lineage
    is not theirs (they are a branch the job left; a rank behind on rank 0's lineage keeps them:
    rank 0's state holds them). Once every rank proved it holds the same bytes, every rank's
    lineage is this generation.

    Args:
        bound: bounds every wait of the sync (the transfer's deadline, the generation's abandon
            signal).
        subgroup: builds a group of some of ``group``'s ranks (``GroupFactory.build_subgroup``);
            None: transfers always use the whole group.
        retire: lets go of a subgroup after its transfer (``GroupFactory.retire``).
        discard: told why, when this rank's unconfirmed steps stop being part of its state.
        own_checksum: ``state.checksum()`` of this rank's state as it is now, computed ahead (the
            trainer hashes while it rendezvouses, so rank 0 and the ranks that receive nothing do
            not hash on the transfer's critical path); None: computed here. A stale value cannot
            pass unseen: it differs from what the receivers hash (rank 0) or makes this rank a
            diverged one that is sent the state (any other rank).

    Raises:
        CollectiveError: a collective failed (the caller re-rendezvouses).
        CheckpointTransferError: rank 0 does not hold the newest step (the rendezvous broke its rule).
        StateCorrupt: after the transfer, the ranks' checksums still differ.
        ModelMismatch: rank 0's model does not match this worker's.
    """
    started = time.monotonic()
    me, world = group.rank, group.world_size
    step = state.counters.step
    layout, arena = state.pack() if me == 0 else (b"", None)
    probe = [_UNSET] * (2 + 2 * world)
    if arena is not None:
        probe[0], probe[1] = len(layout), arena.numel()
    probe[2 + 2 * me], probe[3 + 2 * me] = step, state.lineage
    got = _max_reduce(probe, group, bound)
    n_layout, n_arena = got[0], got[1]
    steps, lineages = got[2 : 2 + 2 * world : 2], got[3 : 2 + 2 * world : 2]
    newest = max(range(world), key=lambda r: steps[r])
    if steps[newest] != steps[0]:
        raise CheckpointTransferError(f"rank 0 holds step {steps[0]} but rank {newest} holds {steps[newest]}")
    needy = [r for r in range(1, world) if lineages[r] < 0 or (steps[r], lineages[r]) != (steps[0], lineages[0])]
    transferred = 0
    mine: int | None = None
    for attempt in range(2):
        if needy:
            mine, moved = _transfer(
                group,
                state,
                layout,
                arena,
                needy,
                n_layout,
                n_arena,
                attempt,
                bound,
                subgroup,
                retire,
                own_checksum if attempt == 0 else None,
                lambda: _adopt_lineage(state, lineages[0], discard),
            )
            transferred += moved
        if mine is None:
            mine = own_checksum if attempt == 0 and own_checksum is not None else state.checksum()
        sums = [_UNSET] * world
        sums[me] = mine
        sums = _max_reduce(sums, group, bound)
        diverged = [r for r in range(1, world) if sums[r] != sums[0]]
        if not diverged:
            break
        if attempt == 0 and not set(diverged) & set(needy):
            log.warning("state_diverged", generation=group.generation, rank=me, step=step, ranks=diverged)
            needy, mine = diverged, (mine if me not in diverged else None)
            continue
        raise StateCorrupt(
            f"state checksums differ across ranks after sync in generation {group.generation}: "
            f"ranks {diverged} differ from rank 0"
        )
    assert mine is not None
    state.lineage = group.generation
    report = SyncReport(transferred, mine, state.counters.step, time.monotonic() - started)
    log.info(
        "state_synced",
        generation=group.generation,
        rank=me,
        step=report.step,
        transferred_bytes=transferred,
        receivers=len(needy),
        checksum=f"{mine:016x}",
        duration_s=round(report.duration_s, 4),
    )
    return report


def _adopt_lineage(state: TrainingState, lineage: int, discard: Discard | None) -> None:
    """This rank's state was just replaced by rank 0's, of ``lineage``."""
    if state.lineage != lineage and discard is not None:
        discard("this member's state was replaced by rank 0's, of another lineage: a branch the job left")
    state.lineage = lineage


def _max_reduce(values: list[int], group: Group, bound: Bound) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64, device=group.device)
    all_reduce(t, group, dist.ReduceOp.MAX, bound)
    return [int(x) for x in t.tolist()]


def transfer_members(world_size: int, needy: Sequence[int], nbytes: int, can_subgroup: bool) -> list[int]:
    """The ranks that take part in broadcasting ``nbytes`` of state from rank 0 to the ``needy``
    ranks: rank 0 and them, or the whole group when a subgroup would spare the others less than
    ``SUBGROUP_MIN_SAVED_BYTES`` (or cannot be built). Ranks that hold the state already and
    receive it anyway overwrite it with the same bytes, which the checksum round then proves."""
    members = [0, *sorted(set(needy) - {0})]
    skipped = world_size - len(members)
    if not can_subgroup or skipped <= 0 or nbytes * skipped < SUBGROUP_MIN_SAVED_BYTES:
        return list(range(world_size))
    return members


class TransferMode(StrEnum):
    P2P = "p2p"  # rank 0 sends to each receiver
    BROADCAST = "broadcast"  # a broadcast among the members


@dataclass(frozen=True)
class TransferPlan:
    """How the state moves, and among whom (rank 0 first)."""

    mode: TransferMode
    members: list[int]


def plan_transfer(world_size: int, needy: Sequence[int], nbytes: int, backend: str, can_subgroup: bool) -> TransferPlan:
    """Point-to-point sends from rank 0 when at most ``ceil(log2(world_size))`` ranks need the
    state, on gloo; else a broadcast (``transfer_members``).

    gloo's broadcast is a binomial tree that sends the whole buffer at each of its
    ``ceil(log2(world_size))`` hops, to every rank, also to those that hold the state already; k
    sends from rank 0 cost about k buffers on rank 0's link, and no one else's, and need no subgroup
    (a gloo group build, ~15 ms). NCCL keeps the broadcast: its broadcast is pipelined, and its
    point-to-point calls build communicators of their own on first use.
    """
    receivers = sorted(set(needy) - {0})
    if backend == "gloo" and receivers and len(receivers) <= max(1, math.ceil(math.log2(world_size))):
        return TransferPlan(TransferMode.P2P, [0, *receivers])
    return TransferPlan(TransferMode.BROADCAST, transfer_members(world_size, needy, nbytes, can_subgroup))


class _Link(Protocol):
    """Moves tensors from rank 0 to the other members of a transfer, in order."""

    def move(self, tensors: Sequence[torch.Tensor]) -> Iterator[int]:
        """Launch the moves of ``tensors`` now (rank 0's are sent, the others' are filled); the
        returned iterator yields each index, in order, once that tensor has arrived (on rank 0:
        has left), within the bounds of ``collectives.wait``.

        Raises:
            CollectiveError: a move could not start (while iterating: see ``collectives.wait``).
        """
        ...


class _BroadcastLink:
    def __init__(self, group: Group, bound: Bound) -> None:
        self.group, self._bound = group, bound

    def move(self, tensors: Sequence[torch.Tensor]) -> Iterator[int]:
        works = [start_broadcast(t, 0, self.group) for t in tensors]
        return self._arrivals(works)

    def _arrivals(self, works: list[dist.Work]) -> Iterator[int]:
        for i, work in enumerate(works):
            wait(work, self.group, self._bound, "state broadcast")
            yield i


class _PointToPointLink:
    """Rank 0 sends each tensor to every receiver; a receiver receives each from rank 0. Tags count
    the tensors moved over this link, from ``tag_base``: both sides make the same calls."""

    def __init__(self, group: Group, receivers: Sequence[int], tag_base: int, bound: Bound) -> None:
        self.group, self._receivers, self._tag, self._bound = group, list(receivers), tag_base, bound

    def move(self, tensors: Sequence[torch.Tensor]) -> Iterator[int]:
        g, first = self.group, self._tag
        self._tag += len(tensors)
        if g.rank == 0:
            works = [start_send(t, r, g, first + i) for i, t in enumerate(tensors) for r in self._receivers]
            per = len(self._receivers)
        else:
            works = [start_recv(t, 0, g, first + i) for i, t in enumerate(tensors)]
            per = 1
        return self._arrivals(works, per)

    def _arrivals(self, works: list[dist.Work], per: int) -> Iterator[int]:
        for j in wait_each(works, self.group, self._bound, "state transfer"):
            if (j + 1) % per == 0:
                yield j // per


def _transfer(
    group: Group,
    state: TrainingState,
    layout: bytes,
    arena: torch.Tensor | None,
    needy: Sequence[int],
    n_layout: int,
    n_arena: int,
    attempt: int,
    bound: Bound,
    subgroup: SubgroupBuilder | None,
    retire: Retire | None,
    own_checksum: int | None,
    replaced: Callable[[], None],
) -> tuple[int | None, int]:
    """Rank 0's layout and arena to the ``needy`` ranks (``plan_transfer``). Returns this rank's
    checksum if it took part (None if not: it computes its own), and the bytes moved (0 if it did
    not take part). ``own_checksum``: rank 0's, if known (see ``sync_state``)."""
    me, dev = group.rank, group.device
    plan = plan_transfer(group.world_size, needy, n_layout + n_arena, group.backend, subgroup is not None)
    if me not in plan.members:
        return None, 0
    sub = group
    if plan.mode is TransferMode.BROADCAST and len(plan.members) < group.world_size and subgroup is not None:
        sub = subgroup(group, plan.members, f"sync{attempt}")
    link: _Link = (
        _PointToPointLink(group, plan.members[1:], attempt << 8, bound)
        if plan.mode is TransferMode.P2P
        else _BroadcastLink(sub, bound)
    )
    try:
        if me == 0:
            assert arena is not None
            payload = arena.to(dev)  # no copy on CPU: the arena itself goes out
        else:
            payload = torch.empty(n_arena, dtype=torch.uint8, device=dev)
        receives = me != 0
        layout_t = (
            torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(dev)
            if me == 0
            else torch.empty(n_layout, dtype=torch.uint8, device=dev)
        )
        bounds = [n_arena * i // TRANSFER_CHUNKS for i in range(TRANSFER_CHUNKS + 1)]
        spans = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        arrivals = link.move([layout_t, *(payload[a:b] for a, b in spans)])
        mine: int | None = None
        if me == 0:
            mine = own_checksum if own_checksum is not None else state.checksum()  # while the arena goes out
        layout_bytes, total, hasher = layout, 0, None
        for i in arrivals:
            if i == 0 and receives:  # the layout comes first: it says which bytes are the state
                layout_bytes = bytes(layout_t.cpu().numpy())
                try:
                    meta = json.loads(layout_bytes)
                    if not isinstance(meta, dict):
                        raise TypeError("the layout is not a JSON object")
                    total, key = int(meta["total"]), checksum_key(meta)
                except (ValueError, KeyError, TypeError, RecursionError) as exc:
                    raise StateCorrupt(f"state layout from rank 0 is malformed: {exc}") from exc
                if not 0 <= total <= n_arena:
                    raise StateCorrupt(f"state layout total {total} does not fit {n_arena} bytes")
                hasher = state_hasher(key)
            elif receives and hasher is not None and dev.type == "cpu":
                a, b = spans[i - 1]
                if a < total:  # the state bytes of this piece, while the next one arrives
                    hasher.update(payload[a : min(b, total)].numpy().data)
        if receives:
            state.unpack(layout_bytes, payload.cpu())
            replaced()
            streamed = state.streamed_checksum(hasher) if hasher is not None and dev.type == "cpu" else None
            mine = streamed if streamed is not None else state.checksum()
        return mine, n_layout + n_arena
    finally:
        if sub is not group and retire is not None:
            retire(sub)
