"""``digest``: what an agent needs of the whole job, kept small so that no agent reads the whole job
but one. Pure.

Each node's agent reads its own node's records and a few single keys (``agent.jobview``). What it
needs of the others fits in this record, written by the agent of the coordinator's node after its
read of the whole job: the generation's straggler scores need the median of the *other* members'
compute times, and that takes only the middle of the sorted times (``middle_of``, ``score``); a
straggler replacement needs the warm spares waiting on other nodes (``spares``); the metrics need
rank 0's step time. A digest of another generation than the reader's is not used.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from elasticd.wire.stragglers import median_without

MIDDLE = 4  # sorted compute times kept around the median: enough for the median with any one taken out


@dataclass(frozen=True)
class JobDigest:
    generation: int
    computed: int = 0  # how many of its members had a compute time
    start: int = 0  # the rank, in sorted order, of ``middle[0]``
    middle: tuple[float, ...] = ()  # the sorted compute times from ``start``
    rank0_step_time_s: float | None = None
    spares: Mapping[str, int] = field(default_factory=dict)  # node -> warm spares waiting outside the generation


def middle_of(compute: Mapping[str, float]) -> tuple[int, int, tuple[float, ...]]:
    """(how many, the first rank kept, the kept times) of ``compute``'s sorted values: the ranks
    ``n//2 - 2`` to ``n//2 + 1``, all that a median with one value taken out reads."""
    ranked = sorted(compute.values())
    n = len(ranked)
    start = max(0, n // 2 - 2)
    return n, start, tuple(ranked[start : start + MIDDLE])


def score(value: float, digest: JobDigest) -> float | None:
    """A member's straggler score (``wire.stragglers``) from the digest: its compute time
    ``value`` (one of those the digest counted) over the median of the others'. None: fewer
    than two, or a median of 0."""
    n, mid = digest.computed, digest.middle
    if n < 2 or not mid:
        return None
    median = median_without(mid, digest.start, n, value)
    return value / median if median > 0 else None


def encode_digest(d: JobDigest) -> bytes:
    return json.dumps(asdict(d) | {"spares": dict(d.spares)}, sort_keys=True).encode()


def decode_digest(raw: bytes) -> JobDigest:
    """Raises:
    ValueError, TypeError, UnicodeDecodeError, RecursionError: not a digest."""
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    ints = [d.get(k) for k in ("generation", "computed", "start")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ints):
        raise ValueError("generation, computed and start are counts")
    middle, step, spares = d.get("middle"), d.get("rank0_step_time_s"), d.get("spares")
    if not (isinstance(middle, list) and len(middle) <= MIDDLE and all(_time(v) for v in middle)):
        raise ValueError("middle: at most four finite times")
    if list(middle) != sorted(middle) or ints[2] + len(middle) > ints[1]:
        raise ValueError("middle: sorted, within the times counted")
    if not (step is None or _time(step)):
        raise ValueError("rank0_step_time_s: a time or null")
    if not (isinstance(spares, dict) and all(isinstance(v, int) and not isinstance(v, bool) for v in spares.values())):
        raise ValueError("spares: node -> count")
    return JobDigest(ints[0], ints[1], ints[2], tuple(float(v) for v in middle), step, dict(spares))  # type: ignore[arg-type]


def _time(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
