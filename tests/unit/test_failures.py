"""The rule that tells a bug from a fault (``wire.failures``), as a table; the record's encoding."""

from __future__ import annotations

import pytest

from elasticd.wire.failures import (
    FailureRecord,
    decode_failure,
    deterministic_failure,
    encode_failure,
    normalize,
)


def rec(member: str, step: int, exc: str = "ValueError", msg: str = "bad sample N", node: str = "") -> FailureRecord:
    return FailureRecord(member, node or member.split(".")[0], 0, 1, step, exc, msg, "Traceback ...", 1.0)


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("index 17 is out of bounds for dim 0 with size 16", "index N is out of bounds for dim N with size N"),
        ("tensor at 0x7f3a2c1d0e10   is bad\n", "tensor at 0x_ is bad"),
        ("loss 1.5e3 not finite", "loss NeN not finite"),
        ("", ""),
        ("x" * 400, "x" * 300),
    ],
)
def test_normalize_takes_out_numbers_addresses_and_spacing(raw: str, normal: str) -> None:
    assert normalize(raw) == normal


CASES: list[tuple[str, list[FailureRecord], tuple[int, tuple[str, ...]] | None]] = [
    ("no record: no bug", [], None),
    ("one exception once: a fault until it repeats", [rec("a.0.1", 5)], None),
    ("every rank at the same step: a bug", [rec("a.0.1", 5), rec("b.0.2", 5)], (5, ("a.0.1", "b.0.2"))),
    ("again after a restart, at the same step: a bug", [rec("a.0.1", 5), rec("a.0.9", 5)], (5, ("a.0.1", "a.0.9"))),
    ("the same exception at two steps: not yet", [rec("a.0.1", 5), rec("b.0.2", 6)], None),
    ("two exceptions at one step: not yet", [rec("a.0.1", 5), rec("b.0.2", 5, exc="KeyError")], None),
    ("two messages at one step: not yet", [rec("a.0.1", 5), rec("b.0.2", 5, msg="other")], None),
    ("one member's record twice counts once", [rec("a.0.1", 5), rec("a.0.1", 5)], None),
    (
        "the earliest step wins",
        [rec("a.0.1", 9), rec("b.0.2", 9), rec("a.0.3", 4, exc="KeyError"), rec("b.0.4", 4, exc="KeyError")],
        (4, ("a.0.3", "b.0.4")),
    ),
    (
        "at one step, the most records win",
        [rec("a.0.1", 4), rec("b.0.2", 4), rec("c.0.3", 4), rec("a.0.4", 4, exc="E"), rec("b.0.5", 4, exc="E")],
        (4, ("a.0.1", "b.0.2", "c.0.3")),
    ),
]


@pytest.mark.parametrize(("records", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_deterministic_failure(records: list[FailureRecord], expected: tuple[int, tuple[str, ...]] | None) -> None:
    bug = deterministic_failure(records)
    assert (None if bug is None else (bug.step, bug.members)) == expected
    if bug is not None:
        assert bug.describe().startswith(f"step {bug.step}: ")
        assert bug.nodes == tuple(sorted({r.node for r in records if r.member in bug.members}))


def test_a_record_round_trips_and_garbage_is_refused() -> None:
    r = rec("a.0.1", 5)
    assert decode_failure(encode_failure(r)) == r
    for bad in (b"[]", b"{}", b'{"member": 1}', encode_failure(r).replace(b'"step":5', b'"step":"5"'), b"\xff"):
        with pytest.raises((ValueError, TypeError, UnicodeDecodeError)):
            decode_failure(bad)
