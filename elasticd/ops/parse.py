"""A job's raw rows parsed into what ``elasticctl``'s read model is built from. Pure.

Owns turning the rows of one job (one ``get_prefix``) into values: the node agents' records, the
events in time order, the pending drain requests, the last failed checkpoint save, the abort
record, and a restart-mode job's round (``RestartStatus``, from ``wire.restart``'s ``RoundView``);
the members' progress records are ``wire.progress``'s (``parse_progress``, its strict read).
Every parser returns the rows it could not parse as ``"<key>: <why>"`` beside what it parsed.

Never does I/O, never raises on a malformed record (it lists it), and never judges the job's
health (``ops.health``) or assembles the status (``ops.status``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from elasticd.store.kv import KeyValue
from elasticd.wire.failures import FailureRecord, decode_failure
from elasticd.wire.nodefaults import decode_cordon
from elasticd.wire.keys import Keys
from elasticd.wire.ops import (
    EventRecord,
    NodeRecord,
    SaveFailedRecord,
    decode_drain,
    decode_event,
    decode_node,
    decode_save_failed,
    save_failed_key,
)
from elasticd.wire.records import DECODE_ERRORS, AbortRecord, decode_abort
from elasticd.wire.restart import RoundView

T = TypeVar("T")


@dataclass(frozen=True)
class RestartStatus:
    """A restart-mode job (``agent/restart.py``): the agents' current round, from ``restart/``."""

    round: int
    world_size: int
    nodes: tuple[str, ...]  # node rank order
    nproc_per_node: int
    master: str
    restart_count: int
    reason: str
    agents: tuple[str, ...]  # nodes whose agent is alive (leased record)
    failed_round: int  # the last round marked failed (0: none)
    finished_round: int  # the round that finished (0: none)


def _parse_under(
    rows: Iterable[KeyValue], under: str, parse: Callable[[KeyValue], T]
) -> tuple[list[T], tuple[str, ...]]:
    """``parse`` of each row whose key starts with ``under``, in row order; the rows it rejects as
    ``"<key>: <why>"``."""
    out: list[T] = []
    bad: list[str] = []
    for kv in rows:
        if not kv.key.startswith(under):
            continue
        try:
            out.append(parse(kv))
        except DECODE_ERRORS as exc:
            bad.append(f"{kv.key}: {exc}")
    return out, tuple(bad)


def parse_nodes(keys: Keys, rows: Iterable[KeyValue]) -> tuple[dict[str, NodeRecord], tuple[str, ...]]:
    """Node records by node; unparseable ones (or one whose node differs from its key) as
    ``"<key>: <why>"``."""

    def node(kv: KeyValue) -> NodeRecord:
        rec = decode_node(kv.value)
        if kv.key != keys.node(rec.node):
            raise ValueError("node does not match its key")
        return rec

    records, bad = _parse_under(rows, keys.node(""), node)
    return {rec.node: rec for rec in records}, bad


def parse_events(keys: Keys, rows: Iterable[KeyValue]) -> tuple[list[tuple[str, EventRecord]], tuple[str, ...]]:
    """(key, event) in key order, which is time order; unparseable ones as ``"<key>: <why>"``."""
    return _parse_under(sorted(rows, key=lambda kv: kv.key), keys.events, lambda kv: (kv.key, decode_event(kv.value)))


def parse_samples(keys: Keys, rows: Iterable[KeyValue]) -> list[EventRecord]:
    """Rank 0's progress samples (``samples/``), in time order; one that does not parse is left out."""
    got, _ = _parse_under(sorted(rows, key=lambda kv: kv.key), keys.samples, lambda kv: decode_event(kv.value))
    return got


def parse_drains(keys: Keys, rows: Sequence[KeyValue]) -> tuple[set[str], tuple[str, ...]]:
    """Nodes with a drain request. A value that does not parse is still a request (the agent
    drains on the key) but is listed as malformed too."""
    under = keys.drain("")
    _, bad = _parse_under(rows, under, lambda kv: decode_drain(kv.value))
    return {kv.key[len(under) :] for kv in rows if kv.key.startswith(under)}, bad


def parse_save_failed(keys: Keys, rows: Sequence[KeyValue]) -> tuple[SaveFailedRecord | None, tuple[str, ...]]:
    """The job's last failed checkpoint save, if recorded (and parseable)."""
    key = save_failed_key(keys.job)
    for kv in rows:
        if kv.key == key:
            try:
                return decode_save_failed(kv.value), ()
            except DECODE_ERRORS as exc:
                return None, (f"{kv.key}: {exc}",)
    return None, ()


def parse_failures(keys: Keys, rows: Sequence[KeyValue]) -> tuple[tuple[FailureRecord, ...], tuple[str, ...]]:
    """The workers' failure records (``failures/``), oldest first, and those that do not parse."""
    found, bad = [], []
    prefix = keys.failure("")
    for kv in rows:
        if kv.key.startswith(prefix):
            try:
                found.append(decode_failure(kv.value))
            except DECODE_ERRORS as exc:
                bad.append(f"{kv.key}: {exc}")
    return tuple(sorted(found, key=lambda r: (r.time, r.member))), tuple(bad)


def parse_cordons(keys: Keys, rows: Sequence[KeyValue]) -> dict[str, str]:
    """Cordoned nodes and why (``cordon/<node>``); a record that does not parse still cordons."""
    prefix, out = keys.cordon(""), {}
    for kv in rows:
        if kv.key.startswith(prefix):
            try:
                rec = decode_cordon(kv.value)
                out[kv.key[len(prefix) :]] = f"{rec.reason} (by {rec.by})"
            except DECODE_ERRORS:
                out[kv.key[len(prefix) :]] = "a cordon record that does not parse"
    return out


def parse_abort(keys: Keys, rows: Sequence[KeyValue]) -> AbortRecord | None:
    """The abort record, if there is one that parses (``parse_snapshot`` lists one that does not)."""
    for kv in rows:
        if kv.key == keys.abort:
            try:
                return decode_abort(kv.value)
            except DECODE_ERRORS:
                return None  # parse_snapshot already listed it as malformed
    return None


def restart_status(view: RoundView) -> RestartStatus | None:
    """A restart-mode job's round, flat; None when the job has no restart records."""
    r = view.round
    if r is None and not view.finished and not view.failed_round:
        return None
    return RestartStatus(
        round=r.round if r else 0,
        world_size=r.world_size if r else 0,
        nodes=r.nodes if r else (),
        nproc_per_node=r.nproc_per_node if r else 0,
        master=f"{r.master_addr}:{r.master_port}" if r else "",
        restart_count=r.restart_count if r else 0,
        reason=r.reason if r else "",
        agents=tuple(sorted(view.agents)),
        failed_round=view.failed_round,
        finished_round=view.finished,
    )
