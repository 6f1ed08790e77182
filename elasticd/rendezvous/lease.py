"""What one member knows of its own liveness in etcd: its lease (``Lease``), and whether etcd
answers it lately (``Reachability``); the commit vote's ``stale`` and ``reached_etcd`` come from them.

``Lease`` owns the lease id (a new grant after the old one was lost replaces it), the TTL etcd granted
(learned from each renewal's answer, as python-etcd3's ``Lease`` keeps ``granted_ttl``: etcd may
raise a short TTL to its minimum, and rounds to whole seconds), when the last granted renewal was
asked, and the SIGCONT count then (``continued``): together they say whether the lease is fresh.

Never writes a key, never starts a thread (``Reachability.background`` is the loop of the
membership's own), and never decides what a lost lease means (the membership does). The keepalive thread renews and reads it while the training thread may grant a
new one: each field is written in one assignment, and a renewal's answer counts only for the lease
it was asked for.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import structlog

from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.rendezvous import continued
from elasticd.retry import Clock, Deadline
from elasticd.store.kv import KeyValueStore

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Renewal:
    """One renewal's answer: the lease asked for, the TTL it has now (0: gone), and when it was
    asked (monotonic seconds, and ``continued.count()`` then)."""

    lease: int
    ttl_s: float
    asked_at: float
    continues: int


class Lease:
    """A member's lease: granted, renewed and revoked through the store; fresh while certainly alive."""

    def __init__(self, store: KeyValueStore, ttl_s: float, clock: Clock) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._clock = clock
        self.id = 0  # 0: none granted yet
        self.renewed_at = float("-inf")  # when the last renewal that etcd granted was asked
        self._renewed_continues = 0  # continued.count() when that renewal was asked
        # The TTL etcd granted; the commit fence counts on this one, not on the one asked for.
        self.granted_ttl_s = ttl_s
        self.grants = 0  # renewals of the current lease etcd granted (and counted), ever growing
        self.answered = threading.Event()  # set on every renewal's answer (``confirm`` waits on it)

    def grant(self) -> int:
        """Grant a new lease (it replaces the old id) and learn the TTL etcd gave it.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
            LeaseLost: the new lease was gone before its TTL could be read.
        """
        asked_at, continues = self._clock(), continued.count()
        self.id = self._store.grant_lease(self._ttl_s)
        self._note_granted(self._store.refresh_lease(self.id))
        self.renewed_at, self._renewed_continues = asked_at, continues
        return self.id

    def renew(self) -> Renewal:
        """Ask etcd to renew the current lease; ``keep`` the answer to count it.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
        """
        lease = self.id
        asked_at, continues = self._clock(), continued.count()
        try:
            ttl = self._store.refresh_lease(lease)
        except LeaseLost:
            ttl = 0.0
        return Renewal(lease, ttl, asked_at, continues)

    def keep(self, renewal: Renewal) -> None:
        """Count a granted renewal, unless a new lease replaced the one it renewed meanwhile."""
        if renewal.ttl_s > 0 and renewal.lease == self.id:
            self._note_granted(renewal.ttl_s)
            self.renewed_at, self._renewed_continues = renewal.asked_at, renewal.continues
            self.grants += 1
        self.answered.set()

    def confirm(self, lease: int, grants: int, renew: threading.Event, deadline: Deadline,
                lost: Callable[[], bool], poll_s: float) -> bool:
        """Whether etcd grants ``lease`` a renewal beyond the ``grants`` counted so far, setting
        ``renew`` (the keepalive thread's cue) until one is answered, up to ``deadline``; False at
        once when ``lost()`` or a new lease replaced it. A granted renewal proves the lease never
        expired (an expired lease id never comes back): an etcd leader election, or the end of an
        outage, only held the renewals back."""
        while not (lost() or self.id != lease):
            if self.grants > grants:
                return True
            if deadline.expired():
                return False
            self.answered.clear()
            renew.set()
            self.answered.wait(min(deadline.remaining_s(), poll_s))
        return False

    def revoke(self) -> None:
        """Revoke the lease now (its keys vanish at once), if one was granted.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
            LeaseLost: the lease was already gone.
        """
        if self.id:
            self._store.revoke_lease(self.id)

    def fresh(self, margin_s: float) -> bool:
        """Certainly alive: renewed less than the granted TTL minus ``margin_s`` ago, by a renewal
        asked after this process last continued from a stop (see continued.py)."""
        return self._clock() - self.renewed_at < self.granted_ttl_s - margin_s and not self.continued_since_renewal()

    def continued_since_renewal(self) -> bool:
        """This process was stopped and continued since it asked for its last granted renewal."""
        return continued.count() != self._renewed_continues

    def _note_granted(self, ttl: float) -> None:
        """A renewal's answer is the TTL the lease now has: the one etcd granted."""
        if ttl > 0:
            self.granted_ttl_s = ttl


class Reachability:
    """Whether etcd answers this member's background requests: the last answer, and when, and the
    requests it holds now. Each outage is logged once, when it begins and when it ends.

    A request held past its bound counts as "not answering" at once, before the client's retries
    give up: in an etcd leader election every renewal hangs, while the last answer (just before the
    election) still looked recent; a member counted as "answered by etcd" then made every step wait
    for the others' renewals (``commit.commit_outcome``'s retry) for the whole election."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._ok = True  # the last etcd request of the background threads was answered
        self._ok_at = clock()  # ... and when the last answer came
        self._down_logged = False
        self._held: dict[int, tuple[float, float]] = {}  # thread -> (asked at, bound) of a request out now

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

    def lately(self, within_s: float) -> bool:
        """The last request was answered, less than ``within_s`` ago, and no request is held past
        its bound now."""
        now = self._clock()
        if any(now - asked > bound for asked, bound in list(self._held.values())):
            return False
        return self._ok and now - self._ok_at < within_s

    def background(self, stop: threading.Event, wake: threading.Event, ask: Callable[[], T],
                   then: Callable[[T], None], every_s: float, held_s: float = math.inf) -> None:
        """A background thread's loop until ``stop``: on ``wake`` (or every ``every_s``) ``ask``
        etcd, note whether it answered, and ``then`` act on the answer. A request unanswered for
        over ``held_s`` makes ``lately`` False until it returns."""
        me = threading.get_ident()
        while not stop.is_set():
            wake.wait(every_s)
            wake.clear()
            if stop.is_set():
                return
            self._held[me] = (self._clock(), held_s)
            try:
                answer = ask()
            except EtcdUnavailable as exc:
                self.answered(False, str(exc))
                continue
            finally:
                self._held.pop(me, None)
            self.answered(True)
            then(answer)
