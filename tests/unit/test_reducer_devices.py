"""The gradient reducer's bucket rules (``reducer.same_device``, buckets per device, the
staging copy on the group's device; ``vote_dtype``, the vote's own float32 bucket for a
low-precision model). The cross-device path itself runs on a GPU: ``tests/programs/gpu_job.py``
(NCCL with the model on the CPU) and ``python -m elasticd.chaos --device cuda`` (gloo with the
model on the GPU); the low-precision vote in real groups: ``test_low_precision.py``."""

from __future__ import annotations

import pytest
import torch

from elasticd.worker.step.reducer import GradientReducer, same_device, vote_dtype


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("cpu", "cpu", True),
        ("cpu", "cuda:0", False),
        ("cuda:0", "cpu", False),
        ("cuda:0", "cuda:0", True),
        ("cuda:0", "cuda:1", False),
        ("cpu", "meta", False),
    ],
)
def test_same_device(a: str, b: str, same: bool) -> None:
    assert same_device(torch.device(a), torch.device(b)) is same


def test_buckets_split_by_device_and_stage_on_the_group_device() -> None:
    on_cpu = torch.nn.Parameter(torch.ones(3))
    on_meta = torch.nn.Parameter(torch.ones(2, device="meta"))
    reducer = GradientReducer([on_cpu, on_meta], torch.device("cpu"))
    buckets = reducer._buckets  # noqa: SLF001 - the rule under test
    assert [b.params for b in buckets] == [[on_meta], [on_cpu]]  # reverse order, one device per bucket
    assert buckets[0].buffer.device.type == "meta" and buckets[0].staging is not None
    assert buckets[0].staging.device.type == "cpu"
    assert buckets[1].staging is None and buckets[1].outbound() is buckets[1].buffer
    reducer.close()


@pytest.mark.parametrize(
    ("dtype", "vote"),
    [
        (torch.float32, None),
        (torch.float64, None),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
    ],
)
def test_vote_dtype(dtype: torch.dtype, vote: torch.dtype | None) -> None:
    assert vote_dtype(dtype) is vote


def test_why_a_low_precision_vote_cannot_count_a_large_generation() -> None:
    # a ring all_reduce adds in the tensor's dtype: the 257th voter is lost in bfloat16, the 2,049th in float16
    assert float(torch.tensor(256.0, dtype=torch.bfloat16) + 1) == 256.0
    assert float(torch.tensor(2048.0, dtype=torch.float16) + 1) == 2048.0
    assert float(torch.tensor(2**24 - 1, dtype=torch.float32) + 1) == 2**24


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_model_gets_a_float32_vote_bucket_of_its_own_launched_last(dtype: torch.dtype) -> None:
    first, last = torch.nn.Parameter(torch.ones(3, dtype=dtype)), torch.nn.Parameter(torch.ones(2, dtype=dtype))
    reducer = GradientReducer([first, last], torch.device("cpu"))
    buckets = reducer._buckets  # noqa: SLF001 - the rule under test
    assert [b.params for b in buckets] == [[last, first], []]
    assert buckets[0].buffer.dtype == dtype and buckets[0].extra == 0 and buckets[0].buffer.numel() == 5
    vote = buckets[1]
    assert vote is reducer._vote_bucket  # noqa: SLF001
    assert vote.buffer.dtype == torch.float32 and vote.numel == 0 and vote.extra == reducer.VOTE_SLOTS
    reducer.close()


def test_a_float32_model_keeps_the_vote_in_its_last_gradient_bucket() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    reducer = GradientReducer([p], torch.device("cpu"))
    (bucket,) = reducer._buckets  # noqa: SLF001
    assert bucket is reducer._vote_bucket and bucket.extra == reducer.VOTE_SLOTS  # noqa: SLF001
    assert bucket.buffer.dtype == torch.float32 and bucket.buffer.numel() == 3 + reducer.VOTE_SLOTS
    reducer.close()
