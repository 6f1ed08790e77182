"""One parsed read of a job's rendezvous keys (``Snapshot``, ``parse_snapshot``), which ready
records a published generation consumed (``consumed``), and the records already decoded
(``DecodedRecords``: a reader that parses the whole job each round decodes only what changed)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

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


def _generation(kv: KeyValue) -> GenerationRecord:
    return decode_generation(kv.value)


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


_T = TypeVar("_T")


class DecodedRecords:
    """What each key's record decoded to, by its ``mod_revision``: a record is decoded once per
    version it has. The coordinator parses the whole job every round (``JobReader.snapshot``); with
    this, a round decodes the records changed since the last (``store.mirror`` reads only those),
    not every member's. Records are immutable, so one decoded record serves every snapshot that
    holds it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, tuple[int, object]] = {}
        self.decoded = 0  # records decoded (or tried), not found held: for tests and the benchmark

    def get(self, kv: KeyValue, decoder: Callable[[KeyValue], _T]) -> _T:
        """``decoder(kv)``, or what it gave for this key at this revision.

        Raises:
            what ``decoder`` raises (nothing is held then).
        """
        held = self._held.get(kv.key)  # one dict read: atomic, and ``keep`` replaces the dict whole
        if held is not None and held[0] == kv.mod_revision:
            return held[1]  # type: ignore[return-value]
        with self._lock:
            self.decoded += 1
        value = decoder(kv)
        with self._lock:
            self._held[kv.key] = (kv.mod_revision, value)
        return value

    def keep(self, keys: set[str]) -> None:
        """Forget every key not in ``keys`` (those of the newest parse: deleted keys go)."""
        with self._lock:
            if len(self._held) > len(keys) or any(k not in keys for k in self._held):
                self._held = {k: v for k, v in self._held.items() if k in keys}


def _fresh(kv: KeyValue, decoder: Callable[[KeyValue], _T]) -> _T:
    return decoder(kv)


@dataclass
class _JobRecords:
    """The job's own records in one read (one of each at most), as ``_job_records`` found them."""

    generation: GenerationRecord | None = None
    generation_revision: int = 0
    abort: AbortRecord = AbortRecord(0, "", "")
    finished: FinishedRecord | None = None
    committed_step: int = -1
    checkpoint: CheckpointRecord | None = None
    verdict: VerdictRecord | None = None
    verdict_revision: int = 0
    coordinator: CoordinatorRecord | None = None
    coordinator_revision: int = 0


def _job_records(
    keys: Keys, kvs: Iterable[KeyValue], get: Callable[[KeyValue, Callable[[KeyValue], _T]], _T], malformed: list[str]
) -> _JobRecords:
    """The job's own records among ``kvs`` (every key but the members' and ready ones), the
    generation filled from its roster when it is a large one; garbage is added to ``malformed``."""
    out = _JobRecords()
    rosters: dict[int, list[bytes]] = {}
    for kv in kvs:
        try:
            if kv.key == keys.generation:
                out.generation_revision = kv.mod_revision
                out.generation = get(kv, _generation)  # type: ignore[arg-type]
            elif kv.key == keys.abort:
                out.abort = decode_abort(kv.value)
            elif kv.key == keys.finished:
                out.finished = decode(FinishedRecord, kv.value)
            elif kv.key == keys.committed:
                out.committed_step = decode(CommittedRecord, kv.value).step
            elif kv.key == keys.checkpoint:
                out.checkpoint = decode_checkpoint(kv.value)
            elif kv.key == keys.verdict:
                out.verdict_revision = kv.mod_revision
                out.verdict = decode_verdict(kv.value)
            elif kv.key == keys.coordinator:
                out.coordinator_revision = kv.mod_revision
                out.coordinator = decode(CoordinatorRecord, kv.value)
            elif kv.key.startswith(keys.roster_prefix):
                rosters.setdefault(keys.roster_of(kv.key)[0], []).append(kv.value)
        except DECODE_ERRORS as exc:
            malformed.append(f"{kv.key}: {exc}")
    g = out.generation
    if g is not None and is_sparse(g) and g.generation in rosters:
        try:
            out.generation = fill(g, rosters[g.generation])
            if is_sparse(out.generation):
                raise ValueError("ranks missing")
        except DECODE_ERRORS as exc:
            malformed.append(f"{keys.roster_prefix}{g.generation}: {exc}")
    return out


def parse_snapshot(keys: Keys, kvs: Iterable[KeyValue], decoded: DecodedRecords | None = None) -> Snapshot:
    """Turn the raw keys of a job into a ``Snapshot``; garbage is reported in ``malformed``.
    ``decoded``: records decoded by earlier parses, reused where their revision is the same (the
    snapshot is the same as without it)."""
    get = decoded.get if decoded is not None else _fresh
    members: dict[str, MemberRecord] = {}
    ready: dict[str, ReadyRecord] = {}
    ready_order: dict[str, int] = {}
    ready_revision: dict[str, int] = {}
    malformed: list[str] = []
    others: list[KeyValue] = []
    seen: set[str] = set()
    k_member, k_ready = keys.member(""), keys.ready("")  # formatted once: two records per member

    def member_of(kv: KeyValue) -> MemberRecord:
        m = decode(MemberRecord, kv.value)
        if kv.key != k_member + m.member_id:
            raise ValueError("member id does not match its key")
        return m

    def ready_of(kv: KeyValue) -> ReadyRecord:
        r = decode(ReadyRecord, kv.value)
        if kv.key != k_ready + r.member_id:
            raise ValueError("member id does not match its key")
        return r

    for kv in kvs:
        seen.add(kv.key)
        try:
            if kv.key.startswith(k_member):
                m = get(kv, member_of)
                members[m.member_id] = m
            elif kv.key.startswith(k_ready):
                r = get(kv, ready_of)
                ready[r.member_id] = r
                ready_order[r.member_id] = kv.create_revision
                ready_revision[r.member_id] = kv.mod_revision
            else:
                others.append(kv)
        except DECODE_ERRORS as exc:
            malformed.append(f"{kv.key}: {exc}")
    if decoded is not None:
        decoded.keep(seen)
    job = _job_records(keys, others, get, malformed)
    spent = 0
    for mid in consumed(job.generation_revision, ready_revision):
        spent = max(spent, ready[mid].prev_generation)
        del ready[mid], ready_order[mid]
    return Snapshot(
        job.generation,
        job.generation_revision,
        members,
        ready,
        ready_order,
        job.abort.generation,
        tuple(malformed),
        job.finished,
        job.committed_step,
        checkpoint=job.checkpoint,
        verdict=job.verdict,
        verdict_revision=job.verdict_revision,
        coordinator=job.coordinator,
        ready_revision=ready_revision,
        coordinator_revision=job.coordinator_revision,
        spent_generation=spent,
        out_of_reach=frozenset(job.abort.out_of_reach),
        aborted_at=job.abort.at,
    )
