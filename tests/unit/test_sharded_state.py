"""A sharded model's ``TrainingState`` (FSDP2 over a one-rank gloo group in this process): a state
loaded from a peer, trained on, and replaced again (a member that received rank 0's state twice:
a newcomer that later missed steps) loads, where the restore copy of its optimizer's state once
failed ("invalid python storage")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from elasticd.worker.state.training import TrainingState

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def mesh() -> Iterator[object]:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _state(seed: int, mesh: object) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 3))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return TrainingState(model, torch.optim.AdamW(model.parameters(), lr=0.01))


def _step(state: TrainingState) -> None:
    state.optimizer.zero_grad()
    state.model(torch.randn(5, 6)).sum().backward()
    state.optimizer.step()


def test_a_state_received_twice_loads_and_is_the_senders(mesh: object) -> None:
    sender, receiver = _state(0, mesh), _state(1, mesh)
    _step(sender)
    receiver.unpack(*_copy(sender.pack()))
    _step(receiver)
    _step(sender)
    receiver.unpack(*_copy(sender.pack()))
    assert receiver.checksum() == sender.checksum()
    _step(receiver)  # it trains on the state it holds


def _copy(packed: tuple[bytes, torch.Tensor]) -> tuple[bytes, torch.Tensor]:
    return packed[0], packed[1].clone()  # what arrives is a buffer of the receiver's own
