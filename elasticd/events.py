"""The job's event history in etcd: a best-effort writer that never blocks its caller, and pruning.

Owns ``EventLog``: ``record(kind, **detail)`` appends to a bounded in-memory queue and returns at
once (no I/O, no lock held across I/O), so it is safe on a training step's path; one daemon thread
writes queued events to ``events/<name>`` (names from ``oprecords.event_name``: they sort by time and
never collide between writers) and then prunes. A write that fails is logged and retried on the
next round; when the queue is full the oldest unwritten event is dropped (logged). etcd's
permission denied is not retried: the queued events are dropped and the writer stops (logged,
``event_write_denied``). Nothing here raises to the caller.

Retention: the history holds at most ``events_keep`` events. Every ``EventLog`` (each node agent,
and each rank 0 that records a recovery) prunes after it writes: it lists ``events/`` and deletes
the oldest names beyond ``events_keep``. The ``generation_published`` events, written inside the
publishing transaction (``rendezvous.coordinator``), are pruned by the next ``EventLog`` round of any
writer, so between rounds the history can exceed ``events_keep`` by the generations published
since. Concurrent pruners may delete the same key; deleting a missing key is harmless.

Never imports etcd3 or torch.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

import structlog

from elasticd.errors import EtcdUnavailable, PermissionDenied
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.ops import EventRecord, encode_event, event_name, prune_plan

log = structlog.get_logger(__name__)

# Events waiting to be written, at most; beyond it the oldest is dropped (etcd down for long).
MAX_PENDING_EVENTS = 256
# After a failed write, wait this long before the next attempt (the store already retried).
RETRY_PAUSE_S = 1.0


class EventLog:
    """Writes one process's events to the job's history, off the caller's thread.

    Thread-safe: ``record`` may be called from any thread (not from a signal handler).
    """

    def __init__(
        self,
        store: KeyValueStore,
        keys: Keys,
        source: str,
        keep: int,
        wall_ns: Callable[[], int] = time.time_ns,
        prefix: str = "",
    ) -> None:
        """
        Args:
            store: where the history lives.
            keys: the job's key layout.
            source: the writer's id in each event and in its key name (a member id, or
                ``agent.<node>.<pid>``); no ``/``.
            keep: ``events_keep``: prune the history down to this many events after each write.
            wall_ns: the wall clock in nanoseconds (events of many hosts are ordered by it).
            prefix: where the events go and are pruned (default: ``keys.events``; rank 0's progress
                samples: ``keys.samples``, with a limit of their own).
        """
        if "/" in source or not source:
            raise ValueError(f"an event source must be non-empty with no '/', got {source!r}")
        self._store = store
        self._keys = keys
        self._source = source
        self._keep = keep
        self._wall_ns = wall_ns
        self._prefix = prefix or keys.events
        self._pending: deque[tuple[str, bytes]] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self.written = 0
        self.dropped = 0

    def record(self, kind: str, /, **detail: object) -> None:
        """Queue an event (now, by this writer); returns at once and never raises."""
        now_ns = self._wall_ns()
        rec = EventRecord(time=now_ns / 1e9, kind=str(kind), source=self._source, detail=detail)
        item = (self._prefix + event_name(now_ns, self._source), encode_event(rec))
        with self._cond:
            if self._stop:
                return
            if len(self._pending) >= MAX_PENDING_EVENTS:
                self._pending.popleft()
                self.dropped += 1
                log.warning(
                    "event_dropped", reason="too many events waiting to be written", max_pending=MAX_PENDING_EVENTS
                )
            self._pending.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="elasticd-events", daemon=True)
                self._thread.start()
            self._cond.notify()

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued event was written (or given up on); at most ``timeout_s``.

        Returns:
            True if nothing is left to write.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or self._thread is None:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Write what is queued (at most ``timeout_s``), then stop the thread."""
        self.flush(timeout_s)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=max(0.0, timeout_s))
        with self._cond:
            if self._pending:
                log.warning("events_not_written", count=len(self._pending))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if not self._pending:
                    return  # stopped, and everything was written
                key, value = self._pending[0]
                self._busy = True
            ok = True
            try:
                self._store.put(key, value)
            except EtcdUnavailable as exc:
                ok = False
                log.warning("event_write_failed", error=str(exc)[:300], waiting=len(self._pending))
            except PermissionDenied as exc:  # every write would meet the same role: stop writing
                with self._cond:
                    log.error("event_write_denied", error=str(exc), dropped=len(self._pending))
                    self.dropped += len(self._pending)
                    self._pending.clear()
                    self._stop, self._busy = True, False
                    self._cond.notify_all()
                return
            with self._cond:
                if ok and self._pending and self._pending[0][0] == key:  # unless dropped meanwhile
                    self._pending.popleft()
                    self.written += 1
                more = bool(self._pending)
            if ok and not more:
                try:
                    self._prune()
                except (EtcdUnavailable, PermissionDenied) as exc:
                    log.warning("event_prune_failed", error=str(exc)[:300])
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                if not ok:
                    self._cond.wait_for(lambda: self._stop, timeout=RETRY_PAUSE_S)
                    if self._stop:
                        return

    def _prune(self) -> None:
        rows = self._store.get_prefix(self._prefix)
        doomed = prune_plan([kv.key for kv in rows], self._keep)
        for key in doomed:
            self._store.delete(key)
        if doomed:
            log.debug("events_pruned", deleted=len(doomed), keep=self._keep)
