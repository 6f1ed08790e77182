"""A replica's own process group (``worker.shard.replica``), its call sequence checked with the torch
calls recorded (no GPU here): on GPUs the worker's device is bound before the NCCL group is made
and the group is bound to it; on the CPU a gloo group; shard 0 serves the replica's store; a group
that cannot be made ends the replica (``ReplicaBroken``); and a worker that is no replica's is told
how to make one. The replica on real processes: ``tests/integration/test_sharded.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.device_mesh as device_mesh

from elasticd.config import WorkerEnv
from elasticd.errors import ConfigError, ReplicaBroken
from elasticd.worker.shard import replica as replica_mod

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[object, ...]]:
    seen: list[tuple[object, ...]] = []
    monkeypatch.setattr(replica_mod, "_JOINED", None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        replica_mod, "TCPStore", lambda host, port, **kw: seen.append(("store", host, port, kw["is_master"])) or "store"
    )
    monkeypatch.setattr(replica_mod, "PrefixStore", lambda prefix, store: f"{prefix}@{store}")
    monkeypatch.setattr(
        dist,
        "init_process_group",
        lambda backend, **kw: seen.append(
            ("group", backend, kw["store"], kw["rank"], kw["world_size"], kw["device_id"])
        ),
    )
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: seen.append(("set_device", str(d))))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(
        device_mesh, "init_device_mesh", lambda kind, shape: seen.append(("mesh", kind, shape)) or "mesh"
    )
    return seen


def env(**kw: object) -> WorkerEnv:
    base: dict[str, object] = dict(replica_size=2, shard=1, replica="n.r1.7", replica_store="10.0.0.5:4000")
    return WorkerEnv(**{**base, **kw})  # type: ignore[arg-type]


def test_a_gpu_replica_binds_its_device_before_its_nccl_group(calls: list[tuple[object, ...]]) -> None:
    r = replica_mod.join(env(backend="nccl", local_rank=3))
    assert calls == [
        ("set_device", "cuda:3"),
        ("store", "10.0.0.5", 4000, False),
        ("group", "nccl", "replica/n.r1.7/@store", 1, 2, torch.device("cuda", 3)),
        ("mesh", "cuda", (2,)),
    ]
    assert r.mesh == "mesh" and replica_mod._JOINED is r and replica_mod.join() is r  # once per process


def test_a_cpu_replica_makes_a_gloo_group_over_the_store_its_shard_0_serves(calls: list[tuple[object, ...]]) -> None:
    replica_mod.join(env(backend="gloo", shard=0, local_rank=2))
    assert calls == [
        ("store", "10.0.0.5", 4000, True),
        ("group", "gloo", "replica/n.r1.7/@store", 0, 2, None),
        ("mesh", "cpu", (2,)),
    ]


def test_a_group_that_cannot_be_made_ends_the_replica(calls: list[tuple[object, ...]], monkeypatch) -> None:
    def refuse(backend: str, **kw: object) -> None:
        raise RuntimeError("connect timed out")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    with pytest.raises(ReplicaBroken, match="replica n.r1.7: its 2 ranks did not meet: connect timed out"):
        replica_mod.join(env(backend="gloo"))
    assert replica_mod._JOINED is None


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(replica_size=1, shard=0, replica="", replica_store=""), "start the agent with --replica-size K"),
        (dict(replica_store="nowhere"), "replica_store: expected host:port"),
    ],
)
def test_a_worker_that_is_no_replica_is_told_so(calls, kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        replica_mod.join(env(backend="gloo", **kw))
    assert not calls


def test_the_store_address_parses_ipv6_and_refuses_garbage() -> None:
    assert replica_mod.parse_store("[::1]:80") == ("::1", 80)
    assert replica_mod.parse_store("host:65535") == ("host", 65535)
    for bad in ("host", ":80", "host:0", "host:x"):
        with pytest.raises(ConfigError):
            replica_mod.parse_store(bad)


def test_the_checkpoint_group_is_gloo_on_gpus_too_made_once_and_a_failure_ends_the_replica(calls, monkeypatch) -> None:
    r = replica_mod.join(env(backend="nccl", local_rank=1))
    made: list[tuple[str, float]] = []
    monkeypatch.setattr(
        dist, "new_group", lambda backend, timeout: made.append((backend, timeout.total_seconds())) or "ckpt"
    )
    assert r.checkpoint_group(60.0) == "ckpt" and r.checkpoint_group(5.0) == "ckpt"
    assert made == [("gloo", 60.0)]  # the saves' bytes are on the CPU; every rank made it once, at the start

    def refuse(backend: str, timeout: object) -> None:
        raise RuntimeError("rank 0 is gone")

    monkeypatch.setattr(dist, "new_group", refuse)
    monkeypatch.setattr(replica_mod, "_JOINED", None)
    other = replica_mod.join(env(backend="gloo"))
    with pytest.raises(ReplicaBroken, match="its checkpoint group could not be made: rank 0 is gone"):
        other.checkpoint_group(60.0)
