"""What one member knows of its own liveness in etcd: its lease (``Lease``), and whether etcd
answers it (``Reachability``, for the logs). Liveness only: nothing here enters a step's verdict.

``Lease`` owns the lease id (a new grant after the old one was lost replaces it), the TTL etcd granted
(learned from each renewal's answer, as python-etcd3's ``Lease`` keeps ``granted_ttl``: etcd may
raise a short TTL to its minimum, and rounds to whole seconds) and when the last granted renewal was
asked.

Never writes a key, never starts a thread (``Reachability.background`` is the loop of the
membership's own), and never decides what a lost lease means (the membership does). The keepalive thread renews and reads it while the training thread may grant a
new one: each field is written in one assignment, and a renewal's answer counts only for the lease
it was asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.retry import Clock
from elasticd.store.kv import KeyValueStore

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Renewal:
    """One renewal's answer: the lease asked for, the TTL it has now (0: gone), and when it was
    asked (monotonic seconds)."""

    lease: int
    ttl_s: float
    asked_at: float


class Lease:
    """A member's lease: granted, renewed and revoked through the store."""

    def __init__(self, store: KeyValueStore, ttl_s: float, clock: Clock) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._clock = clock
        self.id = 0  # 0: none granted yet
        self.renewed_at = float("-inf")  # when the last renewal that etcd granted was asked
        self.granted_ttl_s = ttl_s  # the TTL etcd granted (not necessarily the one asked for)

    def grant(self) -> int:
        """Grant a new lease (it replaces the old id) and learn the TTL etcd gave it.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
            LeaseLost: the new lease was gone before its TTL could be read.
        """
        asked_at = self._clock()
        self.id = self._store.grant_lease(self._ttl_s)
        self._note_granted(self._store.refresh_lease(self.id))
        self.renewed_at = asked_at
        return self.id

    def renew(self) -> Renewal:
        """Ask etcd to renew the current lease; ``keep`` the answer to count it.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
        """
        lease = self.id
        asked_at = self._clock()
        try:
            ttl = self._store.refresh_lease(lease)
        except LeaseLost:
            ttl = 0.0
        return Renewal(lease, ttl, asked_at)

    def keep(self, renewal: Renewal) -> None:
        """Count a granted renewal, unless a new lease replaced the one it renewed meanwhile."""
        if renewal.ttl_s > 0 and renewal.lease == self.id:
            self._note_granted(renewal.ttl_s)
            self.renewed_at = renewal.asked_at

    def revoke(self) -> None:
        """Revoke the lease now (its keys vanish at once), if one was granted.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
            LeaseLost: the lease was already gone.
        """
        if self.id:
            self._store.revoke_lease(self.id)

    def _note_granted(self, ttl: float) -> None:
        """A renewal's answer is the TTL the lease now has: the one etcd granted."""
        if ttl > 0:
            self.granted_ttl_s = ttl


class Reachability:
    """Whether etcd answers this member's background requests, for the logs: each outage is logged
    once, when it begins and when it ends."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._ok = True  # the last etcd request of the background threads was answered
        self._ok_at = clock()  # ... and when the last answer came
        self._down_logged = False

    def answered(self, ok: bool, error: str = "") -> None:
        """Note whether etcd answered a request (``error``: why not)."""
        self._ok = ok
        if ok:
            self._ok_at = self._clock()
        if not ok and not self._down_logged:
            self._down_logged = True
            log.warning("etcd_unreachable", error=error[:300])
        elif ok and self._down_logged:
            self._down_logged = False
            log.info("etcd_reachable_again")

    def background(self, stop: threading.Event, wake: threading.Event, ask: Callable[[], T],
                   then: Callable[[T], None], every_s: float) -> None:
        """A background thread's loop until ``stop``: on ``wake`` (or every ``every_s``) ``ask``
        etcd, note whether it answered, and ``then`` act on the answer."""
        while not stop.is_set():
            wake.wait(every_s)
            wake.clear()
            if stop.is_set():
                return
            try:
                answer = ask()
            except EtcdUnavailable as exc:
                self.answered(False, str(exc))
                continue
            self.answered(True)
            then(answer)
