"""What a ported DDP script brings along, against a real etcd (world 1, this process): a ``break``
after the last step, a loss divided by the micro-batch count, the global batch stated at start."""

from __future__ import annotations

import itertools
import json
import os

import pytest
import torch
import torch.nn.functional as F
from structlog.testing import capture_logs

from elasticd import ElasticTrainer, WorkerEnv
from elasticd.config import EtcdConfig, Timeouts, WorldConfig
from elasticd.errors import ConfigError
from elasticd.worker.step.protocol import constant_divisor

pytestmark = pytest.mark.timeout(60)

_ids = itertools.count()


def _env(etcd_server) -> WorkerEnv:
    return WorkerEnv(
        world=WorldConfig(job_id=f"trip{os.getpid()}x{next(_ids)}", min_workers=1),
        etcd=EtcdConfig(endpoints=(etcd_server.endpoint,)),
        timeouts=Timeouts(lease_ttl_s=2, keepalive_s=0.5, join_window_s=0.05, join_s=10),
        node_id="inproc",
    )


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.utils.data.TensorDataset]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    ds = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 3, (64,)))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), ds


def _commits(path) -> list[int]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["step"] for r in lines if r["event"] == "commit"]


def _final(path) -> dict[str, object]:
    return [json.loads(line) for line in path.read_text().splitlines()][-1]


@pytest.mark.parametrize("form", ["loader", "batches"])
def test_a_break_right_after_the_last_step_commits_it(etcd_server, tmp_path, form):
    model, opt, ds = _model()
    audit = tmp_path / "audit.jsonl"
    trainer = ElasticTrainer(
        model, opt, env=_env(etcd_server), audit_path=audit, global_batch_size=8, dataset_size=len(ds)
    )
    with capture_logs() as logs:
        if form == "loader":
            for x, y in trainer.loader(ds, max_steps=5):
                trainer.step(F.cross_entropy(model(x), y))
                if trainer.step_count == 5:
                    break  # the script's own end, at the last step
        else:
            for batch in trainer.batches(max_steps=5):
                trainer.step(F.cross_entropy(model(ds.tensors[0][batch.indices]), ds.tensors[1][batch.indices]))
                if trainer.step_count == 5:
                    break
        trainer.close()
    assert _commits(audit) == [1, 2, 3, 4, 5]  # the last one too
    assert "branch" not in _final(audit) and _final(audit)["step"] == 5
    assert not [e for e in logs if e["event"] == "steps_discarded"]
    assert trainer.confirmed_step == 5


def test_a_break_before_the_last_step_leaves_the_step_unconfirmed(etcd_server, tmp_path):
    model, opt, ds = _model()
    audit = tmp_path / "audit.jsonl"
    trainer = ElasticTrainer(
        model, opt, env=_env(etcd_server), audit_path=audit, global_batch_size=8, dataset_size=len(ds)
    )
    with capture_logs() as logs:
        for x, y in trainer.loader(ds, max_steps=5):
            trainer.step(F.cross_entropy(model(x), y))
            if trainer.step_count == 3:
                break  # not the job's end: the others (if any) would go on without this member
        trainer.close()
    assert _commits(audit) == [1, 2]  # step 3 was never confirmed by a later collective
    assert [e["steps"] for e in logs if e["event"] == "steps_discarded"] == [[3]]


@pytest.mark.parametrize("divide", [lambda loss: loss / 2, lambda loss: loss * 0.5, lambda loss: loss.div(2.0)])
def test_a_loss_divided_by_the_accumulation_steps_is_refused(etcd_server, divide):
    model, opt, ds = _model()
    trainer = ElasticTrainer(model, opt, env=_env(etcd_server), accumulation_steps=2)
    with pytest.raises(ConfigError, match=r"ElasticTrainer.backward\(loss\): the loss is divided by 2"):
        for x, y in trainer.loader(ds, max_steps=3, batch_size=4):
            trainer.step(divide(F.cross_entropy(model(x), y)))
    assert trainer.step_count == 0


def test_an_undivided_loss_with_accumulation_trains(etcd_server):
    model, opt, ds = _model()
    trainer = ElasticTrainer(model, opt, env=_env(etcd_server), accumulation_steps=2)
    for x, y in trainer.loader(ds, max_steps=2, batch_size=4):
        trainer.step(F.cross_entropy(model(x), y) / 3)  # a constant that is not the step count: the user's
    assert trainer.step_count == 2


@pytest.mark.parametrize(
    ("kwargs", "event", "source", "size"),
    [
        ({}, "global_batch_from_first_generation", "first generation", 4 * 2 * 1),
        ({"reference_world_size": 3}, "global_batch", "reference_world_size", 4 * 2 * 3),
        ({"global_batch_size": 12}, "global_batch", "global_batch_size", 12),
    ],
)
def test_the_global_batch_is_stated_at_start(etcd_server, kwargs, event, source, size):
    model, opt, ds = _model()
    trainer = ElasticTrainer(model, opt, env=_env(etcd_server), accumulation_steps=2, **kwargs)
    with capture_logs() as logs:
        for x, y in trainer.loader(ds, max_steps=1, batch_size=4 if "global_batch_size" not in kwargs else None):
            trainer.step(F.cross_entropy(model(x), y))
    stated = [e for e in logs if e["event"].startswith("global_batch")]
    assert len(stated) == 1, stated
    assert stated[0]["event"] == event and stated[0]["source"] == source
    assert stated[0]["global_batch_size"] == size
    if event == "global_batch_from_first_generation":
        assert stated[0]["log_level"] == "warning" and "reference_world_size" in stated[0]["fix"]


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda x: x.sum() / 4, 4.0),
        (lambda x: x.sum() * 0.25, 4.0),
        (lambda x: x.sum() / torch.tensor(3.0), 3.0),
        (lambda x: x.sum() * (1 / 3), 3.0),
        (lambda x: x.sum(), None),
        (lambda x: x.sum() + 1, None),
        (lambda x: x.sum() / x.sum(), None),  # divided by something that carries a gradient: the user's math
        (lambda x: (x.sum() / 2).exp(), None),  # the division is not the last operation
    ],
)
def test_constant_divisor_recognizes_a_loss_divided_by_a_constant(make, expected):
    assert constant_divisor(make(torch.randn(3, requires_grad=True))) == expected


def test_members_that_break_after_the_last_step_end_the_job_together(local_job):
    # agents/mlp.py --break-at-end: every member leaves its loop with a break right after step 20;
    # the goodbye barrier still confirms the last step on each.
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn("--steps", "20", "--step-sleep", "0.01", "--break-at-end")
    assert job.wait_all(90) == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == 20 and len(rep.final_checksums) == 2 and len(set(rep.final_checksums)) == 1, rep
    for w in job.workers:
        assert "steps_discarded" not in w.log_text()
