"""The trainer in this process against a real etcd (world 1): batch modes, a finished job, a job
whose state is gone. Multi-process behaviour is in test_faults.py."""

from __future__ import annotations

import itertools
import os
import time

import pytest
import torch
import torch.nn.functional as F

from elasticd import BatchMode, ElasticTrainer, WorkerEnv
from elasticd.config import EtcdConfig, RetryPolicy, Timeouts, WorldConfig
from elasticd.errors import StateLost
from elasticd.store.etcd import EtcdClient
from elasticd.wire.keys import Keys

pytestmark = pytest.mark.timeout(60)

_ids = itertools.count()


def _env(etcd_server, job_id: str) -> WorkerEnv:
    return WorkerEnv(
        world=WorldConfig(job_id=job_id, min_workers=1),
        etcd=EtcdConfig(endpoints=(etcd_server.endpoint,)),
        timeouts=Timeouts(lease_ttl_s=2, keepalive_s=0.5, join_window_s=0.05, join_s=10),
        node_id="inproc",
    )


def _trainer(etcd_server, job_id: str, **kwargs: object) -> tuple[ElasticTrainer, torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(100, 8), torch.randint(0, 3, (100,))
    trainer = ElasticTrainer(model, opt, dataset_size=100, global_batch_size=10, env=_env(etcd_server, job_id), **kwargs)
    return trainer, model, x, y


def _train(trainer: ElasticTrainer, model, x, y, steps: int) -> int:
    n = 0
    for batch in trainer.batches(max_steps=steps):
        trainer.step(F.cross_entropy(model(x[batch.indices]), y[batch.indices]))
        n += 1
    return n


def _job() -> str:
    return f"inproc{os.getpid()}x{next(_ids)}"


def test_linear_scaling_scales_lr_and_batch_with_world_size(etcd_server):
    trainer, model, x, y = _trainer(etcd_server, _job(), batch_mode=BatchMode.LINEAR_SCALING, reference_world_size=4)
    with trainer:
        _train(trainer, model, x, y, 3)
        assert trainer.world_size == 1
        # the optimizer steps at 0.1 x 1/4; its param_groups (what schedulers set, and the synced
        # state) keep the unscaled rate (test_optimizers.py checks the step itself)
        assert trainer.lr_factor == pytest.approx(1 / 4)
        assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
        assert trainer.state.counters.position == 30  # 10 samples per worker and step


def test_a_late_joiner_of_a_finished_job_stops_without_training(etcd_server):
    job = _job()
    trainer, model, x, y = _trainer(etcd_server, job)
    with trainer:
        assert _train(trainer, model, x, y, 5) == 5
    late, model2, x2, y2 = _trainer(etcd_server, job)
    with late:
        assert _train(late, model2, x2, y2, 5) == 0
        assert late.step_count == 0


def test_a_newcomer_refuses_to_restart_a_job_whose_state_is_gone(etcd_server):
    job = _job()
    trainer, model, x, y = _trainer(etcd_server, job)
    trainer.start()
    for batch in trainer.batches(max_steps=100):
        trainer.step(F.cross_entropy(model(x[batch.indices]), y[batch.indices]))
        if trainer.step_count == 4:
            break
    # progress reaches etcd from the keepalive thread; wait (bounded) until the job's mark is there
    store = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), Timeouts(), RetryPolicy())
    key = Keys("/elasticd", job).committed
    deadline = time.monotonic() + 10
    while store.get(key) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.get(key) is not None
    trainer.close(clean=False)  # the only member vanishes mid-job (no finished record)
    newcomer, model2, x2, y2 = _trainer(etcd_server, job)
    with pytest.raises(StateLost, match="no waiting member holds the job's state"):
        with newcomer:
            _train(newcomer, model2, x2, y2, 100)


def test_drain_leaves_after_the_next_committed_step(etcd_server):
    trainer, model, x, y = _trainer(etcd_server, _job())
    with trainer:
        for batch in trainer.batches(max_steps=100):
            trainer.step(F.cross_entropy(model(x[batch.indices]), y[batch.indices]))
            if trainer.step_count == 3:
                trainer.drain()
        assert trainer.drained and trainer.step_count == 4
