"""The commit rule: whether a step whose gradient all_reduce completed is applied. Pure.

Owns ``Vote`` (what each member puts in the vote slots of its last gradient bucket), ``Tally`` (the
slots summed by the all_reduce, so every member reads the same numbers), ``Fence`` (what this member
knows locally once the sum arrived) and ``commit_outcome``, which turns them into a ``Verdict``.
Imports nothing but the standard library: no torch, no etcd, no clock (``now`` is passed in).

Why the fence is part of the vote. A member used to check its own lease *after* the all_reduce and
refuse to commit alone when the lease looked stale: after an etcd restart one member's renewal
failed while the others' succeeded, so the others committed a step that it did not (a split
commit), and the step was done again in the next generation. Now each member votes whether it may
commit *before* the sum, and every member decides from the same sum:

* a veto (the generation was superseded or aborted, or this member's lease is gone) aborts the
  step everywhere: nothing is applied, the members re-rendezvous;
* a stale lease while etcd answers a member whose own lease is fresh (so that member could see the
  stale one expire and give up on it) retries the same step in the same group, nothing applied,
  until the renewal lands or the lease expires and the generation is abandoned (bounded by the
  lease TTL);
* a stale lease while etcd answers no member with a fresh lease is no reason to stop: either no
  member can read etcd (an outage), or every renewal fails alike, which is an etcd without a leader
  (a leader election: no lease can expire while there is no leader, and the new leader extends
  every lease by its TTL when it takes over), so none can act on an expiry, and the completed
  all_reduce proves that every member is alive. Training goes on through an etcd outage, and no
  longer stops for the ~1-2 s of a leader election once every member's renewal is pending (it did:
  a member answered just before the election counted as "reached", and every step was retried
  until the renewals landed);
* otherwise the step is committed by every member (and the members regroup after it if one asked).

What stays local: a member that learns, after the sum, that its generation was fenced or its
lease is gone does not apply the step. Nor, unless a view read from etcd after the sum shows its
generation still current (``check_generation``), does a member whose sum came after a wait long
enough for a reach check (``rendezvous.reach``) to have left it out: a member cut off from the
network gets its sum *late*, once its link is back, because the peers that left it out still
have the abandoned all_reduce pending in gloo and complete it with its data; its watch had not
caught up with the abort, and it applied the step its peers did again without it (stop 26:
``test_link_cut.py``, ``bench host-loss``). Two more refusals are ``confirmable``: its own lease has
expired by its clock while etcd answered members at vote time (it was frozen past its lease, and
its peers may have given up on the step), or it was stopped and continued since it last renewed
its lease (its agent may have revoked the lease: ``continued.py``). The executor then asks etcd for
a renewal within ``lease_confirm_s``; a granted one proves the lease never ended (a lease id never
comes back: an agent's revocation, or an expiry, is final), so no peer gave up on this member and
the step is applied with the others (a leader election or an outage only held the renewals back;
a short stop landing after the vote used to make the stopped member refuse a step its peers
applied: a split commit). A member continued from a stop before its vote votes "stale" until a
renewal asked after the continue succeeds (or fails with the lease gone, a veto), so every member
retries the step. A member that refuses is behind, never ahead: it re-registers as a newcomer and
rank 0 of the next generation, chosen for holding the newest step, sends it the state. If every
member that applied dies before that regroup, the survivors apply its kept sum (``rollforward``);
and what a member applied is its commit only once a later sum or sync confirms it (``journal``),
so a member that got a sum its peers never did, and was lost, committed nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

VOTE_SLOTS = 7  # the extra floats carried by the last gradient bucket (Vote.slots)


@dataclass(frozen=True)
class Vote:
    """One member's vote on the step it is about to send its last gradient bucket for."""

    weighted_loss: float  # its loss times its share of the global batch
    veto: bool  # it must not commit: its generation was superseded or aborted, or its lease is gone
    regroup: bool  # it asks the members to regroup after this step (newcomers wait, or it drains)
    stale: bool  # its lease is not certainly alive (not renewed within lease TTL - keepalive)
    reached_etcd: bool  # its last etcd request was answered

    def slots(self) -> list[float]:
        fresh_reached = self.reached_etcd and not self.stale  # a member that could see another's lease expire
        return [self.weighted_loss, float(self.veto), float(self.regroup), float(self.stale),
                float(self.reached_etcd), float(fresh_reached), 1.0]


@dataclass(frozen=True)
class Tally:
    """The vote slots summed over the generation (identical on every member)."""

    loss: float
    vetoes: int
    regroups: int
    stale: int
    reached_etcd: int
    voters: int
    fresh_reached: int = 0  # members whose lease is fresh and whose last etcd request was answered

    @classmethod
    def from_slots(cls, summed: Sequence[float]) -> Tally:
        if len(summed) != VOTE_SLOTS:
            raise ValueError(f"expected {VOTE_SLOTS} vote slots, got {len(summed)}")
        loss, *counts = summed
        vetoes, regroups, stale, reached, fresh_reached, voters = (round(x) for x in counts)
        return cls(float(loss), vetoes, regroups, stale, reached, voters, fresh_reached)


@dataclass(frozen=True)
class Fence:
    """What this member knows locally once the sum arrived (monotonic seconds)."""

    fenced: bool  # its generation was superseded or aborted (seen in etcd)
    lease_lost: bool  # etcd said its lease is gone
    renewed_at: float  # when it last asked for a renewal that etcd granted
    lease_ttl_s: float  # the TTL etcd granted (at least etcd's minimum; see Membership)
    continued: bool = False  # stopped and continued since its last renewal was asked (continued.py)
    confirmed: bool = False  # etcd granted a renewal answered after the sum: the lease never expired
    waited_s: float = 0.0  # how long it waited for the sum (its all_reduce's wait)
    reach_s: float = math.inf  # the shortest wait after which a reach check may ask (inf: the check is off)
    current: bool = False  # a view read from etcd after the sum still had its generation current


class Outcome(StrEnum):
    COMMIT = "commit"  # apply the step (optimizer.step(), counters)
    RETRY = "retry"  # apply nothing; do the same step again in the same group
    ABORT = "abort"  # apply nothing; leave the generation and re-rendezvous


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: str
    regroup: bool = False  # COMMIT: re-rendezvous after this step
    unanimous: bool = True  # False: a local refusal (this member is behind the others, never ahead)
    confirmable: bool = False  # ABORT lifted by a renewal granted after the sum (Fence.confirmed)
    check_generation: bool = False  # ABORT lifted by a view read after the sum (Fence.current)


def commit_outcome(tally: Tally, world_size: int, fence: Fence, now: float) -> Verdict:
    """Decide what this member does with a step whose all_reduce completed. Pure.

    Every branch but the last two is a function of ``tally`` alone, which is the same on every
    member, so those decisions are unanimous.
    """
    if tally.voters != world_size:
        return Verdict(Outcome.ABORT, f"{tally.voters} votes in a generation of {world_size}")
    if tally.vetoes:
        return Verdict(Outcome.ABORT, f"{tally.vetoes} member(s) vetoed: generation superseded or "
                       f"aborted, or a lease is gone")
    if tally.stale and tally.fresh_reached:
        return Verdict(Outcome.RETRY, f"{tally.stale} member(s) wait for a lease renewal while etcd "
                       f"answers {tally.fresh_reached} with a fresh lease")
    if fence.fenced or fence.lease_lost:
        why = "my lease is gone" if fence.lease_lost else "my generation was superseded or aborted"
        return Verdict(Outcome.ABORT, f"{why} after the vote", unanimous=False)
    if tally.reached_etcd and fence.waited_s >= fence.reach_s and not fence.current:
        return Verdict(Outcome.ABORT, f"the sum arrived after a {fence.waited_s:.2f} s wait, long enough for a reach "
                       f"check to have left this member out (its peers' abandoned all_reduce can complete late)",
                       unanimous=False, check_generation=True)
    if fence.continued and not fence.confirmed:
        return Verdict(Outcome.ABORT, "this process was stopped and continued since its last lease renewal: its "
                       "agent may have revoked the lease and its peers given up on the step", unanimous=False,
                       confirmable=True)
    if tally.reached_etcd and not fence.confirmed and now >= fence.renewed_at + fence.lease_ttl_s:
        return Verdict(Outcome.ABORT, f"my lease expired by my clock {now - fence.renewed_at - fence.lease_ttl_s:.2f} s "
                       f"before the sum arrived (this process was frozen, or etcd held its renewals)",
                       unanimous=False, confirmable=True)
    if tally.regroups:
        return Verdict(Outcome.COMMIT, f"{tally.regroups} member(s) asked to regroup", regroup=True)
    return Verdict(Outcome.COMMIT, "every member voted")
