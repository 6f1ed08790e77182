"""The commit rule ``commit_outcome``, on hand-built tallies and fences with a fixed ``now``.

A world of 3; the lease TTL etcd granted is 2 s, last renewed at ``NOW - 0.5``.
"""

from __future__ import annotations

import pytest

from elasticd.worker.commit import (
    VOTE_SLOTS,
    Fence,
    Outcome,
    Tally,
    Vote,
    commit_outcome,
)

pytestmark = pytest.mark.timeout(30)

NOW = 1000.0
WORLD = 3
OK = Fence(fenced=False, lease_lost=False, renewed_at=NOW - 0.5, lease_ttl_s=2.0)


def tally(vetoes: int = 0, regroups: int = 0, stale: int = 0, reached: int = 3, voters: int = 3,
          fresh_reached: int | None = None) -> Tally:
    fr = max(0, reached - stale) if fresh_reached is None else fresh_reached  # by default the stale ones are not answered
    return Tally(loss=1.5, vetoes=vetoes, regroups=regroups, stale=stale, reached_etcd=reached, voters=voters,
                 fresh_reached=fr)


def fence(**kw: object) -> Fence:
    return Fence(**{**OK.__dict__, **kw})  # type: ignore[arg-type]


CASES = [
    # (what, tally, fence, outcome, regroup, unanimous)
    ("every member voted, all fresh", tally(), OK, Outcome.COMMIT, False, True),
    ("a newcomer waits: commit, then regroup", tally(regroups=1), OK, Outcome.COMMIT, True, True),
    ("a veto aborts everywhere", tally(vetoes=1), OK, Outcome.ABORT, False, True),
    ("a veto wins over a regroup request", tally(vetoes=1, regroups=2), OK, Outcome.ABORT, False, True),
    ("a missing vote aborts", tally(voters=2), OK, Outcome.ABORT, False, True),
    # The split commit of issue 10: one member's renewal failed after an etcd restart while the
    # others' succeeded. Now every member retries the same step; nobody commits alone.
    ("one stale lease while etcd answers the others: retry everywhere", tally(stale=1, reached=2), OK,
     Outcome.RETRY, False, True),
    ("the stale member itself retries too (same tally)", tally(stale=1, reached=2),
     fence(renewed_at=NOW - 1.9), Outcome.RETRY, False, True),
    # etcd is down for everybody: nobody can act on an expiry, the all_reduce proved everyone alive.
    ("etcd outage, all leases stale: commit", tally(stale=3, reached=0), fence(renewed_at=NOW - 30.0),
     Outcome.COMMIT, False, True),
    ("etcd outage, some stale: commit", tally(stale=1, reached=0), OK, Outcome.COMMIT, False, True),
    # An etcd leader election: every renewal pending, some members answered just before it. No
    # lease can expire without a leader (and the new one extends them all): commit. Before, the
    # step was retried until the renewals landed (~1 s per leader kill in chaos runs).
    ("leader election, every lease stale, some answered lately: commit", tally(stale=3, reached=2),
     fence(renewed_at=NOW - 1.6), Outcome.COMMIT, False, True),
    ("one stale, a stale one answered, no fresh one answered: commit", tally(stale=2, reached=1, fresh_reached=0),
     OK, Outcome.COMMIT, False, True),
    ("one stale, one fresh member answered: retry", tally(stale=1, reached=1, fresh_reached=1), OK,
     Outcome.RETRY, False, True),
    ("etcd outage and a regroup request: commit, then regroup", tally(stale=3, reached=0, regroups=1),
     fence(renewed_at=NOW - 30.0), Outcome.COMMIT, True, True),
    # Local refusals: this member ends up behind, never ahead.
    ("superseded after the vote: refuse locally", tally(), fence(fenced=True), Outcome.ABORT, False, False),
    ("lease lost after the vote: refuse locally", tally(), fence(lease_lost=True), Outcome.ABORT, False, False),
    ("frozen past my lease while etcd answered: refuse locally", tally(), fence(renewed_at=NOW - 2.0),
     Outcome.ABORT, False, False),
    ("just inside my lease: commit", tally(), fence(renewed_at=NOW - 1.99), Outcome.COMMIT, False, True),
    # The CI failure of stop 14: a leader election held every renewal past the TTL by the members'
    # clocks while a lookup answered; each member refused locally and the job regrouped 4 times.
    # A renewal granted after the sum proves the lease never expired: commit.
    ("expired by my clock, then a renewal granted: commit", tally(stale=2, reached=2, fresh_reached=0),
     fence(renewed_at=NOW - 2.5, confirmed=True), Outcome.COMMIT, False, True),
    ("expired by my clock, renewal granted, a regroup asked: commit, then regroup", tally(regroups=1),
     fence(renewed_at=NOW - 2.5, confirmed=True), Outcome.COMMIT, True, True),
    ("a granted renewal does not lift a fence", tally(), fence(fenced=True, confirmed=True), Outcome.ABORT,
     False, False),
    # Stopped and continued since the vote: the agent may have revoked the lease (stopped_worker_s)
    # however fresh it looks, and the peers may have given up on the step; a renewal granted after
    # the sum proves it did not (a revoked lease never comes back): the step is applied with the
    # others (stop 23: a short stop after the vote made the stopped member refuse a step its
    # peers applied, a split commit).
    ("stopped and continued since my vote: refuse unless confirmed", tally(), fence(continued=True), Outcome.ABORT,
     False, False),
    ("continued, then a renewal granted: commit with the others", tally(), fence(continued=True, confirmed=True),
     Outcome.COMMIT, False, True),
    ("continued and fenced: a renewal does not lift the fence", tally(),
     fence(continued=True, fenced=True, confirmed=True), Outcome.ABORT, False, False),
    ("continued during an etcd outage: refuse locally too", tally(stale=3, reached=0),
     fence(renewed_at=NOW - 30.0, continued=True), Outcome.ABORT, False, False),
    ("continued, but everyone retries anyway", tally(stale=1, reached=2), fence(continued=True), Outcome.RETRY,
     False, True),
    # Stop 26: a member cut off from the network got its sum late, once its link was back (its peers'
    # abandoned all_reduce, still pending in gloo, completed with its data after a reach check had
    # left it out), and applied a step its peers did again without it. A sum after a wait long
    # enough for a reach check is applied only once a view read from etcd after it shows the
    # generation still current.
    ("a sum after a wait long enough for a reach check: refuse unless the generation is current", tally(),
     fence(waited_s=0.45, reach_s=0.1), Outcome.ABORT, False, False),
    ("... and the view read after it shows it current: commit", tally(),
     fence(waited_s=0.45, reach_s=0.1, current=True), Outcome.COMMIT, False, True),
    ("... or shows it aborted: refuse (the fence)", tally(),
     fence(waited_s=0.45, reach_s=0.1, fenced=True), Outcome.ABORT, False, False),
    ("a short wait needs no read", tally(), fence(waited_s=0.05, reach_s=0.1), Outcome.COMMIT, False, True),
    ("the reach check off: no read", tally(), fence(waited_s=5.0), Outcome.COMMIT, False, True),
    ("a long wait in an etcd outage: nobody could leave anyone out, commit", tally(stale=3, reached=0),
     fence(renewed_at=NOW - 30.0, waited_s=0.45, reach_s=0.1), Outcome.COMMIT, False, True),
    ("current, but frozen past my lease: the lease rule still asks for a renewal", tally(),
     fence(waited_s=3.0, reach_s=0.1, current=True, renewed_at=NOW - 2.5), Outcome.ABORT, False, False),
]


@pytest.mark.parametrize(("what", "t", "f", "outcome", "regroup", "unanimous"), CASES, ids=[c[0] for c in CASES])
def test_commit_outcome(what: str, t: Tally, f: Fence, outcome: Outcome, regroup: bool, unanimous: bool) -> None:
    v = commit_outcome(t, WORLD, f, NOW)
    assert (v.outcome, v.regroup, v.unanimous) == (outcome, regroup, unanimous), v.reason
    assert v.reason


def test_only_the_refusals_a_granted_renewal_can_lift_are_confirmable() -> None:
    """The executor asks etcd for a renewal only when a granted one could change the verdict: an
    expiry by my clock, or a stop and continue; never a fence or a lease etcd said is gone."""
    for f in (fence(renewed_at=NOW - 2.0), fence(continued=True), fence(continued=True, renewed_at=NOW - 2.0)):
        v = commit_outcome(tally(), WORLD, f, NOW)
        assert (v.outcome, v.confirmable) == (Outcome.ABORT, True), v.reason
    for f in (fence(fenced=True), fence(lease_lost=True), fence(continued=True, lease_lost=True),
              fence(continued=True, fenced=True)):
        v = commit_outcome(tally(), WORLD, f, NOW)
        assert (v.outcome, v.confirmable) == (Outcome.ABORT, False), v.reason
    assert not commit_outcome(tally(vetoes=1), WORLD, fence(renewed_at=NOW - 2.0), NOW).confirmable


def test_only_a_late_sum_asks_for_a_view_read() -> None:
    late = commit_outcome(tally(), WORLD, fence(waited_s=0.45, reach_s=0.1), NOW)
    assert (late.check_generation, late.confirmable) == (True, False), late.reason
    for f in (OK, fence(renewed_at=NOW - 2.0), fence(fenced=True, waited_s=0.45, reach_s=0.1),
              fence(waited_s=0.45, reach_s=0.1, current=True)):
        assert not commit_outcome(tally(), WORLD, f, NOW).check_generation


def test_every_member_decides_alike_from_the_same_tally() -> None:
    """The unanimous branches depend on the tally alone: members with different local fences
    that are all in good standing reach the same verdict."""
    fences = [OK, fence(renewed_at=NOW - 1.0), fence(renewed_at=NOW - 0.01)]
    for t in (tally(), tally(regroups=1), tally(vetoes=1), tally(stale=1, reached=2), tally(stale=3, reached=0)):
        verdicts = {(commit_outcome(t, WORLD, f, NOW).outcome, commit_outcome(t, WORLD, f, NOW).regroup)
                    for f in fences}
        assert len(verdicts) == 1, (t, verdicts)


def test_vote_slots_round_trip_through_a_sum() -> None:
    votes = [Vote(0.5, False, False, False, True), Vote(0.25, False, True, True, True),
             Vote(0.25, True, False, False, False)]
    summed = [sum(v.slots()[i] for v in votes) for i in range(VOTE_SLOTS)]
    assert Tally.from_slots(summed) == Tally(loss=1.0, vetoes=1, regroups=1, stale=1, reached_etcd=2, voters=3,
                                             fresh_reached=1)  # the stale one that reached etcd is not fresh
    with pytest.raises(ValueError):
        Tally.from_slots(summed[:-1])
