"""``python -m elasticd.bench checkpoint``: the cost of durable checkpoints on this machine.

Owns measuring (never changing) ``elasticd.durable`` end to end, with ~100 MB of training state
(``agents/mlp.py --hidden 3500``: 12.4 M parameters plus SGD momentum):

* ``ckpt_overhead_ratio``: the mean step time of a job that checkpoints every 10 steps / that of
  the same job without checkpoints, jobs alternating in one run (``--reps`` of each; medians);
* ``save_throughput_ratio``: ``CheckpointWriter`` write throughput (the writer thread: data file,
  fsync, rename, directory fsync, manifest, fsync, rename, directory fsync) / a plain sequential
  write of the same bytes to the same directory with one fsync, alternating, in this process;
* ``resume_s``: workers started with a 100 MB checkpoint of the job on disk -> the job's first
  committed step, next to ``fresh_start_s`` (the same without a checkpoint).

Every process it starts is tracked by PID and killed in ``finally`` blocks.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from elasticd.bench.common import (
    PHASE_TIMEOUT_S,
    BenchError,
    BenchJob,
    LeaseSettings,
    dist_version,
    field_float,
    field_int,
    fmt,
    progress,
    read_json_lines,
    run_subcommand,
)
from elasticd.log import configure_logging
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import REPO_ROOT

CKPT_EVERY = 10


@dataclass(frozen=True)
class CheckpointBenchSettings(LeaseSettings):
    """What ``checkpoint`` runs; printed next to the figures."""

    reps: int = 4
    workers: int = 2
    hidden: int = 3500  # agents/mlp.py --hidden: ~100 MB of parameters + momentum
    steps: int = 120  # per overhead job
    # Mean step time over steps window_from..steps: from the step after the first save (at 10),
    # whose one-time costs (mapping and first touching the 100 MB spare buffer) no later save pays;
    # the plain job is measured over the same steps.
    window_from: int = 11
    every_steps: int = CKPT_EVERY
    write_reps: int = 7
    resume_steps: int = 5  # steps the resume/fresh jobs commit after starting


def _mean_step_s(job: BenchJob, lo: int) -> float:
    """Mean step time over steps lo..last on rank 0 (checkpoint steps included, unlike a median)."""
    rows: list[tuple[int, float]] = sorted(
        (field_int(c, "step"), field_float(c, "t")) for w in job.workers for c in w.commits if c.get("rank") == 0
    )
    rows = [r for r in rows if r[0] >= lo]
    if len(rows) < 2:
        raise BenchError("too few committed steps in the window")
    (s0, t0), (s1, t1) = rows[0], rows[-1]
    return float(t1 - t0) / (s1 - s0)


def _run_job(
    etcd: EtcdServer, workdir: Path, job_id: str, s: CheckpointBenchSettings, steps: int, extra: tuple[str, ...]
) -> tuple[BenchJob, float]:
    """Run ``s.workers`` workers to ``steps``; return the job and the wall time its workers were spawned."""
    job = BenchJob(etcd, workdir, job_id, s.worker_env(s.workers, s.workers))
    spawned = time.time()
    try:
        for _ in range(s.workers):
            job.spawn("--steps", str(steps), "--hidden", str(s.hidden), *extra)
        job.wait_until(
            lambda: all(w.final_seen is not None for w in job.workers), PHASE_TIMEOUT_S * 3, f"job {job_id} to finish"
        )
        job.wait_exit_after_final(5.0)
    finally:
        job.stop()
    return job, spawned


def run_overhead(
    etcd: EtcdServer, workdir: Path, s: CheckpointBenchSettings, progress: Callable[[str], None]
) -> dict[str, object]:
    plain: list[float] = []
    ckpt: list[float] = []
    saves: list[float] = []
    for rep in range(s.reps):
        order = ("plain", "ckpt") if rep % 2 == 0 else ("ckpt", "plain")
        for kind in order:
            d = workdir / f"overhead{rep}-{kind}"
            extra: tuple[str, ...] = ()
            if kind == "ckpt":
                extra = (
                    "--checkpoint-dir",
                    str(d / "ckpt"),
                    "--checkpoint-every-steps",
                    str(s.every_steps),
                    "--checkpoint-keep",
                    "2",
                )
            job, _ = _run_job(etcd, d, f"bcko{os.getpid()}r{rep}{kind}", s, s.steps, extra)
            step_s = _mean_step_s(job, s.window_from)
            (ckpt if kind == "ckpt" else plain).append(step_s)
            if kind == "ckpt":
                for w in job.workers:
                    saves += [
                        field_float(r, "duration_s")
                        for r in read_json_lines(w.proc.log_path)
                        if r.get("event") == "checkpoint_saved"
                    ]
            progress(f"overhead rep {rep} {kind}: mean step {step_s * 1000:.1f} ms")
    ratio = statistics.median(ckpt) / statistics.median(plain)
    return {
        "ckpt_overhead_ratio": ratio,
        "step_s_plain": plain,
        "step_s_ckpt": ckpt,
        "background_write_s": statistics.median(saves) if saves else None,
        "saves": len(saves),
    }


def run_throughput(workdir: Path, s: CheckpointBenchSettings, progress: Callable[[str], None]) -> dict[str, object]:
    """The writer vs a plain write+fsync of the same bytes, alternating, in one directory."""
    import torch

    from elasticd.worker.state.durable import CheckpointWriter, SavedCheckpoint
    from elasticd.worker.state.training import TrainingState

    sys.path.insert(0, str(REPO_ROOT / "agents"))
    from mlp import make_model  # type: ignore[import-not-found, unused-ignore]

    torch.set_num_threads(1)
    model = make_model(32, s.hidden, 10, 0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = model(torch.randn(8, 32)).sum()
    loss.backward()
    opt.step()  # creates the momentum buffers
    state = TrainingState(model, opt)
    d = workdir / "throughput"
    d.mkdir(parents=True, exist_ok=True)
    done: list[SavedCheckpoint] = []
    writer = CheckpointWriter(
        d,
        job_id="bench",
        node="bench",
        signature=state.signature,
        every_steps=1,
        every_s=0.0,
        keep=1,
        wait_s=120.0,
        on_saved=done.append,
    )
    ckpt_bps: list[float] = []
    plain_bps: list[float] = []
    snapshot_s: list[float] = []
    nbytes = 0
    try:

        def checkpoint_once(step: int) -> float:
            state.counters.step = step
            t0 = time.perf_counter()
            writer.save(state, generation=1)
            snapshot_s.append(time.perf_counter() - t0)
            if not writer.wait_idle(120.0) or len(done) != step:
                raise BenchError("the checkpoint write failed or did not finish (see the log)")
            saved = done[-1]
            size = saved.manifest.file_bytes + saved.path.with_suffix(".json").stat().st_size
            return size / saved.duration_s

        def plain_once(size: int) -> float:
            view = memoryview(bytearray(os.urandom(1024)) * (size // 1024 + 1))[:size]
            target = d / "plain.bin"
            t0 = time.perf_counter()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                off = 0
                while off < size:
                    off += os.write(fd, view[off : off + (16 << 20)])
                os.fsync(fd)
            finally:
                os.close(fd)
            bps = size / (time.perf_counter() - t0)
            target.unlink()
            return bps

        checkpoint_once(1)  # warm-up: learns the size; not counted
        nbytes = done[0].manifest.file_bytes + done[0].path.with_suffix(".json").stat().st_size
        snapshot_s.clear()
        for rep in range(s.write_reps):  # alternating order: neither always follows the other
            if rep % 2:
                plain_bps.append(plain_once(nbytes))
                ckpt_bps.append(checkpoint_once(rep + 2))
            else:
                ckpt_bps.append(checkpoint_once(rep + 2))
                plain_bps.append(plain_once(nbytes))
            progress(f"write rep {rep}: checkpoint {ckpt_bps[-1] / 1e6:.0f} MB/s, plain {plain_bps[-1] / 1e6:.0f} MB/s")
    finally:
        writer.close()
    return {
        "save_throughput_ratio": statistics.median(ckpt_bps) / statistics.median(plain_bps),
        "checkpoint_MBps": statistics.median(ckpt_bps) / 1e6,
        "plain_MBps": statistics.median(plain_bps) / 1e6,
        "pairwise_ratio_median": statistics.median(c / p for c, p in zip(ckpt_bps, plain_bps, strict=True)),
        "snapshot_copy_s": statistics.median(snapshot_s),
        "state_bytes": nbytes,
    }


def _first_commit_s(job: BenchJob, spawned: float) -> tuple[float, float]:
    """Seconds from spawning the workers, and from the first trainer start (after Python and torch
    are imported), to the job's first commit."""
    first = min((field_float(c, "t") for w in job.workers for c in w.commits), default=None)
    started = min((w.start_t for w in job.workers if w.start_t is not None), default=None)
    if first is None or started is None:
        raise BenchError("no commit")
    return first - spawned, first - started


def run_resume(
    etcd: EtcdServer, workdir: Path, s: CheckpointBenchSettings, progress: Callable[[str], None]
) -> dict[str, object]:
    """A job that saves, killed; then new job ids started with and without its checkpoint on disk."""
    src = workdir / "resume-src"
    src_job_id = f"bckr{os.getpid()}src"
    ckdir = src / "ckpt"
    job, _ = _run_job(etcd, src, src_job_id, s, 20, ("--checkpoint-dir", str(ckdir), "--checkpoint-every-steps", "20"))
    del job
    resume_s: list[float] = []
    fresh_s: list[float] = []
    resume_join: list[float] = []
    fresh_join: list[float] = []
    load_s: list[float] = []
    for rep in range(s.reps):
        for kind in ("resume", "fresh") if rep % 2 == 0 else ("fresh", "resume"):
            job_id = f"bckr{os.getpid()}r{rep}{kind}"
            d = workdir / f"resume{rep}-{kind}"
            target = d / "ckpt"
            if kind == "resume":  # the source job's checkpoint, as this job's: a start from disk
                shutil.copytree(ckdir / src_job_id, target / job_id)
            steps = 20 + s.resume_steps if kind == "resume" else s.resume_steps
            job, spawned = _run_job(etcd, d, job_id, s, steps, ("--checkpoint-dir", str(target)))
            first, joined = _first_commit_s(job, spawned)
            first_step = min(field_int(c, "step") for w in job.workers for c in w.commits)
            if kind == "resume":
                if first_step != 21:
                    raise BenchError(f"the resumed job's first commit is step {first_step}, not 21")
                resume_s.append(first)
                resume_join.append(joined)
                for w in job.workers:
                    load_s += [
                        field_float(r, "duration_s")
                        for r in read_json_lines(w.proc.log_path)
                        if r.get("event") == "checkpoint_loaded"
                    ]
            else:
                fresh_s.append(first)
                fresh_join.append(joined)
            progress(
                f"resume rep {rep} {kind}: first commit (step {first_step}) {first:.2f} s after spawn, "
                f"{joined:.2f} s after the trainer started"
            )
    return {
        "resume_s": statistics.median(resume_s),
        "fresh_start_s": statistics.median(fresh_s),
        "resume_from_trainer_start_s": statistics.median(resume_join),
        "fresh_from_trainer_start_s": statistics.median(fresh_join),
        "checkpoint_load_s": statistics.median(load_s) if load_s else None,
    }


def run_checkpoint_bench(
    s: CheckpointBenchSettings, workdir: Path, progress: Callable[[str], None]
) -> dict[str, object]:
    figures: dict[str, object] = {}
    errors: list[str] = []
    with EtcdServer() as etcd:
        phases: list[tuple[str, Callable[[], dict[str, object]]]] = [
            ("throughput", lambda: run_throughput(workdir, s, progress)),
            ("overhead", lambda: run_overhead(etcd, workdir, s, progress)),
            ("resume", lambda: run_resume(etcd, workdir, s, progress)),
        ]
        for name, phase in phases:
            try:
                figures.update(phase())
            except BenchError as exc:
                errors.append(f"{name}: {exc}")
    return {
        "figures": figures,
        "targets": {"ckpt_overhead_ratio": "<= 1.05", "save_throughput_ratio": ">= 0.8"},
        "settings": {
            **asdict(s),
            "cpus": os.cpu_count(),
            "torch": dist_version("torch"),
            "workload": f"agents/mlp.py --hidden {s.hidden}",
            "directory": str(workdir),
        },
        "errors": errors,
    }


def render(result: Mapping[str, object]) -> str:
    f = result["figures"]
    assert isinstance(f, dict)
    lines = [
        "durable checkpoints (python -m elasticd.bench checkpoint)",
        f"  ckpt_overhead_ratio    {fmt(f.get('ckpt_overhead_ratio'))}   target <= 1.05 "
        f"(mean step, checkpoint every {CKPT_EVERY} steps / none)",
        f"  save_throughput_ratio  {fmt(f.get('save_throughput_ratio'))}   target >= 0.8 "
        f"({fmt(f.get('checkpoint_MBps'), 0)} MB/s vs plain write+fsync {fmt(f.get('plain_MBps'), 0)} MB/s; "
        f"median of pairwise ratios {fmt(f.get('pairwise_ratio_median'))})",
        f"  resume_s               {fmt(f.get('resume_s'))}   spawn -> first commit from a "
        f"{fmt((f.get('state_bytes') or 0) / 1e6, 0)} MB checkpoint",
        f"  fresh_start_s          {fmt(f.get('fresh_start_s'))}   spawn -> first commit, nothing on disk",
        f"  (from trainer start)   {fmt(f.get('resume_from_trainer_start_s'))} vs "
        f"{fmt(f.get('fresh_from_trainer_start_s'))}   after Python and torch are imported",
        f"  checkpoint_load_s      {fmt(f.get('checkpoint_load_s'))}   verify + load, per worker",
        f"  snapshot_copy_s        {fmt(f.get('snapshot_copy_s'), 4)}   the copy on the training thread",
        f"  background_write_s     {fmt(f.get('background_write_s'))}   the writer thread, per save",
    ]
    errs = result.get("errors")
    if isinstance(errs, list) and errs:
        lines += ["", "ERRORS"] + [f"  {str(e).splitlines()[0]}" for e in errs]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    """``checkpoint``'s flags."""
    d = CheckpointBenchSettings()
    p.add_argument("--reps", type=int, default=d.reps, help="repetitions of the job phases (default %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="MLP width (default %(default)s: ~100 MB state)")
    p.add_argument("--steps", type=int, default=d.steps, help="steps per overhead job (default %(default)s)")


def run_cmd(args: argparse.Namespace) -> int:
    """``checkpoint``: run it (in ``--workdir``: its filesystem is the one measured), print the figures."""
    s = CheckpointBenchSettings(reps=args.reps, hidden=args.hidden, steps=args.steps)
    configure_logging(level=logging.WARNING)  # this process saves too; its info lines would mix with --json
    return run_subcommand(
        args, "elasticd-bench-ckpt-", lambda workdir: run_checkpoint_bench(s, workdir, progress), render
    )
