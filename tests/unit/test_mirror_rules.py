"""The rules that bring a prefix's copy up to date from a read of what changed (``store.mirror``)."""

from __future__ import annotations

import pytest

from elasticd.store.kv import KeyValue, RangeResult
from elasticd.store.mirror import merge_changes, merge_listing


def kv(key: str, mod: int, value: bytes = b"v", create: int = 0) -> KeyValue:
    return KeyValue(key, value, mod, create or mod)


COPY = {"a": kv("a", 3), "b": kv("b", 4), "c": kv("c", 5)}  # as of revision 5


@pytest.mark.parametrize(
    ("why", "changed", "count", "keys"),
    [
        ("nothing changed", [], 3, {"a": 3, "b": 4, "c": 5}),
        ("a key rewritten", [kv("b", 7)], 3, {"a": 3, "b": 7, "c": 5}),
        ("a key created", [kv("d", 6)], 4, {"a": 3, "b": 4, "c": 5, "d": 6}),
        ("a key deleted and written again", [kv("a", 8, create=8)], 3, {"a": 8, "b": 4, "c": 5}),
        ("a key deleted", [], 2, None),
        ("a key deleted, another created", [kv("d", 6)], 3, None),
        ("a key deleted, another rewritten", [kv("b", 7)], 2, None),
    ],
)
def test_merge_changes(why: str, changed: list[KeyValue], count: int, keys: dict[str, int] | None) -> None:
    got = merge_changes(COPY, RangeResult(changed, count))
    assert (None if got is None else {k: v.mod_revision for k, v in got.items()}) == keys, why


def listing(*mods: tuple[str, int]) -> RangeResult:
    return RangeResult([kv(k, m, b"") for k, m in mods], len(mods))


@pytest.mark.parametrize(
    ("why", "keys_now", "changed", "expected"),
    [
        ("c deleted", [("a", 3), ("b", 4)], [], {"a": 3, "b": 4}),
        ("c deleted, d created", [("a", 3), ("b", 4), ("d", 6)], [kv("d", 6)], {"a": 3, "b": 4, "d": 6}),
        ("a deleted, b rewritten", [("b", 7), ("c", 5)], [kv("b", 7)], {"b": 7, "c": 5}),
        ("every key deleted", [], [], {}),
        ("the listing names a change the read lacks", [("a", 3), ("b", 9)], [], None),
        ("an unchanged key at another revision than the copy's", [("a", 2), ("b", 4)], [], None),
        ("an unchanged key the copy lacks", [("a", 3), ("e", 5)], [], None),
    ],
)
def test_merge_listing(
    why: str, keys_now: list[tuple[str, int]], changed: list[KeyValue], expected: dict[str, int] | None
) -> None:
    got = merge_listing(COPY, 5, listing(*keys_now), RangeResult(changed, len(keys_now)))
    assert (None if got is None else {k: v.mod_revision for k, v in got.items()}) == expected, why
    if got is not None:
        assert all(v.value == b"v" for v in got.values()), "values come from the copy or the changes, never the listing"
