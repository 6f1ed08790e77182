"""The rendezvous records as JSON in etcd, and the one codec (``encode``, ``decode``). Pure.

Parsing never trusts a record: ``decode`` raises ``ValueError`` (or ``TypeError``) on anything that
is not exactly the dataclass it expects, and the readers list such a record as malformed.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, replace
from typing import TypeVar


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
    # A warm spare (1): it waits outside every generation and is taken only to bring a generation
    # back to the job's full size (``rendezvous.decide.choose_members``); never a newcomer asking
    # to join. ``standby`` (1): a spare of a standby node (``--standby``), taken after the others.
    spare: int = 0
    standby: int = 0
    # Sharded training (``replica_size`` > 1): this process is shard ``shard`` of replica
    # ``replica``, whose ``replica_size`` processes join and leave generations together
    # (``rendezvous.decide.whole_replicas``). ``replica`` is "" where the member is a replica alone.
    replica: str = ""
    shard: int = 0
    replica_size: int = 1
    # The port a Python thread of this member answers on (``rendezvous.answer``); 0: none (a reader
    # that knows no such field, or a member that does not answer).
    answer_port: int = 0


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
    # A secret the coordinator draws for this generation: its members' store keys live under it,
    # so a process that can reach the store's port but cannot read the job's etcd keys can neither
    # read nor overwrite what they exchange ("" in records made by hand or by tests).
    token: str = ""
    # The job's full size: the largest world size it reached (up to max_workers), carried from
    # generation to generation; spares are taken while a generation is smaller (0: this one's size).
    full_size: int = 0
    # How many of the first ranks held the newest step (``committed_step``) when it was published
    # (the rank order puts them first); 0: unknown (a record made by hand or before this field).
    # A leave without a ready round needs its first survivor among them (``rendezvous.survivors``).
    holders: int = 0

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member_id: str) -> int:
        return self.members.index(member_id)


@dataclass(frozen=True)
class CoordinatorRecord:
    """``coordinator`` (under the coordinator's member lease): the member that reads the job's
    ``members/`` and ``ready/`` records and publishes its generations (``rendezvous.coordinator``);
    elected by create-if-absent, so it is gone, and another is elected, when its lease ends."""

    member_id: str
    node: str


@dataclass(frozen=True)
class VerdictRecord:
    """``verdict`` (not leased): what the coordinator makes of ``generation`` (0: none published
    yet), so that members never read each other's records. Written only when there is something
    to say, and coarse on purpose (the first reason to abandon is kept, newcomers are a flag): a
    record every member watches must change O(1) times per membership change, not once per member."""

    generation: int
    signature: str  # the job's model signature (the generation's, or the first waiting member's)
    abandon: str  # non-empty: why the generation cannot go on (members lost their lease, or left it)
    pending: int  # 1: waiting members that a regroup now would admit
    orphaned: int  # 1: no member of the generation is alive (its state is only on disk)
    error: str  # non-empty: the job's state is lost (every member waiting raises StateLost)
    # While orphaned: when (Unix time, by the writer's clock) a coordinator first judged it so, kept
    # by every later coordinator; a resume waits ``resume_hold_s`` from it (0: not orphaned, or
    # not recorded). Not leased: the generation's own records end with its leases.
    orphaned_at: float = 0.0


VERDICT_IDS = 8  # member ids named in a reason (for logs)
OUT_OF_REACH_IDS = 64  # members an abort names as out of reach, at most (its record stays small)


@dataclass(frozen=True)
class AbortRecord:
    """``abort``: the named generation is broken; its members must re-rendezvous. ``out_of_reach``:
    the members whose hosts a reach check found silent (``rendezvous.reach``), held out of new
    generations until ``reach_hold_s`` after ``at`` (Unix time, by the writer's clock)
    (``rendezvous.decide.held_out``)."""

    generation: int
    member_id: str
    reason: str
    out_of_reach: tuple[str, ...] = ()
    at: float = 0.0


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
        ok = {"int": isinstance(value, int), "str": isinstance(value, str), "float": isinstance(value, (int, float))}[
            kind
        ]
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


# What a reader catches around any decoder of a record from etcd (the one set; a record is never
# trusted: bad JSON, a wrong shape, bad UTF-8, absurd nesting).
DECODE_ERRORS: tuple[type[Exception], ...] = (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError)

_R = TypeVar("_R")


def as_dict(record: object) -> dict[str, object]:
    """The record's fields, less each optional one at its default (a reader of an older version,
    which knows no such field, still reads a record that does not use it)."""
    fields = record.__dataclass_fields__  # type: ignore[attr-defined]
    return {
        k: v
        for k, v in asdict(record).items()  # type: ignore[call-overload]
        if fields[k].default is MISSING or v != fields[k].default
    }


def encode(record: object) -> bytes:
    return json.dumps(as_dict(record), sort_keys=True).encode()


def _decode(cls: type, raw: bytes) -> object:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    fields = cls.__dataclass_fields__  # type: ignore[attr-defined]
    required = {n for n, f in fields.items() if f.default is MISSING}
    if not required <= set(data) <= set(fields):
        raise ValueError(f"fields {sorted(data)} != {sorted(fields)}")
    for name, f in fields.items():
        if name not in data:
            continue
        want = {"int": int, "str": str, "float": (int, float), "tuple[str, ...]": list}[str(f.type)]
        if not isinstance(data[name], want) or isinstance(data[name], bool):
            raise ValueError(f"field {name} is not {f.type}")
        if str(f.type) == "float":
            data[name] = float(data[name])
    for name, f in fields.items():
        if str(f.type) == "tuple[str, ...]" and name in data:
            if not all(isinstance(m, str) for m in data[name]):
                raise ValueError(f"{name} must be strings")
            data[name] = tuple(data[name])
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
    """A ``generation`` record. A large generation's (``wire.roster``: no members listed, its
    ``world_size`` given) comes back *sparse*, every member ``""`` until filled from its roster.

    Raises:
        ValueError, TypeError, UnicodeDecodeError, RecursionError: the bytes are not such a record.
    """
    data = json.loads(raw)
    if isinstance(data, dict) and data.get("members") == [] and "world_size" in data:
        world = data.pop("world_size")
        if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_WORLD:
            raise ValueError(f"world_size must be an int in [1, {MAX_WORLD}]")
        rec = replace(decode(GenerationRecord, json.dumps(data).encode()), members=("",) * world)
        if rec.generation < 1:
            raise ValueError("generation must be >= 1")
        return rec
    rec = decode(GenerationRecord, raw)
    if rec.generation < 1 or len(set(rec.members)) != len(rec.members) or not rec.members or "" in rec.members:
        raise ValueError("generation must be >= 1 with distinct, non-empty members")
    return rec


MAX_WORLD = 10**7  # a generation record naming more members is garbage


def decode_verdict(raw: bytes) -> VerdictRecord:
    rec = decode(VerdictRecord, raw)
    if rec.generation < 0 or rec.orphaned not in (0, 1) or rec.pending not in (0, 1):
        raise ValueError("generation must be >= 0, orphaned and pending 0 or 1")
    if not math.isfinite(rec.orphaned_at) or rec.orphaned_at < 0:
        raise ValueError("orphaned_at must be a finite time >= 0")
    return rec


def decode_abort(raw: bytes) -> AbortRecord:
    return decode(AbortRecord, raw)
