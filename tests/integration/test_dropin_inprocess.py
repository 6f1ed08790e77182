"""The drop-in form in this process against a real etcd (world 1): a script's own loop, its
DataLoader and its errors. Faults are in test_dropin.py."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import elasticd
from elasticd.config import EtcdConfig, Timeouts, WorldConfig
from elasticd.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

_ids = itertools.count()


def _env(etcd_server) -> elasticd.WorkerEnv:
    return elasticd.WorkerEnv(
        world=WorldConfig(job_id=f"dropin{os.getpid()}x{next(_ids)}", min_workers=1),
        etcd=EtcdConfig(endpoints=(etcd_server.endpoint,)),
        timeouts=Timeouts(lease_ttl_s=2, keepalive_s=0.5, join_window_s=0.05, join_s=10),
        node_id="inproc",
    )


def _parts() -> tuple[torch.nn.Module, torch.optim.Optimizer, TensorDataset]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), data


def test_a_script_loop_over_epochs_with_its_own_dataloader(etcd_server) -> None:
    model, opt, data = _parts()
    ddp = elasticd.DistributedDataParallel(model, opt, accumulation_steps=2, env=_env(etcd_server))
    sampler = elasticd.DistributedSampler(data, seed=3, batch_size=4)
    loader = DataLoader(data, batch_size=4, sampler=sampler, drop_last=True)
    seen: list[int] = []
    lengths = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        lengths.append(len(loader))
        for i, (x, _y) in enumerate(loader):
            loss = F.cross_entropy(ddp(x), _y) / 2
            loss.backward()
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()
                with torch.no_grad():  # an evaluation: no micro-batch of the step
                    ddp(x)
            seen.extend(x[:, 0].tolist())
    assert lengths == [10, 10, 10] and ddp.step_count == 15  # 40 samples / (2 x 4) per epoch
    assert ddp.rank == 0 and ddp.world_size == 1
    ddp.close()
    # each epoch used each sample once
    firsts = data.tensors[0][:, 0].tolist()
    for e in range(3):
        assert sorted(seen[e * 40 : (e + 1) * 40]) == sorted(firsts)


def test_past_epochs_are_empty_for_a_loop_that_starts_behind_the_job(etcd_server) -> None:
    model, opt, data = _parts()
    ddp = elasticd.DistributedDataParallel(model, opt, env=_env(etcd_server))
    sampler = elasticd.DistributedSampler(data, batch_size=8)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    sampler.set_epoch(2)  # a loop that starts at epoch 2 (the script resumed itself): the stream starts there
    assert len(loader) == 5
    for x, y in loader:
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
    sampler.set_epoch(0)
    assert len(loader) == 0 and list(loader) == []  # a newcomer's loop catching up
    sampler.set_epoch(3)
    assert len(loader) == 5
    ddp.close()


def test_wrong_uses_are_config_errors_naming_the_public_api(etcd_server) -> None:
    model, opt, data = _parts()
    with pytest.raises(ConfigError, match=r"create elasticd\.DistributedDataParallel"):
        list(elasticd.DistributedSampler(data, batch_size=4))
    with pytest.raises(ConfigError, match="drop num_replicas/rank"):
        elasticd.DistributedSampler(data, num_replicas=2, rank=0, batch_size=4)
    with pytest.raises(ConfigError, match="map-style"):
        elasticd.DistributedSampler(iter(range(3)), batch_size=4)
    with pytest.raises(ConfigError, match="accumulation_steps must be >= 1"):
        elasticd.DistributedDataParallel(model, opt, accumulation_steps=0, env=_env(etcd_server))
    ddp = elasticd.DistributedDataParallel(model, opt, env=_env(etcd_server))
    with pytest.raises(ConfigError, match="one per process"):
        elasticd.DistributedDataParallel(model, opt, env=_env(etcd_server))
    x, y = data.tensors[0][:4], data.tensors[1][:4]
    before = [p.detach().clone() for p in model.parameters()]
    F.cross_entropy(model(x), y).backward()  # the bare model: no averaged gradients
    with pytest.raises(ConfigError, match=r"optimizer\.step\(\): no averaged gradients .*DistributedDataParallel"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing applied
    opt.zero_grad()
    F.cross_entropy(ddp(x), y).backward()  # the same script, fixed: training goes on
    opt.step()
    assert ddp.step_count == 1
    ddp.close()


def test_an_epoch_loop_left_early_is_named_before_the_next_one_starts(etcd_server) -> None:
    model, opt, data = _parts()
    ddp = elasticd.DistributedDataParallel(model, opt, env=_env(etcd_server))
    sampler = elasticd.DistributedSampler(data, batch_size=4)
    loader = DataLoader(data, batch_size=4, sampler=sampler, num_workers=1, prefetch_factor=2)
    try:
        for i, (x, y) in enumerate(loader):  # 10 batches; the loop leaves after 3, 2 more prefetched
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            if i == 2:
                break
        sampler.set_epoch(1)
        with pytest.raises(ConfigError, match="ended with 2 of its batches unused"):
            next(iter(loader))
    finally:
        ddp.close()
