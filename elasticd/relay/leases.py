"""The member leases a node's relay grants its workers under the node's one etcd lease (``MemberLeases``).

etcd sees one lease per node: the node agent's (its node record's), renewed once per
``keepalive_s``. Each worker holds a *member lease* of its node's relay instead of an etcd lease
of its own, and its leased records (``members/``, ``ready/``, ``progress/``, the ``coordinator``
seat) are written through the relay under the node's lease. The relay knows its workers' liveness
first hand, so a member lease needs no renewal: it lives while its worker's connection is open and
its process runs, and it ends

* when its worker's socket closes (the process exited or was killed): at once;
* when its worker's process has been stopped (SIGSTOP, SIGTSTP: state ``T``, seen in ``/proc``)
  for ``lease_ttl_s``, as an etcd lease not renewed for its TTL would (``expired``, the rule);
* when its worker revokes it (it leaves the job), or the agent releases it (its supervision says
  the worker is dead, stopped past ``stopped_worker_s``, hung or its replica ended);
* when the node's lease ends (the agent lost etcd for ``lease_ttl_s``): every member lease with
  it, its keys with the node's lease.

The relay then deletes the keys written under the member lease and tells its worker, which
answers 0 at its next renewal and registers again.

Owns the bookkeeping only: no I/O, no clock (``now`` is an argument), no thread; the relay holds
its lock around every call.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass
class MemberLease:
    """One worker's lease of its relay: who holds it, since when its process is stopped (None:
    running), and the keys written under it."""

    id: int
    owner: Hashable  # the worker's connection
    pid: int = 0  # the worker's process (0: unknown: no stop is seen)
    stopped_since: float | None = None
    # key -> the value it must still hold to be deleted (None: any value; the key is this
    # member's alone); a key is noted before it is written, so none written escapes its lease
    keys: dict[str, bytes | None] = field(default_factory=dict)
    ended: bool = False  # no write under it from now on; its keys still to delete


def expired(leases: Iterable[MemberLease], now: float, ttl_s: float) -> list[int]:
    """The live member leases whose process has been stopped for ``ttl_s`` by ``now``: ended, as
    etcd ends a lease not renewed for its TTL. Pure."""
    return [m.id for m in leases if not m.ended and m.stopped_since is not None and now - m.stopped_since >= ttl_s]


class MemberLeases:
    """The live member leases of one relay. Ids are never reused while the relay runs."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._ids = itertools.count(1)
        self._live: dict[int, MemberLease] = {}

    def __len__(self) -> int:
        return len(self._live)

    def grant(self, owner: Hashable, pid: int = 0) -> int:
        lease = next(self._ids)
        self._live[lease] = MemberLease(lease, owner, pid)
        return lease

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

    def pids(self) -> dict[int, int]:
        """lease -> the pid of its worker's process, for each live lease whose pid is known."""
        return {m.id: m.pid for m in self._live.values() if not m.ended and m.pid}

    def observe(self, stopped: Mapping[int, bool], now: float) -> None:
        """The process states seen at ``now``: lease -> whether its worker's process is stopped."""
        for lease, is_stopped in stopped.items():
            m = self._live.get(lease)
            if m is None or m.ended:
                continue
            if not is_stopped:
                m.stopped_since = None
            elif m.stopped_since is None:
                m.stopped_since = now

    def end(self, leases: Iterable[int]) -> list[int]:
        """Mark ``leases`` ended (those live); returns them. Their keys stay noted until ``take``."""
        out = []
        for lease in leases:
            m = self._live.get(lease)
            if m is not None and not m.ended:
                m.ended = True
                out.append(lease)
        return out

    def owner_of(self, lease: int) -> Hashable | None:
        m = self._live.get(lease)
        return None if m is None else m.owner

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

    def of_owner(self, owner: Hashable) -> list[int]:
        return [m.id for m in self._live.values() if m.owner == owner and not m.ended]

    def holding(self, keys: Iterable[str]) -> list[int]:
        """The live leases under which any of ``keys`` was noted."""
        wanted = set(keys)
        return [m.id for m in self._live.values() if not m.ended and wanted & m.keys.keys()]

    def forget_all(self) -> dict[int, Hashable]:
        """The node's lease ended: every member lease with it (their keys are gone already); their
        owners, to tell them."""
        owners = {m.id: m.owner for m in self._live.values()}
        self._live.clear()
        return owners
