"""The resume rules, pure: whether a member looks for a durable checkpoint
(``should_load_checkpoint``), and when a generation that resumes the job without any member of its
last generation may be published (``resume_held_until``, from the time ``orphaned_since`` records
in the coordinator's verdict).

No I/O and no clock: times are passed in. Used by ``rendezvous.decide``, which re-exports
``should_load_checkpoint``.
"""

from __future__ import annotations

from elasticd.config import Timeouts
from elasticd.wire.snapshot import Snapshot


def should_load_checkpoint(snap: Snapshot, held_step: int) -> bool:
    """Whether a member about to rendezvous should look for a durable checkpoint (pure).

    Yes when no member of the current generation is alive (or there is none), the job has not
    finished, and this member holds nothing, or less than the newest step the job is known to have
    reached (``generation``, ``committed`` or ``checkpoint`` record). While a generation has live
    members they hold its newest state, and a newcomer gets it from rank 0. Loading is not resuming:
    the generation that resumes waits for ``resume_held_until``, and the load overlaps that wait.
    """
    g = snap.generation
    if snap.finished is not None and (g is None or snap.finished.generation >= g.generation):
        return False
    if g is not None and any(m in snap.members for m in g.members):
        return False
    newest = max(g.committed_step if g else -1, snap.committed_step, snap.checkpoint.step if snap.checkpoint else -1)
    return held_step < 0 or held_step < newest


def orphaned_since(snap: Snapshot, now: float) -> float:
    """When the current generation of a full snapshot was first judged to have no live member, for
    the coordinator's verdict (``VerdictRecord.orphaned_at``): the stored verdict's time if it says
    so already (every later coordinator keeps the first one's), else ``now`` (the caller's wall
    clock); 0.0 while a member of it lives or there is none. Pure."""
    g = snap.generation
    if g is None or any(m in snap.members for m in g.members):
        return 0.0
    v = snap.verdict
    if v is not None and v.generation == g.generation and v.orphaned and v.orphaned_at > 0:
        return v.orphaned_at
    return now


def resume_held_until(
    snap: Snapshot, seen: float, now: float, timeouts: Timeouts, wall: float | None = None
) -> float | None:
    """Until when (on ``now``'s clock) a generation that resumes the job without any member of its
    last generation is held back; None when nothing holds it: a member of that generation lives
    (it holds the state, or it left it, and the generation cannot train without it), or there is
    no earlier generation (a new job never waits). Pure.

    Why a hold. A generation whose members are all cut off from etcd, but not from each other,
    trains on: a step needs no etcd, and nothing on the step path bounds how long it goes on. etcd
    meanwhile sees every one of its leases end and no live member, as if they had died, and a
    resume from older state (the durable checkpoint, or a member left behind) would commit the
    steps that generation commits too. Held ``resume_hold_s``, it gets that long to reconnect: its
    members then come back holding the newest step, rank first, and no step is done twice. One cut
    off for longer still trains beside the resumed job; only a bound on training without etcd, on
    the members' side, would close that.

    Why a time, and from when. A generation cut off and a dead one look alike in etcd (every lease
    ended, nothing written since); the leased records of its last sign of life (members, progress)
    end with it, and no record tells a lease revoked on a clean close from one that expired. So the
    hold runs from when the generation was first seen with no live member, which is after its last
    contact with etcd, by two clocks, and ends at the earlier of:

    * ``seen`` + ``resume_hold_s``: this process's own first sight of it broken, on ``now``'s
      (monotonic) clock, so no clock skew between hosts holds a resume longer than that;
    * the verdict's ``orphaned_at`` (``orphaned_since``) + ``resume_hold_s``, read with ``wall``
      (this process's wall clock; None: not read): a coordinator that takes over late, or a job
      restarted long after, does not wait again from the start. A host whose clock is ahead of the
      writer's ends the hold that much early.
    """
    g = snap.generation
    if g is None or any(m in snap.members for m in g.members):
        return None
    until = seen + timeouts.resume_hold_s
    v = snap.verdict
    if wall is not None and v is not None and v.generation == g.generation and v.orphaned and v.orphaned_at > 0:
        until = min(until, now + (v.orphaned_at + timeouts.resume_hold_s - wall))
    return until
