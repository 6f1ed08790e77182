"""A copy of the keys under a few prefixes, brought up to date by reading what changed
(``RangeMirror``), and the rules that merge such a read into the copy (``merge_changes``,
``merge_listing``).

The coordinator reads its job's rendezvous every round: every member's and ready record. Read
whole, a round costs etcd the job's size (megabytes at a fleet's), whatever changed. A mirror
reads, in one transaction at one revision, each prefix's keys changed since the revision it holds
(etcd's ``min_mod_revision`` filter) and how many keys lie under it now (etcd counts before it
filters). A copy of the prefix is then exact when that count is what the copy and the changed keys
add up to: a key in the copy that was deleted since would make the count smaller, and the changed
keys include every key created since. Otherwise (a member left, a lease ended) it reads the keys
alone, without their values, with the changes again, at one revision; only a read that still does
not add up (never, but for a defect) reads everything. Each read is consistent: one revision for
every prefix, as a whole read is. Never imports etcd3; the rules are pure.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from elasticd.store.kv import KeyValue, KeyValueStore, RangeQuery, RangeResult

Copy = Mapping[str, KeyValue]  # one prefix's keys as of the mirror's revision


def merge_changes(copy: Copy, changed: RangeResult) -> dict[str, KeyValue] | None:
    """The prefix's keys now, from its ``copy`` and a read of the keys changed since the copy's
    revision (``changed``: ``min_mod_revision`` one past it, ``count`` every key under the prefix
    now); None when a key of the copy was deleted since (the read cannot say which). Pure."""
    fresh = {kv.key: kv for kv in changed.kvs}
    created = sum(1 for key in fresh if key not in copy)
    if changed.count != len(copy) + created:
        return None
    return {**copy, **fresh}


def merge_listing(copy: Copy, since: int, listing: RangeResult, changed: RangeResult) -> dict[str, KeyValue] | None:
    """The prefix's keys now, from its ``copy`` (as of revision ``since``), every key under the
    prefix now without its value (``listing``, ``keys_only``) and, read at the same revision, the
    keys changed since (``changed``); None when they disagree (a key the listing says is unchanged
    that the copy lacks or holds at another revision). Pure."""
    fresh = {kv.key: kv for kv in changed.kvs}
    out: dict[str, KeyValue] = {}
    for kv in listing.kvs:
        held = fresh.get(kv.key) if kv.mod_revision > since else copy.get(kv.key)
        if held is None or held.mod_revision != kv.mod_revision:
            return None
        out[kv.key] = held
    return out


class RangeMirror:
    """The keys under ``prefixes``, read from ``store`` as they are now, at the cost of what changed
    since the last read (``read``). Thread-safe: concurrent reads each read etcd and the newest
    revision's copy is kept."""

    def __init__(self, store: KeyValueStore, prefixes: Sequence[str]) -> None:
        self._store = store
        self._prefixes = tuple(prefixes)
        self._lock = threading.Lock()
        self._revision = 0  # of the copies (0: none yet)
        self._copies: tuple[dict[str, KeyValue], ...] = ()
        self.reads = {"changes": 0, "listings": 0, "whole": 0}  # how each read ended (for tests)

    def read(self) -> list[KeyValue]:
        """Every key under each prefix, in the order of the prefixes and by key within each, as of
        one revision.

        Raises:
            EtcdUnavailable: the store could not be reached within its retry bound.
        """
        with self._lock:
            since, copies = self._revision, self._copies
        if since == 0:
            revision, copies = self._whole()
        else:
            revision, got = self._store.read_ranges([RangeQuery(p, since + 1) for p in self._prefixes])
            merged = [merge_changes(c, r) for c, r in zip(copies, got, strict=True)]
            if all(m is not None for m in merged):
                self._count("changes")
                copies = tuple(m for m in merged if m is not None)
            else:
                revision, copies = self._listed(since, copies, [m is None for m in merged])
        with self._lock:
            if revision >= self._revision:
                self._revision, self._copies = revision, copies
        return [kv for copy in copies for _, kv in sorted(copy.items())]

    def _listed(
        self, since: int, copies: tuple[dict[str, KeyValue], ...], deleted: list[bool]
    ) -> tuple[int, tuple[dict[str, KeyValue], ...]]:
        """Read again, at one revision: the changes since ``since`` of every prefix, and the keys
        of those where some were ``deleted``; merge (``merge_listing``), or read everything."""
        queries = [RangeQuery(p, since + 1) for p in self._prefixes]
        listed = [RangeQuery(p, keys_only=True) for p, d in zip(self._prefixes, deleted, strict=True) if d]
        revision, got = self._store.read_ranges(queries + listed)
        changes, listings = got[: len(queries)], iter(got[len(queries) :])
        out: list[dict[str, KeyValue]] = []
        for copy, change, d in zip(copies, changes, deleted, strict=True):
            merged = merge_listing(copy, since, next(listings), change) if d else merge_changes(copy, change)
            if merged is None:
                return self._whole()
            out.append(merged)
        self._count("listings")
        return revision, tuple(out)

    def _whole(self) -> tuple[int, tuple[dict[str, KeyValue], ...]]:
        revision, got = self._store.read_ranges([RangeQuery(p) for p in self._prefixes])
        self._count("whole")
        return revision, tuple({kv.key: kv for kv in r.kvs} for r in got)

    def _count(self, how: str) -> None:
        with self._lock:
            self.reads[how] += 1
