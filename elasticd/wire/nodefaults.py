"""Each node's record of faults, read from the job's events, and its cordon. Pure.

A node's faults are the job's events its agent wrote (``EventRecord.detail["node"]``), of four
kinds: ``crash`` (``worker_exited`` other than a clean exit 0 or a member asking to rejoin), ``hang``
(``worker_hung``), ``health`` (``health_check_failed``) and ``straggler``
(``straggler_detected``). ``node_faults`` counts them per node over a window (``elasticctl
status`` shows the last hour); ``crash_times`` gives one node's crash times, from which its agent
decides a cordon: more than ``cordon_crashes`` crashes within ``cordon_window_s``.

``CordonRecord`` is ``cordon/<node>`` (not leased): a node cordoned by its agent for its crashes,
or by an operator (``elasticctl cordon``), stays out of the job (its agent starts no worker, as for
a failing health check) until ``elasticctl uncordon`` deletes it. No I/O, no clock reads.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass

from elasticd.errors import EXIT_REJOIN
from elasticd.wire.ops import EventKind, EventRecord

FAULT_KINDS = ("crash", "hang", "health", "straggler")
_FAULTS: Mapping[str, str] = {
    EventKind.WORKER_HUNG: "hang",
    EventKind.HEALTH_CHECK_FAILED: "health",
    EventKind.STRAGGLER_DETECTED: "straggler",
}


def fault_of(event: EventRecord) -> str | None:
    """The fault kind ``event`` records (None: no fault)."""
    if event.kind == EventKind.WORKER_EXITED:
        d = event.detail
        clean = d.get("exit_kind") == "succeeded" or d.get("code") == EXIT_REJOIN  # a member that asks to start again
        return None if clean else "crash"
    return _FAULTS.get(event.kind)


def node_faults(events: Iterable[EventRecord], now: float, window_s: float) -> dict[str, Counter[str]]:
    """Per node, its faults by kind within the last ``window_s`` before ``now`` (wall clock)."""
    out: dict[str, Counter[str]] = {}
    for e in events:
        node, kind = e.detail.get("node"), fault_of(e)
        if kind is not None and isinstance(node, str) and now - window_s <= e.time <= now:
            out.setdefault(node, Counter())[kind] += 1
    return out


def crash_times(events: Iterable[EventRecord], node: str) -> list[float]:
    """When ``node``'s workers crashed, oldest first (from its ``worker_exited`` events)."""
    return sorted(e.time for e in events if e.detail.get("node") == node and fault_of(e) == "crash")


def should_cordon(crashes: Iterable[float], now: float, limit: int, window_s: float) -> bool:
    """More than ``limit`` crashes within the last ``window_s`` (``limit`` 0: never)."""
    return limit > 0 and sum(1 for t in crashes if now - window_s <= t <= now) > limit


def describe(faults: Mapping[str, int]) -> str:
    """``2 crash, 1 hang`` (kinds in FAULT_KINDS order); ``-`` for none."""
    return ", ".join(f"{faults[k]} {k}" for k in FAULT_KINDS if faults.get(k)) or "-"


@dataclass(frozen=True)
class CordonRecord:
    """``cordon/<node>``: the node stays out of the job until ``elasticctl uncordon``."""

    node: str
    by: str  # "agent" (its crashes) or who ran elasticctl cordon
    reason: str
    time: float  # wall clock


def encode_cordon(record: CordonRecord) -> bytes:
    return json.dumps(asdict(record), sort_keys=True).encode()


def decode_cordon(raw: bytes) -> CordonRecord:
    """Raises ``ValueError`` (or ``TypeError``) on anything but a cordon record."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("a cordon record is a JSON object")
    rec = CordonRecord(**data)
    if not all(isinstance(v, str) for v in (rec.node, rec.by, rec.reason)) or not isinstance(rec.time, int | float):
        raise ValueError("a cordon record's node, by and reason are strings and its time a number")
    return rec
