"""What one member knows of its own liveness in etcd: its lease (``Lease``), and whether etcd
answers it (``Reachability``, for the logs). Liveness only: nothing here enters a step's verdict.

``Lease`` owns the lease id (a new grant after the old one was lost replaces it).

Never writes a key, never starts a thread (``Reachability.background`` is the loop of the
membership's own), and never decides what a lost lease means (the membership does). The
keepalive thread renews it while the training thread may grant a new one: a renewal's answer
names the lease it was asked for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.store.kv import KeyValueStore

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Renewal:
    """One renewal's answer: the lease asked for, and the TTL it has now (0: gone)."""

    lease: int
    ttl_s: float


class Lease:
    """A member's lease: granted, renewed and revoked through the store."""

    def __init__(self, store: KeyValueStore, ttl_s: float) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self.id = 0  # 0: none granted yet

    def grant(self) -> int:
        """Grant a new lease (it replaces the old id).

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
        """
        self.id = self._store.grant_lease(self._ttl_s)
        return self.id

    def renew(self) -> Renewal:
        """Ask etcd to renew the current lease.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
        """
        lease = self.id
        try:
            ttl = self._store.refresh_lease(lease)
        except LeaseLost:
            ttl = 0.0
        return Renewal(lease, ttl)

    def revoke(self) -> None:
        """Revoke the lease now (its keys vanish at once), if one was granted.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
            LeaseLost: the lease was already gone.
        """
        if self.id:
            self._store.revoke_lease(self.id)


class Reachability:
    """Whether etcd answers this member's background requests, for the logs: each outage is logged
    once, when it begins and when it ends."""

    def __init__(self) -> None:
        self._down_logged = False

    def answered(self, ok: bool, error: str = "") -> None:
        """Note whether etcd answered a request (``error``: why not)."""
        if not ok and not self._down_logged:
            self._down_logged = True
            log.warning("etcd_unreachable", error=error[:300])
        elif ok and self._down_logged:
            self._down_logged = False
            log.info("etcd_reachable_again")

    def background(
        self,
        stop: threading.Event,
        wake: threading.Event,
        ask: Callable[[], T],
        then: Callable[[T], None],
        every_s: float,
    ) -> None:
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
