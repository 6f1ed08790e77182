"""The sharded checkpoint's format (``worker.shard.checkpoint``) in one process: where each tensor of
the state goes in the DCP state dict, a shard written with torch.distributed.checkpoint and read
back into another state (its checksum checked), and the refusals that name what to do. The K ranks
of a replica writing one together, on real processes: ``tests/integration/test_sharded_checkpoint.py``."""

from __future__ import annotations

import errno
import json
from types import SimpleNamespace
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from elasticd import ElasticTrainer
from elasticd.config import CheckpointConfig, WorkerEnv, WorldConfig
from elasticd.errors import CheckpointModelChanged
from elasticd.worker.shard.checkpoint import cause_of, places, read_shard, rest_start, sharded_state
from elasticd.worker.state.checksum import checksum_key, state_checksum
from elasticd.worker.state.durable_format import (
    FORMAT_SHARDED,
    Entry,
    Manifest,
    checkpoint_name,
    job_dir,
    load_latest,
    read_manifest,
    scan,
    verify,
)
from elasticd.worker.state.training import TrainingState

pytestmark = [pytest.mark.timeout(60), pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


def _state(seed: int, steps: int) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        sched.step()
    state = TrainingState(model, opt)
    state.register("scheduler", sched)
    state.counters.step = steps
    return state


def _save(state: TrainingState, directory: Path, seq: int, shards: int = 2) -> Entry:
    """Shard 0 of a checkpoint as the writer lays it out, written by this process alone."""
    layout_bytes, arena = state.pack()
    layout = json.loads(layout_bytes)
    arena = arena.clone()
    total = int(layout["total"])
    checksum = state_checksum(checksum_key(layout), memoryview(arena.numpy())[:total], total)
    name = checkpoint_name(seq, state.counters.step)
    data = directory / f"{name}.dcp"
    sd = sharded_state(layout_bytes, arena, places(layout, state), 0, torch.tensor([checksum]))
    dcp.save(sd, storage_writer=FileSystemWriter(data), no_dist=True)
    man = Manifest(
        format=FORMAT_SHARDED,
        version=1,
        job="j",
        seq=seq,
        step=state.counters.step,
        generation=1,
        node="n",
        signature=state.signature,
        file=data.name,
        file_bytes=1,
        header_bytes=0,
        payload_offset=0,
        payload_bytes=arena.numel(),
        state_bytes=total,
        state_checksum=checksum,
        crc32=0,
        epoch=0,
        position=0,
        created=0.0,
        shards=shards,
    )
    (directory / f"{name}.json").write_text(json.dumps(asdict(man)))
    return next(e for e in scan(directory) if e.seq == seq)


def test_each_tensor_of_the_state_goes_where_torch_keys_it_and_the_rest_follows_them() -> None:
    state = _state(0, 2)
    layout_bytes, arena = state.pack()
    layout = json.loads(layout_bytes)
    placed = places(layout, state)
    assert {p.path for p in placed.values()} == {
        ("model", "0.weight"),
        ("model", "0.bias"),
        ("model", "2.weight"),
        ("model", "2.bias"),
        *(
            ("optim", "state", fqn, key)
            for fqn in ("0.weight", "0.bias", "2.weight", "2.bias")
            for key in ("step", "exp_avg", "exp_avg_sq")
        ),
    }
    start = rest_start(layout, placed)
    assert all(int(e[3]) >= start for e in layout["tensors"] if e[0] not in placed)  # the scheduler, the counters
    sd = sharded_state(layout_bytes, arena, placed, 1, torch.tensor([7]))
    assert sd["model"]["2.bias"].data_ptr() == arena.data_ptr() + next(  # type: ignore[index]
        int(e[3]) for e in layout["tensors"] if e[0] == "model.2.bias"
    )
    assert set(sd["elasticd"]) == {"shard-1"}  # type: ignore[arg-type]
    assert sd["elasticd"]["shard-1"]["rest"].numel() == arena.numel() - start  # type: ignore[index]


def test_a_shard_written_with_dcp_loads_into_another_state_and_is_the_same_state(tmp_path: Path) -> None:
    saved = _state(0, 3)
    want = saved.checksum()
    _save(saved, tmp_path, seq=1)
    fresh = _state(1, 0)  # other weights, no optimizer state yet, the scheduler at its start
    loaded = load_latest(tmp_path, fresh, read=lambda e: read_shard(e, fresh, 0, 2))
    assert loaded is not None and loaded.manifest.step == 3 and loaded.manifest.state_checksum == want
    assert fresh.checksum() == want and fresh.counters.step == 3
    for a, b in zip(saved.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert fresh.registered()["scheduler"].state_dict() == saved.registered()["scheduler"].state_dict()  # type: ignore[attr-defined]


def test_corrupt_bytes_of_a_shard_are_refused_and_the_previous_checkpoint_loads(tmp_path: Path) -> None:
    old = _state(0, 2)
    _save(old, tmp_path, seq=1)
    newer_state = _state(0, 4)
    flipped = _save(newer_state, tmp_path, seq=2)
    cut = _save(newer_state, tmp_path, seq=3)
    assert flipped.data_path is not None and cut.data_path is not None
    blob = next(flipped.data_path.glob("*.distcp"))
    raw = bytearray(blob.read_bytes())
    at = raw.find(newer_state.model[0].weight.detach().numpy().tobytes())  # type: ignore[index]
    assert at > 0
    raw[at + 5] ^= 0xFF  # a byte of a weight
    blob.write_bytes(bytes(raw))
    blob = next(cut.data_path.glob("*.distcp"))
    blob.write_bytes(blob.read_bytes()[:100])  # cut short
    fresh = _state(1, 0)
    loaded = load_latest(tmp_path, fresh, read=lambda e: read_shard(e, fresh, 0, 2))
    assert loaded is not None and loaded.manifest.seq == 1 and fresh.checksum() == old.checksum()
    assert len(loaded.rejected) == 2, loaded.rejected
    assert "torch.distributed.checkpoint could not read it" in loaded.rejected[0]
    assert "checksum of shard 0" in loaded.rejected[1] and "does not match" in loaded.rejected[1]


def test_a_checkpoint_of_another_replica_size_is_refused_naming_the_flag(tmp_path: Path) -> None:
    entry = _save(_state(0, 2), tmp_path, seq=1, shards=4)
    with pytest.raises(ValueError, match="replica_size 4, and this worker's replica_size is 2: .*--replica-size 4"):
        read_shard(entry, _state(1, 0), 0, 2)
    with pytest.raises(ValueError, match="a sharded checkpoint of replica_size 4, and this worker's replica_size is 1"):
        verify(entry)  # a data-parallel worker


def test_a_manifest_without_the_shards_field_reads_as_one_shard(tmp_path: Path) -> None:
    entry = _save(_state(0, 1), tmp_path, seq=1)
    assert entry.manifest_path is not None
    data = json.loads(entry.manifest_path.read_text())
    assert read_manifest(entry.manifest_path).shards == 2
    del data["shards"]
    entry.manifest_path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="is not 'elasticd-checkpoint'"):  # a sharded format needs shards > 1
        read_manifest(entry.manifest_path)


def test_a_failed_dcp_save_is_reported_as_the_os_error_that_caused_it(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    state = _state(0, 1)
    layout_bytes, arena = state.pack()
    sd = sharded_state(layout_bytes, arena, places(json.loads(layout_bytes), state), 0, torch.tensor([0]))
    with pytest.raises(CheckpointException) as raised:  # a BaseException: the writer thread must not let it by
        dcp.save(sd, storage_writer=FileSystemWriter(tmp_path / "a-file" / "x.dcp"), no_dist=True)
    cause = cause_of(raised.value)
    assert isinstance(cause, OSError) and cause.errno in (errno.ENOTDIR, errno.EEXIST), cause


@pytest.mark.parametrize(("shards", "mine"), [(2, 1), (4, 2)])
def test_a_worker_that_finds_only_checkpoints_of_another_replica_size_stops_naming_the_flag(
    tmp_path: Path, shards: int, mine: int
) -> None:
    directory = job_dir(tmp_path, "job")
    directory.mkdir(parents=True)
    _save(_state(0, 2), directory, seq=1, shards=shards)
    before = sorted(p.name for p in directory.iterdir())
    model = _state(1, 0).model
    trainer = ElasticTrainer(
        model,
        torch.optim.AdamW(model.parameters()),
        dataset_size=16,
        global_batch_size=4,
        env=WorkerEnv(node_id="n0", world=WorldConfig(job_id="job")),
        checkpoint=CheckpointConfig(checkpoint_dir=str(tmp_path)),
    )
    if mine > 1:  # a rank of a replica of ``mine`` (no schedule: no checkpoint group is made)
        trainer.checkpoints.shard_over(SimpleNamespace(size=mine, shard=0))  # type: ignore[arg-type]
    with pytest.raises(CheckpointModelChanged) as info:
        trainer.checkpoints.resume(-1)
    assert f"saved at replica_size {shards}, and this worker's is {mine}" in str(info.value)
    assert f"Start the agents with --replica-size {shards}" in str(info.value)
    assert sorted(p.name for p in directory.iterdir()) == before  # nothing deleted
    assert trainer.state.counters.step == 0
