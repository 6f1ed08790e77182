"""One parsed read of a job's rendezvous keys (``Snapshot``, ``parse_snapshot``), and which ready
records a published generation consumed (``consumed``). Pure."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.roster import fill, is_sparse
from elasticd.wire.records import (
    DECODE_ERRORS,
    AbortRecord,
    CheckpointRecord,
    CommittedRecord,
    CoordinatorRecord,
    FinishedRecord,
    GenerationRecord,
    MemberRecord,
    ReadyRecord,
    VerdictRecord,
    decode,
    decode_abort,
    decode_checkpoint,
    decode_generation,
    decode_verdict,
)


@dataclass(frozen=True)
class Snapshot:
    """Everything under the job prefix, parsed; malformed records are listed, not fatal."""

    generation: GenerationRecord | None = None
    generation_revision: int = 0
    members: Mapping[str, MemberRecord] = field(default_factory=dict)
    ready: Mapping[str, ReadyRecord] = field(default_factory=dict)
    ready_order: Mapping[str, int] = field(default_factory=dict)
    aborted: int = 0
    malformed: tuple[str, ...] = ()
    finished: FinishedRecord | None = None
    committed_step: int = -1
    checkpoint: CheckpointRecord | None = None
    verdict: VerdictRecord | None = None
    verdict_revision: int = 0
    coordinator: CoordinatorRecord | None = None
    ready_revision: Mapping[str, int] = field(default_factory=dict)  # each ready record's mod_revision
    coordinator_revision: int = 0
    spent_generation: int = 0  # the newest generation a consumed ready record's member had left
    # nodes of members left out because their processes are gone while their leases live
    # (``rendezvous.decide.without_gone``): a node lost whole, whose spares are gone too
    lost_nodes: frozenset[str] = frozenset()
    out_of_reach: frozenset[str] = frozenset()  # members the abort of ``aborted`` found out of reach
    aborted_at: float = 0.0  # when that abort was written (Unix time, by its writer's clock)

    @property
    def highest_generation_seen(self) -> int:
        """The newest generation number known (the next is numbered past it): consumed ready records
        count too, or a garbage generation record would let newcomers number theirs below the one
        still training."""
        seen = [self.generation.generation if self.generation else 0, self.aborted, self.spent_generation]
        seen += [r.prev_generation for r in self.ready.values()]
        return max(seen)


def consumed(generation_revision: int, ready_revision: Mapping[str, int]) -> list[str]:
    """The ready records that the generation record (written at ``generation_revision``; 0: none)
    consumed: every one written before it. Its members' records are spent; a record of a member it
    left out is stale: the member died after an earlier generation took it (its lease not yet
    ended), or it still waits, and then it writes its record anew on seeing a generation without
    it (``Membership.join``), so a record counts only while it is newer than the generation.
    Without that, a member killed unrevoked came back as a candidate the moment a generation left
    it out, and the next was published with a dead member. The records are not deleted when a
    generation is published (one operation per member in the publishing transaction, and etcd
    refuses more than 128 by default: no generation of 127 or more could form); a snapshot
    leaves them out, so they count as gone, as deleted ones did. The same holds after a
    generation record that does not parse (garbage written by hand): who it consumed is unknown,
    and the members training in the generation it replaced must not look like waiting ones."""
    return [m for m, rev in ready_revision.items() if rev < generation_revision]


def parse_snapshot(keys: Keys, kvs: Iterable[KeyValue]) -> Snapshot:
    """Turn the raw keys of a job into a ``Snapshot``; garbage is reported in ``malformed``."""
    generation: GenerationRecord | None = None
    generation_revision = verdict_revision = coordinator_revision = 0
    members: dict[str, MemberRecord] = {}
    ready: dict[str, ReadyRecord] = {}
    ready_order: dict[str, int] = {}
    ready_revision: dict[str, int] = {}
    abort = AbortRecord(0, "", "")
    finished: FinishedRecord | None = None
    committed_step = -1
    checkpoint: CheckpointRecord | None = None
    verdict: VerdictRecord | None = None
    coordinator: CoordinatorRecord | None = None
    malformed: list[str] = []
    rosters: dict[int, list[bytes]] = {}
    for kv in kvs:
        try:
            if kv.key == keys.generation:
                generation_revision = kv.mod_revision
                generation = decode_generation(kv.value)
            elif kv.key == keys.abort:
                abort = decode_abort(kv.value)
            elif kv.key == keys.finished:
                finished = decode(FinishedRecord, kv.value)
            elif kv.key == keys.committed:
                committed_step = decode(CommittedRecord, kv.value).step
            elif kv.key == keys.checkpoint:
                checkpoint = decode_checkpoint(kv.value)
            elif kv.key == keys.verdict:
                verdict_revision = kv.mod_revision
                verdict = decode_verdict(kv.value)
            elif kv.key == keys.coordinator:
                coordinator_revision = kv.mod_revision
                coordinator = decode(CoordinatorRecord, kv.value)
            elif kv.key.startswith(keys.roster_prefix):
                rosters.setdefault(keys.roster_of(kv.key)[0], []).append(kv.value)
            elif kv.key.startswith(keys.member("")):
                m = decode(MemberRecord, kv.value)
                if kv.key != keys.member(m.member_id):
                    raise ValueError("member id does not match its key")
                members[m.member_id] = m
            elif kv.key.startswith(keys.ready("")):
                r = decode(ReadyRecord, kv.value)
                if kv.key != keys.ready(r.member_id):
                    raise ValueError("member id does not match its key")
                ready[r.member_id] = r
                ready_order[r.member_id] = kv.create_revision
                ready_revision[r.member_id] = kv.mod_revision
        except DECODE_ERRORS as exc:
            malformed.append(f"{kv.key}: {exc}")
    if generation is not None and is_sparse(generation) and generation.generation in rosters:
        try:
            generation = fill(generation, rosters[generation.generation])
            if is_sparse(generation):
                raise ValueError("ranks missing")
        except DECODE_ERRORS as exc:
            malformed.append(f"{keys.roster_prefix}{generation.generation}: {exc}")
    spent = 0
    for mid in consumed(generation_revision, ready_revision):
        spent = max(spent, ready[mid].prev_generation)
        del ready[mid], ready_order[mid]
    return Snapshot(
        generation,
        generation_revision,
        members,
        ready,
        ready_order,
        abort.generation,
        tuple(malformed),
        finished,
        committed_step,
        checkpoint=checkpoint,
        verdict=verdict,
        verdict_revision=verdict_revision,
        coordinator=coordinator,
        ready_revision=ready_revision,
        coordinator_revision=coordinator_revision,
        spent_generation=spent,
        out_of_reach=frozenset(abort.out_of_reach),
        aborted_at=abort.at,
    )
