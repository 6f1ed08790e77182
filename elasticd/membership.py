"""The rendezvous: members, generations, the pure decision ``next_action`` and its executor.

Owns the membership protocol over a ``KeyValueStore`` (defined here, satisfied by ``etcd.py``):

* every member registers ``members/<id>`` under its own lease, renewed in the background;
* a member that wants into the next generation writes ``ready/<id>`` under the same lease;
* ``next_action(snapshot, me, window, now)`` decides, purely, whether to wait, publish the next
  ``generation`` record (by compare-and-set on its ``mod_revision``), join a published one, or fail;
* a watcher keeps two flags fresh for the hot path: the current generation must be abandoned
  (a member lost its lease, the generation was aborted or superseded), or newcomers wait to join.

Never imports etcd3 or torch.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, replace
from enum import StrEnum
from typing import Protocol, TypeVar

import structlog

from elasticd import continued
from elasticd.commit import Fence
from elasticd.config import Timeouts, WorldConfig
from elasticd.errors import (
    EtcdUnavailable,
    JobFinished,
    LeaseLost,
    ModelMismatch,
    RendezvousClosed,
    StateLost,
)
from elasticd.oprecords import EventKind, EventRecord, encode_event, event_name
from elasticd.retry import Clock, Deadline

log = structlog.get_logger(__name__)


# ---------------------------------------------------------------------------------------------
# The store this module consumes


@dataclass(frozen=True)
class KeyValue:
    """One key as read from the store."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int = 0


class KeyValueStore(Protocol):
    """What the rendezvous needs from etcd. ``etcd.EtcdClient`` satisfies it structurally."""

    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        """The keys under each of ``prefixes`` (a whole key is a prefix too), read in one
        transaction, so all of them are from one revision; in the order of ``prefixes``."""
        ...

    def put(self, key: str, value: bytes, lease: int = 0) -> None: ...

    def delete(self, key: str) -> None: ...

    def compare_and_put(
        self, key: str, expected_mod_revision: int, value: bytes, delete_keys: Iterable[str] = (),
        put_keys: Mapping[str, bytes] | None = None, lease: int = 0,
    ) -> bool:
        """Put ``key`` (under ``lease``, if not 0; and delete ``delete_keys``, and put ``put_keys``,
        unleased) iff its mod_revision is as expected (0: absent), all in one transaction.

        Raises:
            LeaseLost: ``lease`` is gone (only when the compare held).
        """
        ...

    def grant_lease(self, ttl_s: float) -> int: ...

    def refresh_lease(self, lease: int) -> float:
        """Renew; return the remaining TTL in seconds (<= 0: the lease is gone)."""
        ...

    def revoke_lease(self, lease: int) -> None: ...

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` (no arguments) after any change under ``prefix``; return a canceller."""
        ...


# ---------------------------------------------------------------------------------------------
# Records (JSON in etcd; parsing never trusts them)


class Keys:
    """The etcd key layout of one job (documented in README)."""

    def __init__(self, root: str, job_id: str) -> None:
        self.job = f"{root}/{job_id}"

    @property
    def prefix(self) -> str:
        return self.job + "/"

    @property
    def generation(self) -> str:
        return f"{self.job}/generation"

    @property
    def abort(self) -> str:
        return f"{self.job}/abort"

    @property
    def finished(self) -> str:
        return f"{self.job}/finished"

    @property
    def committed(self) -> str:
        return f"{self.job}/committed"

    @property
    def checkpoint(self) -> str:
        return f"{self.job}/checkpoint"

    def member(self, member_id: str) -> str:
        return f"{self.job}/members/{member_id}"

    def ready(self, member_id: str) -> str:
        return f"{self.job}/ready/{member_id}"

    def progress(self, member_id: str) -> str:
        return f"{self.job}/progress/{member_id}"

    def event(self, name: str) -> str:
        """``events/<name>``; writers take ``name`` from ``oprecords.event_name`` (sorts by time)."""
        return f"{self.job}/events/{name}"

    @property
    def events(self) -> str:
        return f"{self.job}/events/"

    def node(self, node: str) -> str:
        """``nodes/<node>``: the node agent's record, under the agent's lease."""
        return f"{self.job}/nodes/{node}"

    def drain(self, node: str) -> str:
        """``drain/<node>``: an operator's request that this node drain (``elasticctl drain``)."""
        return f"{self.job}/drain/{node}"

    @property
    def rendezvous(self) -> tuple[str, ...]:
        """What a member reads for the rendezvous and its health checks: everything but the
        records written all the time or kept by the hundred (progress, events, nodes, drain)."""
        return (self.generation, self.abort, self.finished, self.committed, self.checkpoint,
                self.member(""), self.ready(""))

    @property
    def membership_changes(self) -> tuple[str, ...]:
        """What a member watches: the keys whose change can end a generation or start the next.
        The rest of ``rendezvous`` (committed step, checkpoint) is read by the periodic poll."""
        return (self.generation, self.abort, self.finished, self.member(""), self.ready(""))


@dataclass(frozen=True)
class MemberRecord:
    """A live member (``members/<id>``, leased)."""

    member_id: str
    node: str
    local_rank: int
    pid: int
    host: str
    store_port: int
    signature: str


@dataclass(frozen=True)
class ReadyRecord:
    """A member waiting for the next generation (``ready/<id>``, leased)."""

    member_id: str
    committed_step: int
    prev_generation: int
    prev_rank: int
    signature: str


@dataclass(frozen=True)
class GenerationRecord:
    """A published generation (``generation``): dense rank order and where its store lives."""

    generation: int
    members: tuple[str, ...]
    store_host: str
    store_port: int
    signature: str
    committed_step: int
    reason: str

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int:
        return self.members.index(member_id)


@dataclass(frozen=True)
class AbortRecord:
    """``abort``: the named generation is broken; its members must re-rendezvous."""

    generation: int
    member_id: str
    reason: str


@dataclass(frozen=True)
class CommittedRecord:
    """``committed`` (not leased): the job's newest committed step as last published by a rank 0.
    It outlives the members, so a newcomer can tell a fresh job from one whose state is gone."""

    generation: int
    step: int


@dataclass(frozen=True)
class CheckpointRecord:
    """``checkpoint`` (not leased): the job's latest good durable checkpoint, written by the member
    that saved it (or that loaded it, when the record was missing or older). Decoded tolerantly
    (``decode_checkpoint``): fields may be added, and only these are read."""

    step: int
    path: str
    node: str
    generation: int = 0
    seq: int = 0
    bytes: int = 0
    time: float = 0.0


def decode_checkpoint(raw: bytes) -> CheckpointRecord:
    """Parse a ``checkpoint`` record: ``step``, ``path`` and ``node`` are required; the other known
    fields are optional; unknown fields are ignored.

    Raises:
        ValueError, TypeError, UnicodeDecodeError, RecursionError: the bytes are not such a record.
    """
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    out: dict[str, object] = {}
    for name, f in CheckpointRecord.__dataclass_fields__.items():
        if name not in data:
            if f.default is MISSING:
                raise ValueError(f"field {name} is missing")
            continue
        value = data[name]
        kind = str(f.type)
        ok = {"int": isinstance(value, int), "str": isinstance(value, str),
              "float": isinstance(value, (int, float))}[kind]
        if not ok or isinstance(value, bool):
            raise ValueError(f"field {name} is not {kind}")
        out[name] = float(value) if kind == "float" else value
    rec = CheckpointRecord(**out)  # type: ignore[arg-type]
    if rec.step < 0:
        raise ValueError("step must be >= 0")
    return rec


@dataclass(frozen=True)
class FinishedRecord:
    """``finished``: every member reached the target step together; the job is done."""

    generation: int
    step: int


_R = TypeVar("_R")


def encode(record: object) -> bytes:
    return json.dumps(asdict(record), sort_keys=True).encode()  # type: ignore[call-overload]


def _decode(cls: type, raw: bytes) -> object:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    if set(data) != set(fields):
        raise ValueError(f"fields {sorted(data)} != {sorted(fields)}")
    for name, f in fields.items():
        want = {"int": int, "str": str, "tuple[str, ...]": list}[str(f.type)]
        if not isinstance(data[name], want) or isinstance(data[name], bool):
            raise ValueError(f"field {name} is not {f.type}")
    if "members" in data:
        if not all(isinstance(m, str) for m in data["members"]):
            raise ValueError("members must be strings")
        data["members"] = tuple(data["members"])
    return cls(**data)


def decode(cls: type[_R], raw: bytes) -> _R:
    """Parse one record of type ``cls``, trusting nothing.

    Raises:
        ValueError, TypeError, UnicodeDecodeError, RecursionError: the bytes are not such a record.
    """
    rec = _decode(cls, raw)
    assert isinstance(rec, cls)
    return rec


def decode_generation(raw: bytes) -> GenerationRecord:
    rec = decode(GenerationRecord, raw)
    if rec.generation < 1 or len(set(rec.members)) != len(rec.members) or not rec.members:
        raise ValueError("generation must be >= 1 with distinct, non-empty members")
    return rec


def decode_abort(raw: bytes) -> AbortRecord:
    return decode(AbortRecord, raw)


@dataclass(frozen=True)
class Snapshot:
    """Everything under the job prefix, parsed; malformed records are listed, not fatal."""

    generation: GenerationRecord | None = None
    generation_revision: int = 0
    members: Mapping[str, MemberRecord] = field(default_factory=dict)
    ready: Mapping[str, ReadyRecord] = field(default_factory=dict)
    ready_order: Mapping[str, int] = field(default_factory=dict)
    aborted: int = 0
    malformed: tuple[str, ...] = ()
    finished: FinishedRecord | None = None
    committed_step: int = -1
    checkpoint: CheckpointRecord | None = None

    @property
    def highest_generation_seen(self) -> int:
        seen = [self.generation.generation if self.generation else 0, self.aborted]
        seen += [r.prev_generation for r in self.ready.values()]
        return max(seen)


def parse_snapshot(keys: Keys, kvs: Iterable[KeyValue]) -> Snapshot:
    """Turn the raw keys of a job into a ``Snapshot``; garbage is reported in ``malformed``."""
    generation: GenerationRecord | None = None
    generation_revision = 0
    members: dict[str, MemberRecord] = {}
    ready: dict[str, ReadyRecord] = {}
    ready_order: dict[str, int] = {}
    aborted = 0
    finished: FinishedRecord | None = None
    committed_step = -1
    checkpoint: CheckpointRecord | None = None
    malformed: list[str] = []
    for kv in kvs:
        try:
            if kv.key == keys.generation:
                generation_revision = kv.mod_revision
                generation = decode_generation(kv.value)
            elif kv.key == keys.abort:
                aborted = decode_abort(kv.value).generation
            elif kv.key == keys.finished:
                finished = decode(FinishedRecord, kv.value)
            elif kv.key == keys.committed:
                committed_step = decode(CommittedRecord, kv.value).step
            elif kv.key == keys.checkpoint:
                checkpoint = decode_checkpoint(kv.value)
            elif kv.key.startswith(keys.member("")):
                m = decode(MemberRecord, kv.value)
                if kv.key != keys.member(m.member_id):
                    raise ValueError("member id does not match its key")
                members[m.member_id] = m
            elif kv.key.startswith(keys.ready("")):
                r = decode(ReadyRecord, kv.value)
                if kv.key != keys.ready(r.member_id):
                    raise ValueError("member id does not match its key")
                ready[r.member_id] = r
                ready_order[r.member_id] = kv.create_revision
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as exc:
            malformed.append(f"{kv.key}: {exc}")
    return Snapshot(
        generation, generation_revision, members, ready, ready_order, aborted, tuple(malformed), finished,
        committed_step, checkpoint=checkpoint,
    )


# ---------------------------------------------------------------------------------------------
# The pure decision


class ActionKind(StrEnum):
    WAIT = "wait"
    PUBLISH = "publish"
    JOIN = "join"
    REREGISTER = "reregister"
    FAIL = "fail"
    FINISHED = "finished"
    STATE_LOST = "state_lost"


@dataclass(frozen=True)
class Me:
    member_id: str
    signature: str
    last_generation: int


@dataclass(frozen=True)
class Window:
    """What this process saw of the current round, on its own monotonic clock."""

    entered_at: float
    candidates_changed_at: float
    broken_at: float | None = None  # when this member first saw the current generation broken


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    reason: str
    until: float | None = None
    record: GenerationRecord | None = None
    expected_revision: int = 0
    consumed_ready: tuple[str, ...] = ()
    error: str = ""
    standby: bool = False  # WAIT: the job is at max_workers and healthy; I wait for a place


def candidates_of(snap: Snapshot) -> list[ReadyRecord]:
    """Ready members that are alive and whose model matches the job's signature."""
    job_sig = snap.generation.signature if snap.generation else _first_signature(snap)
    return [
        r
        for r in snap.ready.values()
        if r.member_id in snap.members and r.signature == job_sig
    ]


def _first_signature(snap: Snapshot) -> str:
    alive = [r for r in snap.ready.values() if r.member_id in snap.members]
    if not alive:
        return ""
    return min(alive, key=lambda r: (snap.ready_order.get(r.member_id, 0), r.member_id)).signature


def generation_broken(snap: Snapshot) -> bool:
    """The current generation can no longer make progress: aborted, or a member's lease is gone."""
    g = snap.generation
    if g is None:
        return True
    return snap.aborted >= g.generation or any(m not in snap.members for m in g.members)


def rank_order(snap: Snapshot, chosen: Iterable[ReadyRecord]) -> list[ReadyRecord]:
    """Newest committed step first (so rank 0 holds it), then survivors in their old rank order,
    then newcomers in arrival order."""
    old = snap.generation.members if snap.generation else ()

    def key(r: ReadyRecord) -> tuple[int, int, int, int, str]:
        survivor = r.member_id in old and r.prev_generation == (snap.generation.generation if snap.generation else -1)
        return (
            -r.committed_step,
            0 if survivor else 1,
            r.prev_rank if survivor else 0,
            snap.ready_order.get(r.member_id, 0),
            r.member_id,
        )

    return sorted(chosen, key=key)


def should_load_checkpoint(snap: Snapshot, held_step: int) -> bool:
    """Whether a member about to rendezvous should look for a durable checkpoint (pure).

    Yes when no member of the current generation is alive (or there is none), the job has not
    finished, and this member holds nothing, or less than the newest step the job is known to have
    reached (``generation``, ``committed`` or ``checkpoint`` record). While a generation has live
    members they hold its newest state, and a newcomer gets it from rank 0.
    """
    g = snap.generation
    if snap.finished is not None and (g is None or snap.finished.generation >= g.generation):
        return False
    if g is not None and any(m in snap.members for m in g.members):
        return False
    newest = max(g.committed_step if g else -1, snap.committed_step,
                 snap.checkpoint.step if snap.checkpoint else -1)
    return held_step < 0 or held_step < newest


def next_action(
    snap: Snapshot, me: Me, window: Window, now: float, world: WorldConfig, timeouts: Timeouts
) -> Action:
    """Decide what this member does next in a rendezvous. Pure: no I/O, no clock reads."""
    g = snap.generation
    if g is not None and me.member_id in g.members and g.generation > me.last_generation:
        return Action(ActionKind.JOIN, f"generation {g.generation} includes me", record=g)
    if snap.finished is not None and (g is None or snap.finished.generation >= g.generation):
        return Action(ActionKind.FINISHED, f"the job finished at step {snap.finished.step}")
    if me.member_id not in snap.members or me.member_id not in snap.ready:
        return Action(ActionKind.REREGISTER, "my member or ready record is gone (lease expired?)")
    job_sig = g.signature if g else _first_signature(snap)
    if job_sig and me.signature != job_sig:
        return Action(
            ActionKind.FAIL,
            "model mismatch",
            error=f"this worker's model signature {me.signature[:12]} differs from the job's "
            f"{job_sig[:12]} (parameter names, shapes or dtypes differ)",
        )
    cands = candidates_of(snap)
    ids = {r.member_id for r in cands}
    broken = generation_broken(snap)
    if g is not None:
        missing = [m for m in g.members if m in snap.members and m not in ids]
        if missing and not broken:
            if me.member_id not in g.members and g.world_size >= world.max_workers:
                return Action(ActionKind.WAIT, f"standby: generation {g.generation} is healthy at "
                              f"max_workers {world.max_workers}", standby=True)
            return Action(ActionKind.WAIT, f"generation {g.generation} is healthy; waiting for its "
                          f"members {missing} to reach a step boundary")
        if missing and not any(r.member_id in g.members for r in cands):
            # Only members of the generation hold its state. Publishing without any of them while
            # some live would start over from older state (a newcomer alone would train from step
            # 0): wait for them. Bounded by their leases (and the agent's hang detection).
            return Action(ActionKind.WAIT, f"waiting for the live members {missing} of generation "
                          f"{g.generation}, which hold its state")
        # The last call starts when this member saw the generation broken: a newcomer that has
        # been waiting for long must not cut it short.
        last_call = max(window.entered_at, window.broken_at or window.entered_at) + timeouts.last_call_s
        if missing and now < last_call:
            return Action(ActionKind.WAIT, f"last call for {missing}", until=last_call)
    if len(cands) < world.min_workers:
        return Action(ActionKind.WAIT, f"{len(cands)} ready < min_workers {world.min_workers}")
    best = max(r.committed_step for r in cands)
    resume = g is None and best > 0  # a first generation from state loaded from disk
    if g is not None and not any(m in snap.members for m in g.members):
        newest = max(g.committed_step, snap.committed_step)
        ck = snap.checkpoint
        if best < newest and ck is None:
            return Action(
                ActionKind.STATE_LOST,
                "state lost",
                error=f"every member of generation {g.generation} is gone and no waiting member holds "
                f"the job's state (step {newest}; the best here: {best}), and no durable checkpoint is "
                f"recorded for this job (set checkpoint_dir to save them); restart from a checkpoint",
            )
        if best < newest and best < 0:
            assert ck is not None
            return Action(ActionKind.WAIT, f"every member of generation {g.generation} is gone and no waiting "
                          f"member holds state or could load the checkpoint at step {ck.step} ({ck.path} on "
                          f"{ck.node}); waiting for one that can")
        resume = best >= 0  # nobody of it lives: the state came from disk (steps after it are done again)
    old = set(g.members) if g else set()
    newcomers = ids - old
    settle = window.candidates_changed_at + timeouts.join_window_s
    if newcomers and len(cands) < world.max_workers and now < settle:
        return Action(ActionKind.WAIT, "join window open", until=settle)
    chosen = rank_order(snap, cands)[: world.max_workers]
    rank0 = snap.members[chosen[0].member_id]
    number = snap.highest_generation_seen + 1
    if resume:
        reason = "resume"
    elif g is None:
        reason = "start"
    elif snap.aborted >= g.generation:
        reason = "aborted"
    elif any(m not in snap.members for m in g.members):
        reason = "member_lost"
    elif newcomers:
        reason = "join"
    else:
        reason = "regroup"
    record = GenerationRecord(
        generation=number,
        members=tuple(r.member_id for r in chosen),
        store_host=rank0.host,
        store_port=rank0.store_port,
        signature=job_sig,
        committed_step=chosen[0].committed_step,
        reason=reason,
    )
    return Action(
        ActionKind.PUBLISH,
        reason,
        record=record,
        expected_revision=snap.generation_revision,
        consumed_ready=tuple(record.members),
    )


@dataclass(frozen=True)
class Health:
    """What a member of ``current`` makes of a snapshot (``assess_health``)."""

    abandon: bool  # leave the generation at the next chance (a wait in it ends now)
    reason: str
    fenced: bool  # and never commit in it again (superseded, aborted, or my lease is gone)
    join_pending: bool | None  # newcomers would be admitted by a regroup (None: this read cannot tell)
    newcomers: tuple[str, ...] = ()


def newcomers_admitted(snap: Snapshot, current: GenerationRecord, world: WorldConfig) -> tuple[str, ...]:
    """The ready candidates outside ``current`` that a regroup now would take in (pure).

    None while ``current`` is at ``max_workers``: a standby beyond it waits until a member leaves
    (the generation then breaks and the standby is chosen); forcing generations for it would only
    slow the job down, since ``rank_order`` would leave it out again."""
    if current.world_size >= world.max_workers:
        return ()
    return tuple(r.member_id for r in candidates_of(snap) if r.member_id not in current.members)


def assess_health(snap: Snapshot, current: GenerationRecord, me: str, joined_revision: int,
                  lease_lost: bool, world: WorldConfig) -> Health:
    """Whether the generation ``current`` that ``me`` is in can go on, from one snapshot (pure).

    ``joined_revision`` is the generation record's ``mod_revision`` when ``me`` joined it: a
    snapshot read before that says nothing about this generation, so only ``lease_lost`` counts then.
    """
    if lease_lost:
        return Health(True, "my lease expired", True, None)
    if snap.generation_revision < joined_revision:
        return Health(False, "", False, None)
    if snap.generation is None and snap.generation_revision != 0:
        # garbage written by hand: reported by snapshot(); not a reason to stop training
        return Health(False, "", False, None)
    if snap.generation is None or snap.generation.generation != current.generation:
        return Health(True, "generation superseded", True, None)
    if snap.aborted >= current.generation:
        return Health(True, "generation aborted", True, None)
    newcomers = newcomers_admitted(snap, current, world)
    lost = [m for m in current.members if m not in snap.members]
    if lost:
        return Health(True, f"members lost their lease: {lost}", False, bool(newcomers), newcomers)
    # A member that wrote a ready record naming this generation has left it (its step failed, and
    # it is at the rendezvous): waiting for it in a collective could only end at collective_s.
    left = [m for m in current.members if m != me and m in snap.ready
            and snap.ready[m].prev_generation >= current.generation]
    if left:
        return Health(True, f"members left the generation: {left}", False, bool(newcomers), newcomers)
    return Health(False, "", False, bool(newcomers), newcomers)


# ---------------------------------------------------------------------------------------------
# The executor


@dataclass(frozen=True)
class Joined:
    """The outcome of a rendezvous, from this member's point of view."""

    record: GenerationRecord
    rank: int
    duration_s: float
    excused_s: float = 0.0  # time not counted against the join deadline (etcd down, standby)

    @property
    def generation(self) -> int:
        return self.record.generation

    @property
    def world_size(self) -> int:
        return self.record.world_size


class MemberState(StrEnum):
    UNREGISTERED = "unregistered"
    REGISTERED = "registered"
    CLOSED = "closed"


class Membership:
    """One member's presence in a job: lease, registration, rendezvous, and the health watcher.

    Thread-safety: ``join``/``abort``/``close`` are called from the training thread; the keepalive
    and watcher threads only set flags read through ``must_abandon`` and ``join_pending``.
    """

    def __init__(
        self,
        store: KeyValueStore,
        keys: Keys,
        member: MemberRecord,
        world: WorldConfig,
        timeouts: Timeouts,
        clock: Clock = time.monotonic,
    ) -> None:
        self._store = store
        self._keys = keys
        self.record = member
        self._world = world
        self._timeouts = timeouts
        self._clock = clock
        self._lease = 0
        self._state = MemberState.UNREGISTERED
        self._lock = threading.Lock()
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._current: GenerationRecord | None = None
        self._joined_revision = 0  # mod_revision of the generation record this member joined
        self._abandon = False
        self._fenced = False
        self._abandon_reason = ""
        self._join_pending = False
        self._lease_lost = False
        self._cancel_watches: list[Callable[[], None]] = []
        self._threads: list[threading.Thread] = []
        self._warned_malformed: set[str] = set()
        self._progress: Mapping[str, object] | None = None
        self._renewed_at = float("-inf")
        self._renewed_continues = 0  # continued.count() when the last granted renewal was asked
        # The TTL etcd granted (it may raise a short one to its minimum, and rounds to whole
        # seconds); the fence counts on this one, learned from the renewals' answers.
        self._granted_ttl_s = timeouts.lease_ttl_s
        self._etcd_ok = True  # the last etcd request of the background threads was answered
        self._etcd_ok_at = clock()  # ... and when the last answer came
        self._etcd_down_logged = False
        self._renew = threading.Event()  # renew now (a commit waits for a renewal)

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def member_id(self) -> str:
        return self.record.member_id

    def start(self) -> None:
        """Register and start the keepalive and watcher threads.

        An unreachable etcd is waited for, up to ``etcd_outage_s`` (a worker started during an
        outage, e.g. one its agent restarted, waits for etcd instead of failing again).

        Raises:
            EtcdUnavailable: etcd stayed unreachable for ``etcd_outage_s``.
        """
        deadline = Deadline.after(self._timeouts.etcd_outage_s, self._clock)
        while True:
            try:
                self._register()
                break
            except EtcdUnavailable as exc:
                if deadline.expired():
                    raise
                log.warning("register_waiting_for_etcd", error=str(exc)[:200],
                            bound_s=round(deadline.remaining_s(), 1))
                self._stop.wait(min(self._timeouts.keepalive_s, deadline.remaining_s()))
        self._cancel_watches = [self._store.watch_prefix(p, self._on_change) for p in self._keys.membership_changes]
        for name, target in (("elasticd-keepalive", self._keepalive_loop), ("elasticd-watch", self._watch_loop)):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def close(self) -> None:
        """Leave the job now: revoke the lease so peers see this member gone at once."""
        if self._state == MemberState.CLOSED:
            return
        self._stop.set()
        self._changed.set()
        self._renew.set()
        for cancel in self._cancel_watches:
            try:
                cancel()
            except EtcdUnavailable:
                pass
        try:
            if self._lease:
                self._store.revoke_lease(self._lease)
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("lease_revoke_failed", error=str(exc))
        for t in self._threads:
            t.join(timeout=self._timeouts.etcd_request_s * 2)
        self._state = MemberState.CLOSED
        log.info("membership_closed", member=self.member_id)

    def _put_ready(self, ready: ReadyRecord) -> None:
        """Write my ready record, re-registering first if my lease is gone."""
        try:
            self._store.put(self._keys.ready(self.member_id), encode(ready), lease=self._lease)
        except LeaseLost:
            log.warning("member_reregistered", member=self.member_id, cause="lease expired")
            self._register()
            self._store.put(self._keys.ready(self.member_id), encode(ready), lease=self._lease)

    def _register(self) -> None:
        asked_at, continues = self._clock(), continued.count()
        self._lease = self._store.grant_lease(self._timeouts.lease_ttl_s)
        self._note_granted(self._store.refresh_lease(self._lease))  # learn the TTL etcd granted
        self._renewed_at, self._renewed_continues = asked_at, continues
        self._store.put(self._keys.member(self.member_id), encode(self.record), lease=self._lease)
        with self._lock:
            self._lease_lost = False
        self._state = MemberState.REGISTERED
        log.info("member_registered", member=self.member_id, lease=self._lease)

    # -- background threads -----------------------------------------------------------------

    def _on_change(self) -> None:
        self._changed.set()

    def set_progress(self, payload: Mapping[str, object]) -> None:
        """Hand the latest progress to the keepalive thread, which publishes it (off the hot path)."""
        self._progress = payload

    def _note_granted(self, ttl: float) -> None:
        """A renewal's answer is the TTL the lease now has: the one etcd granted."""
        if ttl > 0:
            self._granted_ttl_s = ttl

    def _etcd_answered(self, ok: bool, error: str = "") -> None:
        self._etcd_ok = ok
        if ok:
            self._etcd_ok_at = self._clock()
        if not ok and not self._etcd_down_logged:
            self._etcd_down_logged = True
            log.warning("etcd_unreachable", error=error[:300])
        elif ok and self._etcd_down_logged:
            self._etcd_down_logged = False
            log.info("etcd_reachable_again")

    def renew_soon(self) -> None:
        """Ask the keepalive thread for a renewal now (a step waits for one)."""
        self._renew.set()

    def _keepalive_loop(self) -> None:
        published: Mapping[str, object] | None = None
        while not self._stop.is_set():
            self._renew.wait(self._timeouts.keepalive_s)
            self._renew.clear()
            if self._stop.is_set():
                return
            # The renewal first: a step may be waiting for it (a vote of "stale"); the progress
            # writes after it, and only while etcd answers (each could spend the retry budget).
            lease = self._lease
            asked_at, continues = self._clock(), continued.count()
            try:
                ttl = self._store.refresh_lease(lease)
            except LeaseLost:
                ttl = 0.0
            except EtcdUnavailable as exc:
                self._etcd_answered(False, str(exc))
                continue
            self._etcd_answered(True)
            if ttl > 0 and lease == self._lease:
                self._note_granted(ttl)
                self._renewed_at, self._renewed_continues = asked_at, continues
            progress = self._progress
            if progress is not None and progress is not published:
                self.publish_progress(progress)
                published = progress
                if progress.get("rank") == 0:
                    self._publish_committed(progress)
            if ttl <= 0 and lease == self._lease:
                with self._lock:
                    if not self._lease_lost:
                        log.warning("lease_expired", member=self.member_id, lease=lease)
                    self._lease_lost = True
                self._changed.set()

    def _watch_loop(self) -> None:
        # Watches can break (etcd restarts); polling every keepalive interval covers that.
        while not self._stop.is_set():
            self._changed.wait(self._timeouts.keepalive_s)
            self._changed.clear()
            if self._stop.is_set():
                return
            try:
                snap = self.snapshot()
            except EtcdUnavailable as exc:
                self._etcd_answered(False, str(exc))
                continue
            self._etcd_answered(True)
            self._update_health(snap)

    def snapshot(self) -> Snapshot:
        """Read and parse the job's rendezvous keys (``Keys.rendezvous``), in one transaction.

        Raises:
            EtcdUnavailable: etcd could not be reached within the retry bound.
        """
        snap = parse_snapshot(self._keys, self._store.get_prefixes(self._keys.rendezvous))
        for bad in snap.malformed:
            if bad not in self._warned_malformed:
                self._warned_malformed.add(bad)
                log.error("malformed_record_ignored", record=bad)
        return snap

    def _update_health(self, snap: Snapshot) -> None:
        with self._lock:
            current = self._current
            if current is None:
                return
            h = assess_health(snap, current, self.member_id, self._joined_revision, self._lease_lost, self._world)
            self._fenced = self._fenced or h.fenced
            if h.abandon and not self._abandon:
                self._abandon, self._abandon_reason = True, h.reason
                log.warning("generation_abandon_requested", generation=current.generation, cause=h.reason)
            if h.join_pending is None:
                return
            if h.join_pending and not self._join_pending:
                log.info("join_requested", generation=current.generation, newcomers=list(h.newcomers))
            self._join_pending = h.join_pending

    # -- hot-path flags ---------------------------------------------------------------------

    def lease_fresh(self) -> bool:
        """This member's lease is certainly alive: renewed less than ``TTL - keepalive_s`` ago (the
        TTL etcd granted), by a renewal asked after this process last continued from a stop (its
        agent revokes the lease of a worker stopped for ``stopped_worker_s``: see continued.py)."""
        return (self._clock() - self._renewed_at < self._granted_ttl_s - self._timeouts.keepalive_s
                and not self.continued_since_renewal())

    def continued_since_renewal(self) -> bool:
        """This process was stopped and continued since it asked for its last granted renewal."""
        return continued.count() != self._renewed_continues

    def vote(self) -> tuple[bool, bool, bool]:
        """(veto, stale, reached_etcd) for this member's commit vote (``commit.Vote``): veto when
        the generation was superseded or aborted or the lease is gone; stale when the lease is not
        certainly alive (a renewal is then asked for at once); reached_etcd when the last request
        of the background threads was answered, within the last two keepalive intervals."""
        stale = not self.lease_fresh()
        if stale:
            self._renew.set()
        # Answered lately: the background threads ask every keepalive_s, so two intervals without
        # an answer mean etcd is not answering, before the client's retries have given up.
        reached = self._etcd_ok and self._clock() - self._etcd_ok_at < 2 * self._timeouts.keepalive_s
        return self._fenced or self._lease_lost, stale, reached

    def fence(self) -> Fence:
        """What this member knows of its own standing once a step's vote is summed."""
        return Fence(fenced=self._fenced, lease_lost=self._lease_lost, renewed_at=self._renewed_at,
                     continued=self.continued_since_renewal(),
                     lease_ttl_s=self._granted_ttl_s)

    def must_abandon(self) -> bool:
        """The current generation cannot finish: a member is gone, or it was aborted/superseded."""
        return self._abandon

    @property
    def abandon_reason(self) -> str:
        return self._abandon_reason

    def join_pending(self) -> bool:
        """Newcomers wait to join: re-rendezvous at the next step boundary."""
        return self._join_pending

    # -- rendezvous -------------------------------------------------------------------------

    def abort(self, generation: int, reason: str) -> None:
        """Mark ``generation`` broken so every member leaves it at once.

        Written off the training thread (which goes on to the rendezvous at once), and retried
        while etcd is unreachable, up to ``etcd_outage_s``: members waiting in a collective of that
        generation learn it as soon as etcd answers (they also leave when they see this member's
        ready record). Written by compare-and-set, and never over an abort of a newer generation.
        """
        rec = AbortRecord(generation=generation, member_id=self.member_id, reason=reason[:200])
        t = threading.Thread(target=self._publish_abort, args=(rec,), name="elasticd-abort", daemon=True)
        t.start()

    def _publish_abort(self, rec: AbortRecord) -> None:
        deadline = Deadline.after(self._timeouts.etcd_outage_s, self._clock)
        failures = 0
        while not self._stop.is_set() and not deadline.expired():
            try:
                kv = self._store.get(self._keys.abort)
                if kv is not None:
                    try:
                        if decode_abort(kv.value).generation >= rec.generation:
                            return  # already aborted (or a newer generation is): nothing to add
                    except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
                        pass  # garbage: replace it
                if self._store.compare_and_put(self._keys.abort, kv.mod_revision if kv else 0, encode(rec)):
                    if failures:
                        log.info("abort_published", generation=rec.generation, after_failures=failures)
                    return
            except EtcdUnavailable as exc:
                failures += 1
                if failures == 1:
                    log.warning("abort_publish_failed", generation=rec.generation, error=str(exc)[:300],
                                retrying_for_s=round(deadline.remaining_s(), 1))
                self._stop.wait(min(self._timeouts.keepalive_s, deadline.remaining_s()))

    def join(
        self, committed_step: int, deadline: Deadline, resume: Callable[[int], int] | None = None
    ) -> Joined:
        """Wait for (or publish) the next generation that includes this member.

        Args:
            committed_step: the newest step whose state this member holds (-1: none).
            deadline: when to give up.
            resume: loads durable state newer than the step given, if there is any, and returns
                the step now held. Called (at most once per join) when ``should_load_checkpoint``
                says so; the ready record then carries the new step.

        Time while etcd does not answer (up to ``etcd_outage_s``) and time as a standby (the job is
        at ``max_workers`` and healthy; up to ``standby_s``) is added to ``deadline``: a member that
        holds live state never gives up because etcd is down, and a standby waits for a place.

        Raises:
            RendezvousClosed: no generation could be formed before ``deadline``.
            ModelMismatch: this member's model differs from the job's.
            EtcdUnavailable: etcd stayed unreachable for ``etcd_outage_s``.
        """
        started = self._clock()
        prev = self._current
        with self._lock:
            self._current = None
            self._abandon = False
            self._join_pending = False
        me = Me(self.member_id, self.record.signature, prev.generation if prev else 0)
        ready = ReadyRecord(
            member_id=self.member_id,
            committed_step=committed_step,
            prev_generation=prev.generation if prev else 0,
            prev_rank=prev.rank_of(self.member_id) if prev and self.member_id in prev.members else 0,
            signature=self.record.signature,
        )
        window = Window(entered_at=started, candidates_changed_at=started)
        last_cands: frozenset[str] = frozenset()
        last_reason = ""
        excused = {"etcd": 0.0, "standby": 0.0}  # seconds not counted against deadline
        bounds = {"etcd": self._timeouts.etcd_outage_s, "standby": self._timeouts.standby_s}
        excuse, since = "", started
        ready_written = False
        broken_seen = 0  # the broken generation whose break this member saw (0: none)
        while True:
            t = self._clock()
            if excuse:
                excused[excuse] += t - since
                if excused[excuse] > bounds[excuse]:
                    raise (EtcdUnavailable if excuse == "etcd" else RendezvousClosed)(
                        f"{last_reason} for longer than {excuse}_{'outage_' if excuse == 'etcd' else ''}s "
                        f"({bounds[excuse]:g} s)")
            excuse, since = "", t
            if deadline.at - deadline.clock() + sum(excused.values()) <= 0:
                raise RendezvousClosed(
                    f"no generation formed within the join timeout ({last_reason})"
                )
            self._changed.clear()
            try:
                if not ready_written:
                    if self._lease_lost:
                        self._register()
                    self._put_ready(ready)
                    ready_written = True
                snap = self.snapshot()
            except EtcdUnavailable as exc:
                excuse, last_reason = "etcd", f"etcd unreachable: {str(exc)[:200]}"
                self._etcd_answered(False, str(exc))
                self._stop.wait(self._timeouts.keepalive_s)
                continue
            self._etcd_answered(True)
            if resume is not None and should_load_checkpoint(snap, ready.committed_step):
                held = resume(ready.committed_step)
                resume = None
                if held != ready.committed_step:
                    ready = replace(ready, committed_step=held)
                    if self.member_id in self.snapshot().ready:  # not consumed by a generation meanwhile
                        self._put_ready(ready)
                continue
            cands = frozenset(r.member_id for r in candidates_of(snap))
            now = self._clock()
            if cands != last_cands:
                window = replace(window, candidates_changed_at=now)
                last_cands = cands
            broken = snap.generation.generation if snap.generation and generation_broken(snap) else 0
            if broken != broken_seen:
                broken_seen = broken
                window = replace(window, broken_at=now if broken else None)
            action = next_action(snap, me, window, now, self._world, self._timeouts)
            last_reason = action.reason
            if action.kind is ActionKind.JOIN:
                assert action.record is not None
                return self._joined(action.record, started, snap, sum(excused.values()))
            if action.kind is ActionKind.FAIL:
                self.close()
                raise ModelMismatch(action.error)
            if action.kind is ActionKind.STATE_LOST:
                self.close()
                raise StateLost(action.error)
            try:
                if action.kind is ActionKind.FINISHED:
                    self._store.delete(self._keys.ready(self.member_id))
                    raise JobFinished(action.reason)
                if action.kind is ActionKind.REREGISTER:
                    log.warning("member_reregistered", member=self.member_id, cause=action.reason)
                    if self.member_id not in snap.members:
                        self._register()
                    self._put_ready(ready)
                    continue
                if action.kind is ActionKind.PUBLISH:
                    assert action.record is not None
                    won = self._store.compare_and_put(
                        self._keys.generation,
                        action.expected_revision,
                        encode(action.record),
                        delete_keys=[self._keys.ready(m) for m in action.consumed_ready],
                        put_keys=dict([self._published_event(action.record)]),  # the history, same txn
                    )
            except EtcdUnavailable as exc:
                excuse, last_reason = "etcd", f"etcd unreachable: {str(exc)[:200]}"
                self._stop.wait(self._timeouts.keepalive_s)
                continue
            if action.kind is ActionKind.PUBLISH:
                assert action.record is not None
                if won:
                    log.info(
                        "generation_published",
                        generation=action.record.generation,
                        world_size=action.record.world_size,
                        members=list(action.record.members),
                        cause=action.reason,
                    )
                continue
            if action.standby:
                if excuse != "standby" and excused["standby"] == 0.0:
                    log.info("standby_waiting", member=self.member_id, reason=action.reason,
                             bound_s=self._timeouts.standby_s)
                excuse = "standby"
            wait_s = self._timeouts.keepalive_s
            if action.until is not None:
                wait_s = min(wait_s, max(0.0, action.until - now))
            self._changed.wait(max(0.0, min(wait_s, deadline.at - deadline.clock() + sum(excused.values()))))

    def _published_event(self, record: GenerationRecord) -> tuple[str, bytes]:
        """The ``generation_published`` event that goes into the publishing transaction."""
        now_ns = time.time_ns()  # wall clock: events from many hosts are ordered by it
        event = EventRecord(time=now_ns / 1e9, kind=EventKind.GENERATION_PUBLISHED, source=self.member_id,
                            detail={"generation": record.generation, "reason": record.reason,
                                    "world_size": record.world_size, "members": list(record.members),
                                    "committed_step": record.committed_step})
        return self._keys.event(event_name(now_ns, self.member_id)), encode_event(event)

    def _joined(self, record: GenerationRecord, started: float, snap: Snapshot, excused_s: float = 0.0) -> Joined:
        with self._lock:
            self._current = record
            self._joined_revision = snap.generation_revision
            self._abandon = False
            self._fenced = False
            self._abandon_reason = ""
        self._update_health(snap)
        return Joined(record, record.rank_of(self.member_id), self._clock() - started, excused_s)

    def _publish_committed(self, progress: Mapping[str, object]) -> None:
        step, generation = progress.get("step"), progress.get("generation")
        if not isinstance(step, int) or not isinstance(generation, int):
            return
        try:
            self._store.put(self._keys.committed, encode(CommittedRecord(generation=generation, step=step)))
        except EtcdUnavailable as exc:
            log.warning("committed_publish_failed", error=str(exc))

    def publish_checkpoint(self, record: CheckpointRecord, only_if_newer: bool = False) -> None:
        """Record the job's latest good durable checkpoint (best effort).

        Args:
            only_if_newer: write only if the key is absent or names an older step (by
                compare-and-set, so a concurrent save is never overwritten by an older record).
        """
        try:
            if not only_if_newer:
                self._store.put(self._keys.checkpoint, encode(record))
                return
            kv = self._store.get(self._keys.checkpoint)
            if kv is not None:
                try:
                    if decode_checkpoint(kv.value).step >= record.step:
                        return
                except (ValueError, TypeError, UnicodeDecodeError, RecursionError):
                    pass  # garbage: replace it
            self._store.compare_and_put(self._keys.checkpoint, kv.mod_revision if kv else 0, encode(record))
        except EtcdUnavailable as exc:
            log.warning("checkpoint_publish_failed", step=record.step, error=str(exc))

    def mark_finished(self, generation: int, step: int) -> None:
        """Record that every member reached the target step together (late joiners stop)."""
        try:
            self._store.put(self._keys.finished, encode(FinishedRecord(generation=generation, step=step)))
        except EtcdUnavailable as exc:
            log.warning("finished_publish_failed", error=str(exc))

    def publish_progress(self, payload: Mapping[str, object]) -> None:
        """Best-effort progress record for ``elasticctl`` (leased: it vanishes with the member)."""
        try:
            self._store.put(
                self._keys.progress(self.member_id), json.dumps(dict(payload)).encode(), lease=self._lease
            )
        except (EtcdUnavailable, LeaseLost) as exc:
            log.warning("progress_publish_failed", error=str(exc))


_incarnations = itertools.count()


def new_member_id(node: str, local_rank: int) -> str:
    """A member id unique per incarnation: node, local rank, pid, and a counter when one process
    joins more than once (a member that left must come back as a newcomer, never as its old self)."""
    n = next(_incarnations)
    return f"{node}.{local_rank}.{os.getpid()}" + (f".{n}" if n else "")
