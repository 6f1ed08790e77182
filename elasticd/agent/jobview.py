"""The node agent's read model of a job's progress, and the hang test over it.

Owns ``JobView`` (one read of a job's keys, parsed: generation, world size, the job's committed
step, each member's record and progress record), how one local worker looks in it
(``observe_worker``, found by node and pid as the agent's lease lookup does), and the pure
bookkeeping of the hang test: a worker's ``ProgressMark`` (when its progress last advanced, and
where the job stood then) and ``is_hung``; and ``JobReader``, the thread that reads the job's keys
for the agent (at ``job_read_interval_s``) so that etcd never stalls the agent's loop. Never writes
to etcd; apart from ``JobReader``, no I/O and no clock (the caller passes the time of the read).
Imports no torch.

A worker *advances* when, in a read, it is waiting for a generation (a ready record: waiting is
legitimate, e.g. at ``max_workers``), or when its (phase, generation, step) differs from the
previous read while its member record exists. A worker whose record vanished (a SIGSTOPped
process loses its lease) does not advance. It is hung when one read taken at least
``hang_timeout_s`` after its last advance still shows no advance while the job's committed step is
higher than when it last advanced: without a fresh read (etcd down) there is no evidence, so no
verdict. A finished job has no hung workers: its members revoke their leases as they leave, and a
worker that reached the last step between two reads looks, until it exits, like one that vanished.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import structlog

from elasticd.config import AgentConfig
from elasticd.errors import EtcdUnavailable, PermissionDenied
from elasticd.retry import Clock
from elasticd.store.kv import KeyValue, KeyValueStore
from elasticd.store.mirror import RangeMirror
from elasticd.wire.keys import Keys
from elasticd.wire.nodefaults import decode_cordon
from elasticd.wire.failures import DeterministicFailure, FailureRecord, decode_failure, deterministic_failure
from elasticd.wire.progress import ProgressRecord, parse_progress
from elasticd.wire.records import DECODE_ERRORS, MemberRecord
from elasticd.wire.roster import bucket_of, buckets_for, fill, is_sparse
from elasticd.wire.snapshot import DecodedRecords, Snapshot, parse_snapshot
from elasticd.wire.digest import JobDigest, decode_digest, encode_digest, middle_of, score
from elasticd.wire.stragglers import straggler_scores

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class JobView:
    """One read of a job's keys, as the agent uses it."""

    read_at: float  # monotonic time of the read
    generation: int = 0  # 0: none published
    world_size: int = 0
    in_generation: frozenset[str] = frozenset()
    job_step: int = -1  # the newest committed step anyone published (-1: none)
    members: Mapping[str, MemberRecord] = field(default_factory=dict)
    waiting: frozenset[str] = frozenset()  # members with a ready record
    progress: Mapping[str, ProgressRecord] = field(default_factory=dict)
    finished: bool = False  # the job reached its target step (``finished`` record)
    failures: tuple[FailureRecord, ...] = ()  # workers' uncaught exceptions (``failures/``)
    cordoned: Mapping[str, str] = field(default_factory=dict)  # node -> why (``cordon/<node>``)
    # True: every member's records were read; False: this node's only, and the rest is ``digest``'s
    full: bool = True
    digest: JobDigest | None = None  # ``wire.digest``, when ``full`` is False (None: none yet)

    @functools.cached_property
    def compute(self) -> dict[str, float]:
        """The compute time of each generation member whose progress record was read."""
        return {
            m: p.compute_s
            for m, p in self.progress.items()
            if m in self.in_generation and p.generation == self.generation and p.compute_s is not None
        }

    @functools.cached_property
    def scores(self) -> dict[str, float]:
        """Each generation member's straggler score (``wire.stragglers``), from its progress record
        (this node's members only, against the digest's median, when the read was not ``full``)."""
        if self.full:
            return straggler_scores(self.compute)
        d = self._digest
        if d is None:
            return {}
        return {m: s for m, t in self.compute.items() if (s := score(t, d)) is not None}

    @property
    def _digest(self) -> JobDigest | None:
        """The digest, if it is of this view's generation."""
        d = self.digest
        return d if d is not None and d.generation == self.generation else None

    def spares_waiting(self, other_than: str) -> int:
        """Warm spares waiting outside the generation on nodes other than ``other_than``."""
        if not self.full:
            d = self._digest
            return sum(k for node, k in d.spares.items() if node != other_than) if d is not None else 0
        return sum(k for node, k in spares_by_node(self).items() if node != other_than)

    @functools.cached_property
    def rank0_step_time_s(self) -> float | None:
        """Rank 0's last step time in this generation (None: not known)."""
        if not self.full:
            d = self._digest
            return d.rank0_step_time_s if d is not None else None
        rank0 = (
            p
            for m, p in self.progress.items()
            if m in self.in_generation and p.rank == 0 and p.generation == self.generation and p.step_time_s is not None
        )
        return next((p.step_time_s for p in rank0), None)

    @functools.cached_property
    def bug(self) -> DeterministicFailure | None:
        """The bug that stops the job, if the failure records show one (``wire.failures``)."""
        return deterministic_failure(self.failures)


def spares_by_node(view: JobView) -> dict[str, int]:
    """The warm spares waiting outside the generation, by node, in a ``full`` view."""
    out: dict[str, int] = {}
    for m, rec in view.members.items():
        if rec.spare and m in view.waiting and m not in view.in_generation:
            out[rec.node] = out.get(rec.node, 0) + 1
    return out


def digest_of(view: JobView) -> JobDigest:
    """What the other agents need of a ``full`` view (``wire.digest``)."""
    n, start, middle = middle_of(view.compute)
    return JobDigest(view.generation, n, start, middle, view.rank0_step_time_s, spares_by_node(view))


def read_job_view(
    keys: Keys,
    kvs: Iterable[KeyValue],
    read_at: float,
    full: bool = True,
    digest: JobDigest | None = None,
    roster: Sequence[bytes] = (),
    decoded: DecodedRecords | None = None,
) -> JobView:
    """Parse the rows of a job (``keys.rendezvous``, ``progress/`` and ``failures/``, the latter two
    read tolerantly: ``wire.progress``), all of it (``full``) or a node's (``node_prefixes``) with
    the job's ``digest`` and the node's ``roster`` bucket of a large generation; records that do
    not parse are left out. ``decoded``: the member and ready records decoded by earlier reads
    (``wire.snapshot.DecodedRecords``)."""
    rows = list(kvs)
    failures, cordoned = [], {}
    for kv in rows:
        if kv.key.startswith(keys.failure("")):
            with contextlib.suppress(ValueError, TypeError, UnicodeDecodeError, RecursionError):
                failures.append(decode_failure(kv.value))
        elif kv.key.startswith(keys.cordon("")):  # a record that does not parse still cordons
            node = kv.key[len(keys.cordon("")) :]
            try:
                cordoned[node] = decode_cordon(kv.value).reason
            except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
                cordoned[node] = "a cordon record that does not parse"
    snap = parse_snapshot(keys, rows, decoded)
    progress, _ = parse_progress(keys, rows, tolerant=True)
    g = snap.generation
    if g is not None and roster and is_sparse(g):
        with contextlib.suppress(*DECODE_ERRORS):
            g = fill(g, roster)
    steps = [snap.committed_step, g.committed_step if g else -1, *(p.step for p in progress.values())]
    return JobView(
        read_at=read_at,
        generation=g.generation if g else 0,
        world_size=g.world_size if g else 0,
        in_generation=frozenset(g.members) if g else frozenset(),
        job_step=max(steps),
        members=dict(snap.members),
        waiting=frozenset(snap.ready),
        progress=progress,
        finished=snap.finished is not None,
        failures=tuple(failures),
        cordoned=cordoned,
        full=full,
        digest=digest,
    )


class WorkerPhase(StrEnum):
    ABSENT = "absent"  # no member record (not registered yet, or its lease is gone)
    REGISTERED = "registered"  # a member record, neither waiting nor in the generation
    WAITING = "waiting"  # a ready record: waiting for the next generation
    TRAINING = "training"  # in the current generation


@dataclass(frozen=True)
class WorkerObservation:
    """How one local worker looks in a ``JobView``."""

    phase: WorkerPhase
    member_id: str = ""
    step: int = -1
    generation: int = 0
    progress: ProgressRecord | None = None


def local_members(view: JobView, node: str, pids: Collection[int]) -> list[str]:
    """Ids of the member records of ``node`` whose pid is in ``pids`` (newest incarnation last)."""
    return sorted(m for m, rec in view.members.items() if rec.node == node and rec.pid in pids)


def observe_worker(view: JobView, node: str, pids: Collection[int]) -> WorkerObservation:
    """The phase and progress of the local worker whose process (or a child) has one of ``pids``."""
    best = WorkerObservation(WorkerPhase.ABSENT)
    order = [WorkerPhase.ABSENT, WorkerPhase.REGISTERED, WorkerPhase.WAITING, WorkerPhase.TRAINING]
    for mid in local_members(view, node, pids):
        prog = view.progress.get(mid)
        if mid in view.waiting:
            phase = WorkerPhase.WAITING
        elif mid in view.in_generation:
            phase = WorkerPhase.TRAINING
        else:
            phase = WorkerPhase.REGISTERED
        obs = WorkerObservation(phase, mid, prog.step if prog else -1, prog.generation if prog else 0, prog)
        if order.index(obs.phase) >= order.index(best.phase):
            best = obs
    return best


@dataclass(frozen=True)
class ProgressMark:
    """When a worker's progress last advanced, what it was, and the job's step at that moment."""

    key: tuple[str, int, int]  # (phase, generation, step)
    at: float  # monotonic time of the read that showed the advance
    job_step: int


def advance_mark(mark: ProgressMark | None, obs: WorkerObservation, view: JobView) -> ProgressMark | None:
    """The worker's mark after ``view``. Pure.

    A worker never seen in etcd has no mark (no hang verdict before its first registration).
    """
    if obs.phase is WorkerPhase.ABSENT:
        return mark
    key = (str(obs.phase), obs.generation, obs.step)
    if obs.phase is WorkerPhase.WAITING or mark is None or key != mark.key:
        return ProgressMark(key, view.read_at, view.job_step)
    return mark


def is_hung(mark: ProgressMark | None, view: JobView | None, hang_timeout_s: float) -> bool:
    """True when ``view``, read at least ``hang_timeout_s`` after the worker last advanced, shows the
    job's committed step past where it stood then. Pure; False without a mark, a view, or a timeout,
    and once the job has finished (its workers leave, and their records vanish, as they exit)."""
    if mark is None or view is None or hang_timeout_s <= 0 or view.finished:
        return False
    return view.read_at - mark.at >= hang_timeout_s and view.job_step > mark.job_step


HANG_READS_PER_TIMEOUT = 10  # reads of the job per hang_timeout_s when only hang detection needs them
STRAGGLER_READS_PER_BOUND = 4  # reads of the job per straggler_s (a straggler is found within 1.25 x straggler_s)


def job_read_interval_s(config: AgentConfig, live_consumers: bool) -> float:
    """How often the agent reads the job's keys: every ``keepalive_s`` for metrics and systemd
    STATUS (``live_consumers``); else ``STRAGGLER_READS_PER_BOUND`` times per ``straggler_s`` and
    ``HANG_READS_PER_TIMEOUT`` times per ``hang_timeout_s``, whichever is more often, but never more
    often than every ``keepalive_s`` (each read holds every member's records, so many nodes
    reading a large job often would load etcd)."""
    k = config.timeouts.keepalive_s
    if live_consumers:
        return k
    # straggler detection: STRAGGLER_READS_PER_BOUND reads per straggler_s
    interval = config.straggler_s / STRAGGLER_READS_PER_BOUND
    if config.hang_timeout_s > 0:
        interval = min(interval, config.hang_timeout_s / HANG_READS_PER_TIMEOUT)
    return max(k, interval)


class JobReader:
    """A thread that reads the job's keys every ``interval_s`` and keeps the newest ``JobView``.

    Each agent reads its own node's records (``node_prefixes``) and the job's ``digest``
    (``wire.digest``); the agent of the coordinator's node alone reads the whole job, and writes
    the digest from it: a job of many nodes is read once per interval, not once per node, and
    each whole read after the first costs etcd the records that changed since (``store.mirror``:
    the progress records, every node's each ``keepalive_s``; the member and ready records only at a
    change of membership).

    It keeps etcd off the agent's loop: a slow or absent etcd delays only the next view (each
    read is bounded by the store's own request timeout and retries), and a failed read leaves the
    previous view in place, so nothing is decided on evidence that was not read. etcd's permission
    denied ends the thread and stays in ``denied`` (the agent stops on it).
    """

    def __init__(
        self,
        store: KeyValueStore,
        keys: Keys,
        clock: Clock,
        interval_s: float,
        on_read: Callable[[], None] = lambda: None,
        node: str = "",
    ) -> None:
        """
        Args:
            on_read: called (on this thread) after each successful read: the agent's loop wakes.
            node: this agent's node ("": read the whole job every time, and write no digest).
        """
        self._store, self._keys, self._clock, self._interval_s = store, keys, clock, interval_s
        self._on_read, self._node = on_read, node
        self._latest: JobView | None = None
        self._written = b""  # the digest this reader last wrote
        self._bucket: tuple[int, KeyValue | None] = (0, None)  # (generation revision, this node's roster bucket)
        # the whole job, read at the cost of what changed since the last whole read (``store.mirror``)
        self._whole = RangeMirror(store, (*keys.rendezvous, keys.progress(""), keys.failure(""), keys.cordon("")))
        self._decoded = DecodedRecords()  # the whole job's member and ready records, decoded once per version
        self._stop = threading.Event()
        self._wake = threading.Event()  # read now (``refresh``) or stop
        self._failing = False
        self.denied: PermissionDenied | None = None  # set when etcd refused the reads; the thread ended
        self._thread = threading.Thread(target=self._run, name="elasticd-job-reader", daemon=True)
        self._thread.start()

    def latest(self) -> JobView | None:
        return self._latest

    def refresh(self) -> None:
        """Read again now rather than at the next interval (the agent needs a view newer than an event)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(self._interval_s + 1.0)  # a read under way may outlast this; it is a daemon

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # a refresh from now on asks for a read after this one
            try:
                view = self._read()
            except EtcdUnavailable as exc:
                if not self._failing:
                    log.warning("job_read_failed", error=str(exc)[:300])
                self._failing = True
            except PermissionDenied as exc:  # every read would meet the same role: stop, tell the agent
                log.error("job_read_denied", error=str(exc))
                self.denied = exc
                return
            else:
                if self._failing:
                    log.info("job_read_recovered")
                self._failing = False
                self._latest = view
                self._on_read()
            self._wake.wait(self._interval_s)

    def _read(self) -> JobView:
        """This node's records and the digest; the whole job (and the digest written) when this is the
        coordinator's node or no node was given."""
        if self._node:
            rows = self._store.get_prefixes(node_prefixes(self._keys, self._node))
            snap = parse_snapshot(self._keys, rows)
            if snap.coordinator is None or snap.coordinator.node != self._node:
                return read_job_view(
                    self._keys, rows, self._clock(), False, _digest_in(self._keys, rows), self._roster(snap)
                )
        view = read_job_view(self._keys, self._whole.read(), self._clock(), decoded=self._decoded)
        if self._node:
            self._write_digest(view)
        return view

    def _roster(self, snap: Snapshot) -> list[bytes]:
        """This node's roster bucket of a large generation (``wire.roster``), read once per generation."""
        g = snap.generation
        if g is None or not is_sparse(g):
            return []
        if self._bucket[0] != snap.generation_revision:
            key = self._keys.roster(g.generation, bucket_of(self._node, buckets_for(g.world_size)))
            self._bucket = (snap.generation_revision, self._store.get(key))
        kv = self._bucket[1]
        return [kv.value] if kv is not None else []

    def _write_digest(self, view: JobView) -> None:
        raw = encode_digest(digest_of(view))
        if raw == self._written:
            return
        try:
            self._store.put(self._keys.digest, raw)
        except EtcdUnavailable as exc:  # the next read writes it again
            log.info("digest_not_written", error=str(exc)[:200])
            return
        self._written = raw


def node_prefixes(keys: Keys, node: str) -> tuple[str, ...]:
    """What one agent reads of its job: the member's view (the generation, committed step, finished,
    coordinator, ...), its node's member, ready and progress records, the failures, the cordons and
    the digest; never another node's records."""
    mine = f"{node}."
    return (
        *keys.member_view,
        keys.member(mine),
        keys.ready(mine),
        keys.progress(mine),
        keys.failure(""),
        keys.cordon(""),
        keys.digest,
    )


def _digest_in(keys: Keys, rows: Iterable[KeyValue]) -> JobDigest | None:
    for kv in rows:
        if kv.key == keys.digest:
            with contextlib.suppress(ValueError, TypeError, UnicodeDecodeError, RecursionError):
                return decode_digest(kv.value)
    return None
