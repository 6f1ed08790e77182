"""The member leases a node's relay grants its workers under the node's one etcd lease (``MemberLeases``).

etcd sees one lease per node: the relay's (``NodeRelay``), renewed once per ``keepalive_s``. Each
worker holds a *member lease* of the relay instead of an etcd lease of its own: it renews it with
the relay, over the node's Unix socket, as it would renew an etcd lease, and its leased records
(``members/``, ``ready/``, ``progress/``, the ``coordinator`` seat) are written through the relay
under the node's lease. A member lease ends as an etcd lease would, and then the relay deletes the
keys written under it:

* not renewed for ``lease_ttl_s`` (a stopped or hung-up worker; ``expired``, the rule);
* revoked by its worker (it leaves the job), or by the agent (its supervision says the worker is
  dead or stopped);
* its worker's socket closed (the process exited or was killed): at once;
* the node's lease ended (the agent lost etcd for ``lease_ttl_s``): every member lease with it (its
  keys went with the node's lease).

Owns the bookkeeping only: no I/O, no clock (``now`` is an argument), no thread; the relay holds
its lock around every call.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field


@dataclass
class MemberLease:
    """One worker's lease of its relay: who holds it, when it was last renewed, and the keys written
    under it (key -> the value written, which must still be there for the relay to delete it)."""

    id: int
    owner: Hashable  # the worker's connection
    renewed_at: float
    # key -> the value it must still hold to be deleted (None: any value; the key is this
    # member's alone); a key is noted before it is written, so none written escapes its lease
    keys: dict[str, bytes | None] = field(default_factory=dict)
    ended: bool = False  # no renewal and no write under it from now on; its keys still to delete


def expired(leases: Iterable[MemberLease], now: float, ttl_s: float) -> list[int]:
    """The live member leases not renewed for ``ttl_s`` by ``now``: ended, as etcd ends a lease. Pure."""
    return [m.id for m in leases if not m.ended and now - m.renewed_at >= ttl_s]


def next_expiry(leases: Iterable[MemberLease], ttl_s: float) -> float | None:
    """When the next live member lease ends if not renewed (None: none). Pure."""
    return min((m.renewed_at + ttl_s for m in leases if not m.ended), default=None)


class MemberLeases:
    """The live member leases of one relay. Ids are never reused while the relay runs."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._ids = itertools.count(1)
        self._live: dict[int, MemberLease] = {}

    def __len__(self) -> int:
        return len(self._live)

    def grant(self, owner: Hashable, now: float) -> int:
        lease = next(self._ids)
        self._live[lease] = MemberLease(lease, owner, now)
        return lease

    def renew(self, lease: int, owner: Hashable, now: float) -> float:
        """Renew ``lease`` for its ``owner``; the TTL it has now (0: it ended, or is not theirs)."""
        m = self._live.get(lease)
        if m is None or m.ended or m.owner != owner:
            return 0.0
        m.renewed_at = now
        return self.ttl_s

    def holds(self, lease: int, owner: Hashable) -> bool:
        """``lease`` is live and ``owner``'s."""
        m = self._live.get(lease)
        return m is not None and not m.ended and m.owner == owner

    def note(self, lease: int, owner: Hashable, key: str, value: bytes | None) -> bool:
        """``key`` is about to be written under ``lease`` by ``owner``: noted, so that the lease's
        end deletes it (``value``: only while it holds that value); False: the lease has ended or
        is not theirs, and nothing may be written under it."""
        if not self.holds(lease, owner):
            return False
        self._live[lease].keys[key] = value
        return True

    def end(self, leases: Iterable[int]) -> list[int]:
        """Mark ``leases`` ended (those live); returns them. Their keys stay noted until ``take``."""
        out = []
        for lease in leases:
            m = self._live.get(lease)
            if m is not None and not m.ended:
                m.ended = True
                out.append(lease)
        return out

    def take(self, leases: Iterable[int]) -> list[tuple[str, bytes | None]]:
        """Forget ended ``leases``; the keys noted under them, for the relay to delete."""
        out: list[tuple[str, bytes | None]] = []
        for lease in leases:
            m = self._live.get(lease)
            if m is not None and m.ended:
                del self._live[lease]
                out.extend(m.keys.items())
        return out

    def expired(self, now: float) -> list[int]:
        return expired(self._live.values(), now, self.ttl_s)

    def next_expiry(self) -> float | None:
        return next_expiry(self._live.values(), self.ttl_s)

    def of_owner(self, owner: Hashable) -> list[int]:
        return [m.id for m in self._live.values() if m.owner == owner and not m.ended]

    def holding(self, keys: Iterable[str]) -> list[int]:
        """The live leases under which any of ``keys`` was noted."""
        wanted = set(keys)
        return [m.id for m in self._live.values() if not m.ended and wanted & m.keys.keys()]

    def forget_all(self) -> int:
        """The node's lease ended: every member lease with it (their keys are gone already)."""
        n = len(self._live)
        self._live.clear()
        return n
