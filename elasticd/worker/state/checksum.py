"""The state checksum: its seed (the layout's canonical JSON) and the hash of the arena's bytes.

Owns ``checksum_key`` (the one definition of what of a layout the checksum covers), ``state_hasher``
and ``state_checksum`` (XXH3 over the key and the state bytes), used alike by ``state`` (a live
state), ``sync`` (the bytes as they arrive) and ``durable``/``durable_format`` (a file on disk, so
it can be checked without loading it). Never reads a state or a file itself, and never decides what
a mismatch means (its callers do).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import xxhash

MASK63 = (1 << 63) - 1  # checksums fit a signed int64 tensor (sync all_reduces them)
# The layout's RNG sizes, like the RNG bytes past "total", are outside the checksum (as the CPU RNG
# always was): the RNG is no state the ranks must agree on, and a worker's device count is its own.
UNCHECKED_LAYOUT_KEYS = frozenset({"rng", "cuda_rng"})

StateHasher = xxhash.xxh3_64


def checksum_key(layout: Mapping[str, object]) -> bytes:
    """The seed of the state checksum: the canonical JSON (sorted keys) of everything a layout
    says about the state: its tensors' names, dtypes, shapes and offsets, the optimizer's param
    groups and scalars, the registered objects' state (``extras``). The counters are arena bytes,
    so the hash of those covers them. Not the RNG sizes (``UNCHECKED_LAYOUT_KEYS``).

    Raises:
        ValueError: the layout holds a NaN or an infinity (a layout of ``TrainingState.pack`` never does).
        TypeError: it holds a value JSON cannot hold.
    """
    checked = {k: v for k, v in layout.items() if k not in UNCHECKED_LAYOUT_KEYS}
    return json.dumps(checked, sort_keys=True, allow_nan=False, separators=(",", ":")).encode()


def state_hasher(layout_key: bytes) -> StateHasher:
    """A streaming hash of a state, seeded with ``layout_key`` (``checksum_key`` of its layout):
    feed it the arena's state bytes (in any number of pieces, in order) and ``intdigest() & MASK63``
    is the checksum. XXH3 (the ``xxhash`` package) hashes ~13 GB/s here, CRC-32 (zlib) ~3 GB/s."""
    h = xxhash.xxh3_64()
    h.update(len(layout_key).to_bytes(8, "little"))
    h.update(layout_key)
    return h


def state_checksum(layout_key: bytes, state_bytes: memoryview, total: int) -> int:
    """``TrainingState.checksum`` from ``layout_key`` (``checksum_key`` of the layout) and the
    arena's first ``total`` bytes."""
    assert len(state_bytes) == total, (len(state_bytes), total)
    h = state_hasher(layout_key)
    h.update(state_bytes)
    return h.intdigest() & MASK63
