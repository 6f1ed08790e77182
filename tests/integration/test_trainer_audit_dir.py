"""A trainer in this process against a real etcd writes its audit lines where ``ELASTICD_AUDIT_DIR``
says, unless it is given an ``audit_path``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from elasticd import ElasticTrainer
from elasticd.settings import worker_env_from_environ

pytestmark = pytest.mark.timeout(60)


def _trainer(etcd_server, audit_dir: Path, job_id: str, **kwargs: object) -> ElasticTrainer:
    env = worker_env_from_environ(
        {
            "ELASTICD_ETCD_ENDPOINTS": etcd_server.endpoint,
            "ELASTICD_JOB_ID": job_id,
            "ELASTICD_NODE_ID": "inproc",
            "ELASTICD_LOCAL_RANK": "0",
            "ELASTICD_AUDIT_DIR": str(audit_dir),
            "ELASTICD_LEASE_TTL_S": "2",
            "ELASTICD_KEEPALIVE_S": "0.5",
            "ELASTICD_JOIN_WINDOW_S": "0.05",
            "ELASTICD_JOIN_S": "10",
        }
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    return ElasticTrainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), dataset_size=40, global_batch_size=10, env=env, **kwargs
    )


def _train(trainer: ElasticTrainer, steps: int) -> None:
    x, y = torch.randn(40, 8), torch.randint(0, 3, (40,))
    for batch in trainer.batches(max_steps=steps):
        trainer.step(F.cross_entropy(trainer.model(x[batch.indices]), y[batch.indices]))


def _events(path: Path) -> list[str]:
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


def test_a_trainer_without_audit_path_writes_to_the_audit_dir_and_audit_path_wins(etcd_server, tmp_path: Path):
    job = f"auditdir{os.getpid()}"
    _train(_trainer(etcd_server, tmp_path / "audit", job), 3)
    events = _events(tmp_path / "audit" / job / "inproc.0.jsonl")
    assert events[:2] == ["start", "sync"] and events.count("commit") == 3 and events[-1] == "final"

    own = tmp_path / "own.jsonl"
    _train(_trainer(etcd_server, tmp_path / "other", f"{job}b", audit_path=own), 2)
    assert _events(own)[:2] == ["start", "sync"]
    assert not (tmp_path / "other").exists()
