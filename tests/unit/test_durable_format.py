"""The on-disk store in one process: round trip, corruption and fallback, refusing foreign files
(a pickle that would run code), retention, and failed saves that disturb nothing."""

from __future__ import annotations

import errno
import json
import os
import pickle
import stat
import zlib
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elasticd.worker.state.durable import DIRECT_ALIGN, CheckpointWriter, load_latest
from elasticd.worker.state.checksum import state_checksum
from elasticd.worker.state.durable_format import (
    FORMAT,
    HEADER_LEN,
    MAGIC,
    VERSION,
    checkpoint_name,
    read_manifest,
    scan,
)
from elasticd.worker.state.training import TrainingState
from tests.unit.test_checkpoint import make_state, train

pytestmark = pytest.mark.timeout(60)


def writer(directory: Path, keep: int = 3, every_steps: int = 1) -> CheckpointWriter:
    return CheckpointWriter(
        directory,
        job_id="j",
        node="n0",
        signature=make_state().signature,
        every_steps=every_steps,
        every_s=0.0,
        keep=keep,
        wait_s=10.0,
    )


def save_steps(directory: Path, steps: list[int], keep: int = 10) -> TrainingState:
    """Train one state and checkpoint it at each of ``steps``; return it as of the last one."""
    state = make_state(0)
    w = writer(directory, keep=keep)
    done = 0
    for s in steps:
        train(state, s - done, seed=s)
        done = s
        assert w.save(state, generation=1)
        assert w.wait_idle(10)
    w.close()
    assert w.failures == 0
    return state


def params(state: TrainingState) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def test_round_trip_restores_model_optimizer_counters_and_rng(tmp_path: Path) -> None:
    state = save_steps(tmp_path, [3])
    state.counters.epoch, state.counters.position = 2, 40
    w = writer(tmp_path)
    torch.manual_seed(1234)  # the RNG state at the save...
    expected_rng = torch.get_rng_state()
    w.save(state, generation=4)
    w.close()
    torch.manual_seed(99)  # ...is what a resumed worker continues with, not its own
    fresh = make_state(seed=5)
    loaded = load_latest(tmp_path, fresh)
    assert loaded is not None and loaded.manifest.step == 3 and loaded.manifest.generation == 4
    assert (fresh.counters.step, fresh.counters.epoch, fresh.counters.position) == (3, 2, 40)
    for k, v in params(state).items():
        assert torch.equal(fresh.model.state_dict()[k], v), k
    assert fresh.checksum() == state.checksum() == loaded.manifest.state_checksum
    assert torch.equal(torch.get_rng_state(), expected_rng)
    # the optimizer continues identically: one more step on each gives the same parameters
    train(state, 1, seed=7)
    train(fresh, 1, seed=7)
    assert fresh.checksum() == state.checksum()


def test_newer_than_leaves_the_state_alone(tmp_path: Path) -> None:
    save_steps(tmp_path, [2, 4])
    fresh = make_state(seed=5)
    before = fresh.checksum()
    assert load_latest(tmp_path, fresh, newer_than=4) is None
    assert fresh.checksum() == before
    assert load_latest(tmp_path / "nothing-here", fresh) is None


def _newest(directory: Path) -> Path:
    data = scan(directory)[0].data_path
    assert data is not None
    return data


@pytest.mark.parametrize(
    "damage", ["truncate", "flip_payload_byte", "flip_header_byte", "drop_manifest", "garbage_manifest"]
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_good_one(tmp_path: Path, damage: str) -> None:
    save_steps(tmp_path, [2, 5])
    newest = _newest(tmp_path)
    raw = bytearray(newest.read_bytes())
    if damage == "truncate":
        newest.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip_payload_byte":
        raw[-100] ^= 0x01
        newest.write_bytes(raw)
    elif damage == "flip_header_byte":
        raw[40] ^= 0x20
        newest.write_bytes(raw)
    elif damage == "drop_manifest":
        newest.with_suffix(".json").unlink()
    else:
        newest.with_suffix(".json").write_text("{not json")
    fresh = make_state(seed=5)
    with capture_logs() as logs:
        loaded = load_latest(tmp_path, fresh)
    assert loaded is not None and loaded.manifest.step == 2 and fresh.counters.step == 2
    rejected = [e for e in logs if e["event"] == "checkpoint_rejected"]
    assert len(rejected) == 1 and rejected[0]["step"] == 5, logs
    want = {
        "truncate": "truncated",
        "flip_payload_byte": "CRC-32",
        "flip_header_byte": "CRC-32",
        "drop_manifest": "no manifest",
        "garbage_manifest": "Expecting",
    }[damage]
    assert want in rejected[0]["reason"], rejected[0]
    assert loaded.rejected and want in loaded.rejected[0]


class _Exploit:
    """Unpickling this creates a marker file: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("with_manifest", [True, False])
def test_a_pickle_that_would_run_code_is_refused_and_nothing_runs(tmp_path: Path, with_manifest: bool) -> None:
    save_steps(tmp_path, [3])
    good = read_manifest(scan(tmp_path)[0].manifest_path)  # type: ignore[arg-type]
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"model": _Exploit(marker)})
    name = "99999999-step000000000900"
    (tmp_path / f"{name}.ckpt").write_bytes(payload)
    if with_manifest:  # a manifest that matches the file exactly: only the format check can refuse it
        fake = json.loads(scan(tmp_path)[1].manifest_path.read_text())  # type: ignore[union-attr]
        fake.update(
            seq=99999999,
            step=900,
            file=f"{name}.ckpt",
            file_bytes=len(payload),
            crc32=zlib.crc32(payload),
            header_bytes=0,
            payload_offset=0,
            payload_bytes=len(payload),
            state_bytes=0,
        )
        (tmp_path / f"{name}.json").write_text(json.dumps(fake))
    fresh = make_state(seed=5)
    with capture_logs() as logs:
        loaded = load_latest(tmp_path, fresh)
    assert not marker.exists()
    assert loaded is not None and loaded.manifest.step == good.step == 3
    rejected = [e for e in logs if e["event"] == "checkpoint_rejected"]
    assert len(rejected) == 1 and rejected[0]["step"] == 900
    assert ("not an elasticd checkpoint" if with_manifest else "no manifest") in rejected[0]["reason"]
    assert not payload.startswith(MAGIC)


def test_a_checkpoint_of_another_model_is_skipped(tmp_path: Path) -> None:
    save_steps(tmp_path, [3])
    other = make_state(seed=0, hidden=16)
    with capture_logs() as logs:
        assert load_latest(tmp_path, other) is None
    assert any("signature" in str(e.get("reason")) for e in logs if e["event"] == "checkpoint_rejected")


def test_retention_keeps_the_newest_k_by_save_order(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2, 3, 4, 5], keep=2)
    entries = scan(tmp_path)
    assert [(e.step, e.manifest_path is not None, e.data_path is not None) for e in entries] == [
        (5, True, True),
        (4, True, True),
    ]
    # a job resumed from an older step writes newer checkpoints: save order wins, not step numbers
    state = make_state(seed=0)
    train(state, 3)
    w = writer(tmp_path, keep=2)
    w.save(state, generation=9)
    w.close()
    assert [e.step for e in scan(tmp_path)] == [3, 5]
    fresh = make_state(seed=5)
    loaded = load_latest(tmp_path, fresh)
    assert loaded is not None and loaded.manifest.step == 3 and loaded.manifest.generation == 9


def test_a_failed_save_reports_keeps_the_previous_and_the_next_save_retries(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    failed: list[int] = []
    w = CheckpointWriter(
        blocker / "job",
        job_id="j",
        node="n0",
        signature=make_state().signature,
        every_steps=1,
        every_s=0.0,
        keep=2,
        wait_s=10.0,
        on_failed=lambda step, exc: failed.append(step),
    )
    state = make_state(0)
    train(state, 1)
    with capture_logs() as logs:
        assert w.save(state, generation=1)
        assert w.wait_idle(10)
        train(state, 1)
        assert w.save(state, generation=1)  # tried again
        assert w.wait_idle(10)
    w.close()
    assert failed == [1, 2] and w.failures == 2
    errors = [e for e in logs if e["event"] == "checkpoint_save_failed"]
    assert len(errors) == 2 and errors[0]["errno"] in ("ENOTDIR", "EEXIST"), errors


def test_schedule_by_steps_and_by_time(tmp_path: Path) -> None:
    now = [100.0]
    w = CheckpointWriter(
        tmp_path,
        job_id="j",
        node="n",
        signature="s",
        every_steps=5,
        every_s=0.0,
        keep=1,
        wait_s=1.0,
        clock=lambda: now[0],
    )
    assert [s for s in range(1, 16) if w.due(s)] == [5, 10, 15]
    t = CheckpointWriter(
        tmp_path,
        job_id="j",
        node="n",
        signature="s",
        every_steps=0,
        every_s=30.0,
        keep=1,
        wait_s=1.0,
        clock=lambda: now[0],
    )
    assert not t.due(1)
    now[0] += 30.0
    assert t.due(2)


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask_022", "umask_000"])
def test_checkpoints_and_manifests_are_0640_in_a_0750_directory_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    # Outside the unit's UMask=0027 (a worker started by hand, under the usual 022 or none at all),
    # a checkpoint holds the model and is still no other user's to read.
    directory = tmp_path / "ckpt" / "job"
    previous = os.umask(umask)
    try:
        save_steps(directory, [2, 4])
    finally:
        os.umask(previous)
    files = [p for e in scan(directory) for p in (e.data_path, e.manifest_path) if p is not None]
    assert sorted(p.suffix for p in files) == [".ckpt", ".ckpt", ".json", ".json"]
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {p.name: "0o640" for p in files}
    assert oct(stat.S_IMODE(directory.stat().st_mode)) == "0o750"


def _round_trip(directory: Path) -> Path:
    state = save_steps(directory, [2, 5])
    fresh = make_state(seed=9)
    loaded = load_latest(directory, fresh)
    assert loaded is not None and loaded.manifest.step == 5 and loaded.rejected == ()
    assert fresh.checksum() == state.checksum()
    assert loaded.path.stat().st_size == loaded.manifest.file_bytes  # the padded last block was cut off
    assert loaded.manifest.payload_offset % DIRECT_ALIGN == 0
    return loaded.path


def test_data_files_are_written_with_o_direct_where_the_filesystem_allows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[int] = []
    real_open = os.open

    def spy(path: object, flags: int, *args: object) -> int:
        if str(path).endswith(f".ckpt.tmp.{os.getpid()}"):
            opened.append(flags)
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", spy)
    _round_trip(tmp_path)
    assert opened and all(f & os.O_DIRECT for f in opened)


def test_a_filesystem_that_refuses_o_direct_gets_the_same_file_through_the_page_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open
    refused: list[str] = []

    def no_direct(path: object, flags: int, *args: object) -> int:
        if flags & os.O_DIRECT:  # what tmpfs on older kernels answers
            refused.append(str(path))
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_direct)
    _round_trip(tmp_path)
    assert refused


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm tmpfs")
def test_round_trip_on_tmpfs() -> None:
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        _round_trip(Path(d))


# -- registered objects, and files of format version 2 ---------------------------------------------


def test_round_trip_with_registered_objects(tmp_path: Path) -> None:
    from tests.unit.test_state_extras import Rig, same, state_dicts

    src = Rig(1)
    src.train(3)
    w = CheckpointWriter(
        tmp_path, job_id="j", node="n0", signature=src.state.signature, every_steps=1, every_s=0.0, keep=3, wait_s=10.0
    )
    assert w.save(src.state, generation=1)
    w.close()
    dst = Rig(2)
    loaded = load_latest(tmp_path, dst.state)
    assert loaded is not None and loaded.manifest.version == VERSION == 3
    assert same(state_dicts(dst), state_dicts(src))
    assert dst.state.checksum() == src.state.checksum() == loaded.manifest.state_checksum
    src.train(1, seed=3)
    dst.train(1, seed=3)
    assert dst.state.checksum() == src.state.checksum()

    other = Rig(3, register=["ema"])  # a worker that registered other objects refuses the file
    with capture_logs() as logs:
        assert load_latest(tmp_path, other.state) is None
    reasons = [e["reason"] for e in logs if e["event"] == "checkpoint_rejected"]
    assert len(reasons) == 1 and "registered objects" in reasons[0], reasons


def write_version_2(directory: Path, state: TrainingState, seq: int) -> Path:
    """A checkpoint of ``state`` as format version 2 wrote it: the layout without registered objects
    or CUDA RNG, param groups' tuples as lists, optimizer scalars as bare JSON, 64-byte payload
    alignment, and the state checksum seeded with the tensor entries only."""
    layout, flat = state.pack()
    meta = json.loads(layout)
    optim_sd = state.optimizer.state_dict()
    old = {
        "tensors": meta["tensors"],
        "total": meta["total"],
        "param_groups": [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in optim_sd["param_groups"]
        ],
        "optim_scalars": {
            f"{i}.{k}": v
            for i, st in optim_sd["state"].items()
            for k, v in st.items()
            if not isinstance(v, torch.Tensor)
        },
        "rng": meta["rng"],
    }
    assert meta["cuda_rng"] == [] and meta["extras"] == {}
    payload = bytes(flat.numpy())
    c = state.counters
    header = json.dumps(
        {
            "format": FORMAT,
            "version": 2,
            "job": "j",
            "step": c.step,
            "generation": 1,
            "node": "n0",
            "signature": state.signature,
            "payload_bytes": len(payload),
            "layout": old,
        }
    ).encode()
    prefix = MAGIC + HEADER_LEN.pack(len(header)) + header
    prefix += bytes(-len(prefix) % 64)
    total = old["total"]
    name = checkpoint_name(seq, c.step)
    (directory / f"{name}.ckpt").write_bytes(prefix + payload)
    manifest = {
        "format": FORMAT,
        "version": 2,
        "job": "j",
        "seq": seq,
        "step": c.step,
        "generation": 1,
        "node": "n0",
        "signature": state.signature,
        "file": f"{name}.ckpt",
        "file_bytes": len(prefix) + len(payload),
        "header_bytes": len(header),
        "payload_offset": len(prefix),
        "payload_bytes": len(payload),
        "state_bytes": total,
        "state_checksum": state_checksum(json.dumps(old["tensors"]).encode(), memoryview(payload[:total]), total),
        "crc32": zlib.crc32(payload[total:], zlib.crc32(prefix)),
        "epoch": c.epoch,
        "position": c.position,
        "created": 0.0,
    }
    (directory / f"{name}.json").write_text(json.dumps(manifest))
    return directory / f"{name}.ckpt"


def test_a_version_2_checkpoint_still_loads(tmp_path: Path) -> None:
    from tests.unit.test_checkpoint import ADAM, assert_same_tensors

    src = make_state(1, ADAM)  # Adam: betas are a tuple, which version 2 wrote as a list
    train(src, 3)
    src.counters.epoch, src.counters.position = 1, 12
    write_version_2(tmp_path, src, seq=1)
    fresh = make_state(2, ADAM)
    loaded = load_latest(tmp_path, fresh)
    assert loaded is not None and loaded.manifest.version == 2 and not loaded.rejected
    assert_same_tensors(src, fresh)
    assert (fresh.counters.step, fresh.counters.epoch, fresh.counters.position) == (3, 1, 12)
    # Every worker that loads the file holds the same state (betas come back as the list version 2
    # wrote, so today's checksum differs from the saver's, not between the ranks that resume).
    again = make_state(3, ADAM)
    assert load_latest(tmp_path, again) is not None and again.checksum() == fresh.checksum()
    train(src, 1, seed=4)
    train(fresh, 1, seed=4)
    assert_same_tensors(src, fresh)


def test_a_damaged_version_2_checkpoint_is_still_verified(tmp_path: Path) -> None:
    src = make_state(1)
    train(src, 2)
    data = write_version_2(tmp_path, src, seq=1)
    raw = bytearray(data.read_bytes())
    raw[read_manifest(data.with_suffix(".json")).payload_offset + 3] ^= 0x01  # a state byte
    data.write_bytes(raw)
    with capture_logs() as logs:
        assert load_latest(tmp_path, make_state(2)) is None
    reasons = [e["reason"] for e in logs if e["event"] == "checkpoint_rejected"]
    assert len(reasons) == 1 and "checksum of the state tensors" in reasons[0], reasons
