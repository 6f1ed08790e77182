"""Fixtures of every unit test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _keep_global_rng() -> Iterator[None]:
    """``TrainingState.unpack`` sets the global RNG (it is part of the state): no test leaks that
    into the next."""
    saved = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(saved)
