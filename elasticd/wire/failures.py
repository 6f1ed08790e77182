"""A worker's failure as the job records it, and the rule that tells a bug from a fault. Pure.

Owns ``FailureRecord`` (``failures/<member>``, not leased: written by a worker whose script raised,
just before its process ends), ``normalize`` (an exception message with its numbers and addresses
taken out, so that one bug reads the same on every rank), and ``deterministic_failure``, the rule
every agent and ``elasticctl status`` apply alike to the records they read:

    the same exception (type and normalized message) at the same step, recorded by
    ``DETERMINISTIC_REPEATS`` (2) or more workers — every member of a generation raising at
    once, or a worker raising again at the step where it raised before its restart — is a bug
    in the script or its data, not a fault: restarting cannot get past it.

A fault (a killed process, a lost node, a cut link) leaves no record: only an uncaught exception
does. Two records of one step need that step to have been tried twice (it was not committed the
first time) or by two ranks at once, so a transient error that strikes once is restarted as
before. Encoding and decoding only: no I/O, no clock reads. Imports nothing from elasticd.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

# How many records of the same exception at the same step make it a bug, not a fault.
DETERMINISTIC_REPEATS = 2
MESSAGE_CHARS = 300  # a normalized message is cut here
DETAIL_CHARS = 2000  # the traceback's tail kept for people

_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")  # an address, or a number
_SPACE = re.compile(r"\s+")


def normalize(message: str) -> str:
    """``message`` with addresses and numbers replaced (``0x7f..`` -> ``0x_``, ``12.5`` -> ``N``) and
    white space collapsed: "index 17 is out of bounds" on one rank and "index 3 ..." on another
    are one bug."""
    text = _VARYING.sub(lambda m: "0x_" if m.group().startswith("0x") else "N", message)
    return _SPACE.sub(" ", text).strip()[:MESSAGE_CHARS]


@dataclass(frozen=True)
class FailureRecord:
    """``failures/<member>``: a worker's uncaught exception, recorded as its process ends."""

    member: str  # the member id (or node.local_rank.pid before it registered)
    node: str
    local_rank: int
    generation: int  # the generation it was in (0: none yet)
    step: int  # the step it was computing: its last applied step + 1
    exc_type: str  # the exception's qualified class name
    message: str  # normalized (``normalize``)
    detail: str  # the exception and the traceback's last lines, as printed (for people)
    time: float  # wall clock on the worker's host

    @property
    def signature(self) -> tuple[int, str, str]:
        return (self.step, self.exc_type, self.message)


def encode_failure(record: FailureRecord) -> bytes:
    return json.dumps(asdict(record), separators=(",", ":")).encode()


def decode_failure(raw: bytes) -> FailureRecord:
    """Raises ``ValueError`` (or ``TypeError``) on anything but a failure record."""
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError("a failure record is a JSON object")
    rec = FailureRecord(**data)
    ints = (rec.local_rank, rec.generation, rec.step)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        raise ValueError("local_rank, generation and step must be integers")
    texts = (rec.member, rec.node, rec.exc_type, rec.message, rec.detail)
    if not all(isinstance(v, str) for v in texts) or not isinstance(rec.time, int | float):
        raise ValueError("a failure record's texts must be strings and its time a number")
    return rec


@dataclass(frozen=True)
class DeterministicFailure:
    """The job's verdict when a bug stops it: where, what, and who raised it."""

    step: int
    exc_type: str
    message: str
    members: tuple[str, ...]  # the workers that raised it, sorted
    nodes: tuple[str, ...]
    detail: str  # one record's detail (the traceback's tail)

    def describe(self) -> str:
        """``step 40: ValueError: bad sample N (raised by 3 workers on nodes a, b)``."""
        nodes = ", ".join(self.nodes)
        return (
            f"step {self.step}: {self.exc_type}: {self.message} (raised by {len(self.members)} "
            f"workers on node{'s' if len(self.nodes) > 1 else ''} {nodes}; a bug in the script or "
            f"its data, not a fault: restarting cannot get past it)"
        )


def deterministic_failure(
    records: Iterable[FailureRecord], repeats: int = DETERMINISTIC_REPEATS
) -> DeterministicFailure | None:
    """The bug that stops the job, if the records show one: the earliest step at which ``repeats``
    or more records carry the same exception (ties: the most records, then the type). None: no
    exception was seen that often (faults and one-off errors are restarted)."""
    groups: dict[tuple[int, str, str], list[FailureRecord]] = {}
    for r in records:
        groups.setdefault(r.signature, []).append(r)
    found = [(sig, recs) for sig, recs in groups.items() if len({r.member for r in recs}) >= repeats]
    if not found:
        return None
    (step, exc_type, message), recs = min(found, key=lambda f: (f[0][0], -len(f[1]), f[0][1], f[0][2]))
    recs = sorted(recs, key=lambda r: r.member)
    return DeterministicFailure(
        step,
        exc_type,
        message,
        tuple(r.member for r in recs),
        tuple(sorted({r.node for r in recs})),
        recs[0].detail,
    )
