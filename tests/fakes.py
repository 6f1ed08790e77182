"""An in-memory ``store.kv.KeyValueStore`` with etcd's semantics, and a manual clock.

Only for what a real server would make slow: revisions, compare-and-set and leases behave like etcd
(``tests/integration/test_kv_contract.py`` runs the same suite against both, so this cannot drift):

* one global revision; every change (a put, a delete of an existing key, a successful transaction,
  a lease that ends with keys attached) advances it by exactly one, and all keys changed by that
  operation carry it as their ``mod_revision``; ``create_revision`` stays until the key is deleted;
* ``compare_and_put`` compares the key's ``mod_revision`` (0: the key must be absent) and, on
  success, puts the key (under ``lease``, if one is given) and deletes ``delete_keys`` in the same
  revision;
* leases run on a ``ManualClock``; a lease whose TTL has passed is expired (its keys deleted) at the
  start of the next call, so time only moves when a test says so;
* a put or revoke naming a lease that no longer exists raises ``LeaseLost``, like ``EtcdClient``;
* watch callbacks run synchronously, after the change and outside the store's lock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from elasticd.errors import LeaseLost
from elasticd.store.kv import KeyValue, RangeQuery, RangeResult


class ManualClock:
    """A monotonic clock that moves only when told (callable like ``time.monotonic``)."""

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go back")
        with self._lock:
            self._now += seconds


@dataclass
class _Lease:
    ttl_s: float
    expires_at: float
    keys: set[str] = field(default_factory=set)


@dataclass
class _Watch:
    prefix: str
    callback: Callable[[], None]
    active: bool = True


class FakeKeyValueStore:
    """``KeyValueStore`` in memory (thread-safe), with etcd's revision, CAS and lease semantics."""

    def __init__(self, clock: ManualClock | None = None) -> None:
        self.clock = clock or ManualClock()
        self.revision = 1  # etcd starts at revision 1 with an empty keyspace
        self._data: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x1000)
        self._watches: list[_Watch] = []
        self._lock = threading.RLock()
        self.calls = 0  # how many store operations were made (for tests that count round trips)
        self.term = 1  # etcd's raft term (a test raises it: a new leader, which refreshed every lease)

    # -- internals (call with the lock held) --------------------------------------------------

    def _begin(self) -> list[str]:
        """Count the call and expire the leases whose time has come; return the keys changed."""
        self.calls += 1
        changed: list[str] = []
        now = self.clock()
        for lease_id, lease in sorted(self._leases.items()):
            if lease.expires_at <= now:
                changed += self._end_lease(lease_id)
        return changed

    def _end_lease(self, lease_id: int) -> list[str]:
        lease = self._leases.pop(lease_id)
        gone = sorted(k for k in lease.keys if k in self._data and self._data[k].lease == lease_id)
        if gone:
            self.revision += 1
            for k in gone:
                del self._data[k]
        return gone

    def _put(self, key: str, value: bytes, lease: int) -> None:
        """Write one key at the current revision (the caller advanced it)."""
        old = self._data.get(key)
        if old is not None and old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        if lease:
            self._leases[lease].keys.add(key)
        self._data[key] = KeyValue(
            key=key,
            value=bytes(value),
            mod_revision=self.revision,
            create_revision=old.create_revision if old is not None else self.revision,
            lease=lease,
        )

    def _delete(self, key: str) -> bool:
        old = self._data.pop(key, None)
        if old is None:
            return False
        if old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        return True

    def _notify(self, changed: Iterable[str]) -> None:
        """Run the callbacks of the watches whose prefix covers a changed key (lock not held)."""
        keys = list(changed)
        if not keys:
            return
        with self._lock:
            watches = [w for w in self._watches if w.active]
        for w in watches:
            if w.active and any(k.startswith(w.prefix) for k in keys):
                w.callback()

    # -- KeyValueStore ------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            changed = self._begin()
            kv = self._data.get(key)
        self._notify(changed)
        return kv

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        with self._lock:
            changed = self._begin()
            rows = [kv for k, kv in sorted(self._data.items()) if k.startswith(prefix)]
        self._notify(changed)
        return rows

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        with self._lock:
            changed = self._begin()
            rows = [kv for p in prefixes for k, kv in sorted(self._data.items()) if k.startswith(p)]
        self._notify(changed)
        return rows

    def read_ranges(self, queries: Sequence[RangeQuery]) -> tuple[int, list[RangeResult]]:
        with self._lock:
            changed = self._begin()
            results = []
            for q in queries:
                under = [kv for k, kv in sorted(self._data.items()) if k.startswith(q.prefix)]
                kept = [kv for kv in under if kv.mod_revision >= q.min_mod_revision]
                if q.keys_only:
                    kept = [replace(kv, value=b"") for kv in kept]
                results.append(RangeResult(kept, len(under)))
            revision = self.revision
        self._notify(changed)
        return revision, results

    def put_many(self, items: Sequence[tuple[str, bytes, int]], what: str = "put_many") -> int:
        with self._lock:
            changed = self._begin()
            lost = [lease for _, _, lease in items if lease and lease not in self._leases]
            if not lost:
                self.revision += 1
                for key, value, lease in items:
                    self._put(key, value, lease)
                    changed.append(key)
            revision = self.revision
        self._notify(changed)
        if lost:
            raise LeaseLost(f"{what}: the lease {lost[0]} no longer exists")
        return revision

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        return FakeKeyValueStore.put_many(self, [(key, value, lease)], "put")

    def delete(self, key: str) -> None:
        with self._lock:
            changed = self._begin()
            if key in self._data:
                self.revision += 1
                self._delete(key)
                changed.append(key)
        self._notify(changed)

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
        deletes = list(delete_keys)
        extra = dict(put_keys or {})
        with self._lock:
            changed = self._begin()
            current = self._data.get(key)
            actual = current.mod_revision if current is not None else 0
            ok = actual == expected_mod_revision
            # etcd checks the lease of the branch it takes only: a failed compare is no error
            raise_lost = ok and bool(lease) and lease not in self._leases
            if ok and not raise_lost:
                self.revision += 1
                self._put(key, value, lease)
                changed.append(key)
                for k in deletes:
                    if k != key and self._delete(k):
                        changed.append(k)
                for start, end in delete_ranges:
                    for k in [k for k in self._data if start <= k < end and k != key]:
                        if self._delete(k):
                            changed.append(k)
                for k, v in extra.items():
                    self._put(k, v, 0)
                    changed.append(k)
        self._notify(changed)
        if raise_lost:
            raise LeaseLost(f"compare_and_put: the lease {lease} no longer exists")
        return ok

    def grant_lease(self, ttl_s: float) -> int:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        with self._lock:
            changed = self._begin()
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = _Lease(ttl_s, self.clock() + ttl_s)
        self._notify(changed)
        return lease_id

    def refresh_lease(self, lease: int) -> float:
        with self._lock:
            changed = self._begin()
            found = self._leases.get(lease)
            if found is None:
                ttl = 0.0
            else:
                found.expires_at = self.clock() + found.ttl_s
                ttl = found.ttl_s
        self._notify(changed)
        return ttl

    def raft_term(self) -> int:
        return self.term

    def new_leader(self) -> None:
        """What etcd does when a new leader is elected: a higher raft term, and every lease refreshed
        to its full TTL (etcd's lessor ``Promote``)."""
        with self._lock:
            self.term += 1
            for lease in self._leases.values():
                lease.expires_at = self.clock() + lease.ttl_s

    def revoke_lease(self, lease: int) -> None:
        with self._lock:
            changed = self._begin()
            known = lease in self._leases
            if known:
                changed += self._end_lease(lease)
        self._notify(changed)
        if not known:
            raise LeaseLost(f"revoke_lease: the lease {lease} no longer exists")

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        watch = _Watch(prefix, callback)
        with self._lock:
            changed = self._begin()
            self._watches.append(watch)
        self._notify(changed)

        def cancel() -> None:
            with self._lock:
                watch.active = False
                if watch in self._watches:
                    self._watches.remove(watch)

        return cancel

    # -- test helpers (not part of KeyValueStore) ---------------------------------------------

    def lease_ttl_remaining(self, lease: int) -> float:
        """Seconds until ``lease`` expires on the manual clock (<= 0: gone); changes nothing."""
        with self._lock:
            found = self._leases.get(lease)
            return found.expires_at - self.clock() if found is not None else 0.0


class GuardedStore(FakeKeyValueStore):
    """The fake store where every call first passes ``guard(call)``: a test's subclass raises there
    to refuse it (etcd down, a role that does not cover the key)."""

    def guard(self, call: str) -> None:
        """Raise to refuse ``call`` (the method's name)."""

    def get(self, key: str) -> KeyValue | None:
        self.guard("get")
        return super().get(key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        self.guard("get_prefix")
        return super().get_prefix(prefix)

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        self.guard("get_prefixes")
        return super().get_prefixes(prefixes)

    def read_ranges(self, queries: Sequence[RangeQuery]) -> tuple[int, list[RangeResult]]:
        self.guard("read_ranges")
        return super().read_ranges(queries)

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self.guard("put")
        return super().put(key, value, lease)

    def put_many(self, items: Sequence[tuple[str, bytes, int]]) -> int:
        self.guard("put_many")
        return super().put_many(items)

    def delete(self, key: str) -> None:
        self.guard("delete")
        super().delete(key)

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
        self.guard("compare_and_put")
        return super().compare_and_put(key, expected_mod_revision, value, delete_keys, put_keys, lease, delete_ranges)

    def grant_lease(self, ttl_s: float) -> int:
        self.guard("grant_lease")
        return super().grant_lease(ttl_s)

    def refresh_lease(self, lease: int) -> float:
        self.guard("refresh_lease")
        return super().refresh_lease(lease)

    def revoke_lease(self, lease: int) -> None:
        self.guard("revoke_lease")
        super().revoke_lease(lease)

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        self.guard("watch_prefix")
        return super().watch_prefix(prefix, callback)
