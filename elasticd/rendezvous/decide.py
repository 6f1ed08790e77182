"""The rendezvous decisions, pure: the coordinator's (``publish_decision``, ``judge``: from a
full snapshot), a waiting member's (``member_action``, ``should_resume``: from its small view),
a deputy's (``next_action``: both), the rank order, the resume rules (``rendezvous.resume``), and
``assess_health`` (whether a generation can go on, from a member's view).

No I/O and no clock: ``now`` is passed in. The executor is ``rendezvous.membership``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, replace
from enum import StrEnum

from elasticd.config import Timeouts, WorldConfig
from elasticd.rendezvous.resume import orphaned_since, resume_held_until, should_load_checkpoint
from elasticd.wire.records import VERDICT_IDS, GenerationRecord, ReadyRecord, VerdictRecord
from elasticd.wire.snapshot import Snapshot


class ActionKind(StrEnum):
    WAIT = "wait"
    PUBLISH = "publish"
    JOIN = "join"
    REREGISTER = "reregister"
    FAIL = "fail"
    FINISHED = "finished"
    STATE_LOST = "state_lost"


@dataclass(frozen=True)
class Me:
    member_id: str
    signature: str
    last_generation: int
    spare: bool = False  # a warm spare: it waits (standby) until a generation takes it


@dataclass(frozen=True)
class Window:
    """What this process saw of the current round, on its own monotonic clock."""

    entered_at: float
    # When the set of waiting newcomers (``waiting_newcomers``) last changed: the join window runs
    # from it. Members of the current generation arriving at the rendezvous do not move it.
    newcomers_changed_at: float
    broken_at: float | None = None  # when this member first saw the current generation broken


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    reason: str
    until: float | None = None
    record: GenerationRecord | None = None
    expected_revision: int = 0
    error: str = ""
    standby: bool = False  # WAIT: the job is at max_workers and healthy; I wait for a place
    resume_held: bool = False  # WAIT: a resume is held until ``until`` (``resume.resume_held_until``)


def candidates_of(snap: Snapshot) -> list[ReadyRecord]:
    """Ready members that are alive and whose model matches the job's signature."""
    job_sig = snap.generation.signature if snap.generation else _first_signature(snap)
    return [r for r in snap.ready.values() if r.member_id in snap.members and r.signature == job_sig]


def _first_signature(snap: Snapshot) -> str:
    alive = [r for r in snap.ready.values() if r.member_id in snap.members]
    if not alive:
        return ""
    return min(alive, key=lambda r: (snap.ready_order.get(r.member_id, 0), r.member_id)).signature


def is_spare(snap: Snapshot, member_id: str) -> bool:
    """A live spare outside the current generation (one that a generation took is a member like
    any other from then on)."""
    rec = snap.members.get(member_id)
    g = snap.generation
    return rec is not None and bool(rec.spare) and (g is None or member_id not in g.members)


def full_size(g: GenerationRecord | None) -> int:
    """The job's full size as ``g`` records it (the largest world size reached; 0: no generation)."""
    return max(g.full_size, g.world_size) if g is not None else 0


def carried_full_size(g: GenerationRecord | None, size: int, world: WorldConfig) -> int:
    """The full size the generation after ``g`` records, with ``size`` members: the largest reached,
    never past ``max_workers``. Pure."""
    return min(world.max_workers, max(full_size(g), size))


def spare_target(g: GenerationRecord | None, world: WorldConfig) -> int:
    """How many members spares may bring a generation up to: the job's full size (at least
    ``min_workers``), never past ``max_workers``; none before a first generation (spares replace,
    they never start a job: the first spare up would otherwise start it alone)."""
    if g is None:
        return 0
    return min(world.max_workers, max(full_size(g), world.min_workers))


def missing_members(snap: Snapshot, ready: Collection[str]) -> list[str]:
    """The current generation's members that are alive but not among ``ready``, in rank order. Pure."""
    g = snap.generation
    return [m for m in (g.members if g else ()) if m in snap.members and m not in ready]


def holds_state(g: GenerationRecord, cands: Iterable[ReadyRecord]) -> bool:
    """Whether a waiting member holds generation ``g``'s state: a member of it at the step it began
    from or later (every member that synced it is; one that joined it but never saw it built is
    not, nor is a newcomer). Pure."""
    return any(r.member_id in g.members and r.committed_step >= g.committed_step for r in cands)


def without_gone(snap: Snapshot, gone: Collection[str]) -> Snapshot:
    """``snap`` without the members in ``gone`` (their processes are gone: ``rendezvous.probe``),
    unless no live member of the current generation that may hold its state would be left (one not
    ready yet may; a ready one below the step it began from does not): on that alone the job's state
    is not given up (their leases decide). Pure."""
    g = snap.generation
    if not gone or g is None:
        return snap
    kept = [m for m in g.members if m in snap.members and m not in gone]
    if not any(m not in snap.ready or snap.ready[m].committed_step >= g.committed_step for m in kept):
        return snap
    lost = frozenset(r.node for m, r in snap.members.items() if m in gone)
    return replace(
        snap, members={m: r for m, r in snap.members.items() if m not in gone}, lost_nodes=snap.lost_nodes | lost
    )


def held_out(snap: Snapshot, now: float, hold_s: float) -> dict[str, float]:
    """The members kept out of new generations at ``now`` (Unix time), each with when it may come
    back: those the abort of ``snap`` names out of reach (a reach check found their hosts silent),
    until ``hold_s`` after the abort was written, unless a generation newer than the aborted one
    took them back (a member like any other then). Every coordinator and deputy reads the same
    record, so they hold the same members until the same time. Pure."""
    until = snap.aborted_at + hold_s
    if not snap.out_of_reach or now >= until:
        return {}
    g = snap.generation
    taken = set(g.members) if g is not None and g.generation > snap.aborted else set()
    return {m: until for m in snap.out_of_reach if m not in taken}


def replica_of(snap: Snapshot, member_id: str) -> tuple[str, int, int]:
    """(replica, shard, replica size) of a live member; a member that is a replica alone (every
    member of a data-parallel job) is ``(member_id, 0, 1)``. Pure."""
    rec = snap.members.get(member_id)
    if rec is None or rec.replica_size <= 1 or not rec.replica:
        return member_id, 0, 1
    return rec.replica, rec.shard, rec.replica_size


def whole_replicas(snap: Snapshot, records: Iterable[ReadyRecord]) -> list[list[ReadyRecord]]:
    """``records`` as replicas, each in shard order, in the order their first record comes: only
    a replica with one record for each of its shards takes part (one whose rank is gone or not
    ready yet waits outside, whole: its processes join and leave together). Pure."""
    shards: dict[str, dict[int, ReadyRecord]] = {}
    sizes: dict[str, int] = {}
    broken: set[str] = set()
    for r in records:
        key, shard, size = replica_of(snap, r.member_id)
        held = shards.setdefault(key, {})
        if shard in held or not 0 <= shard < size or sizes.setdefault(key, size) != size:
            broken.add(key)
        held[shard] = r
    return [
        [held[i] for i in range(sizes[key])]
        for key, held in shards.items()
        if key not in broken and len(held) == sizes[key]
    ]


def _flat(replicas: Iterable[list[ReadyRecord]]) -> list[ReadyRecord]:
    return [r for replica in replicas for r in replica]


def _up_to(replicas: Iterable[list[ReadyRecord]], limit: int) -> list[list[ReadyRecord]]:
    """The first replicas whose members together fit in ``limit`` (one that does not fit is skipped)."""
    taken: list[list[ReadyRecord]] = []
    count = 0
    for replica in replicas:
        if count + len(replica) <= limit:
            taken.append(replica)
            count += len(replica)
    return taken


def choose_members(snap: Snapshot, cands: Iterable[ReadyRecord], world: WorldConfig) -> list[ReadyRecord]:
    """The members of the next generation, in rank order (pure), by whole replicas
    (``whole_replicas``; a data-parallel member is one): the ready candidates that are not spares
    (``rank_order``, up to ``max_workers``), then spares up to ``spare_target``: last those of a
    node whose member of the generation lives but is not ready (a node lost whole, its leases not
    expired yet); first those on the nodes with the fewest chosen members (a crashed worker's own
    node, a lost node's replacement), a standby node's after the others, then in arrival order."""
    pool = list(cands)
    replicas = whole_replicas(snap, pool)
    regular = _up_to(
        _ranked(snap, [rep for rep in replicas if not is_spare(snap, rep[0].member_id)]), world.max_workers
    )
    need = spare_target(snap.generation, world) - len(_flat(regular))
    if need <= 0:
        return _flat(regular)
    per_node: dict[str, int] = {}
    for r in _flat(regular):
        node = snap.members[r.member_id].node
        per_node[node] = per_node.get(node, 0) + 1
    # A node whose member of the generation is alive but not ready is suspect: lost with all its
    # processes, their leases not expired yet (a crashed worker's agent revokes its lease at once);
    # so is one whose member's process was found gone with its lease alive (``without_gone``).
    suspect = {snap.members[m].node for m in missing_members(snap, {r.member_id for r in pool})}
    suspect |= snap.lost_nodes
    spares = sorted(
        (rep for rep in replicas if is_spare(snap, rep[0].member_id)),
        key=lambda rep: (
            snap.members[rep[0].member_id].node in suspect,
            per_node.get(snap.members[rep[0].member_id].node, 0),
            snap.members[rep[0].member_id].standby,
            snap.ready_order.get(rep[0].member_id, 0),
            rep[0].member_id,
        ),
    )
    return _flat(_ranked(snap, regular + _up_to(spares, need)))


def generation_broken(snap: Snapshot) -> bool:
    """The current generation can no longer make progress: aborted, or a member's lease is gone."""
    g = snap.generation
    if g is None:
        return True
    return snap.aborted >= g.generation or any(m not in snap.members for m in g.members)


def rank_order(snap: Snapshot, chosen: Iterable[ReadyRecord]) -> list[ReadyRecord]:
    """Newest committed step first (so rank 0 holds it), then survivors in their old rank order,
    then newcomers in arrival order; a replica's members stay together, in shard order, ranked by
    the least step any of them holds (``whole_replicas``: the chosen are whole replicas)."""
    return _flat(_ranked(snap, whole_replicas(snap, chosen)))


def _ranked(snap: Snapshot, replicas: Iterable[list[ReadyRecord]]) -> list[list[ReadyRecord]]:
    old = snap.generation.members if snap.generation else ()
    prev = snap.generation.generation if snap.generation else -1

    def key(replica: list[ReadyRecord]) -> tuple[int, int, int, int, str]:
        r = replica[0]
        survivor = all(m.member_id in old and m.prev_generation == prev for m in replica)
        return (
            -min(m.committed_step for m in replica),
            0 if survivor else 1,
            r.prev_rank if survivor else 0,
            min(snap.ready_order.get(m.member_id, 0) for m in replica),
            r.member_id,
        )

    return sorted(replicas, key=key)


def next_action(snap: Snapshot, me: Me, window: Window, now: float, world: WorldConfig, timeouts: Timeouts) -> Action:
    """The whole rendezvous decision for ``me`` from one full snapshot: its own checks, then
    ``publish_decision``. The running protocol splits it (a member: ``member_action`` on its view;
    the coordinator and deputies: ``publish_decision``); the rules' table tests go through it.
    Pure: no I/O, no clock reads."""
    done = _joined_or_finished(snap, me)
    if done is not None:
        return done
    g = snap.generation
    if me.member_id not in snap.members or me.member_id not in snap.ready:
        return Action(ActionKind.REREGISTER, "my member or ready record is gone (lease expired?)")
    job_sig = g.signature if g else _first_signature(snap)
    if job_sig and me.signature != job_sig:
        return _mismatch(me, job_sig)
    return publish_decision(snap, window, now, world, timeouts, me.member_id)


def _joined_or_finished(snap: Snapshot, me: Me) -> Action | None:
    """JOIN a newer generation that includes ``me``, or FINISHED when the job is done (None: neither)."""
    g = snap.generation
    if g is not None and me.member_id in g.members and g.generation > me.last_generation:
        return Action(ActionKind.JOIN, f"generation {g.generation} includes me", record=g)
    if snap.finished is not None and (g is None or snap.finished.generation >= g.generation):
        return Action(ActionKind.FINISHED, f"the job finished at step {snap.finished.step}")
    return None


def _mismatch(me: Me, job_sig: str) -> Action:
    return Action(
        ActionKind.FAIL,
        "model mismatch",
        error=f"this worker's model signature {me.signature[:12]} differs from the job's "
        f"{job_sig[:12]} (parameter names, shapes or dtypes differ)",
    )


def publish_decision(
    snap: Snapshot,
    window: Window,
    now: float,
    world: WorldConfig,
    timeouts: Timeouts,
    me: str = "",
    wall: float | None = None,
) -> Action:
    """What the coordinator does for the members waiting in ``snap``: WAIT (``standby`` when the
    generation is healthy at ``max_workers`` and ``me`` is not in it; ``resume_held``: a resume
    is held, ``resume.resume_held_until``, which reads ``wall``), PUBLISH the next generation, or
    STATE_LOST. Pure."""
    g = snap.generation
    job_sig = g.signature if g else _first_signature(snap)
    cands = candidates_of(snap)
    ids = {r.member_id for r in cands}
    broken = generation_broken(snap)
    if g is not None:
        missing = missing_members(snap, ids)
        if missing and not broken:
            if me not in g.members and g.world_size >= world.max_workers:
                return Action(
                    ActionKind.WAIT,
                    f"standby: generation {g.generation} is healthy at max_workers {world.max_workers}",
                    standby=True,
                )
            return Action(
                ActionKind.WAIT,
                f"generation {g.generation} is healthy; waiting for its "
                f"members {missing[:VERDICT_IDS]} to reach a step boundary",
            )
        if missing and not holds_state(g, cands):
            # Only members of the generation that synced it hold its state (one that joined it but
            # never saw it built holds nothing). Publishing without any of them while some live
            # would start over from older state (a newcomer alone would train from step 0): wait
            # for them. Bounded by their leases (and the agent's hang detection).
            return Action(
                ActionKind.WAIT,
                f"waiting for the live members {missing[:VERDICT_IDS]} of "
                f"generation {g.generation}, which hold its state",
            )
        # The last call starts when the round began or the generation was seen broken, whichever
        # is later: a newcomer that has been waiting for long must not cut it short.
        last_call = max(window.entered_at, window.broken_at or window.entered_at) + timeouts.last_call_s
        if missing and now < last_call:
            return Action(ActionKind.WAIT, f"last call for {missing[:VERDICT_IDS]}", until=last_call)
    chosen = choose_members(snap, cands, world)
    if len(chosen) < world.min_workers:
        return Action(ActionKind.WAIT, f"{len(chosen)} ready < min_workers {world.min_workers}")
    best = max(r.committed_step for r in cands)
    resume = g is None and best > 0  # a first generation from state loaded from disk
    if g is not None and not (any(m in snap.members for m in g.members) and holds_state(g, cands)):
        # nobody alive holds the generation's state: every member gone, or the live ones never
        # synced it (they joined generations that were never built: publishing such a generation
        # would start the job over from step 0)
        newest = max(g.committed_step, snap.committed_step)
        ck = snap.checkpoint
        if best < newest and ck is None:
            return Action(
                ActionKind.STATE_LOST,
                "state lost",
                error=f"every member of generation {g.generation} is gone and no waiting member holds "
                f"the job's state (step {newest}; the best here: {best}), and no durable checkpoint is "
                f"recorded for this job (set checkpoint_dir to save them); restart from a checkpoint",
            )
        if best < newest and best < 0:
            assert ck is not None
            return Action(
                ActionKind.WAIT,
                f"every member of generation {g.generation} is gone and no waiting "
                f"member holds state or could load the checkpoint at step {ck.step} ({ck.path} on "
                f"{ck.node}); waiting for one that can",
            )
        resume = best >= 0  # nobody of it lives: the state came from disk (steps after it are done again)
        held = resume_held_until(
            snap, window.entered_at if window.broken_at is None else window.broken_at, now, timeouts, wall
        )
        if resume and held is not None and now < held:
            return Action(
                ActionKind.WAIT,
                f"resume held: every lease of generation {g.generation} ended, and it "
                "may be training cut off from etcd (resume_hold_s)",
                until=held,
                resume_held=True,
            )
    old = set(g.members) if g else set()
    newcomers = {m for m in ids - old if not is_spare(snap, m)}
    settle = window.newcomers_changed_at + timeouts.join_window_s
    if newcomers and len(chosen) < world.max_workers and now < settle:
        return Action(ActionKind.WAIT, "join window open", until=settle)
    rank0 = snap.members[chosen[0].member_id]
    number = snap.highest_generation_seen + 1
    if resume:
        reason = "resume"
    elif g is None:
        reason = "start"
    elif snap.aborted >= g.generation:
        reason = "aborted"
    elif any(m not in snap.members for m in g.members):
        reason = "member_lost"
    elif newcomers:
        reason = "join"
    elif any(m not in old for m in (r.member_id for r in chosen)):
        reason = "spare"
    else:
        reason = "regroup"
    record = GenerationRecord(
        generation=number,
        members=tuple(r.member_id for r in chosen),
        store_host=rank0.host,
        store_port=rank0.store_port,
        signature=job_sig,
        committed_step=chosen[0].committed_step,
        reason=reason,
        full_size=carried_full_size(g, len(chosen), world),
        holders=sum(1 for r in chosen if r.committed_step == chosen[0].committed_step),
    )
    return Action(
        ActionKind.PUBLISH,
        reason,
        record=record,
        expected_revision=snap.generation_revision,
    )


def waiting_newcomers(snap: Snapshot) -> frozenset[str]:
    """The ready candidates outside the current generation (every candidate before the first one),
    spares aside (no join window waits for them): whose arrivals open and extend the join window.
    Pure."""
    old = set(snap.generation.members) if snap.generation else set()
    return frozenset(
        r.member_id for r in candidates_of(snap) if r.member_id not in old and not is_spare(snap, r.member_id)
    )


def join_window_closes_at(
    snap: Snapshot, window: Window | None, now: float, world: WorldConfig, timeouts: Timeouts
) -> float | None:
    """While newcomers that a regroup of the current generation would admit are inside their join
    window, when it closes (``join_window_s`` after the set of waiting newcomers last changed);
    None when it is over, cut short (taking them in brings the generation to ``max_workers``), or
    nobody new waits. Until then the generation's members are not told of the newcomers (``judge``):
    they train on, since a regroup would only wait for the window to close (it cost every join
    ~0.25 s of training). Pure."""
    g = snap.generation
    if g is None or window is None or generation_broken(snap):  # a broken one is left at once anyway
        return None
    admitted = newcomers_admitted(snap, g, world)
    if not any(not is_spare(snap, m) for m in admitted):  # spares: no join window (publish_decision)
        return None
    outside = [r for r in candidates_of(snap) if r.member_id not in g.members]
    if g.world_size + len(outside) >= world.max_workers:  # cut short, as publish_decision does
        return None
    closes = window.newcomers_changed_at + timeouts.join_window_s
    return closes if now < closes else None


def judge(
    snap: Snapshot, world: WorldConfig, error: str = "", join_open: bool = False, now: float = 0.0
) -> VerdictRecord | None:
    """The coordinator's verdict on the current generation of a full snapshot (pure), or None when
    there is nothing to say (a healthy generation, nobody waiting to be admitted, no lost state,
    one model, or a finished job whose members are leaving): members take no verdict for a healthy
    one. ``error``: the job's state is lost (``publish_decision``). ``join_open``: the newcomers'
    join window is still open (``join_window_closes_at``): they are not announced yet. A verdict
    already stored for the generation keeps its reason to abandon: members that leave one by one
    must not rewrite a record that every member watches. An orphaned generation's verdict says
    since when (``resume.orphaned_since``, ``now`` being the caller's wall clock)."""
    g = snap.generation
    if g is None:
        sigs = {r.signature for r in snap.ready.values() if r.member_id in snap.members}
        if len(sigs) <= 1 and not error:
            return None
        return VerdictRecord(0, _first_signature(snap), "", 0, 0, error)
    if snap.finished is not None and snap.finished.generation >= g.generation:
        return None  # the job is done: its members leave one by one, nothing is lost
    stored = snap.verdict if snap.verdict is not None and snap.verdict.generation == g.generation else None
    abandon = stored.abandon if stored is not None else ""
    if not abandon:
        lost = [m for m in g.members if m not in snap.members]
        left = [m for m in g.members if m in snap.ready and snap.ready[m].prev_generation >= g.generation]
        if lost or left:
            what, ids = ("lost their lease", lost) if lost else ("left the generation", left)
            more = f" and {len(ids) - VERDICT_IDS} more" if len(ids) > VERDICT_IDS else ""
            abandon = f"members {what}: {ids[:VERDICT_IDS]}{more}"
    # newcomers are announced once their join window closed; to members that leave the generation
    # anyway (abandon) at once, so a window opening and closing never rewrites the record
    pending = bool(newcomers_admitted(snap, g, world)) and (not join_open or bool(abandon))
    orphaned = not any(m in snap.members for m in g.members)
    if not (abandon or pending or orphaned or error):
        return None
    return VerdictRecord(
        g.generation, g.signature, abandon, int(pending), int(orphaned), error, orphaned_since(snap, now)
    )


def verdict_on(view: Snapshot) -> VerdictRecord | None:
    """The verdict in ``view`` if it is about ``view``'s generation (an older one says nothing)."""
    v, g = view.verdict, view.generation
    if v is None or v.generation != (g.generation if g else 0):
        return None
    return v


def member_action(view: Snapshot, me: Me, world: WorldConfig) -> Action:
    """What a waiting member does next, from its own small view (``Keys.member_view``: the
    generation, abort, finished, verdict and coordinator records; never another member's). Pure.

    JOIN a generation that includes it; FINISHED; FAIL when its model differs from the job's;
    STATE_LOST when the coordinator said so; else WAIT (``standby`` when the generation is healthy
    at ``max_workers`` without it). Publishing is the coordinator's (``publish_decision``)."""
    done = _joined_or_finished(view, me)
    if done is not None:
        return done
    g = view.generation
    verdict = verdict_on(view)
    job_sig = g.signature if g else (verdict.signature if verdict else "")
    if job_sig and me.signature != job_sig:
        return _mismatch(me, job_sig)
    if verdict is not None and verdict.error:
        return Action(ActionKind.STATE_LOST, "state lost", error=verdict.error)
    if view.coordinator is None:
        return Action(ActionKind.WAIT, "no coordinator: electing one")
    if me.spare:
        return Action(ActionKind.WAIT, "spare: waiting until a generation needs me", standby=True)
    if (
        g is not None
        and me.member_id not in g.members
        and g.world_size >= world.max_workers
        and view.aborted < g.generation
        and (verdict is None or not verdict.abandon)
    ):
        return Action(
            ActionKind.WAIT,
            f"standby: generation {g.generation} is healthy at max_workers {world.max_workers}",
            standby=True,
        )
    return Action(ActionKind.WAIT, f"waiting for the coordinator {view.coordinator.member_id}")


def should_resume(view: Snapshot, held_step: int) -> bool:
    """``should_load_checkpoint`` from a member's small view: the coordinator's verdict says
    whether any member of the generation lives (pure)."""
    g = view.generation
    if g is not None:
        verdict = verdict_on(view)
        if verdict is None or not verdict.orphaned:
            return False
    return should_load_checkpoint(replace(view, members={}), held_step)


@dataclass(frozen=True)
class Health:
    """What a member of ``current`` makes of a snapshot (``assess_health``)."""

    abandon: bool  # leave the generation at the next chance (a wait in it ends now)
    reason: str
    fenced: bool  # and never commit in it again (superseded by one without me, aborted, or my lease is gone)
    join_pending: bool | None  # newcomers would be admitted by a regroup (None: this read cannot tell)
    superseded: bool = False  # a newer generation is published


def newcomers_admitted(snap: Snapshot, current: GenerationRecord, world: WorldConfig) -> tuple[str, ...]:
    """The ready candidates outside ``current`` that a regroup now would take in (pure).

    None while ``current`` is at ``max_workers``: a standby beyond it waits until a member leaves
    (the generation then breaks and the standby is chosen); forcing generations for it would only
    slow the job down, since ``rank_order`` would leave it out again."""
    if current.world_size >= world.max_workers:
        return ()
    outside = [r for r in candidates_of(snap) if r.member_id not in current.members]
    regular = tuple(r.member_id for r in outside if not is_spare(snap, r.member_id))
    if regular or current.world_size >= spare_target(current, world):
        return regular  # spares wait quietly while the generation is at the job's full size
    return tuple(r.member_id for r in outside)


def assess_health(view: Snapshot, current: GenerationRecord, me: str, joined_revision: int, lease_lost: bool) -> Health:
    """Whether the generation ``current`` that ``me`` is in can go on, from its small view (pure):
    the generation, abort and verdict records (``Keys.member_view``), never the members' own.

    ``joined_revision`` is the generation record's ``mod_revision`` when ``me`` joined it: a
    view read before that says nothing about this generation, so only ``lease_lost`` counts then.
    """
    if lease_lost:
        return Health(True, "my lease expired", True, None)
    if view.generation_revision < joined_revision:
        return Health(False, "", False, None)
    if view.generation is None and view.generation_revision != 0:
        # garbage written by hand: reported by the reader; not a reason to stop training
        return Health(False, "", False, None)
    if view.generation is None or view.generation.generation != current.generation:
        # Fenced unless the newer generation takes me (the survivors of a lost member, published at
        # once: rendezvous.survivors): it cannot train without me, so a step whose sum I hold is
        # still mine to apply with the peers that applied it.
        fenced = view.generation is None or me not in view.generation.members
        return Health(True, "generation superseded", fenced, None, view.generation is not None)
    if view.aborted >= current.generation:
        return Health(True, "generation aborted", True, None)
    v = verdict_on(view)
    if v is None:  # healthy, or not judged yet: the coordinator writes a verdict only to say something
        return Health(False, "", False, False)
    if v.abandon:
        return Health(True, v.abandon, False, bool(v.pending))
    return Health(False, "", False, bool(v.pending))
