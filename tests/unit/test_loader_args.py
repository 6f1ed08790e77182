"""The DataLoader arguments ``ElasticTrainer.loader`` takes: each passed on, taken at the value that
means what elasticd does, or refused with a ConfigError that names the public API and says why."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elasticd import ElasticTrainer, WorkerEnv
from elasticd.config import EtcdConfig
from elasticd.errors import ConfigError
from elasticd.worker.data.loader import LOADER_ARGUMENTS, ElasticLoader, loader_arguments
from elasticd.worker.data.sampler import ElasticSampler

DATASET = TensorDataset(torch.arange(40.0))


def _collate(samples: list[Any]) -> list[Any]:
    return samples


@pytest.mark.parametrize(
    ("given", "passed"),
    [
        ({}, {}),
        (
            {"num_workers": 2, "collate_fn": _collate, "pin_memory": True},
            {"num_workers": 2, "collate_fn": _collate, "pin_memory": True},
        ),
        (
            {"prefetch_factor": 4, "persistent_workers": False, "timeout": 5.0},
            {"prefetch_factor": 4, "persistent_workers": False, "timeout": 5.0},
        ),
        ({"shuffle": True, "num_workers": 1}, {"num_workers": 1}),
        ({"shuffle": None}, {}),
        ({"drop_last": False}, {}),
        ({"sampler": None, "batch_sampler": None}, {}),
        ({"in_order": True}, {}),
        ({"pin_memory_device": ""}, {}),
    ],
    ids=[
        "nothing",
        "passed-on",
        "more-passed-on",
        "shuffle",
        "shuffle-none",
        "drop-last-false",
        "samplers-none",
        "in-order",
        "pin-memory-device-empty",
    ],
)
def test_accepted_arguments(given: dict[str, Any], passed: dict[str, Any]) -> None:
    assert loader_arguments(given) == passed


@pytest.mark.parametrize(
    ("given", "message"),
    [
        (
            {"drop_last": True},
            r"^ElasticTrainer\.loader: drop_last=True cannot be honoured: elasticd keeps an epoch's "
            r"short last global batch .*; remove drop_last",
        ),
        (
            {"shuffle": False},
            r"^ElasticTrainer\.loader: shuffle=False cannot be honoured: .*seeded random order "
            r"\(ElasticTrainer\(seed=\.\.\.\)\).*; remove shuffle",
        ),
        (
            {"sampler": DistributedSampler(DATASET, num_replicas=2, rank=0)},
            r"^ElasticTrainer\.loader: sampler=DistributedSampler cannot be honoured: elasticd chooses which samples "
            r"each rank reads.*remove it and pass the dataset",
        ),
        (
            {"batch_sampler": [[0, 1]]},
            r"^ElasticTrainer\.loader: batch_sampler=list cannot be honoured: .*batch_size "
            r"here, or ElasticTrainer\(global_batch_size=\.\.\.\)",
        ),
        ({"in_order": False}, r"^ElasticTrainer\.loader: in_order=False cannot be honoured: .*remove in_order"),
        ({"pin_memory_device": "cuda"}, r"^ElasticTrainer\.loader: pin_memory_device='cuda' cannot be honoured"),
        (
            {"shufle": True},
            r"^ElasticTrainer\.loader: unknown argument shufle \(did you mean shuffle\?\); it takes "
            r"batch_size, num_workers, .*generator \(and shuffle=True, drop_last=False",
        ),
        (
            {"num_worker": 2, "dataset": DATASET},
            r"^ElasticTrainer\.loader: unknown arguments dataset, num_worker "
            r"\(did you mean num_workers\?\); it takes batch_size",
        ),
        ({"bogus": 1}, r"^ElasticTrainer\.loader: unknown argument bogus; it takes batch_size, num_workers"),
    ],
    ids=[
        "drop-last",
        "no-shuffle",
        "sampler",
        "batch-sampler",
        "out-of-order",
        "pin-memory-device",
        "typo",
        "typo-and-dataset",
        "unknown",
    ],
)
def test_refused_arguments_name_the_public_api_and_say_why(given: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        loader_arguments(given)
    assert "ElasticLoader" not in str(err.value) and "ElasticSampler" not in str(err.value)


def test_every_dataloader_argument_is_passed_on_or_taken_at_its_default() -> None:
    """A DataLoader argument of a newer torch that this table does not know fails here."""
    params = inspect.signature(DataLoader.__init__).parameters
    for name, p in params.items():
        if name in ("self", "dataset", "batch_size"):
            continue
        passed = loader_arguments({name: p.default})
        assert passed == ({name: p.default} if name in LOADER_ARGUMENTS else {}), name
    own = inspect.signature(ElasticLoader.__init__).parameters
    assert set(LOADER_ARGUMENTS) == {n for n, p in own.items() if p.kind is p.KEYWORD_ONLY}


def test_a_dataloader_with_its_own_sampler_is_told_the_public_way_to_port() -> None:
    dl = DataLoader(DATASET, sampler=DistributedSampler(DATASET, num_replicas=2, rank=0))
    with pytest.raises(
        ConfigError,
        match=r"^ElasticTrainer\.loader: the DataLoader has its own sampler "
        r"\(DistributedSampler\)",
    ) as err:
        ElasticLoader.from_dataloader(dl, ElasticSampler(40, 8))
    assert "ElasticTrainer.loader(dataset, batch_size=..., num_workers=...)" in str(err.value)
    assert "ElasticLoader" not in str(err.value) and "ElasticSampler" not in str(err.value)


@pytest.mark.timeout(30)
def test_the_trainer_refuses_before_it_joins_the_job() -> None:
    """No etcd answers at this endpoint: the refusal comes before the trainer connects."""
    model = torch.nn.Linear(1, 1)
    env = WorkerEnv(node_id="n", etcd=EtcdConfig(endpoints=("127.0.0.1:9",)))
    trainer = ElasticTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), env=env)
    with pytest.raises(ConfigError, match=r"^ElasticTrainer\.loader: drop_last=True cannot be honoured"):
        trainer.loader(DATASET, max_steps=10, batch_size=8, drop_last=True)
    with pytest.raises(ConfigError, match=r"^ElasticTrainer\.loader: unknown argument drop_lsat"):
        trainer.loader(DATASET, max_steps=10, batch_size=8, drop_lsat=True)
    trainer.close()
