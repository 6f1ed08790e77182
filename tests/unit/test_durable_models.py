"""Checkpoints of two models in one job directory: retention never deletes the other model's, and a
worker that finds only another model's checkpoints refuses to start over from step 1 unless
``checkpoint_allow_new_model`` is set. Also: a failed save is published to etcd."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elasticd.config import CheckpointConfig, WorkerEnv, WorldConfig
from elasticd.errors import CheckpointModelChanged, ModelMismatch
from elasticd.wire.keys import Keys
from elasticd.wire.ops import decode_save_failed, save_failed_key
from elasticd.worker.state.durable import (
    CheckpointWriter,
    load_latest,
    new_model_refusal,
    removable,
)
from elasticd.worker.state.durable_format import (
    Entry,
    job_dir,
    other_models,
    scan,
    signature_of,
)
from elasticd.worker.trainer import ElasticTrainer
from tests.fakes import FakeKeyValueStore
from tests.unit.test_checkpoint import make_model, make_state, train

pytestmark = pytest.mark.timeout(60)

A, B = "a" * 64, "b" * 64


# -- retention, pure ----------------------------------------------------------------------------


def entry(seq: int, manifest: bool = True, data: bool = True) -> Entry:
    name = f"{seq:08d}-step{seq * 10:012d}"
    return Entry(
        seq, seq * 10, Path(f"/d/{name}.ckpt") if data else None, Path(f"/d/{name}.json") if manifest else None
    )


RETENTION = [
    # (name, [(seq, signature, manifest, data)], keep, seqs removed)
    ("only ours: the newest keep stay", [(1, A, 1, 1), (2, A, 1, 1), (3, A, 1, 1)], 2, [1]),
    (
        "another model's are never removed, and do not count",
        [(1, B, 1, 1), (2, B, 1, 1), (3, A, 1, 1), (4, A, 1, 1), (5, A, 1, 1)],
        1,
        [3, 4],
    ),
    ("another model's newer than ours stay too", [(1, A, 1, 1), (2, A, 1, 1), (3, B, 1, 1)], 1, [1]),
    ("another model's orphan data file stays", [(1, B, 0, 1), (5, A, 1, 1)], 1, []),
    (
        "our old orphan data file goes, a newer one may be a save in progress",
        [(1, A, 0, 1), (2, A, 1, 1), (3, A, 0, 1)],
        1,
        [1],
    ),
    ("unreadable files count as ours (no model to protect)", [(1, None, 1, 1), (2, A, 1, 1), (3, A, 1, 1)], 2, [1]),
    ("a directory of another model only: nothing removed", [(1, B, 1, 1), (2, B, 1, 1)], 1, []),
]


@pytest.mark.parametrize(("name", "files", "keep", "removed"), RETENTION, ids=[c[0] for c in RETENTION])
def test_removable(name: str, files: list[tuple[int, str | None, int, int]], keep: int, removed: list[int]) -> None:
    entries = [(entry(seq, bool(m), bool(d)), sig) for seq, sig, m, d in files]
    assert sorted(e.seq for e in removable(entries, A, keep)) == removed


REFUSAL = [
    # (name, others, allow, refused)
    ("nothing of another model", {}, False, False),
    ("another model's checkpoints, not allowed", {B: [30, 20]}, False, True),
    ("another model's checkpoints, allowed", {B: [30, 20]}, True, False),
]


@pytest.mark.parametrize(("name", "others", "allow", "refused"), REFUSAL, ids=[c[0] for c in REFUSAL])
def test_new_model_refusal(name: str, others: dict[str, list[int]], allow: bool, refused: bool) -> None:
    why = new_model_refusal(Path("/ckpt/job"), A, others, allow)
    assert (why is not None) is refused
    if why is not None:  # names the directory, both signatures and the way out
        for words in (
            "/ckpt/job",
            B[:12],
            A[:12],
            "newest step 30",
            "checkpoint_allow_new_model",
            "ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL",
        ):
            assert words in why, why


# -- two models in one directory, on disk -------------------------------------------------------


def save(directory: Path, hidden: int, steps: list[int], keep: int) -> str:
    state = make_state(0, hidden=hidden)
    w = CheckpointWriter(
        directory, job_id="j", node="n0", signature=state.signature, every_steps=1, every_s=0.0, keep=keep, wait_s=10.0
    )
    done = 0
    for s in steps:
        train(state, s - done, seed=s)
        done = s
        assert w.save(state, generation=1) and w.wait_idle(10)
    w.close()
    assert w.failures == 0
    return state.signature


def test_retention_of_a_new_model_keeps_every_checkpoint_of_the_old_one(tmp_path: Path) -> None:
    sig_a = save(tmp_path, 8, [10, 20, 30], keep=2)
    assert [e.step for e in scan(tmp_path)] == [30, 20]
    sig_b = save(tmp_path, 16, [1, 2, 3, 4], keep=1)
    assert sig_a != sig_b
    by_model = {e.step: signature_of(e) for e in scan(tmp_path)}
    assert by_model == {4: sig_b, 30: sig_a, 20: sig_a}
    assert other_models(tmp_path, sig_b) == {sig_a: [30, 20]}
    assert other_models(tmp_path, sig_a) == {sig_b: [4]}
    # model A can still resume from its own newest checkpoint, past B's newer save
    loaded = load_latest(tmp_path, make_state(5, hidden=8))
    assert loaded is not None and loaded.manifest.step == 30 and len(loaded.rejected) == 1


def test_signature_of_falls_back_on_the_data_header_and_is_none_for_garbage(tmp_path: Path) -> None:
    sig = save(tmp_path, 8, [1, 2], keep=5)
    newest, older = scan(tmp_path)
    assert newest.manifest_path is not None and older.manifest_path is not None and older.data_path is not None
    newest.manifest_path.unlink()  # a data file without its manifest (a crash before the manifest)
    older.manifest_path.write_text("{not json")
    assert [signature_of(e) for e in scan(tmp_path)] == [sig, sig]
    older.data_path.write_bytes(b"\x80\x04garbage")
    assert signature_of(scan(tmp_path)[1]) is None
    assert signature_of(Entry(9, 9, tmp_path / "missing.ckpt", None)) is None


# -- the trainer's resume rule ------------------------------------------------------------------


def trainer(ckpt: Path, hidden: int, allow: bool = False, store: FakeKeyValueStore | None = None) -> ElasticTrainer:
    model = make_model(0, hidden)
    env = WorkerEnv(node_id="n0", world=WorldConfig(job_id="job"))
    return ElasticTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        dataset_size=16,
        global_batch_size=4,
        env=env,
        store=store,
        checkpoint=CheckpointConfig(checkpoint_dir=str(ckpt), checkpoint_allow_new_model=allow),
    )


def test_a_worker_of_another_model_refuses_to_start_over_and_deletes_nothing(tmp_path: Path) -> None:
    directory = job_dir(tmp_path, "job")
    save(directory, 8, [10, 20], keep=3)
    before = sorted(p.name for p in directory.iterdir())
    t = trainer(tmp_path, hidden=16)
    with capture_logs() as logs, pytest.raises(CheckpointModelChanged) as info:
        t.checkpoints.resume(-1)
    assert isinstance(info.value, ModelMismatch)  # a FatalError: the worker stops (agents/mlp.py exits 2)
    assert str(directory) in str(info.value) and "newest step 20" in str(info.value)
    assert "checkpoint_model_changed" in [e["event"] for e in logs if e["log_level"] == "error"]
    assert sorted(p.name for p in directory.iterdir()) == before
    assert t.state.counters.step == 0


def test_with_the_setting_a_new_model_starts_over_and_a_worker_holding_state_is_never_refused(tmp_path: Path) -> None:
    directory = job_dir(tmp_path, "job")
    save(directory, 8, [10], keep=3)
    with capture_logs() as logs:
        assert trainer(tmp_path, hidden=16, allow=True).checkpoints.resume(-1) == -1
    started = [e["event"] for e in logs if e["event"].startswith("checkpoint_new_model")]
    assert started == ["checkpoint_new_model_started"]
    assert trainer(tmp_path, hidden=16).checkpoints.resume(5) == 5  # holds step 5 already: not starting over
    assert trainer(tmp_path / "empty", hidden=16).checkpoints.resume(-1) == -1  # a fresh job: nothing to protect
    assert trainer(tmp_path, hidden=8).checkpoints.resume(-1) == 10  # the same model resumes as before


def test_a_failed_save_is_published_under_save_failed(tmp_path: Path) -> None:
    store = FakeKeyValueStore()
    t = trainer(tmp_path, hidden=8, store=store)
    t.checkpoints.on_failed(20, OSError(errno.EROFS, "Read-only file system"))
    kv = store.get(save_failed_key(Keys("/elasticd", "job").job))
    assert kv is not None
    rec = decode_save_failed(kv.value)
    assert (rec.step, rec.errno, rec.node, rec.directory) == (20, "EROFS", "n0", str(job_dir(tmp_path, "job")))
    assert "Read-only file system" in rec.error and rec.time > 0
    t.checkpoints.on_failed(30, RuntimeError("boom"))
    rec = decode_save_failed(store.get(save_failed_key(Keys("/elasticd", "job").job)).value)  # type: ignore[union-attr]
    assert (rec.step, rec.errno, rec.error) == (30, None, "RuntimeError: boom")
    assert json.loads(kv.value)["errno"] == "EROFS"
