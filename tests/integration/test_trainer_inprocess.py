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


def _trainer(
    etcd_server, job_id: str, **kwargs: object
) -> tuple[ElasticTrainer, torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(100, 8), torch.randint(0, 3, (100,))
    trainer = ElasticTrainer(
        model, opt, dataset_size=100, global_batch_size=10, env=_env(etcd_server, job_id), **kwargs
    )
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


# -- the split step, accumulation, the endless source, init_from, loader input ---------------------


def test_rank_and_world_size_are_readable_before_the_loop(etcd_server):
    trainer, model, x, y = _trainer(etcd_server, _job())
    with trainer:
        assert (trainer.rank, trainer.world_size) == (0, 1)  # the first rendezvous happened here
        assert _train(trainer, model, x, y, 2) == 2
    assert trainer.rank == 0  # its last rank, after close


def test_accumulation_over_micro_batches_equals_one_big_batch(etcd_server):
    def run(k: int) -> dict[str, torch.Tensor]:
        trainer, model, x, y = _trainer(etcd_server, _job(), accumulation_steps=k)
        sizes = []
        with trainer:
            for batch in trainer.batches(max_steps=4):
                sizes.append((batch.micro, batch.micro_count, len(batch.indices)))
                trainer.step(F.cross_entropy(model(x[batch.indices]), y[batch.indices]))
        assert [(m, c) for m, c, _ in sizes[:k]] == [(i, k) for i in range(k)]
        assert sorted(n for *_, n in sizes[:k]) == sorted(10 // k + (i < 10 % k) for i in range(k))
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    one, three = run(1), run(3)  # 10 samples per step: micro-batches of 4, 3 and 3
    for name in one:
        torch.testing.assert_close(three[name], one[name], rtol=1e-6, atol=1e-7)


def test_backward_then_clip_then_commit(etcd_server):
    trainer, model, x, y = _trainer(etcd_server, _job())
    norms = []
    with trainer:
        for batch in trainer.batches(max_steps=3):
            assert trainer.backward(F.cross_entropy(model(x[batch.indices]), y[batch.indices])) is True
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)))
            assert max(float(p.grad.norm()) for p in model.parameters()) <= 1e-3 + 1e-9  # clipped in place
            result = trainer.commit()
            assert result is not None and result.step == trainer.step_count
    assert len(norms) == 3 and min(norms) > 1e-3  # the clip really clipped


def test_commit_is_required_before_the_next_batch(etcd_server):
    trainer, model, x, y = _trainer(etcd_server, _job())
    with trainer:
        it = trainer.batches(max_steps=5)
        batch = next(it)
        trainer.backward(F.cross_entropy(model(x[batch.indices]), y[batch.indices]))
        with pytest.raises(RuntimeError, match="commit"):
            next(it)


def test_the_endless_source_needs_no_dataset_size(etcd_server):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    trainer = ElasticTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), global_batch_size=7, env=_env(etcd_server, _job())
    )
    seen = []
    with trainer:
        for batch in trainer.batches(max_steps=5):
            seen.extend(batch.indices)
            g = torch.Generator().manual_seed(1)
            xs = torch.stack([torch.randn(8, generator=g.manual_seed(i)) for i in batch.indices])
            trainer.step(model(xs).pow(2).mean())
    assert seen == list(range(35))  # global sample numbers, each once, no epochs


def test_init_from_a_weights_only_torch_save_file(etcd_server, tmp_path):
    torch.manual_seed(5)
    source = torch.nn.Linear(8, 3)
    sched_src = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(source.parameters(), lr=0.1), 2)
    path = tmp_path / "ck.pt"
    torch.save(
        {"model": source.state_dict(), "sched": {**sched_src.state_dict(), "last_epoch": 7}, "step": 7, "epoch": 1},
        path,
    )
    trainer, model, x, y = _trainer(etcd_server, _job(), init_from=path)
    sched = torch.optim.lr_scheduler.StepLR(trainer.optimizer, 2)
    trainer.register("scheduler", sched)
    with trainer:
        torch.testing.assert_close(model.weight, source.weight)
        assert sched.last_epoch == 7
        assert trainer.step_count == 7  # the file's step count goes on
        assert _train(trainer, model, x, y, 9) == 2
        assert trainer.step_count == 9


@pytest.mark.parametrize("content", ["missing", "pickle", "other_model"])
def test_init_from_refuses_what_it_cannot_load_with_a_clear_error(etcd_server, tmp_path, content):
    from elasticd.errors import ConfigError

    path = tmp_path / "ck.pt"
    if content == "pickle":
        torch.save({"model": torch.nn.Linear(8, 3)}, path)  # a module object: weights_only refuses it
    elif content == "other_model":
        torch.save(torch.nn.Linear(4, 3).state_dict(), path)
    trainer, *_ = _trainer(etcd_server, _job(), init_from=path)
    with pytest.raises(ConfigError, match="init_from"):
        trainer.start()
    trainer.close(clean=False)


def test_register_after_start_is_refused(etcd_server):
    from elasticd.errors import ConfigError

    trainer, *_ = _trainer(etcd_server, _job())
    with trainer:
        with pytest.raises(ConfigError, match="before start"):
            trainer.register("ema", torch.optim.lr_scheduler.StepLR(trainer.optimizer, 2))


def test_loader_refuses_a_dataloader_with_a_sampler_and_an_iterable_dataset(etcd_server):
    from elasticd.errors import ConfigError

    ds = torch.utils.data.TensorDataset(torch.randn(100, 8), torch.randint(0, 3, (100,)))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    trainer, *_ = _trainer(etcd_server, _job())
    with trainer:
        dl = torch.utils.data.DataLoader(ds, sampler=torch.utils.data.SubsetRandomSampler(range(50)))
        with pytest.raises(ConfigError, match="sampler"):
            trainer.loader(dl, max_steps=3)
        with pytest.raises(ConfigError):
            trainer.loader(Stream(), max_steps=3)
        with pytest.raises(ConfigError, match="dataset_size"):
            trainer.loader(torch.utils.data.TensorDataset(torch.randn(50, 8)), max_steps=3)


def test_loader_batch_size_per_rank_and_the_first_generation_as_reference(etcd_server):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    ds = torch.utils.data.TensorDataset(torch.randn(100, 8), torch.randint(0, 3, (100,)))
    trainer = ElasticTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        accumulation_steps=2,
        batch_mode=BatchMode.LINEAR_SCALING,
        env=_env(etcd_server, _job()),
    )
    got = []
    for xb, yb in trainer.loader(ds, max_steps=3, batch_size=4, num_workers=2):  # starts and closes itself
        got.append(len(xb))
        trainer.step(F.cross_entropy(model(xb), yb))
    assert got == [4] * 6  # 3 steps x 2 micro-batches of 4
    assert trainer.state.counters.reference_world == 1 and trainer.lr_factor == 1.0
    assert trainer.state.counters.position == 24


def test_several_optimizers_each_step_and_travel(etcd_server):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3))
    a = torch.optim.SGD(model[0].parameters(), lr=0.1)
    b = torch.optim.Adam(model[1].parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(100, 8), torch.randint(0, 3, (100,))
    trainer = ElasticTrainer(model, [a, b], dataset_size=100, global_batch_size=10, env=_env(etcd_server, _job()))
    with trainer:
        assert _train(trainer, model, x, y, 2) == 2
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert list(trainer.state.registered()) == ["optimizer_1"] and b.state_dict()["state"]


def test_a_closed_trainer_is_freed_at_once_and_cannot_train_again(etcd_server):
    import gc
    import weakref

    from elasticd.errors import ConfigError

    trainer, model, x, y = _trainer(etcd_server, _job())
    assert _train(trainer, model, x, y, 2) == 2  # started and closed by batches() itself
    with pytest.raises(RuntimeError, match="closed"):
        _train(trainer, model, x, y, 4)
    ref = weakref.ref(trainer)
    gc.disable()
    try:
        del trainer
        assert ref() is None  # no reference cycle keeps it (and its store connections) alive
    finally:
        gc.enable()
    nobatch = ElasticTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), env=_env(etcd_server, _job()))
    with pytest.raises(ConfigError, match="batch size"):
        next(nobatch.batches(max_steps=3))
