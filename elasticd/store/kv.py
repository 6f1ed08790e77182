"""The key-value store port: what elasticd needs from etcd, and the key as read.

Owns ``KeyValue`` and the ``KeyValueStore`` protocol. ``store.etcd.EtcdClient`` satisfies it
structurally; the unit tests' fake does too. Imports nothing of elasticd but the base modules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class KeyValue:
    """One key as read from the store."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


@dataclass(frozen=True)
class RangeQuery:
    """One range read of ``KeyValueStore.read_ranges``: every key under ``prefix`` (a whole key is a
    prefix too), or only those changed since a revision."""

    prefix: str
    min_mod_revision: int = 0  # only the keys whose mod_revision is at least this (0: every key)
    keys_only: bool = False  # the keys and their revisions, no values


@dataclass(frozen=True)
class RangeResult:
    """What one ``RangeQuery`` read: the keys that pass its filter, in key order, and how many keys
    lie under its prefix, whatever the filter (etcd counts the range before filtering)."""

    kvs: list[KeyValue]
    count: int


class KeyValueStore(Protocol):
    """What the rendezvous needs from etcd. ``etcd.EtcdClient`` satisfies it structurally."""

    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        """The keys under each of ``prefixes`` (a whole key is a prefix too), read in one
        transaction, so all of them are from one revision; in the order of ``prefixes``."""
        ...

    def read_ranges(self, queries: Sequence[RangeQuery]) -> tuple[int, list[RangeResult]]:
        """Every query of ``queries`` in one transaction: the store's revision it read at, and a
        result per query, in order. A copy of some prefixes (``store.mirror``) reads only what
        changed since its revision this way."""
        ...

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Put ``key`` (under ``lease``, if not 0); returns the store's revision after the put (the
        key's mod_revision)."""
        ...

    def put_many(self, items: Sequence[tuple[str, bytes, int]]) -> int:
        """Put every (key, value, lease) of ``items`` (lease 0: none) in one transaction; returns the
        store's revision after it (each key's mod_revision).

        Raises:
            LeaseLost: a lease of ``items`` is gone (nothing was written).
        """
        ...

    def delete(self, key: str) -> None: ...

    def compare_and_put(
        self,
        key: str,
        expected_mod_revision: int,
        value: bytes,
        delete_keys: Iterable[str] = (),
        put_keys: Mapping[str, bytes] | None = None,
        lease: int = 0,
        delete_ranges: Iterable[tuple[str, str]] = (),
    ) -> bool:
        """Put ``key`` (under ``lease``, if not 0; and delete ``delete_keys`` and every key in each
        [start, end) of ``delete_ranges``, and put ``put_keys``, unleased) iff its mod_revision is as
        expected (0: absent), all in one transaction.

        Raises:
            LeaseLost: ``lease`` is gone (only when the compare held).
        """
        ...

    def delete_held(self, items: Sequence[tuple[str, bytes | None]], lease: int) -> int:
        """Delete each (key, value) of ``items`` that is still held by ``lease`` (and, where
        ``value`` is not None, still holds that value), each key by a transaction of its own; returns
        how many were deleted. A node's relay releases one worker's keys of the node's lease this
        way: a key written since under another lease, or by another member, stays."""
        ...

    def grant_lease(self, ttl_s: float) -> int: ...

    def refresh_lease(self, lease: int) -> float:
        """Renew; return the remaining TTL in seconds (<= 0: the lease is gone)."""
        ...

    def revoke_lease(self, lease: int) -> None: ...

    def raft_term(self) -> int:
        """The highest etcd raft term seen in an answer to ``get`` (0: none seen). A higher one means
        a new leader since, which refreshed every lease to its full TTL (``presence.wait_began``)."""
        ...

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (no arguments) after any change under ``prefix``; return a canceller."""
        ...
