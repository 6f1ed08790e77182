"""The health verdict of one job (what ``elasticctl status`` exits with). Pure.

Owns ``Health`` and its exit codes, the stall bound, and the rules that judge a job from its
parsed records (``classify``; ``classify_restart`` for a restart-mode job). Never reads etcd,
never reads a clock (``now`` is passed in), and never formats a report (``ops.render``).

Health (``classify``), first match wins:

* ``finished``: a ``finished`` record exists for the current (or a later) generation.
* ``failed``: the job's failure records show a bug (``wire.failures.deterministic_failure``: the
  same exception at the same step in two or more workers); the agents stop the job on it.
* ``degraded`` (first): the ``generation`` record does not parse (written by hand), but live members
  report by their progress records (written within the stall bound) that they train in a
  generation: health comes from those live records, and they are shown as training.
* ``down``: no key of the job exists; there is no generation (or a malformed one and no live member
  reports training); a member of the generation lost its lease; the generation was aborted (a
  re-rendezvous is under way); or its world size is below ``min_workers`` (when given).
* ``stalled``: the generation's members are all alive, but none has committed a step (nor finished
  joining) for longer than the stall bound: ``stall_after_s`` (default ``STALL_AFTER_S``; 0: never
  stalled), or ``STALL_STEP_FACTOR`` times the slowest member's last step time if that is longer.
  The last activity is the newest ``time`` of the members' progress records, or the
  ``generation_published`` event of the generation when none has one yet.
* ``degraded``: the generation runs, but below ``max_workers`` (when given); without
  ``max_workers``, some live member is not in the generation; or the job's last checkpoint save
  failed (a ``save_failed`` record newer than the ``checkpoint`` record).
* ``healthy``: the generation runs at ``max_workers`` (when given), or holds every live member, and
  no checkpoint save failed since the last good one.

``min_workers`` and ``max_workers`` are not stored in etcd, so the caller passes them (or not).

Exit codes of ``elasticctl status`` (``JobStatus.exit_code``; ``EXIT_*`` below):

* 0: healthy or finished;
* 1: degraded;
* 2: down, stalled, failed, no such job, or etcd did not answer (the last one is decided in ``cli.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum

from elasticd.ops.parse import RestartStatus
from elasticd.wire.ops import SaveFailedRecord
from elasticd.wire.progress import ProgressRecord
from elasticd.wire.records import CheckpointRecord, GenerationRecord
from elasticd.wire.snapshot import Snapshot

EXIT_OK = 0
EXIT_DEGRADED = 1
EXIT_DOWN = 2
# Default of ``stall_after_s`` (``elasticctl status --stall-after-s``): no committed step for this long
# while every member of the generation is alive is a stall. Far above what a recovery takes with
# the default timeouts (a broken collective is abandoned after ``collective_s`` = 30 s), so a job
# that recovers is never reported stalled.
STALL_AFTER_S = 120.0
STALL_STEP_FACTOR = 10.0  # a job whose steps are slow gets this many step times before it is stalled


class Health(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    DOWN = "down"
    STALLED = "stalled"
    FINISHED = "finished"
    FAILED = "failed"  # a bug stopped the job (``wire.failures``): no restart gets past it

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self]


_EXIT_CODES = {
    Health.HEALTHY: EXIT_OK,
    Health.FINISHED: EXIT_OK,
    Health.DEGRADED: EXIT_DEGRADED,
    Health.DOWN: EXIT_DOWN,
    Health.STALLED: EXIT_DOWN,
    Health.FAILED: EXIT_DOWN,
}


def classify_restart(r: RestartStatus, min_workers: int | None, max_workers: int | None) -> tuple[Health, str]:
    """The health of a restart-mode job (pure): finished; down while a failed round is being
    replaced, when a node of the round lost its agent, or below ``min_workers``; degraded below
    ``max_workers``; else healthy."""
    if r.finished_round and r.finished_round >= r.round:
        return Health.FINISHED, f"restart mode: round {r.finished_round} finished"
    if not r.round:
        return Health.DOWN, "restart mode: no round yet"
    if r.failed_round >= r.round:
        return Health.DOWN, f"restart mode: round {r.round} ended; the agents are restarting every worker"
    lost = [n for n in r.nodes if n not in r.agents]
    if lost:
        return Health.DOWN, f"restart mode: round {r.round} lost the agent of {', '.join(lost)}"
    if min_workers is not None and r.world_size < min_workers:
        return Health.DOWN, f"restart mode: world size {r.world_size} < min_workers {min_workers}"
    if max_workers is not None and r.world_size < max_workers:
        return Health.DEGRADED, f"restart mode: world size {r.world_size} < max_workers {max_workers}"
    return Health.HEALTHY, f"restart mode: round {r.round} runs with world size {r.world_size}"


def stall_bound(stall_after_s: float, step_times: Iterable[float | None]) -> float:
    """How long without activity makes a job stalled (pure): ``stall_after_s``, or
    ``STALL_STEP_FACTOR`` times the slowest of ``step_times`` if that is longer."""
    slowest = max((t for t in step_times if t is not None), default=0.0)
    return max(stall_after_s, STALL_STEP_FACTOR * slowest)


def last_activity(
    members: Iterable[str], progress: Mapping[str, ProgressRecord], published_at: float | None
) -> float | None:
    """The wall-clock time of a generation's last sign of life (pure): the newest progress record of
    its members (written at each commit and when a member finished joining), else the time its
    ``generation_published`` event says; None when neither is known."""
    times = [progress[m].time for m in members if m in progress]
    if published_at is not None:
        times.append(published_at)
    return max(times, default=None)


def derived_generation(
    snap: Snapshot, progress: Mapping[str, ProgressRecord], now: float, stall_after_s: float
) -> tuple[int, tuple[str, ...]] | None:
    """When the ``generation`` record does not parse: (number, members in rank order) of the
    newest generation that live members report training in, by progress records younger than the
    stall bound (pure). None when the record parses or is absent, or no live member reports."""
    if snap.generation is not None or not snap.generation_revision:
        return None
    bound = stall_bound(stall_after_s or STALL_AFTER_S, (p.step_time_s for p in progress.values()))
    fresh = {m: p for m, p in progress.items() if m in snap.members and now - p.time <= bound}
    if not fresh:
        return None
    number = max(p.generation for p in fresh.values())
    members = sorted((m for m, p in fresh.items() if p.generation == number), key=lambda m: (fresh[m].rank, m))
    return number, tuple(members)


def save_failing(failed: SaveFailedRecord | None, checkpoint: CheckpointRecord | None) -> bool:
    """The job's latest checkpoint save failed (pure): a ``save_failed`` record exists and no good
    checkpoint was recorded after it (by the records' wall-clock times; by step when the
    ``checkpoint`` record has no time)."""
    if failed is None:
        return False
    if checkpoint is None:
        return True
    if checkpoint.time:
        return failed.time > checkpoint.time
    return failed.step >= checkpoint.step


def classify(
    snap: Snapshot,
    any_keys: bool,
    prefix: str,
    min_workers: int | None,
    max_workers: int | None,
    *,
    now: float = 0.0,
    progress: Mapping[str, ProgressRecord] | None = None,
    stall_after_s: float = 0.0,
    activity: float | None = None,
    save_failed: SaveFailedRecord | None = None,
) -> tuple[Health, str]:
    """The health of a job and a one-line reason (pure; the rules are in the module docstring).

    Args:
        now: the wall clock the records are aged against.
        progress: the members' progress records, by member id.
        stall_after_s: see ``stall_bound`` (0: stalls are not checked).
        activity: the generation's last sign of life (``last_activity``), if known.
        save_failed: the failed save, when it is newer than the last good checkpoint.
    """
    progress = progress or {}
    g = snap.generation
    if snap.finished is not None and (g is None or snap.finished.generation >= g.generation):
        return Health.FINISHED, (f"finished at step {snap.finished.step} (generation {snap.finished.generation})")
    if not any_keys:
        return Health.DOWN, f"no such job: nothing under {prefix}"
    if g is None:
        derived = derived_generation(snap, progress, now, stall_after_s)
        if derived is not None:
            number, members = derived
            newest = max(progress[m].time for m in members)
            step = max(progress[m].step for m in members)
            return Health.DEGRADED, (
                f"the generation record is malformed (see malformed), but {len(members)} "
                f"live member(s) train in generation {number} by their progress records "
                f"(step {step}, {now - newest:.1f}s ago)"
            )
        if snap.generation_revision:
            return Health.DOWN, "the generation record is malformed (see malformed)"
        alive = [r for r in snap.ready.values() if r.member_id in snap.members]
        want = f" of min_workers {min_workers}" if min_workers is not None else ""
        return Health.DOWN, (f"no generation yet: {len(snap.members)} registered, {len(alive)} ready{want}")
    missing = [m for m in g.members if m not in snap.members]
    if missing:
        return Health.DOWN, (
            f"generation {g.generation} lost {len(missing)} of {g.world_size} members; re-rendezvous pending"
        )
    if snap.aborted >= g.generation:
        return Health.DOWN, f"generation {g.generation} was aborted; re-rendezvous pending"
    if min_workers is not None and g.world_size < min_workers:
        return Health.DOWN, f"world size {g.world_size} < min_workers {min_workers}"
    if stall_after_s > 0 and activity is not None:
        bound = stall_bound(stall_after_s, (progress[m].step_time_s for m in g.members if m in progress))
        if now - activity > bound:
            steps = [progress[m].step for m in g.members if m in progress]
            at = f"step {max(steps)}" if steps else "no step yet"
            return Health.STALLED, (
                f"no step committed for {now - activity:.1f}s (> {bound:g}s) by the "
                f"{g.world_size} live member(s) of generation {g.generation} ({at})"
            )
    health, reason = _size_health(snap, g, max_workers)
    if save_failed is not None:
        what = f"the last checkpoint save failed (step {save_failed.step}: {save_failed.errno or save_failed.error})"
        if health is Health.HEALTHY:
            return Health.DEGRADED, what
        reason += f"; {what}"
    return health, reason


def _size_health(snap: Snapshot, g: GenerationRecord, max_workers: int | None) -> tuple[Health, str]:
    if max_workers is not None:
        if g.world_size < max_workers:
            return Health.DEGRADED, f"world size {g.world_size} < max_workers {max_workers}"
        relation = "=" if g.world_size == max_workers else ">"
        return Health.HEALTHY, f"world size {g.world_size} {relation} max_workers {max_workers}"
    outside = [m for m in snap.members if m not in g.members and not snap.members[m].spare]  # spares wait
    if outside:
        return Health.DEGRADED, (
            f"{len(outside)} live member(s) not in generation {g.generation} (world size {g.world_size})"
        )
    return Health.HEALTHY, f"all {g.world_size} live members are in generation {g.generation}"
