"""The progress record's one codec (``wire.progress``): what the worker writes reads back the same,
in both reads; extra fields are allowed; a strict read (``elasticctl``) refuses a record missing a
field or with one of the wrong type, a tolerant read (the agent) needs only ``step`` and
``generation`` and takes any other field's default."""

from __future__ import annotations

import json

import pytest

from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.progress import ProgressRecord, decode_progress, encode_progress, parse_progress

pytestmark = pytest.mark.timeout(30)

KEYS = Keys("/elasticd", "j")

WRITTEN = ProgressRecord(
    step=12,
    generation=3,
    rank=1,
    step_time_s=0.02,
    recoveries=2,
    last_recovery_s=0.4,
    last_recovery_cause="PeerLost",
    time=1_700_000_000.5,
)

# What the worker writes: every field, those at their default too (null where None).
FIELDS = {
    "step",
    "generation",
    "rank",
    "step_time_s",
    "recoveries",
    "last_recovery_s",
    "last_recovery_cause",
    "time",
    "compute_s",
}


_DROP = object()  # a field _raw leaves out


def _raw(**fields: object) -> bytes:
    """A record as the worker writes it (step 1, generation 1, rank 0, ...), with ``fields`` changed."""
    base: dict[str, object] = {
        "step": 1,
        "generation": 1,
        "rank": 0,
        "step_time_s": 0.5,
        "recoveries": 0,
        "last_recovery_s": None,
        "last_recovery_cause": None,
        "time": 1.0,
    }
    base.update(fields)
    return json.dumps({k: v for k, v in base.items() if v is not _DROP}).encode()


@pytest.mark.parametrize("tolerant", [False, True], ids=["strict", "tolerant"])
@pytest.mark.parametrize(
    "record",
    [WRITTEN, ProgressRecord(step=0, generation=1, rank=0, time=2.0)],
    ids=["after a recovery", "fresh, no step time yet"],
)
def test_round_trip(record: ProgressRecord, tolerant: bool) -> None:
    raw = encode_progress(record)
    assert set(json.loads(raw)) == FIELDS  # every field written, so a strict reader finds each
    assert decode_progress(raw, tolerant=tolerant) == record


@pytest.mark.parametrize("tolerant", [False, True], ids=["strict", "tolerant"])
def test_extra_fields_are_allowed(tolerant: bool) -> None:
    raw = json.dumps({**json.loads(encode_progress(WRITTEN)), "extra": [1], "host": "x"}).encode()
    assert decode_progress(raw, tolerant=tolerant) == WRITTEN


# (case, raw, strict: the record or None for ValueError, tolerant: the same)
CASES: list[tuple[str, bytes, ProgressRecord | None, ProgressRecord | None]] = [
    (
        "only step and generation",
        json.dumps({"step": 1, "generation": 1, "extra": [1]}).encode(),
        None,
        ProgressRecord(step=1, generation=1),
    ),
    (
        "step_time_s missing",
        _raw(step_time_s=_DROP),
        None,
        ProgressRecord(step=1, generation=1, rank=0, time=1.0),
    ),
    (
        "step_time_s null",
        _raw(step_time_s=None),
        ProgressRecord(1, 1, 0, None, 0, time=1.0),
        ProgressRecord(1, 1, 0, None, 0, time=1.0),
    ),
    ("step_time_s a string", _raw(step_time_s="fast"), None, ProgressRecord(1, 1, 0, None, 0, time=1.0)),
    ("rank missing", _raw(rank=_DROP), None, ProgressRecord(1, 1, -1, 0.5, 0, time=1.0)),
    (
        "compute_s a duration",
        _raw(compute_s=0.25),
        ProgressRecord(1, 1, 0, 0.5, 0, time=1.0, compute_s=0.25),
        ProgressRecord(1, 1, 0, 0.5, 0, time=1.0, compute_s=0.25),
    ),
    (
        "compute_s negative: unknown",
        _raw(compute_s=-1.0),
        ProgressRecord(1, 1, 0, 0.5, 0, time=1.0),
        ProgressRecord(1, 1, 0, 0.5, 0, time=1.0),
    ),
    (
        "compute_s a string: unknown",
        _raw(compute_s="x"),
        ProgressRecord(1, 1, 0, 0.5, 0, time=1.0),
        ProgressRecord(1, 1, 0, 0.5, 0, time=1.0),
    ),
    ("rank a bool", _raw(rank=True), None, ProgressRecord(1, 1, -1, 0.5, 0, time=1.0)),
    ("time missing", _raw(time=_DROP), None, ProgressRecord(1, 1, 0, 0.5, 0)),
    ("time infinite", _raw(time=float("inf")), None, ProgressRecord(1, 1, 0, 0.5, 0, time=float("inf"))),
    ("recoveries missing", _raw(recoveries=_DROP), None, ProgressRecord(1, 1, 0, 0.5, 0, time=1.0)),
    ("recoveries null", _raw(recoveries=None), None, None),
    ("recoveries a float", _raw(recoveries=1.0), None, None),
    ("step a bool", _raw(step=True), None, None),
    ("step a string", _raw(step="ten"), None, None),
    ("generation missing", _raw(generation=_DROP), None, None),
    (
        "recovery fields of another type: None in both",
        _raw(last_recovery_s="slow", last_recovery_cause=7),
        ProgressRecord(1, 1, 0, 0.5, 0, time=1.0),
        ProgressRecord(1, 1, 0, 0.5, 0, time=1.0),
    ),
    ("not an object", b"[]", None, None),
    ("empty object", b"{}", None, None),
    ("not JSON", b"\x00", None, None),
    ("not UTF-8", b"\xff\xfe", None, None),
]


@pytest.mark.parametrize(("raw", "strict", "tolerant"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_strict_and_tolerant_reads(raw: bytes, strict: ProgressRecord | None, tolerant: ProgressRecord | None) -> None:
    if strict is None:
        with pytest.raises(ValueError):
            decode_progress(raw)
    else:
        assert decode_progress(raw) == strict
    if tolerant is None:
        with pytest.raises(ValueError):
            decode_progress(raw, tolerant=True)
    else:
        assert decode_progress(raw, tolerant=True) == tolerant


def test_a_step_time_that_is_not_finite() -> None:
    raw = _raw(step_time_s=float("nan"))
    with pytest.raises(ValueError):
        decode_progress(raw)  # strict: not a finite number
    got = decode_progress(raw, tolerant=True).step_time_s  # tolerant: a number, kept as it is
    assert got is not None and got != got


def test_parse_progress_by_member_and_what_does_not_parse() -> None:
    rows = [
        KeyValue(KEYS.progress("m0"), encode_progress(WRITTEN), 5, 5, 7),
        KeyValue(KEYS.progress("m1"), json.dumps({"step": 2, "generation": 3}).encode(), 5, 5, 7),
        KeyValue(KEYS.progress("m2"), b"not json", 5, 5, 7),
        KeyValue(KEYS.progress("a/b"), encode_progress(WRITTEN), 5, 5, 7),
        KeyValue(KEYS.member("m0"), b"{}", 5, 5, 7),  # not under progress/: not looked at
    ]
    strict, bad = parse_progress(KEYS, rows)
    assert strict == {"m0": WRITTEN}
    assert sorted(b.split(": ")[0] for b in bad) == sorted(KEYS.progress(m) for m in ("m1", "m2", "a/b"))
    tolerant, bad = parse_progress(KEYS, rows, tolerant=True)
    assert tolerant == {"m0": WRITTEN, "m1": ProgressRecord(step=2, generation=3)}
    assert len(bad) == 2
