"""The reducer's check of a rank's own gradients for NaN and infinity (``all_finite``): exact for
every dtype, including a sum that overflows while every element is finite."""

from __future__ import annotations

import math

import pytest
import torch

from elasticd.worker.step.reducer import all_finite

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("values", "finite"),
    [
        ([0.5, -1.0, 2.0], True),
        ([0.5, NAN, 2.0], False),
        ([INF, 1.0], False),
        ([-INF, 1.0], False),
        ([INF, -INF], False),  # the sum is NaN
        ([], True),
    ],
)
def test_all_finite_finds_nan_and_infinity(values: list[float], finite: bool, dtype: torch.dtype) -> None:
    grads = torch.tensor(values, dtype=dtype)
    assert bool(all_finite(grads, on_cpu=True)) is finite
    assert bool(all_finite(grads, on_cpu=False)) is finite  # the element-wise test, as a tensor


@pytest.mark.parametrize(
    ("dtype", "value"),
    [
        (torch.float32, 3.0e38),  # ten of them overflow a float32 sum
        (torch.float16, 60000.0),  # two of them overflow float16; the sum accumulates in float32
        (torch.bfloat16, 3.0e38),
    ],
)
def test_large_finite_gradients_are_finite(dtype: torch.dtype, value: float) -> None:
    grads = torch.full((10,), value, dtype=dtype)
    assert torch.isfinite(grads).all()
    assert all_finite(grads, on_cpu=True) is True


def test_the_cpu_check_reads_the_whole_bucket() -> None:
    grads = torch.zeros(100_000)
    assert all_finite(grads, on_cpu=True) is True
    grads[77_777] = NAN
    assert all_finite(grads, on_cpu=True) is False
