"""Deputies: the members that publish a generation themselves when the coordinator is late
(``deputy_tier``: who; ``deputy_starts_s``: when). Pure; the rounds they run are the
coordinator's (``rendezvous.coordinator``, ``elected=False``), started by ``Membership.join``.
"""

from __future__ import annotations

from elasticd.config import Timeouts

DEPUTY_RANKS = 2  # ranks per tier of deputies (members that publish for a late coordinator)
DEPUTY_TIERS = 4  # tiers, spread over the rank order: at most DEPUTY_RANKS x DEPUTY_TIERS deputies


def deputy_tier(rank: int, world: int) -> int | None:
    """The deputy tier of the member of ``rank`` in the generation it leaves, of ``world`` members
    (None: not a deputy). Tier t is the ``DEPUTY_RANKS`` ranks from ``t * world // DEPUTY_TIERS``:
    spread over the rank order, so that a node holding consecutive ranks (its GPUs) does not hold
    every tier; a rank in two tiers takes the first. Pure."""
    for t in range(DEPUTY_TIERS):
        first = t * world // DEPUTY_TIERS
        if first <= rank < first + DEPUTY_RANKS:
            return t
    return None


def deputy_starts_s(tier: int | None, coordinator_heard: bool, timeouts: Timeouts) -> float | None:
    """How long into a rendezvous a deputy of ``tier`` begins its own rounds (None: it does not).
    Tier 0 after ``coordinator_grace_s``; tier t > 0 one ``deputy_step_s`` per tier later, and only
    while the coordinator has said nothing about the broken generation (``coordinator_heard``: a
    verdict on it, ``verdict_on``): a coordinator at work writes one within a round, and its
    deputies of tier 0 publish beside it; the later tiers cover a coordinator lost together with
    them (on one node, or a node lost while the other's link was down). Pure."""
    if tier is None:
        return None
    if tier == 0:
        return timeouts.coordinator_grace_s
    if coordinator_heard:
        return None
    return timeouts.coordinator_grace_s + tier * timeouts.deputy_step_s
