"""The README's main command: a local elastic job that loses a worker and gains one, watched live.

Owns the demo only. It starts a real etcd on loopback and ``--workers`` processes of the default
workload ``agents/mlp.py`` (through ``localcluster``, every process tracked by PID), SIGKILLs one
worker mid-step after about a third of the steps, starts a newcomer so that it joins at about two
thirds (early by the measured start-up time of a worker), prints a progress line about once a second (read from the workers' audit logs and the generation record in
etcd), and ends with the verdict of ``audit.check``. It holds no training or rendezvous logic, and it
stops everything it started, by PID, on every way out (Ctrl-C included).

Usage::

    python -m elasticd.demo [--workers 3] [--steps 300] [--step-sleep 0.1] [--keep] [--workdir DIR]

Exit codes: 0 every worker that was not killed exited 0, the newcomer joined, all steps were
committed and the audit found no violation; 1 the run failed; 2 bad arguments or no etcd binary; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TextIO

from elasticd.audit import AuditReport, check_dir
from elasticd.config import EtcdConfig, RetryPolicy, Timeouts, WorkerEnv, WorldConfig
from elasticd.errors import ConfigError, ElasticdError
from elasticd.localcluster import EtcdServer, WorkerProcess, python_program
from elasticd.membership import GenerationRecord, Keys, KeyValueStore, decode_generation

JOB_ID = "demo"
SAMPLES = 2048        # the workload's dataset size; the audit checks every epoch against it
GLOBAL_BATCH = 64
TICK_S = 0.1          # how often the demo polls the audit logs, etcd and the processes
STATUS_EVERY_S = 1.0  # one progress line this often
STRANDED_GRACE_S = 3.0
# Short lease so that a killed worker's key is gone within seconds (the library default is 3 s).
DEMO_TIMEOUTS = Timeouts(lease_ttl_s=2.0, keepalive_s=0.5)


# ---------------------------------------------------------------------------------------------
# Reading what the workers write


class AuditTail:
    """Follows ``worker<i>.jsonl`` files as they grow; yields complete JSON lines only."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def read(self) -> Iterator[tuple[int, dict[str, object]]]:
        """New records since the last call, as (worker index, record)."""
        for path in sorted(self.directory.glob("worker*.jsonl")):
            worker = int(path.stem.removeprefix("worker"))
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
            self._offsets[path] = self._offsets.get(path, 0) + len(chunk)
            data = self._partial.pop(path, b"") + chunk
            *lines, rest = data.split(b"\n")
            if rest:
                self._partial[path] = rest
            for line in lines:
                if line.strip():
                    yield worker, json.loads(line)


@dataclass
class GenerationSeen:
    """One generation as the demo saw it: from the audit sync lines and the etcd record."""

    number: int
    world_size: int
    cause: str                       # the trainer's cause on the first rank that synced
    reason: str = ""                 # the published record's reason (etcd), when seen
    members: tuple[str, ...] = ()
    first_step: int = 0
    last_step: int = 0
    first_commit_t: float = 0.0


@dataclass
class Progress:
    """The job as the demo sees it, updated from the audit records and etcd."""

    step: int = 0
    generation: int = 0
    world_size: int = 0
    loss: float | None = None
    first_loss: float | None = None
    generations: dict[int, GenerationSeen] = field(default_factory=dict)
    reasons: dict[int, GenerationRecord] = field(default_factory=dict)
    joined: dict[int, tuple[int, int]] = field(default_factory=dict)  # worker -> (generation, rank)
    last_commit_t: float = 0.0
    pauses: dict[int, float] = field(default_factory=dict)  # generation -> seconds without a commit
    finals: list[int] = field(default_factory=list)  # the step of each worker's "final" line

    def absorb(self, worker: int, rec: dict[str, object], say: Callable[[str], None]) -> None:
        """Fold one audit record in; announce generations and first joins through ``say``."""
        event = rec.get("event")
        if event == "sync":
            gen, rank, world = _int(rec["generation"]), _int(rec["rank"]), _int(rec["world_size"])
            if gen not in self.generations:
                seen = GenerationSeen(gen, world, str(rec.get("cause", "")))
                known = self.reasons.get(gen)
                if known is not None:
                    seen.reason, seen.members = known.reason, known.members
                self.generations[gen] = seen
                who = f" = {', '.join(_node_of(m) for m in seen.members)}" if seen.members else ""
                say(f"generation {gen}: world {world}{who} ({seen.reason or seen.cause})")
            if worker not in self.joined:
                self.joined[worker] = (gen, rank)
                if gen > 1:
                    say(f"worker {worker} joined: generation {gen}, rank {rank}, step {_int(rec['step'])}")
        elif event == "final":
            self.finals.append(_int(rec["step"]))
        elif event == "commit":
            step, gen = _int(rec["step"]), _int(rec["generation"])
            t = _float(rec["t"])
            current = self.generations.get(gen)
            if current is not None:
                if not current.first_step or step < current.first_step:
                    current.first_step, current.first_commit_t = step, t
                    if gen > 1 and self.last_commit_t:
                        self.pauses[gen] = max(0.0, t - self.last_commit_t)
                current.last_step = max(current.last_step, step)
            if step > self.step:
                self.step, self.generation, self.world_size = step, gen, _int(rec["world_size"])
                self.loss = _float(rec["loss"])
                self.last_commit_t = max(self.last_commit_t, t)
                if self.first_loss is None and step == 1:
                    self.first_loss = self.loss

    def note_record(self, record: GenerationRecord) -> None:
        """Remember a published generation record (polled from etcd)."""
        self.reasons.setdefault(record.generation, record)
        seen = self.generations.get(record.generation)
        if seen is not None and not seen.reason:
            seen.reason, seen.members = record.reason, record.members


def _int(value: object) -> int:
    assert isinstance(value, (int, str, float)), value
    return int(value)


def _float(value: object) -> float:
    assert isinstance(value, (int, str, float)), value
    return float(value)


def _node_of(member_id: str) -> str:
    """``node-2.0.4711`` -> ``node-2`` (member ids are node.local_rank.pid)."""
    return member_id.split(".", 1)[0]


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class Plan:
    workers: int
    steps: int
    step_sleep: float
    kill_worker: int
    kill_at: int   # SIGKILL the victim once this step is committed
    join_at: int   # start the newcomer early enough that it joins near this step
    min_workers: int
    timeout_s: float


@dataclass
class Outcome:
    """What happened, for the summary and the exit code."""

    codes: dict[int, int | None] = field(default_factory=dict)
    killed: int | None = None
    stopped: set[int] = field(default_factory=set)  # stopped by the demo (stranded newcomer)
    problems: list[str] = field(default_factory=list)
    report: AuditReport | None = None


class Demo:
    """One demo run in ``workdir``: an etcd, the workers, the display."""

    def __init__(self, plan: Plan, workdir: Path, out: TextIO) -> None:
        self.plan = plan
        self.workdir = workdir
        self.audit_dir = workdir / "audit"
        self.out = out
        self.started = time.monotonic()
        self.etcd: EtcdServer | None = None
        self.store: KeyValueStore | None = None
        self._close_store: Callable[[], None] | None = None
        self.workers: list[WorkerProcess] = []
        self.progress = Progress()
        self.outcome = Outcome()
        self.startup_s: float | None = None       # spawn to the first synced generation
        self._rate_samples: deque[tuple[float, int]] = deque()
        self._generation_at_kill = 0

    # -- output -----------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {text}", file=self.out, flush=True)

    def status_line(self) -> None:
        p = self.progress
        loss = f"{p.loss:.3g}" if p.loss is not None else "-"
        alive = sum(1 for w in self.workers if w.alive())
        self.say(f"step {p.step:4d}/{self.plan.steps}  generation {p.generation}  world {p.world_size}  "
                 f"loss {loss}  processes alive {alive}")

    # -- processes --------------------------------------------------------------------------

    def start_etcd(self) -> None:
        self.etcd = EtcdServer(data_dir=str(self.workdir / "etcd"))
        self.etcd.start()
        self.say(f"etcd {self.etcd.endpoint} (pid {self.etcd.proc.pid if self.etcd.proc else '?'}), "
                 f"log {self.etcd.log_path}")
        from elasticd.etcd import EtcdClient  # the demo is an entry point: it wires the client here

        client = EtcdClient(EtcdConfig(endpoints=(self.etcd.endpoint,)), DEMO_TIMEOUTS, RetryPolicy(etcd_attempts=2))
        self.store, self._close_store = client, client.close

    def worker_env(self, index: int) -> dict[str, str]:
        assert self.etcd is not None
        env = WorkerEnv(
            world=WorldConfig(job_id=JOB_ID, min_workers=self.plan.min_workers),
            etcd=EtcdConfig(endpoints=(self.etcd.endpoint,)),
            timeouts=DEMO_TIMEOUTS,
            node_id=f"node-{index}",
            local_rank=0,            # each worker plays one node with one process
            backend="gloo",          # every worker on this one machine's CPU, even where CUDA exists
        )
        return env.to_environ()

    def spawn(self, index: int) -> WorkerProcess:
        argv = python_program(
            "agents/mlp.py", "--steps", str(self.plan.steps), "--samples", str(SAMPLES),
            "--global-batch", str(GLOBAL_BATCH), "--step-sleep", str(self.plan.step_sleep),
            "--audit", str(self.audit_dir / f"worker{index}.jsonl"),
        )
        w = WorkerProcess(argv, self.worker_env(index), self.workdir / f"worker{index}.log").start()
        self.workers.append(w)
        self.say(f"started worker {index} (node-{index}, pid {w.pid}), log {w.log_path}")
        return w

    def stop_all(self) -> None:
        """Stop every process this demo started, by PID (idempotent)."""
        for w in self.workers:
            w.stop()
        if self._close_store is not None:
            self._close_store()
            self._close_store = None
        self.store = None
        if self.etcd is not None:
            self.etcd.stop(remove_data=False)

    # -- pacing -----------------------------------------------------------------------------

    def _sample_rate(self) -> None:
        now = time.monotonic()
        self._rate_samples.append((now, self.progress.step))
        while len(self._rate_samples) > 2 and now - self._rate_samples[0][0] > 5.0:
            self._rate_samples.popleft()

    def steps_per_s(self) -> float:
        """Commit rate over the last few seconds."""
        if len(self._rate_samples) < 2:
            return 0.0
        (t0, s0), (t1, s1) = self._rate_samples[0], self._rate_samples[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0

    def newcomer_due(self) -> bool:
        """Time to start the newcomer: after the regroup that followed the kill, and early enough
        (by the measured start-up time of a worker) that it joins near ``plan.join_at``."""
        p = self.progress
        if self.outcome.killed is None or p.generation <= self._generation_at_kill:
            return False
        lead = math.ceil((self.startup_s or 0.0) * self.steps_per_s())
        return p.step >= self.plan.join_at - lead

    # -- the loop ---------------------------------------------------------------------------

    def poll(self, tail: AuditTail) -> None:
        if self.store is not None:
            try:
                kv = self.store.get(Keys(EtcdConfig().prefix, JOB_ID).generation)
            except ElasticdError:
                kv = None  # the display is best effort; the audit decides
            if kv is not None:
                try:
                    self.progress.note_record(decode_generation(kv.value))
                except (ValueError, TypeError, KeyError):
                    pass
        for worker, rec in tail.read():
            self.progress.absorb(worker, rec, self.say)
        for i, w in enumerate(self.workers):
            if i not in self.outcome.codes and w.proc is not None and w.proc.poll() is not None:
                code = w.proc.returncode
                self.outcome.codes[i] = code
                if i == self.outcome.killed:
                    self.say(f"worker {i} is gone (exit {code})")
                elif i in self.outcome.stopped:
                    self.say(f"worker {i} stopped (exit {code})")
                elif code == 0:
                    self.say(f"worker {i} finished (exit 0)")
                else:
                    self.say(f"worker {i} FAILED with exit {code}; see {w.log_path}")

    def run(self) -> Outcome:
        plan = self.plan
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.start_etcd()
        for i in range(plan.workers):
            self.spawn(i)
        tail = AuditTail(self.audit_dir)
        deadline = time.monotonic() + plan.timeout_s
        next_status = time.monotonic() + STATUS_EVERY_S
        newcomer = plan.workers
        stranded_since: float | None = None
        spawned_at = time.monotonic()
        while time.monotonic() < deadline:
            self.poll(tail)
            self._sample_rate()
            p = self.progress
            if self.startup_s is None and p.generations:
                self.startup_s = time.monotonic() - spawned_at
            if self.outcome.killed is None and p.step >= plan.kill_at:
                victim = self.workers[plan.kill_worker]
                if victim.alive():
                    victim.signal(signal.SIGKILL)
                    self.outcome.killed = plan.kill_worker
                    self._generation_at_kill = p.generation
                    self.say(f"killed worker {plan.kill_worker} (pid {victim.pid}) with SIGKILL at step {p.step}")
            if len(self.workers) == newcomer and self.newcomer_due():
                self.say(f"starting a new worker at step {p.step} so that it joins near step {plan.join_at} "
                         f"(workers took {self.startup_s or 0:.1f} s to start; {self.steps_per_s():.1f} steps/s)")
                self.spawn(newcomer)
            if not any(w.alive() for w in self.workers) and len(self.workers) > newcomer:
                break
            if len(self.workers) > newcomer and self.workers[newcomer].alive() and newcomer not in p.joined:
                others = [w for i, w in enumerate(self.workers) if i != newcomer]
                if not any(w.alive() for w in others):
                    stranded_since = stranded_since or time.monotonic()
                    if time.monotonic() - stranded_since > STRANDED_GRACE_S:
                        self.outcome.problems.append(
                            f"worker {newcomer} started too late: the job finished before it could join "
                            "(give the job more --steps or a larger --step-sleep)")
                        self.outcome.stopped.add(newcomer)
                        self.say(f"stopping worker {newcomer}: the job finished before it could join")
                        self.workers[newcomer].stop()
            if not any(w.alive() for w in self.workers) and len(self.workers) == newcomer:
                self.outcome.problems.append("every worker exited before the newcomer was started")
                break
            if time.monotonic() >= next_status:
                self.status_line()
                next_status += STATUS_EVERY_S
            time.sleep(TICK_S)
        else:
            self.outcome.problems.append(f"the job did not finish within --timeout {plan.timeout_s:g} s")
        self.poll(tail)
        self.status_line()
        for i, w in enumerate(self.workers):
            if w.alive():
                w.stop()
            self.outcome.codes.setdefault(i, w.proc.returncode if w.proc is not None else None)
        self.outcome.report = check_dir(self.audit_dir, SAMPLES)
        return self.outcome

    # -- the verdict ------------------------------------------------------------------------

    def verdict(self) -> bool:
        """Print the summary; True iff the run passed."""
        o, p, plan = self.outcome, self.progress, self.plan
        rep = o.report
        assert rep is not None
        problems = list(o.problems)
        for i, code in sorted(o.codes.items()):
            if i != o.killed and i not in o.stopped and code != 0:
                problems.append(f"worker {i} exited with {code} (log: {self.workdir / f'worker{i}.log'})")
        if o.killed is None:
            problems.append("no worker was killed (the job never reached the kill step)")
        if len(self.workers) <= plan.workers:
            problems.append("the newcomer was never started")
        elif plan.workers not in p.joined:
            problems.append(f"worker {plan.workers} never joined")
        if rep.last_step != plan.steps:
            problems.append(f"committed {rep.last_step} of {plan.steps} steps")
        w = self.out.write
        w("\n== summary ==\n")
        continuous = f" (1..{rep.last_step}, no gap, no repeat)" if rep.ok and rep.steps else ""
        w(f"steps committed   {rep.last_step}/{plan.steps}{continuous}; epochs complete {rep.epochs_complete}\n")
        w("generations\n")
        for gen, world in sorted(rep.generations.items()):
            seen = p.generations.get(gen)
            cause = (seen.reason or seen.cause) if seen else "?"
            span = f"steps {seen.first_step}-{seen.last_step}" if seen and seen.first_step else "no step committed"
            pause = f"; no commit for {p.pauses[gen]:.2f} s before its first step" if gen in p.pauses else ""
            w(f"  {gen:3d}  world {world}  {cause:<14} {span}{pause}\n")
        regroups = [g for g in sorted(rep.generations) if g > min(rep.generations, default=0)]
        w(f"recoveries        {len(regroups)} (generations after the first: {regroups})\n")
        last_loss = rep.losses.get(rep.last_step)
        if last_loss is not None:
            first = rep.losses.get(1)
            w(f"loss              {first:.4g} at step 1 -> {last_loss:.4g} at step {rep.last_step}\n"
              if first is not None else f"final loss        {last_loss:.4g}\n")
        codes = ", ".join(
            f"{i}: {'killed' if i == o.killed else 'exit ' + str(c)}" for i, c in sorted(o.codes.items())
        )
        w(f"workers           {codes}\n")
        for step, sums in sorted(rep.finals_by_step.items()):
            n = p.finals.count(step)
            state = f"identical on {n} worker(s) ({next(iter(sums))})" if len(sums) == 1 else f"DIFFER: {sorted(sums)}"
            w(f"final parameters  at step {step}: {state}\n")
        if rep.ok:
            w("invariants        OK\n")
        else:
            w(f"invariants        {len(rep.violations)} VIOLATION(S)\n")
            for v in rep.violations:
                w(f"  - {v}\n")
        for prob in problems:
            w(f"problem           {prob}\n")
        passed = rep.ok and not problems
        w(f"result            {'PASS' if passed else 'FAIL'}\n")
        self.out.flush()
        return passed


# ---------------------------------------------------------------------------------------------
# Entry point


class _Terminated(Exception):
    """SIGTERM arrived: leave through the same cleanup as Ctrl-C."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    def handler(_signum: int, _frame: FrameType | None) -> None:
        raise _Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m elasticd.demo",
        description="A local elastic job on loopback: a real etcd, --workers workers of agents/mlp.py; "
        "one is SIGKILLed after ~1/3 of the steps, a new one joins after ~2/3; the audit checks "
        "the invariants at the end.",
    )
    p.add_argument("--workers", type=int, default=3, help="workers at the start (>= 2; default 3)")
    p.add_argument("--steps", type=int, default=300, help="steps to commit (>= 6; default 300)")
    p.add_argument("--step-sleep", type=float, default=0.1,
                   help="extra seconds per step in each worker, so the run can be watched (default 0.1)")
    p.add_argument("--kill-worker", type=int, default=None,
                   help="index of the worker to SIGKILL (default: the last one started)")
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds (default 600)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="empty or new directory for logs, audit files and etcd data (kept afterwards); "
                   "default: a temporary directory, removed at the end unless --keep or the run failed")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate the arguments.

    Raises:
        ConfigError: an argument is out of range; the message names it.
    """
    if args.workers < 2:
        raise ConfigError(f"--workers: at least 2 (one is killed), got {args.workers}")
    if args.steps < 6:
        raise ConfigError(f"--steps: at least 6, got {args.steps}")
    if args.step_sleep < 0:
        raise ConfigError(f"--step-sleep: must be >= 0, got {args.step_sleep}")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout: must be > 0, got {args.timeout}")
    kill = args.workers - 1 if args.kill_worker is None else args.kill_worker
    if not 0 <= kill < args.workers:
        raise ConfigError(f"--kill-worker: must be in 0..{args.workers - 1}, got {kill}")
    return Plan(
        workers=args.workers,
        steps=args.steps,
        step_sleep=args.step_sleep,
        kill_worker=kill,
        kill_at=args.steps // 3,
        join_at=2 * args.steps // 3,
        # The survivors must be able to go on alone, so never ask for more than workers - 1.
        min_workers=max(1, min(2, args.workers - 1)),
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = make_plan(args)
    except ConfigError as exc:
        print(f"elasticd.demo: {exc}", file=sys.stderr)
        return 2
    if args.workdir is not None:
        workdir: Path = args.workdir.resolve()
        if workdir.exists() and any(workdir.iterdir()):
            print(f"elasticd.demo: --workdir: {workdir} is not empty", file=sys.stderr)
            return 2
        workdir.mkdir(parents=True, exist_ok=True)
        remove = False
    else:
        workdir = Path(tempfile.mkdtemp(prefix="elasticd-demo-"))
        remove = not args.keep
    out = sys.stdout
    demo = Demo(plan, workdir, out)
    print(f"elasticd demo: {plan.workers} workers, {plan.steps} steps, min_workers {plan.min_workers}, "
          f"lease TTL {DEMO_TIMEOUTS.lease_ttl_s:g} s; kill worker {plan.kill_worker} at step {plan.kill_at}, "
          f"a new worker at step {plan.join_at}", file=out)
    print(f"work dir {workdir} (worker<i>.log: worker logs, audit/worker<i>.jsonl: audit, etcd.log)",
          file=out, flush=True)
    code = 1
    try:
        with _sigterm_raises():
            demo.run()
            code = 0 if demo.verdict() else 1
    except ConfigError as exc:  # no etcd binary
        print(f"elasticd.demo: {exc}", file=sys.stderr)
        code = 2
    except (KeyboardInterrupt, _Terminated):
        print("\nelasticd.demo: interrupted; stopping every process it started", file=sys.stderr)
        code = 130
    finally:
        demo.stop_all()
        if remove and code == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"work dir kept: {workdir}", file=out, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
