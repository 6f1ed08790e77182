"""``python -m elasticd.bench agent``: what the node agent adds to recovery, measured end to end.

Owns the ``agent`` benchmark. Each repetition runs one job of the default workload
(``agents/mlp.py``) under ``nodes`` real ``elasticd`` agents (one worker each, separate processes in
sessions of their own) on a real local etcd, and injects three faults in turn:

* ``crash_detect_s``: SIGKILL of one node's worker -> the next generation record published in etcd
  (seen through an etcd watch on the generation key, stamped with the wall clock on arrival). The
  agent revokes the dead worker's lease at once, so nobody waits for the TTL;
* ``drain_s``: once that worker is back (its agent restarted it and it rejoined), SIGTERM of another
  node's agent -> the job's first commit at the smaller world size (audit ``commit`` lines' ``t``).
  Reported next to ``drain_step_time_s``, the median step time before the drain, because the target
  is 2 step times + 1 s;
* ``node_loss_recovery_s``: SIGKILL of a third agent's whole process group (the agent and its
  worker: a lost node) -> the survivor's next commit. Nobody revokes the lost worker's lease, so this
  includes waiting for it to expire (``lease_ttl_s``);
* ``steps_lost``: committed steps missing or repeated, by ``audit.check`` over every node's audit log.

Every process it starts is tracked by PID (the agents by process group) and killed in ``finally``.
It never changes how elasticd behaves: the agents get their settings as flags.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from elasticd.bench.common import (
    DATASET_SIZE,
    PHASE_TIMEOUT_S,
    POLL_S,
    WORKLOAD,
    BenchError,
    LeaseSettings,
    Record,
    Tail,
    dist_version,
    fmt,
    lost_steps,
    median_of,
    progress,
    run_subcommand,
)
from elasticd.config import EtcdConfig, RetryPolicy
from elasticd.errors import ElasticdError
from elasticd.testing.audit import check_dir
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import WorkerProcess, agent_program, python_program
from elasticd.wire.keys import Keys
from elasticd.wire.records import decode_generation
from elasticd.wire.snapshot import parse_snapshot

SETTLE_STEPS = 15        # steps committed at a world size before the next fault
AGENT_TARGETS = {
    "crash_detect_s": "<= 0.2 s",
    "node_loss_recovery_s": "<= lease TTL + 1 s",
    "drain_s": "<= 2 step times + 1 s",
    "steps_lost": "0",
}


@dataclass(frozen=True)
class AgentBenchSettings(LeaseSettings):
    """What ``agent`` runs (the lease is passed to the agents as flags)."""

    reps: int = 5
    nodes: int = 3
    step_sleep_s: float = 0.02


@dataclass
class AgentRep:
    crash_detect_s: float | None = None
    drain_s: float | None = None
    drain_step_time_s: float | None = None
    node_loss_recovery_s: float | None = None
    steps_lost: int = 0
    violations: list[str] = field(default_factory=list)
    error: str | None = None


class _GenerationWatch:
    """Wall-clock arrival time of each generation record, from an etcd watch on its key."""

    def __init__(self, store: object, keys: Keys) -> None:
        self._store = store
        self._key = keys.generation
        self._lock = threading.Lock()
        self.seen: dict[int, float] = {}
        self._cancel: Callable[[], None] | None = None

    def start(self) -> None:
        self._cancel = self._store.watch_prefix(self._key, self._on_change)  # type: ignore[attr-defined]
        self._on_change()

    def _on_change(self) -> None:
        t = time.time()
        try:
            kv = self._store.get(self._key)  # type: ignore[attr-defined]
            number = decode_generation(kv.value).generation if kv is not None else None
        except (ElasticdError, ValueError, TypeError, KeyError):
            return
        if number is not None:
            with self._lock:
                self.seen.setdefault(number, t)

    def first_after(self, generation: int) -> tuple[int, float] | None:
        with self._lock:
            later = sorted((g, t) for g, t in self.seen.items() if g > generation)
        return later[0] if later else None

    def stop(self) -> None:
        if self._cancel is not None:
            try:
                self._cancel()
            except ElasticdError:
                pass
            self._cancel = None


class _AgentJob:
    """One job under ``nodes`` agents; each node's worker appends to ``<node>.jsonl``."""

    def __init__(self, etcd: EtcdServer, workdir: Path, job_id: str, s: AgentBenchSettings) -> None:
        from elasticd.store.etcd import EtcdClient

        self.etcd, self.dir, self.job_id, self.s = etcd, workdir, job_id, s
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_file = self.dir / "elasticd.toml"
        self.config_file.write_text("# settings come from flags\n")
        self.keys = Keys(EtcdConfig().prefix, job_id)
        self.store = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,)), s.timeouts(), RetryPolicy(etcd_attempts=2))
        self.watch = _GenerationWatch(self.store, self.keys)
        self.agents: dict[str, WorkerProcess] = {}
        self.tails: dict[str, Tail] = {}
        self.commits: list[Record] = []   # every node's commit lines, in the order read
        self.expected_gone: set[str] = set()  # nodes whose agent the bench stopped on purpose

    def start(self, node: str) -> WorkerProcess:
        audit = self.dir / f"{node}.jsonl"
        program = python_program(WORKLOAD, "--steps", "1000000", "--step-sleep", str(self.s.step_sleep_s),
                                 "--audit", str(audit))
        argv = agent_program(
            "--config", str(self.config_file), "--etcd", self.etcd.endpoint, "--job-id", self.job_id,
            "--node-id", node, "--nnodes", f"1:{self.s.nodes}", "--nproc-per-node", "1", "--backend", "gloo",
            "--lease-ttl-s", str(self.s.lease_ttl_s), "--keepalive-s", str(self.s.keepalive_s),
            "--", *program,
        )
        agent = WorkerProcess(argv, {}, self.dir / f"agent-{node}.log", new_session=True).start()
        self.agents[node] = agent
        self.tails[node] = Tail(audit)
        return agent

    def poll(self) -> None:
        for tail in self.tails.values():
            self.commits.extend(r for r in tail.read_new() if r.get("event") == "commit")

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = PHASE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if cond():
                return
            for node, a in self.agents.items():
                if not a.alive() and node not in self.expected_gone:
                    raise BenchError(f"agent {node} exited {a.proc.returncode if a.proc else '?'} while "
                                     f"waiting for {what}; see {a.log_path}")
            time.sleep(POLL_S)
        raise BenchError(f"timed out after {timeout:g} s waiting for {what}")

    def commits_since(self, t: float, world: int | None = None) -> list[Record]:
        return [r for r in self.commits if float(r["t"]) > t  # type: ignore[arg-type]
                and (world is None or r["world_size"] == world)]

    def generation(self) -> int:
        return max((int(r["generation"]) for r in self.commits), default=0)  # type: ignore[call-overload]

    def worker_pid(self, node: str) -> int:
        snap = parse_snapshot(self.keys, self.store.get_prefix(self.keys.prefix))
        pids = [m.pid for m in snap.members.values() if m.node == node]
        if len(pids) != 1:
            raise BenchError(f"expected one member of node {node} in etcd, found {pids}")
        return pids[0]

    def stop(self) -> None:
        self.watch.stop()
        for a in self.agents.values():
            a.stop()
        self.store.close()


def _steps_at(commits: list[Record], world: int) -> set[int]:
    return {int(r["step"]) for r in commits if r["world_size"] == world}  # type: ignore[call-overload]


def _step_time(commits: list[Record], world: int) -> float | None:
    """Median time between consecutive committed steps at ``world`` (first commit line of each step)."""
    first: dict[int, float] = {}
    for r in commits:
        if r["world_size"] == world:
            first.setdefault(int(r["step"]), float(r["t"]))  # type: ignore[call-overload, arg-type]
    steps = sorted(first)
    deltas = [first[b] - first[a] for a, b in zip(steps, steps[1:]) if b == a + 1]
    return statistics.median(deltas[-50:]) if deltas else None


def run_agent_rep(etcd: EtcdServer, workdir: Path, rep: int, s: AgentBenchSettings) -> AgentRep:
    out = AgentRep()
    job = _AgentJob(etcd, workdir / f"rep{rep}", f"agentbench{rep}x{int(time.time())}", s)
    nodes = [f"node-{i}" for i in range(s.nodes)]
    victim, drained, lost = nodes[-1], nodes[-2], nodes[0]
    try:
        job.watch.start()
        for node in nodes:
            job.start(node)
        job.wait_for(lambda: len(_steps_at(job.commits, s.nodes)) >= SETTLE_STEPS, f"{s.nodes} workers to train")

        # 1. a worker crashes under its agent
        gen = job.generation()
        pid = job.worker_pid(victim)
        killed_t = time.time()
        os.kill(pid, signal.SIGKILL)
        job.wait_for(lambda: job.watch.first_after(gen) is not None, "the generation after the crash")
        published = job.watch.first_after(gen)
        assert published is not None
        out.crash_detect_s = published[1] - killed_t
        job.wait_for(lambda: len(_steps_at(job.commits_since(killed_t), s.nodes)) >= SETTLE_STEPS,
                     "the restarted worker to rejoin and train")

        # 2. a node is drained (SIGTERM to its agent)
        out.drain_step_time_s = _step_time(job.commits, s.nodes)
        job.expected_gone.add(drained)
        drain_t = time.time()
        job.agents[drained].signal(signal.SIGTERM)
        job.wait_for(lambda: bool(job.commits_since(drain_t, s.nodes - 1)), "a commit at the smaller size")
        out.drain_s = min(float(r["t"]) for r in job.commits_since(drain_t, s.nodes - 1)) - drain_t  # type: ignore[arg-type]
        if job.agents[drained].wait(PHASE_TIMEOUT_S) != 0:
            raise BenchError(f"the drained agent {drained} did not exit 0; see {job.agents[drained].log_path}")
        job.wait_for(lambda: len(_steps_at(job.commits_since(drain_t), s.nodes - 1)) >= SETTLE_STEPS,
                     "steps at the smaller size")

        # 3. a node is lost: its agent and its worker are SIGKILLed together
        job.expected_gone.add(lost)
        lost_t = time.time()
        job.agents[lost].kill_group()
        job.wait_for(lambda: bool(job.commits_since(lost_t, s.nodes - 2)), "the survivor's commit after the node loss")
        out.node_loss_recovery_s = min(float(r["t"]) for r in job.commits_since(lost_t, s.nodes - 2)) - lost_t  # type: ignore[arg-type]
        job.wait_for(lambda: len(_steps_at(job.commits_since(lost_t), s.nodes - 2)) >= SETTLE_STEPS,
                     "steps after the node loss")
    except (BenchError, ElasticdError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        job.stop()
    audit = check_dir(job.dir, DATASET_SIZE)
    out.steps_lost = lost_steps(audit)
    out.violations = list(audit.violations)
    return out


def run_agent_bench(s: AgentBenchSettings, workdir: Path, progress: Callable[[str], None]) -> dict[str, object]:
    reps: list[AgentRep] = []
    with EtcdServer(data_dir=str(workdir / "etcd")) as etcd:
        for i in range(s.reps):
            r = run_agent_rep(etcd, workdir, i, s)
            progress(f"rep {i + 1}/{s.reps}: crash_detect {fmt(r.crash_detect_s)} s, drain {fmt(r.drain_s)} s "
                     f"(step {fmt(r.drain_step_time_s, 4)} s), node_loss {fmt(r.node_loss_recovery_s)} s, "
                     f"steps_lost {r.steps_lost}" + (f", ERROR {r.error}" if r.error else ""))
            reps.append(r)

    def spread(name: str) -> list[float]:
        return sorted(v for v in (getattr(r, name) for r in reps) if v is not None)

    figures = {
        "crash_detect_s": median_of(r.crash_detect_s for r in reps),
        "node_loss_recovery_s": median_of(r.node_loss_recovery_s for r in reps),
        "drain_s": median_of(r.drain_s for r in reps),
        "drain_step_time_s": median_of(r.drain_step_time_s for r in reps),
        "steps_lost": sum(r.steps_lost for r in reps),
    }
    return {
        "benchmark": "agent",
        "settings": {**asdict(s), "workload": f"{WORKLOAD} (one worker per agent)", "torch": dist_version("torch")},
        "figures": figures,
        "targets": AGENT_TARGETS,
        "spread": {k: spread(k) for k in ("crash_detect_s", "node_loss_recovery_s", "drain_s")},
        "reps": [asdict(r) for r in reps],
        "errors": [r.error for r in reps if r.error],
        "violations": [v for r in reps for v in r.violations],
    }


def render_agent(result: Mapping[str, object]) -> str:
    fig, spread, s = result["figures"], result["spread"], result["settings"]
    assert isinstance(fig, dict) and isinstance(spread, dict) and isinstance(s, dict)
    ttl = float(s["lease_ttl_s"])
    step = fig["drain_step_time_s"]
    rows = [
        ("crash_detect_s", "SIGKILL of a worker -> next generation published", "<= 0.2"),
        ("node_loss_recovery_s", "SIGKILL of an agent + its worker -> survivors' next commit", f"<= {ttl + 1:g}"),
        ("drain_s", "SIGTERM of an agent -> first commit at the smaller size",
         f"<= {2 * step + 1:.3f}" if isinstance(step, float) else "<= 2 steps + 1"),
    ]
    lines = [f"elasticd agent benchmark: {s['nodes']} agents x 1 worker, {s['reps']} reps, lease TTL {ttl:g} s, "
             f"keepalive {s['keepalive_s']:g} s, step sleep {s['step_sleep_s']:g} s", "",
             f"{'figure':<22} {'median':>8}  {'spread':<17} {'target':<10} what"]
    for name, what, target in rows:
        values = spread.get(name) or []
        rng = f"{values[0]:.3f}..{values[-1]:.3f}" if values else "-"
        lines.append(f"{name:<22} {fmt(fig[name]):>8}  {rng:<17} {target:<10} {what}")
    lines.append(f"{'drain_step_time_s':<22} {fmt(step, 4):>8}  {'':<17} {'':<10} median step time before the drain")
    lines.append(f"{'steps_lost':<22} {fig['steps_lost']!s:>8}  {'':<17} {'0':<10} by the audit checker, over every fault")
    errors, violations = result["errors"], result["violations"]
    assert isinstance(errors, list) and isinstance(violations, list)
    lines += [f"ERROR {e}" for e in errors] + [f"VIOLATION {v}" for v in violations]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    """``agent``'s flags."""
    d = AgentBenchSettings()
    p.add_argument("--reps", type=int, default=d.reps, help="repetitions (default %(default)s)")
    p.add_argument("--lease-ttl", type=float, default=d.lease_ttl_s, help="the agents' --lease-ttl-s (default %(default)s)")
    p.add_argument("--keepalive", type=float, default=d.keepalive_s, help="the agents' --keepalive-s (default %(default)s)")
    p.add_argument("--step-sleep", type=float, default=d.step_sleep_s, help="the workers' --step-sleep (default %(default)s)")


def run_cmd(args: argparse.Namespace) -> int:
    """``agent``: run it, print the figures; 1 when a repetition failed or a step was lost."""
    s = AgentBenchSettings(reps=args.reps, lease_ttl_s=args.lease_ttl, keepalive_s=args.keepalive,
                           step_sleep_s=args.step_sleep)
    s.timeouts()  # validates the TTL/keepalive pair before anything starts
    return run_subcommand(args, "elasticd-bench-agent-", lambda workdir: run_agent_bench(s, workdir, progress),
                          render_agent)
