"""The gradient reducer's device rules (``collectives.same_device``, buckets per device, the
staging copy on the group's device). The cross-device path itself runs on a GPU:
``tests/programs/gpu_job.py`` (NCCL with the model on the CPU) and ``python -m elasticd.chaos
--device cuda`` (gloo with the model on the GPU)."""

from __future__ import annotations

import pytest
import torch

from elasticd.worker.collectives import GradientReducer, same_device


@pytest.mark.parametrize(("a", "b", "same"), [
    ("cpu", "cpu", True),
    ("cpu", "cuda:0", False),
    ("cuda:0", "cpu", False),
    ("cuda:0", "cuda:0", True),
    ("cuda:0", "cuda:1", False),
    ("cpu", "meta", False),
])
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
