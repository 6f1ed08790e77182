"""The job records one member writes besides its own presence (``Publisher``).

Owns writing: the ``abort`` of a broken generation (off the training thread, retried through an
etcd outage, by compare-and-set and never over an abort of a newer generation); the job's
``committed`` step (from rank 0's progress); the latest good durable ``checkpoint`` (by
compare-and-set, never over a newer one: ordered by step, then seq); the ``finished`` record;
this member's leased ``progress`` record for ``elasticctl`` (the newest handed over, written from
the keepalive thread); and the ``generation_published`` event that goes into the transaction
publishing a generation.

Never decides anything (the membership and the trainer say what to write and when), never writes
the rendezvous keys (``members/``, ``ready/``, ``generation``), and never fails its caller: etcd
being unreachable is logged (the abort is retried up to ``etcd_outage_s``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog

from elasticd.config import Timeouts
from elasticd.errors import EtcdUnavailable, LeaseLost
from elasticd.retry import Clock, Deadline
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.ops import EventKind, EventRecord, encode_event, event_name
from elasticd.wire.progress import ProgressRecord, encode_progress
from elasticd.wire.records import (
    DECODE_ERRORS,
    OUT_OF_REACH_IDS,
    AbortRecord,
    CheckpointRecord,
    CommittedRecord,
    FinishedRecord,
    GenerationRecord,
    decode_abort,
    decode_checkpoint,
    encode,
)

log = structlog.get_logger(__name__)

EVENT_MEMBERS = 64  # members a generation_published event names (the first ranks; world_size counts all)
CHECKPOINT_CAS_TRIES = 5  # compare-and-set rounds of one checkpoint record (each lost one re-reads it)


class Publisher:
    """Writes one member's job records. Thread-safe: its only state is the progress handed over
    (set by the training thread, written by the keepalive thread)."""

    def __init__(
        self,
        store: KeyValueStore,
        keys: Keys,
        member_id: str,
        timeouts: Timeouts,
        clock: Clock,
        stop: threading.Event,
    ) -> None:
        self._store = store
        self._keys = keys
        self._member_id = member_id
        self._timeouts = timeouts
        self._clock = clock
        self._stop = stop  # the member left: stop retrying
        self._progress: ProgressRecord | None = None  # the newest handed over
        self._published: ProgressRecord | None = None  # the newest written

    def abort(self, generation: int, reason: str) -> None:
        """Mark ``generation`` broken, from a thread of its own (see ``Membership.abort``)."""
        rec = AbortRecord(generation=generation, member_id=self._member_id, reason=reason[:200])
        t = threading.Thread(target=self._publish_abort, args=(rec,), name="elasticd-abort", daemon=True)
        t.start()

    def abort_now(self, generation: int, reason: str, out_of_reach: tuple[str, ...] = ()) -> bool | None:
        """Mark ``generation`` broken with one attempt, on this thread (a reach check's: a prober
        that is itself cut off must not write it once its link is back, long after), naming the
        members whose hosts did not answer (the coordinator holds them out for ``reach_hold_s``).

        Returns:
            True: written; False: lost the race; None: it (or a newer generation) was aborted already.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
        """
        rec = AbortRecord(generation, self._member_id, reason[:200], out_of_reach[:OUT_OF_REACH_IDS], time.time())
        return self._put_unless_newer(
            self._keys.abort, encode(rec), lambda raw: (decode_abort(raw).generation,), (rec.generation,)
        )

    def _publish_abort(self, rec: AbortRecord) -> None:
        deadline = Deadline.after(self._timeouts.etcd_outage_s, self._clock)
        failures = 0
        while not self._stop.is_set() and not deadline.expired():
            try:
                written = self._put_unless_newer(
                    self._keys.abort, encode(rec), lambda raw: (decode_abort(raw).generation,), (rec.generation,)
                )
                if written is None:
                    return  # already aborted (or a newer generation is): nothing to add
                if written:
                    if failures:
                        log.info("abort_published", generation=rec.generation, after_failures=failures)
                    return
            except EtcdUnavailable as exc:
                failures += 1
                if failures == 1:
                    log.warning(
                        "abort_publish_failed",
                        generation=rec.generation,
                        error=str(exc)[:300],
                        retrying_for_s=round(deadline.remaining_s(), 1),
                    )
                self._stop.wait(min(self._timeouts.keepalive_s, deadline.remaining_s()))

    def _put_unless_newer(
        self, key: str, value: bytes, order: Callable[[bytes], tuple[int, ...]], mine: tuple[int, ...]
    ) -> bool | None:
        """Write ``value`` by compare-and-set unless ``key`` holds a record whose ``order`` is at
        least ``mine`` (a value that does not decode is replaced). The compare is on the
        mod_revision read (absent: the key must still be absent), so a record written between the
        read and the write makes this one lose instead of overwriting it.

        Returns:
            True: written; False: lost the race to another writer; None: a record as new is there.

        Raises:
            EtcdUnavailable: etcd could not be reached within the store's retry bound.
        """
        kv = self._store.get(key)
        if kv is not None:
            try:
                if order(kv.value) >= mine:
                    return None
            except DECODE_ERRORS:
                pass  # garbage: replace it
        return self._store.compare_and_put(key, kv.mod_revision if kv else 0, value)

    def published_event(self, record: GenerationRecord) -> tuple[str, bytes]:
        """The ``generation_published`` event (key, value) that goes into the publishing transaction."""
        now_ns = time.time_ns()  # wall clock: events from many hosts are ordered by it
        event = EventRecord(
            time=now_ns / 1e9,
            kind=EventKind.GENERATION_PUBLISHED,
            source=self._member_id,
            detail={
                "generation": record.generation,
                "reason": record.reason,
                "world_size": record.world_size,
                "members": list(record.members[:EVENT_MEMBERS]),
                "committed_step": record.committed_step,
            },
        )
        return self._keys.event(event_name(now_ns, self._member_id)), encode_event(event)

    def committed(self, progress: ProgressRecord) -> None:
        """Record the job's committed step from rank 0's progress (best effort)."""
        try:
            record = CommittedRecord(generation=progress.generation, step=progress.step)
            self._store.put(self._keys.committed, encode(record))
        except EtcdUnavailable as exc:
            log.warning("committed_publish_failed", error=str(exc))

    def checkpoint(self, record: CheckpointRecord) -> None:
        """Record the job's latest good durable checkpoint (see ``Membership.publish_checkpoint``),
        always by compare-and-set: only over a missing record, one that does not decode, or one of
        an older (step, seq), so the record never goes back (a writer that lost a race re-reads and
        decides again, at most ``CHECKPOINT_CAS_TRIES`` times). Best effort: etcd unreachable is
        logged."""

        def order(raw: bytes) -> tuple[int, ...]:
            r = decode_checkpoint(raw)
            return (r.step, r.seq)

        try:
            for _ in range(CHECKPOINT_CAS_TRIES):
                written = self._put_unless_newer(
                    self._keys.checkpoint, encode(record), order, (record.step, record.seq)
                )
                if written is None:
                    log.info(
                        "checkpoint_publish_skipped",
                        step=record.step,
                        seq=record.seq,
                        reason="the record names this checkpoint or a newer one",
                    )
                    return
                if written:
                    return
            log.warning(
                "checkpoint_publish_lost",
                step=record.step,
                seq=record.seq,
                tries=CHECKPOINT_CAS_TRIES,
                reason="other writers changed the record between each read and write",
            )
        except EtcdUnavailable as exc:
            log.warning("checkpoint_publish_failed", step=record.step, error=str(exc))

    def finished(self, generation: int, step: int) -> None:
        """Record that every member reached the target step together (best effort)."""
        try:
            self._store.put(self._keys.finished, encode(FinishedRecord(generation=generation, step=step)))
        except EtcdUnavailable as exc:
            log.warning("finished_publish_failed", error=str(exc))

    def set_progress(self, record: ProgressRecord) -> None:
        """Hand over the newest progress; the next ``flush_progress`` writes it."""
        self._progress = record

    def progress_loop(
        self, stop: threading.Event, due: threading.Event, lease: Callable[[], int], poll_s: float
    ) -> None:
        """A thread's loop until ``stop``: ``flush_progress`` each time ``due`` is set (after each
        granted renewal, so only while etcd answers). Off the keepalive thread: a put that etcd
        holds (in a leader election each attempt waits up to ``etcd_request_s``) would hold the
        next renewal back, and a lease could end while its member lives."""
        while not stop.is_set():
            if not due.wait(poll_s):
                continue
            due.clear()
            if not stop.is_set():
                self.flush_progress(lease())

    def flush_progress(self, lease: int) -> None:
        """Write the progress handed over since the last flush, if any (and, from rank 0, the
        committed step)."""
        progress = self._progress
        if progress is not None and progress is not self._published:
            self.progress(progress, lease)
            self._published = progress
            if progress.rank == 0:
                self.committed(progress)

    def progress(self, record: ProgressRecord, lease: int) -> None:
        """This member's progress record for ``elasticctl`` and the agent, under ``lease`` (best effort)."""
        try:
            self._store.put(self._keys.progress(self._member_id), encode_progress(record), lease=lease)
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("progress_publish_failed", error=str(exc))
