"""The worker's bookkeeping: what it records about its own training, and where.

Owns ``Journal``: the audit file (one JSON line per start, sync, resume and commit, and a final
one; a step this member applied becomes a commit line only once confirmed, ``confirm``: a later
collective of the same group completed, a completed sync holds it, or the job's goodbye barrier
completed; else ``discard``); the throttled
``step_committed`` log line and the ``recovered`` one; the progress record
(handed to the membership's keepalive thread, ``Membership.set_progress``); the job's ``recovered``
event, which rank 0 queues (``EventLog``) at the first commit of a recovery generation; and the
job's ``checkpoint`` and ``save_failed`` records (on the checkpoint writer's thread, or at a resume
during the rendezvous). It is told facts by the trainer after they happened. Never decides anything
about a step, a commit, a save or a recovery (the trainer, ``commit`` and ``durable`` do), and
never writes to etcd on a step's path.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

import structlog

from elasticd.config import WorkerEnv
from elasticd.errors import EtcdUnavailable
from elasticd.events import EventLog
from elasticd.log import set_moment
from elasticd.rendezvous.membership import Membership
from elasticd.retry import Clock
from elasticd.store.kv import KeyValueStore
from elasticd.wire.keys import Keys
from elasticd.wire.ops import (
    EventKind,
    SaveFailedRecord,
    encode_save_failed,
    save_failed_key,
)
from elasticd.wire.progress import ProgressRecord
from elasticd.wire.records import CheckpointRecord, GenerationRecord
from elasticd.worker.state.durable import LoadedCheckpoint, SavedCheckpoint, describe_failure
from elasticd.worker.state.durable_format import Manifest
from elasticd.worker.group.process_group import Group
from elasticd.worker.data.sampler import Batch
from elasticd.worker.state.training import Counters
from elasticd.worker.state.sync import SyncReport

log = structlog.get_logger(__name__)

# The weight of the newest step in the smoothed compute time (an exponential moving average): a
# change is half taken in 3 steps, and one slow step moves it by a fifth.
COMPUTE_SMOOTHING = 0.2


class Journal:
    """One worker's records. ``open`` binds it to the membership and the store (at the trainer's
    ``start``); ``close`` writes the audit file's last line and closes it."""

    def __init__(
        self,
        env: WorkerEnv,
        store: KeyValueStore | None,
        audit_path: str | Path | None,
        audit_in_memory: bool,
        log_interval_s: float,
        clock: Clock = time.monotonic,
    ) -> None:
        """
        Args:
            env: this worker's settings (its node, the job's keys, ``events_keep``).
            store: the key-value store, if known yet (else ``open`` names it).
            audit_path: append the audit lines here, each written (to the OS) as it happens, so a
                worker killed with SIGKILL keeps every line it wrote; None: no audit file.
            audit_in_memory: keep the audit lines in memory and write them at ``close`` instead:
                for fault-free measurements only (a killed worker loses its lines). It takes the
                file write out of the step, as a plain training loop that keeps its own records would.
            log_interval_s: log ``step_committed`` at most this often (0: every commit). A JSON log
                line costs about a fifth of a whole step of a small model on a busy 2-core machine.
        """
        self._audit_path = Path(audit_path) if audit_path else None
        self._audit: IO[str] | None = None
        self._audit_memory: list[dict[str, object]] | None = [] if audit_in_memory and audit_path else None
        self._log_interval_s = max(0.0, log_interval_s)
        self._clock = clock  # monotonic: recovery and step durations, the log pacing
        self._logged_at = float("-inf")
        self._membership: Membership | None = None
        self._events: EventLog | None = None
        self._samples: EventLog | None = None  # rank 0's progress samples (keys.samples)
        self._store = store
        self._keys = Keys(env.etcd.prefix, env.world.job_id)
        self._node = env.node_id
        self._events_keep = env.events_keep
        # sharded training: a rank's state is its shard's, so its sync and final lines say which
        self._shard: dict[str, object] = {"shard": env.shard} if env.replica_size > 1 else {}
        self._progress_event_s = env.timeouts.progress_event_s
        self._progress_evented_at = float("-inf")  # when rank 0 last recorded a progress event
        self.recoveries = 0
        self._last_recovery_s: float | None = None  # how long the last recovery took (progress record)
        self._last_recovery_cause: str | None = None
        self._compute_s: float | None = None  # this member's compute time per step, smoothed
        # Rank 0 of a generation that was a recovery: what to record at its first commit.
        self._unrecorded_recovery: dict[str, object] | None = None
        # Steps applied here and not yet confirmed (``confirm``): (step, generation, its audit line or None)
        self._unconfirmed: list[tuple[int, int, dict[str, object] | None]] = []
        self._on_confirm: list[Callable[[int], None]] = []  # told the newest step confirmed
        self._on_discard: list[Callable[[list[int]], None]] = []  # told the steps discarded
        self.confirmed_step = 0  # the newest step this member knows committed (0: none yet)
        self._discarded_last = -1  # the newest step discarded here

    @property
    def auditing(self) -> bool:  # commit lines are kept (what a step's audit line needs is worth computing)
        return self._audit_path is not None

    def open(self, membership: Membership, store: KeyValueStore, member_id: str, started_wall: float) -> None:
        """Bind to ``membership`` (progress and checkpoint records) and ``store`` (failed saves,
        the job's events) of member ``member_id``; open the audit file."""
        self._membership, self._store = membership, store
        # Their threads start with the first event: only a rank 0 writes any (a recovery, a durable
        # save, a progress sample every progress_event_s).
        self._events = EventLog(store, self._keys, member_id, self._events_keep)
        self._samples = EventLog(store, self._keys, member_id, self._events_keep, prefix=self._keys.samples)
        if self._audit_path:
            self._audit_path.parent.mkdir(parents=True, exist_ok=True)
            self._audit = self._audit_path.open("a", buffering=1)
            self._audit_line({"event": "start", "member": member_id, "t": started_wall})

    def close_events(self, timeout_s: float) -> None:
        """Write the queued events (at most ``timeout_s`` each) and stop the event logs' threads."""
        for log_ in (self._events, self._samples):
            if log_ is not None:
                log_.close(timeout_s)

    def on_confirm(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(step)`` whenever steps are confirmed here (``step``: the newest of them)."""
        self._on_confirm.append(listener)

    def on_discard(self, listener: Callable[[list[int]], None]) -> None:
        """Call ``listener(steps)`` whenever applied steps are discarded here."""
        self._on_discard.append(listener)

    def confirm(self) -> None:
        """The steps this member applied since the last confirmation are the job's: a later
        collective of the same group completed (every member applied them), a completed sync holds
        them (``recovered``), or the job's goodbye barrier completed. Their commit lines go out now
        (docs/design/commit-protocol.md)."""
        if not self._unconfirmed:
            return
        for _, _, record in self._unconfirmed:
            if record is not None:
                self._audit_line(record)
        newest = self._unconfirmed[-1][0]
        self._unconfirmed.clear()
        self.confirmed_step = max(self.confirmed_step, newest)
        for listener in self._on_confirm:
            listener(newest)

    def discard(self, why: str) -> None:
        """The steps applied here since the last confirmation are not this member's commits: a sync
        replaced its state with one of another lineage (a branch the job left), or it leaves
        without a confirmation (a drain, a failed step, the job finished by the others). Their
        commit lines never go out."""
        if not self._unconfirmed:
            return
        steps = [step for step, _, _ in self._unconfirmed]
        self._discarded_last = steps[-1]
        log.warning("steps_discarded", steps=steps, reason=why)
        self._unconfirmed.clear()
        for listener in self._on_discard:
            listener(steps)

    def finished(self, generation: int, step: int) -> None:
        """The job's ``finished`` record names ``generation`` and ``step``: a goodbye barrier of that
        generation completed somewhere, so every member of it applied that step. The steps applied
        here are confirmed if they are that generation's, up to that step; else discarded."""
        mine = self._unconfirmed[-1] if self._unconfirmed else None
        if mine is not None and mine[1] == generation and mine[0] == step:
            self.confirm()
        else:
            self.discard(f"the job finished in generation {generation} at step {step} without them")

    def close(self, step: int, checksum: Callable[[], int], joined: bool = True) -> None:
        """Discard the unconfirmed steps, then write the audit file's last line (the step and
        ``checksum()`` of the state held; ``branch`` when that step was discarded: a member whose
        last application the job left holds bytes that are not the job's; ``never_joined`` for a
        member that arrived after the job's end and never held its state), and close it."""
        self.discard("left the job before a later collective or sync confirmed them")
        if self._audit is None:
            return
        final: dict[str, object] = {"event": "final", "step": step, "checksum": f"{checksum():016x}", **self._shard}
        if step > self.confirmed_step and self._discarded_last == step:
            final["branch"] = True  # its last step was discarded: these bytes are not the job's
        if not joined:
            final["never_joined"] = True
        self._audit_line(final)
        if self._audit_memory:
            self._audit.writelines(json.dumps(r) + "\n" for r in self._audit_memory)
            self._audit_memory.clear()
        self._audit.close()
        self._audit = None

    def recovered(
        self,
        *,
        group: Group,
        record: GenerationRecord,
        rendezvous_s: float,
        cause: str,
        cause_detail: str,
        failed_at: float,
        counters: Counters,
        report: SyncReport,
        step_time_s: float | None,
    ) -> None:
        """This member joined ``group`` and holds rank 0's state (``report``). ``cause``: why it
        rendezvoused ("start" for a worker's first join, which is not a recovery); ``failed_at``:
        when (monotonic) the fault was noticed. The steps applied here and not yet confirmed are the
        job's: the completed sync proved every member holds them (those of a branch the job left
        were discarded when the sync replaced this member's state)."""
        self.confirm()
        self._discarded_last = -1  # it holds the job's state now
        self._unrecorded_recovery = None
        if cause != "start":
            self.recoveries += 1
            self._last_recovery_s = round(self._clock() - failed_at, 4)
            self._last_recovery_cause = cause
            if group.rank == 0:
                self._unrecorded_recovery = {
                    "generation": group.generation,
                    "cause": cause,
                    "error": cause_detail,
                    "generation_reason": record.reason,
                    "world_size": group.world_size,
                    "failed_at": failed_at,
                }
        c = counters
        set_moment(step=c.step)
        log.info(
            "recovered",
            generation=group.generation,
            rank=group.rank,
            world_size=group.world_size,
            step=c.step,
            cause=cause,
            members=list(record.members),
            duration_s=round(self._clock() - failed_at, 4),
            rendezvous_s=round(rendezvous_s, 4),
        )
        self._audit_line(
            {
                "event": "sync",
                "generation": group.generation,
                "rank": group.rank,
                "world_size": group.world_size,
                "step": c.step,
                "epoch": c.epoch,
                "position": c.position,
                "checksum": f"{report.checksum:016x}",
                "transferred_bytes": report.transferred_bytes,
                "cause": cause,
                "t": time.time(),
                **self._shard,
                **_resource_counts(),
            }
        )
        self._publish_progress(c.step, group.generation, group.rank, step_time_s)

    def resumed(self, loaded: LoadedCheckpoint) -> None:
        """This member loaded ``loaded`` from disk: the audit line, and the job's ``checkpoint``
        record if it is missing or names an older (step, seq) (compare-and-set, best effort)."""
        m = loaded.manifest
        self._audit_line(
            {
                "event": "resume",
                "step": m.step,
                "epoch": m.epoch,
                "position": m.position,
                "path": str(loaded.path),
                "seq": m.seq,
                "checksum": f"{m.state_checksum:016x}",
                "rejected": list(loaded.rejected),
                "t": time.time(),
            }
        )
        self._publish_checkpoint(m, loaded.path)

    def event(self, kind: EventKind, /, **detail: object) -> None:
        """Record an event of this member for the job (best effort, in the background)."""
        if self._events is not None:
            self._events.record(kind, **detail)

    def checkpoint_saved(self, saved: SavedCheckpoint) -> None:
        """On the writer thread, once the checkpoint is in place (its step confirmed): the job's
        ``checkpoint`` record, by compare-and-set and never over a newer (step, seq) (a late
        writer cannot set it back), and the ``checkpoint_saved`` event (best effort)."""
        m = saved.manifest
        self._publish_checkpoint(m, saved.path)
        if self._events is not None:
            self._events.record(
                EventKind.CHECKPOINT_SAVED,
                step=m.step,
                generation=m.generation,
                seq=m.seq,
                bytes=m.file_bytes,
                duration_s=round(saved.duration_s, 4),
            )

    def _publish_checkpoint(self, m: Manifest, path: Path) -> None:
        """The job's ``checkpoint`` record for ``m`` at ``path`` (compare-and-set, best effort)."""
        if self._membership is not None:
            self._membership.publish_checkpoint(
                CheckpointRecord(
                    step=m.step,
                    path=str(path),
                    node=m.node,
                    generation=m.generation,
                    seq=m.seq,
                    bytes=m.file_bytes,
                    time=m.created,
                )
            )

    def save_failed(self, step: int, exc: Exception, generation: int, directory: Path) -> None:
        """On the writer thread: record the failed save in etcd (``save_failed``, best effort), so
        that ``elasticctl status`` shows it and not only the logs."""
        if self._store is None:
            return
        code, text = describe_failure(exc)
        record = SaveFailedRecord(
            time=time.time(),
            step=step,
            generation=generation,
            node=self._node,
            directory=str(directory),
            error=text[:500],
            errno=code,
        )
        try:
            self._store.put(save_failed_key(self._keys.job), encode_save_failed(record))
        except EtcdUnavailable as exc2:
            log.warning("checkpoint_failure_publish_failed", step=step, error=str(exc2))

    def committed(
        self,
        batch: Batch,
        step: int,
        loss: float,
        generation: int,
        world_size: int,
        duration_s: float,
        compute_s: float | None = None,
    ) -> None:
        """This member applied ``step`` (from ``batch``): the log line, the progress record, and
        (rank 0, first commit of a recovery generation) the ``recovered`` event, from the fault
        noticed to this commit, now; the audit line once the step is confirmed (``confirm``: every
        member applied it; ``discard``: it is not the job's). Queues the event only; the write
        happens off this thread."""
        now = self._clock()
        set_moment(step=step)  # every line of every thread from now on (one dict update)
        if now - self._logged_at >= self._log_interval_s:
            self._logged_at = now
            log.info(
                "step_committed",
                generation=generation,
                rank=batch.rank,
                step=step,
                **({"loss": round(loss, 6)} if loss == loss else {}),  # NaN: not known (the drop-in form)
                world_size=world_size,
                duration_s=round(duration_s, 5),
            )
        self._discarded_last = -1
        self._unconfirmed.append(
            (
                step,
                generation,
                None
                if self._audit is None
                else {
                    "event": "commit",
                    "step": step,
                    "generation": generation,
                    "rank": batch.rank,
                    "world_size": batch.world_size,
                    "epoch": batch.epoch,
                    "position": batch.position,
                    "global_size": batch.global_size,
                    "indices": batch.indices,
                    **({"blocks": list(batch.blocks)} if batch.blocks else {}),
                    "loss": loss,
                    "t": time.time(),
                },
            )
        )
        if compute_s is not None:  # smoothed: one slow step is no straggler
            prev = self._compute_s
            self._compute_s = compute_s if prev is None else prev + COMPUTE_SMOOTHING * (compute_s - prev)
        self._publish_progress(step, generation, batch.rank, duration_s)
        if batch.rank == 0 and self._samples is not None and now - self._progress_evented_at >= self._progress_event_s:
            self._progress_evented_at = now  # the points of elasticctl timeline (a queue append)
            self._samples.record(EventKind.PROGRESS, step=step, generation=generation, world_size=world_size)
        pending, self._unrecorded_recovery = self._unrecorded_recovery, None
        if pending is None or pending["generation"] != generation:
            return  # none, or that generation broke before its first commit and the next one records
        assert self._events is not None
        failed_at = pending.pop("failed_at")
        assert isinstance(failed_at, float)
        self._events.record(EventKind.RECOVERED, **pending, step=step, duration_s=round(self._clock() - failed_at, 4))

    def _publish_progress(self, step: int, generation: int, rank: int, step_time_s: float | None) -> None:
        """Hand the progress record to the membership's keepalive thread."""
        assert self._membership is not None
        self._membership.set_progress(
            ProgressRecord(
                step=step,
                generation=generation,
                rank=rank,
                step_time_s=step_time_s,
                recoveries=self.recoveries,
                last_recovery_s=self._last_recovery_s,
                last_recovery_cause=self._last_recovery_cause,
                time=time.time(),
                compute_s=None if self._compute_s is None else round(self._compute_s, 6),
            )
        )

    def _audit_line(self, record: dict[str, object]) -> None:
        if self._audit_memory is not None:
            self._audit_memory.append(record)
        elif self._audit is not None:
            self._audit.write(json.dumps(record) + "\n")


def _resource_counts() -> dict[str, int]:
    """Open file descriptors and OS threads of this process (Linux; empty elsewhere)."""
    try:
        return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task"))}
    except OSError:
        return {}
