"""What a member reads of its job (``JobReader``): its own small view, or the whole rendezvous.

Owns the two reads and their parsing: ``view`` (``Keys.member_view``: the generation, abort,
finished, committed, checkpoint, verdict and coordinator records, plus, for a large generation,
the one roster bucket of this member's node: ``wire.roster``), whose size does not grow with the
job, read by every member; and ``snapshot`` (``Keys.rendezvous``: every member's and ready record
too), read only by the coordinator, a deputy and tools, each time only what changed since its
last (``store.mirror``), decoding only the records that changed. A malformed record is logged
once and left out. Never writes and never decides.
"""

from __future__ import annotations

from dataclasses import replace

import structlog

from elasticd.store.kv import KeyValueStore
from elasticd.store.mirror import RangeMirror
from elasticd.wire.keys import Keys
from elasticd.wire.records import DECODE_ERRORS, GenerationRecord
from elasticd.wire.roster import bucket_of, buckets_for, fill, is_sparse
from elasticd.wire.snapshot import DecodedRecords, Snapshot, parse_snapshot

log = structlog.get_logger(__name__)


class JobReader:
    """One member's reads. Thread-safe enough: the roster cache is one tuple, replaced whole."""

    def __init__(self, store: KeyValueStore, keys: Keys, node: str) -> None:
        self._store = store
        self._keys = keys
        self._node = node
        self._warned: set[str] = set()
        self._roster: tuple[int, GenerationRecord] | None = None  # (revision, my view of a large generation)
        self._mirror = RangeMirror(store, keys.rendezvous)
        self._decoded = DecodedRecords()  # the whole job's records, decoded once per version

    def view(self) -> Snapshot:
        """This member's view of the job, in one transaction (and one small read of its node's
        roster bucket the first time it sees a large generation); never another member's record,
        so its cost does not grow with the job.

        Raises:
            EtcdUnavailable: etcd could not be reached within the retry bound.
        """
        view = self._parsed(self._keys.member_view)
        g = view.generation
        if g is None or not is_sparse(g):
            return view
        cached = self._roster
        if cached is None or cached[0] != view.generation_revision:
            key = self._keys.roster(g.generation, bucket_of(self._node, buckets_for(g.world_size)))
            kv = self._store.get(key)
            try:
                cached = (view.generation_revision, fill(g, [kv.value] if kv else []))
            except DECODE_ERRORS as exc:
                self._warn(f"{key}: {exc}")
                cached = (view.generation_revision, g)
            self._roster = cached
        return replace(view, generation=cached[1])

    def snapshot(self) -> Snapshot:
        """All of the job's rendezvous keys (``Keys.rendezvous``) as of one revision: the
        coordinator's and a deputy's read, and tools'. After the first, a read costs etcd what
        changed since the last (``store.mirror``), not the job's size, and decodes only the records
        changed since (``wire.snapshot.DecodedRecords``).

        Raises:
            EtcdUnavailable: etcd could not be reached within the retry bound.
        """
        return self._checked(parse_snapshot(self._keys, self._mirror.read(), self._decoded))

    def _parsed(self, prefixes: tuple[str, ...]) -> Snapshot:
        return self._checked(parse_snapshot(self._keys, self._store.get_prefixes(prefixes)))

    def _checked(self, snap: Snapshot) -> Snapshot:
        for bad in snap.malformed:
            self._warn(bad)
        return snap

    def _warn(self, bad: str) -> None:
        if bad not in self._warned:
            self._warned.add(bad)
            log.error("malformed_record_ignored", record=bad)
