"""Durable checkpoints against a real etcd and real gloo workers: a full-job restart after SIGKILL
of every worker, damaged and foreign checkpoint files, and saves into a full or read-only
filesystem (small tmpfs mounts; the tests run as root and unmount in teardown).

Equivalence across the restart uses the tolerance of test_equivalence.py (same global batches,
float32 summation order differs with the world size only; here the world size is 3 throughout).
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.ops.status import read_status
from elasticd.store.etcd import EtcdClient
from elasticd.testing.audit import check, read_lines
from elasticd.testing.localcluster import REPO_ROOT
from elasticd.wire.keys import Keys
from elasticd.worker.state.durable import load_latest
from elasticd.worker.state.durable_format import job_dir, read_manifest, scan

pytestmark = pytest.mark.timeout(240)

STEPS = 150
ARGS = ("--steps", str(STEPS), "--step-sleep", "0.03", "--seed", "7")
NO_SLEEP = ("--steps", str(STEPS), "--step-sleep", "0", "--seed", "7")
PARAM_RTOL, PARAM_ATOL, LOSS_RTOL = 1e-5, 1e-6, 1e-5  # as in test_equivalence.py
DATASET = 2048


def _final(d: Path, i: int) -> dict[str, torch.Tensor]:
    return torch.load(d / f"final{i}.pt", weights_only=True)


def _records(d: Path) -> list[dict[str, Any]]:
    return read_lines(sorted(d.glob("audit*.jsonl")))  # type: ignore[return-value]


def _good(directory: Path) -> list[int]:
    """Steps of the complete checkpoints (manifest present), newest save first."""
    return [e.step for e in scan(directory) if e.manifest_path is not None and e.data_path is not None]


def _kill_all(job: Any) -> None:
    for w in job.workers:
        w.signal(signal.SIGKILL)
    for w in job.workers:
        w.wait(10)


def _restart(local_job: Any, first: Any, **settings: object) -> Any:
    """A new set of workers for the same job id (its etcd keys and its checkpoint directory)."""
    job = local_job(**settings)
    job.job_id = first.job_id
    return job


def _client(etcd_server: Any) -> EtcdClient:
    return EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), Timeouts(), RetryPolicy())


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_full_restart_after_sigkill_of_every_worker_resumes_from_the_checkpoint_exactly(
    local_job: Any, etcd_server: Any, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "20", "--checkpoint-keep", "3")

    ref = local_job(min_workers=3)
    for i in range(3):  # no sleep: it changes no number
        ref.spawn(*NO_SLEEP, "--save-final", str(ref.dir / f"final{i}.pt"))
    assert ref.wait_all(120) == [0, 0, 0], ref.logs_tail()
    ref_rep = ref.audit()
    assert ref_rep.ok, ref_rep.violations

    first = local_job(min_workers=3)
    for _ in range(3):
        first.spawn(*ARGS, *flags)
    directory = job_dir(ckpt, first.job_id)
    first.wait_for(
        lambda: first.committed() >= 70 and bool(_good(directory)) and max(_good(directory)) >= 60,
        90,
        "step 70 and a checkpoint at step 60",
    )
    _kill_all(first)
    reached = first.committed()
    saved = _good(directory)
    assert len(saved) <= 3, saved  # retention
    resume_step = saved[0]
    manifest = read_manifest(
        directory / next(p for p in os.listdir(directory) if p.endswith(f"step{resume_step:012d}.json"))
    )
    assert reached >= resume_step  # the steps after the checkpoint are lost and will be computed again

    client = _client(etcd_server)
    try:
        before = read_status(client, Keys("/elasticd", first.job_id), now=time.time())
    finally:
        client.close()
    assert before.checkpoint is not None and before.checkpoint.step == resume_step
    assert before.checkpoint.path.endswith(f"step{resume_step:012d}.ckpt")

    second = _restart(local_job, first, min_workers=3)
    for i in range(3):
        second.spawn(*ARGS, *flags, "--save-final", str(second.dir / f"final{i}.pt"))
    assert second.wait_all(150) == [0, 0, 0], second.logs_tail()

    client = _client(etcd_server)
    try:
        after = read_status(client, Keys("/elasticd", first.job_id), now=time.time())
    finally:
        client.close()
    assert after.generation is not None and after.generation.reason == "resume"
    assert after.generation.committed_step == resume_step
    rec2 = _records(second.dir)
    resumes = [r for r in rec2 if r["event"] == "resume"]
    assert len(resumes) == 3 and {r["step"] for r in resumes} == {resume_step}, resumes
    syncs = [r for r in rec2 if r["event"] == "sync"]
    first_gen = min(int(r["generation"]) for r in syncs)
    resumed_syncs = [r for r in syncs if r["generation"] == first_gen]
    # identical parameters: the state checksum after the resume equals the one taken at the save
    assert {r["checksum"] for r in resumed_syncs} == {f"{manifest.state_checksum:016x}"}
    assert {r["step"] for r in resumed_syncs} == {resume_step}
    assert all(r["transferred_bytes"] == 0 for r in resumed_syncs)  # all loaded the same file
    assert first_gen > max(int(r["generation"]) for r in _records(first.dir) if r["event"] == "sync")

    # the data position continues exactly: the history up to the checkpoint plus the second run
    # is one clean run, and the recomputed steps took the same global batches and losses
    rec1 = _records(first.dir)
    kept = [r for r in rec1 if r["event"] != "commit" or int(r["step"]) <= resume_step]
    rep = check(kept + rec2, DATASET)
    assert rep.ok, rep.violations
    assert rep.steps == list(range(1, STEPS + 1))
    commits1 = {int(r["step"]): r for r in rec1 if r["event"] == "commit" and r["rank"] == 0}
    commits2 = {int(r["step"]): r for r in rec2 if r["event"] == "commit" and r["rank"] == 0}
    assert min(commits2) == resume_step + 1
    # the steps after the checkpoint that rank 0 recorded before the kill (``reached`` is the
    # highest step of any rank: rank 0 may have died before writing its record of the last one)
    recomputed = sorted(s for s in commits1 if s > resume_step)
    assert recomputed == list(range(resume_step + 1, max(recomputed, default=resume_step) + 1)), recomputed
    for step in recomputed:
        a, b = commits1[step], commits2[step]
        assert (a["epoch"], a["position"], a["indices"]) == (b["epoch"], b["position"], b["indices"]), step
        assert abs(a["loss"] - b["loss"]) <= LOSS_RTOL * max(1.0, abs(a["loss"])), step
    assert (manifest.epoch, manifest.position) == (
        commits1[resume_step + 1]["epoch"],
        commits1[resume_step + 1]["position"],
    )

    # the equivalence of the core holds across the full restart
    finals = [_final(second.dir, i) for i in range(3)]
    reference = _final(ref.dir, 0)
    assert all(torch.equal(finals[0][k], f[k]) for f in finals[1:] for k in f)
    for k, v in reference.items():
        torch.testing.assert_close(finals[0][k], v, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    losses = torch.tensor([rep.losses[s] for s in range(1, STEPS + 1)])
    ref_losses = torch.tensor([ref_rep.losses[s] for s in range(1, STEPS + 1)])
    torch.testing.assert_close(losses, ref_losses, rtol=LOSS_RTOL, atol=1e-7)


class _Exploit:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_damaged_and_foreign_checkpoints_are_refused_and_the_previous_good_one_is_used(
    local_job: Any, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "10", "--checkpoint-keep", "5")
    args = ("--steps", "120", "--step-sleep", "0.02")
    first = local_job(min_workers=2)
    for _ in range(2):
        first.spawn(*args, *flags)
    directory = job_dir(ckpt, first.job_id)
    first.wait_for(lambda: len(_good(directory)) >= 4, 90, "four checkpoints")
    _kill_all(first)
    newest, second_newest, good = _good(directory)[:3]
    entries = {e.step: e for e in scan(directory)}
    # the newest: cut in half; the one before: one flipped bit in the middle of the state
    data = entries[newest].data_path
    assert data is not None
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    data = entries[second_newest].data_path
    assert data is not None
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(raw)
    # and, newer than all of them, a pickle that would run code, with a manifest that fits it
    marker = tmp_path / "marker"
    evil = pickle.dumps({"model": _Exploit(marker)})
    name = "99999999-step000000000999"
    (directory / f"{name}.ckpt").write_bytes(evil)
    fake = json.loads(entries[good].manifest_path.read_text())  # type: ignore[union-attr]
    fake.update(
        seq=99999999,
        step=999,
        file=f"{name}.ckpt",
        file_bytes=len(evil),
        crc32=zlib.crc32(evil),
        state_bytes=0,
        header_bytes=0,
        payload_offset=0,
        payload_bytes=len(evil),
    )
    (directory / f"{name}.json").write_text(json.dumps(fake))

    second = _restart(local_job, first, min_workers=2)
    for _ in range(2):
        second.spawn(*args, *flags)
    assert second.wait_all(120) == [0, 0], second.logs_tail()
    assert not marker.exists()
    resumes = [r for r in _records(second.dir) if r["event"] == "resume"]
    assert {r["step"] for r in resumes} == {good}, resumes
    for w in second.workers:
        events = [json.loads(line) for line in w.log_text().splitlines() if '"checkpoint_rejected"' in line]
        reasons = {e["step"]: e["reason"] for e in events}
        assert set(reasons) == {999, newest, second_newest}, reasons
        assert "not an elasticd checkpoint" in reasons[999]
        assert "truncated" in reasons[newest]
        assert "does not match" in reasons[second_newest] and "corrupt bytes" in reasons[second_newest]
    rep = check(
        [r for r in _records(first.dir) if r["event"] != "commit" or int(r["step"]) <= good] + _records(second.dir),
        DATASET,
    )
    assert rep.ok, rep.violations
    assert rep.last_step == 120


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 320 KiB tmpfs: room for one checkpoint of the default workload (~180 KB), not two."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _intact(directory: Path, step: int) -> None:
    """The checkpoint at ``step`` still verifies and loads (into the workload's model)."""
    sys.path.insert(0, str(REPO_ROOT / "agents"))
    from mlp import make_model

    from elasticd.worker.state.training import TrainingState

    saved = torch.get_rng_state()
    try:
        model = make_model(32, 128, 10, 0)
        state = TrainingState(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        loaded = load_latest(directory, state)
    finally:
        torch.set_rng_state(saved)
    assert loaded is not None and loaded.manifest.step == step and not loaded.rejected


def _save_errors(job: Any) -> list[dict[str, Any]]:
    out = []
    for w in job.workers:
        out += [json.loads(line) for line in w.log_text().splitlines() if '"checkpoint_save_failed"' in line]
    return out


def test_a_full_filesystem_is_reported_and_training_goes_on(local_job: Any, tmpfs: Path) -> None:
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn(
            "--steps", "80", "--step-sleep", "0.01", "--checkpoint-dir", str(tmpfs), "--checkpoint-every-steps", "10"
        )
    assert job.wait_all(120) == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok and rep.last_step == 80, rep.violations
    directory = job_dir(tmpfs, job.job_id)
    assert _good(directory) == [10]  # the first fit; every later one failed and left it intact
    errors = _save_errors(job)
    assert {e["step"] for e in errors} == {20, 30, 40, 50, 60, 70, 80}, errors  # each save tried again
    assert {e["errno"] for e in errors} == {"ENOSPC"}
    assert not [p for p in os.listdir(directory) if ".tmp." in p]  # no partial file left behind
    _intact(directory, 10)


def test_a_read_only_directory_is_reported_and_training_goes_on(local_job: Any, tmpfs: Path) -> None:
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn(
            "--steps",
            "150",
            "--step-sleep",
            "0.02",
            "--checkpoint-dir",
            str(tmpfs),
            "--checkpoint-every-steps",
            "10",
            "--checkpoint-keep",
            "1",
        )
    directory = job_dir(tmpfs, job.job_id)
    job.wait_for(lambda: bool(_good(directory)), 60, "the first checkpoint")
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    frozen = _good(directory)
    at = job.committed()
    assert job.wait_all(120) == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok and rep.last_step == 150, rep.violations
    errors = _save_errors(job)
    assert errors and {e["errno"] for e in errors} == {"EROFS"}, errors
    assert max(e["step"] for e in errors) == 150 and len(errors) >= (150 - at) // 10 - 1
    assert _good(directory) == frozen
    _intact(directory, frozen[0])


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_a_changed_model_keeps_the_old_checkpoints_and_starts_over_only_when_allowed(
    local_job: Any, tmp_path: Path
) -> None:
    """Model A trains and checkpoints; model B (a wider hidden layer) is started for the same job
    id and directory after the etcd keys are gone (a fresh etcd prefix stands for a new cluster)."""
    ckpt = tmp_path / "ckpt"
    flags = ("--checkpoint-dir", str(ckpt), "--checkpoint-every-steps", "10")
    first = local_job(min_workers=1)
    first.spawn("--steps", "40", *flags, "--checkpoint-keep", "2")
    assert first.wait_all(120) == [0], first.logs_tail()
    directory = job_dir(ckpt, first.job_id)
    files_a = sorted(os.listdir(directory))
    assert _good(directory) == [40, 30]
    (sig_a,) = {read_manifest(e.manifest_path).signature for e in scan(directory) if e.manifest_path}

    refused = _restart(local_job, first, min_workers=1)
    refused.spawn("--steps", "30", "--hidden", "64", *flags, "--checkpoint-keep", "1", etcd_prefix="/elasticd-b")
    assert refused.wait_all(120) == [2], refused.logs_tail()
    text = refused.workers[0].log_text()
    assert "CheckpointModelChanged" in text and str(directory) in text and sig_a[:12] in text, text[-3000:]
    assert '"checkpoint_model_changed"' in text and '"step_committed"' not in text
    assert sorted(os.listdir(directory)) == files_a  # nothing deleted, nothing written

    allowed = _restart(local_job, first, min_workers=1)
    allowed.spawn(
        "--steps",
        "30",
        "--hidden",
        "64",
        *flags,
        "--checkpoint-keep",
        "1",
        etcd_prefix="/elasticd-c",
        checkpoint_allow_new_model="true",
    )
    assert allowed.wait_all(120) == [0], allowed.logs_tail()
    assert '"checkpoint_new_model_started"' in allowed.workers[0].log_text()
    assert not [r for r in _records(allowed.dir) if r["event"] == "resume"]  # from step 1
    rep = allowed.audit()
    assert rep.ok and rep.last_step == 30, rep.violations
    by_model = {(read_manifest(e.manifest_path).signature == sig_a, e.step) for e in scan(directory) if e.manifest_path}
    assert by_model == {(True, 40), (True, 30), (False, 30)}  # A's two kept; B keeps its newest one
    assert set(files_a) <= set(os.listdir(directory))
