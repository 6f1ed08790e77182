"""A member's progress record (``progress/<member id>``) as JSON in etcd, and its one codec. Pure.

Owns ``ProgressRecord``: what a worker publishes after each commit and once it finished joining
(built by ``worker.step.journal``, written under the member's lease by ``rendezvous.publish``),
and what ``elasticctl status`` (``ops.status``) and the node agent's hang test and metrics
(``agent.jobview``) read of it; ``encode_progress``; ``decode_progress`` in its two reads; and
``parse_progress``, a job's ``progress/`` rows by member id.

Every field is written, those at their default too, so that a strict reader finds each one. Both
reads allow extra fields and take ``last_recovery_s``, ``last_recovery_cause`` and ``compute_s`` as
None when absent or of another type:

* strict (``elasticctl``: a record it cannot trust is listed as malformed): ``step``,
  ``generation``, ``rank`` and ``recoveries`` are integers, ``time`` a finite number,
  ``step_time_s`` present and null or a finite number;
* tolerant (the agent: a record that says where a worker is counts): ``step`` and ``generation``
  are integers, ``recoveries`` too when present (0 when absent); any other field absent or of
  another type takes its default.

Never does I/O and never reads a clock (the writer passes ``time``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace

from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import DECODE_ERRORS


@dataclass(frozen=True)
class ProgressRecord:
    """``progress/<member id>`` (leased by the member): its last committed step, and how it got there."""

    step: int
    generation: int
    rank: int = -1  # its rank in ``generation`` (-1: unknown, in a tolerant read)
    step_time_s: float | None = None  # how long its last step took (None: no step yet)
    recoveries: int = 0  # how many recoveries this member went through
    last_recovery_s: float | None = None  # how long its last recovery took
    last_recovery_cause: str | None = None  # what broke the generation it recovered from
    time: float = 0.0  # wall clock (time.time()) of the writer (0: unknown, in a tolerant read)
    # its own compute time per step, smoothed: a step's start to its contribution to the sum (its
    # batch, forward and backward; not the wait for the others). None: not measured yet
    compute_s: float | None = None


def encode_progress(record: ProgressRecord) -> bytes:
    """The record as JSON, every field written (a strict reader requires them)."""
    return json.dumps(asdict(record), sort_keys=True).encode()


def decode_progress(raw: bytes, *, tolerant: bool = False) -> ProgressRecord:
    """Parse a progress record, strictly or tolerantly (the module's docstring says what each takes).

    Raises:
        ValueError, TypeError, UnicodeDecodeError, RecursionError: not a progress record.
    """
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    cause = data.get("last_recovery_cause")
    common = ProgressRecord(
        step=_integer(data, "step"),
        generation=_integer(data, "generation"),
        recoveries=_integer(data, "recoveries") if "recoveries" in data or not tolerant else 0,
        last_recovery_s=_number_or_none(data.get("last_recovery_s")),
        last_recovery_cause=cause if isinstance(cause, str) else None,
        compute_s=_duration_or_none(data.get("compute_s")),
    )
    if tolerant:
        rank, moment = data.get("rank"), _number_or_none(data.get("time"))
        return replace(
            common,
            rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else -1,
            step_time_s=_number_or_none(data.get("step_time_s")),
            time=0.0 if moment is None else moment,
        )
    step_time = None if "step_time_s" in data and data["step_time_s"] is None else _finite(data, "step_time_s")
    return replace(common, rank=_integer(data, "rank"), step_time_s=step_time, time=_finite(data, "time"))


def parse_progress(
    keys: Keys, rows: Iterable[KeyValue], *, tolerant: bool = False
) -> tuple[dict[str, ProgressRecord], tuple[str, ...]]:
    """The progress records among ``rows`` by member id (``decode_progress``, strict or tolerant);
    the rows under ``progress/`` that are not one as ``"<key>: <why>"``."""
    under = keys.progress("")
    records: dict[str, ProgressRecord] = {}
    bad: list[str] = []
    for kv in rows:
        if not kv.key.startswith(under):
            continue
        mid = kv.key[len(under) :]
        try:
            if not mid or "/" in mid:
                raise ValueError("not progress/<member id>")
            records[mid] = decode_progress(kv.value, tolerant=tolerant)
        except DECODE_ERRORS as exc:
            bad.append(f"{kv.key}: {exc}")
    return records, tuple(bad)


def _integer(data: Mapping[str, object], name: str) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"field {name} is not an integer")
    return value


def _finite(data: Mapping[str, object], name: str) -> float:
    value = data.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"field {name} is not a finite number")
    return float(value)


def _duration_or_none(value: object) -> float | None:
    v = _number_or_none(value)
    return v if v is not None and math.isfinite(v) and v >= 0 else None


def _number_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
