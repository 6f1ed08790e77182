"""A leave without a ready round (``survivors_generation``, pure).

When members of the current generation lost their lease (a crashed worker its agent revoked, a
member that closed, a lease that ran out) and nothing else is wrong with it, the coordinator
publishes the next generation of the survivors at once: the live members of the broken generation
in their old rank order, then warm spares up to the job's full size, as ``choose_members`` takes
them. The survivors do not each write a ``ready`` record and wait for it to be read (at 1,000
members that round of puts took ~2 s of the members' own CPU on this machine); each learns the new
generation from the one key it watches and joins it (``Membership.join`` looks before it writes).

What the ready round told the coordinator, and why it is not needed here:

- *which step each member holds*, so that rank 0 holds the newest: the survivors keep their old
  order, so the new rank 0 is the first survivor, and it held the state when the broken generation
  was published if its old rank was below that generation's ``holders`` (its first ranks held the
  newest step then: ``rank_order`` puts it first). Any member that committed a step since holds
  the same one unless a step split (a refusal after the sum); the sync then finds rank 0 behind
  (``CheckpointTransferError``), the generation is aborted, and the next one goes through the
  ready round, whose rank order is built from the steps the members report.
- *that each member is alive*: their leases say so; one that is alive but stopped holds the new
  generation's build until its agent revokes its lease (``stopped_worker_s``) or the lease ends,
  where a ready round would have left it out after ``last_call_s``; a host gone from the network
  breaks the generation as any member's loss does.

Not taken when: the generation was not broken by a lost lease alone (an abort with every member
alive, a verdict); a survivor already wrote its ready record with less than the generation's
starting step (it never synced it); the first survivor was not among the holders; fewer than
``min_workers`` survive; or the job finished. Newcomers that wait are not taken here (their join
window decides when they come in): they are announced to the new generation as usual, and come in
at its next step boundary.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from elasticd.config import WorldConfig
from elasticd.rendezvous.decide import candidates_of, carried_full_size, choose_members, is_spare, replica_of
from elasticd.wire.records import GenerationRecord, ReadyRecord
from elasticd.wire.snapshot import Snapshot

REASON = "member_lost"  # the published generation's reason, as the ready round gives it


def survivors_generation(snap: Snapshot, world: WorldConfig) -> GenerationRecord | None:
    """The generation of ``snap``'s current generation's survivors, to publish now without a ready
    round, or None when the ready round must decide (module docstring). The record has no
    ``token`` (the publisher draws it). Pure."""
    g = snap.generation
    if g is None or not g.members or "" in g.members:
        return None
    if snap.finished is not None and snap.finished.generation >= g.generation:
        return None
    # old ranks, one pass; a replica that lost a member leaves whole (its agent ends the others)
    alive = Counter(replica_of(snap, m)[0] for m in g.members if m in snap.members)
    ranked = [
        (rank, m)
        for rank, m in enumerate(g.members)
        if m in snap.members and alive[replica_of(snap, m)[0]] == replica_of(snap, m)[2]
    ]
    survivors = [m for _, m in ranked]
    if len(survivors) == len(g.members) or len(survivors) < world.min_workers:
        return None
    if ranked[0][0] >= g.holders:
        return None  # the first survivor may not hold the newest step: the steps must be asked
    # A survivor that came to the rendezvous says what it holds; one below the step the generation
    # began from never synced it (the generation may never have been built).
    stand_ins: list[ReadyRecord] = []
    for rank, m in ranked:
        came = snap.ready.get(m)
        if came is not None and came.prev_generation == g.generation and came.signature == g.signature:
            if came.committed_step < g.committed_step:
                return None
            stand_ins.append(replace(came, committed_step=g.committed_step))
        else:
            stand_ins.append(ReadyRecord(m, g.committed_step, g.generation, rank, g.signature))
    spares = [r for r in candidates_of(snap) if is_spare(snap, r.member_id)]
    chosen = choose_members(snap, stand_ins + spares, world)
    if [r.member_id for r in chosen[: len(survivors)]] != survivors:
        return None  # a spare holding a newer step would be ranked first: leave it to the ready round
    rank0 = snap.members[chosen[0].member_id]
    return GenerationRecord(
        generation=snap.highest_generation_seen + 1,
        members=tuple(r.member_id for r in chosen),
        store_host=rank0.host,
        store_port=rank0.store_port,
        signature=g.signature,
        committed_step=g.committed_step,
        reason=REASON,
        full_size=carried_full_size(g, len(chosen), world),
        holders=sum(1 for rank, _ in ranked if rank < g.holders),
    )
