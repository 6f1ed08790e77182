"""The hot-path flags of the generation one member is in (``GenerationWatch``).

Owns the generation this member joined (and the ``mod_revision`` it joined at) and the flags the
training thread reads at every step: the generation must be abandoned (and why), it was fenced
(superseded or aborted), newcomers wait to join, this member's lease is gone. The watcher thread
sets them from its views (``assess``, with the pure ``decide.assess_health``), the keepalive thread
from a lost lease, the join resets them (``leave``, ``enter``).

Never reads etcd (it is handed snapshots) and never decides what to do about a flag. Thread-safety:
every write holds one lock; each flag is one attribute, read without it.
"""

from __future__ import annotations

import threading

import structlog

from elasticd.rendezvous.decide import assess_health
from elasticd.wire.records import GenerationRecord
from elasticd.wire.snapshot import Snapshot

log = structlog.get_logger(__name__)


class GenerationWatch:
    """What one member knows of its current generation, as flags for the hot path."""

    def __init__(self, member_id: str) -> None:
        self._member_id = member_id
        self._lock = threading.Lock()
        self.current: GenerationRecord | None = None  # written by the training thread only
        self._joined_revision = 0  # mod_revision of the generation record this member joined
        self.abandon = False
        self.abandon_reason = ""
        self.fenced = False
        self.join_pending = False
        self.lease_lost = False
        # the view in which the current generation was seen superseded: the join looks in it
        # first (a generation of the survivors that includes this member needs no ready record)
        self.superseded_in: Snapshot | None = None

    def leave(self) -> None:
        """A join begins: no current generation, nothing to abandon, no one waiting."""
        with self._lock:
            self.current = None
            self.abandon = False
            self.join_pending = False
            self.superseded_in = None  # the join took it (a failed join must not act on it again)

    def enter(self, record: GenerationRecord, revision: int) -> None:
        """This member joined ``record``, published at ``revision``."""
        with self._lock:
            self.current = record
            self._joined_revision = revision
            self.abandon = False
            self.fenced = False
            self.abandon_reason = ""
            self.superseded_in = None

    def assess(self, view: Snapshot) -> None:
        """Raise the flags that ``view`` (a member's view) calls for (none when no generation is current)."""
        with self._lock:
            current = self.current
            if current is None:
                return
            h = assess_health(view, current, self._member_id, self._joined_revision, self.lease_lost)
            self.fenced = self.fenced or h.fenced
            if h.superseded and self.superseded_in is None:
                self.superseded_in = view
            if h.abandon and not self.abandon:
                self.abandon, self.abandon_reason = True, h.reason
                log.warning("generation_abandon_requested", generation=current.generation, cause=h.reason)
            if h.join_pending is None:
                return
            if h.join_pending and not self.join_pending:
                log.info("join_requested", generation=current.generation)
            self.join_pending = h.join_pending

    def lose_lease(self, lease: int) -> None:
        """etcd said this member's lease ``lease`` is gone."""
        with self._lock:
            if not self.lease_lost:
                log.warning("lease_expired", member=self._member_id, lease=lease)
            self.lease_lost = True

    def regain_lease(self) -> None:
        """This member registered again, under a new lease."""
        with self._lock:
            self.lease_lost = False
