"""One job of the default workload under real ``elasticd`` agents, for the agent benchmarks
(``bench.agent``, ``bench.spares``): its settings, the agents it starts (each node's worker appends
to ``<node>.jsonl``), the commits it reads back and the generations it watches in etcd.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    lost_steps,
)
from elasticd.config import EtcdConfig, RetryPolicy
from elasticd.errors import ElasticdError
from elasticd.testing.audit import check_dir
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import WorkerProcess, agent_program, python_program
from elasticd.wire.keys import Keys
from elasticd.wire.records import decode_generation
from elasticd.wire.snapshot import parse_snapshot

SETTLE_STEPS = 15  # steps committed at a world size before the next fault


@dataclass(frozen=True)
class AgentBenchSettings(LeaseSettings):
    """What ``agent`` runs (the lease is passed to the agents as flags)."""

    reps: int = 5
    nodes: int = 3
    step_sleep_s: float = 0.02
    spare_reps: int = 5  # repetitions of the warm-spare figures, each with spares and without (0: none)
    relay: str = "on"  # the agents' relay: on (their default), off, or both (each repetition once each way)
    relay_on: bool = True  # this job's agents run their node relay (one etcd lease per node)


class GenerationWatch:
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


class AgentJob:
    """One job under ``nodes`` agents; each node's worker appends to ``<node>.jsonl``."""

    def __init__(
        self, etcd: EtcdServer, workdir: Path, job_id: str, s: AgentBenchSettings, workload: tuple[str, ...] = ()
    ) -> None:
        """``workload``: more flags of the workers' program (``agents/mlp.py``)."""
        from elasticd.store.etcd import EtcdClient

        self.etcd, self.dir, self.job_id, self.s = etcd, workdir, job_id, s
        self.workload = workload
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_file = self.dir / "elasticd.toml"
        self.config_file.write_text("# settings come from flags\n")
        self.keys = Keys(EtcdConfig().prefix, job_id)
        self.store = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,)), s.timeouts(), RetryPolicy(etcd_attempts=2))
        self.watch = GenerationWatch(self.store, self.keys)
        self.agents: dict[str, WorkerProcess] = {}
        self.tails: dict[str, Tail] = {}
        self.commits: list[Record] = []  # every node's commit lines, in the order read
        self.by_node: dict[str, list[Record]] = {}  # each node's commit lines
        self.expected_gone: set[str] = set()  # nodes whose agent the bench stopped on purpose

    def start(
        self, node: str, *flags: str, prefix: Sequence[str] = (), etcd_endpoint: str | None = None
    ) -> WorkerProcess:
        """Start ``node``'s agent (``flags``: more of its own, such as ``--spares 1``); ``prefix`` runs
        it elsewhere (``ip netns exec``), where etcd is ``etcd_endpoint`` (default: its loopback one)."""
        audit = self.dir / f"{node}.jsonl"
        program = python_program(
            WORKLOAD,
            "--steps",
            "1000000",
            "--step-sleep",
            str(self.s.step_sleep_s),
            "--audit",
            str(audit),
            *self.workload,
        )
        argv = agent_program(
            "--config",
            str(self.config_file),
            "--etcd",
            etcd_endpoint or self.etcd.endpoint,
            "--job-id",
            self.job_id,
            "--node-id",
            node,
            "--nnodes",
            f"1:{self.s.nodes}",
            "--nproc-per-node",
            "1",
            "--backend",
            "gloo",
            "--lease-ttl-s",
            str(self.s.lease_ttl_s),
            "--keepalive-s",
            str(self.s.keepalive_s),
            "--relay",
            "true" if self.s.relay_on else "false",
            *flags,
            "--",
            *program,
        )
        agent = WorkerProcess([*prefix, *argv], {}, self.dir / f"agent-{node}.log", new_session=True).start()
        self.agents[node] = agent
        self.tails[node] = Tail(audit)
        return agent

    def poll(self) -> None:
        for node, tail in self.tails.items():
            new = [r for r in tail.read_new() if r.get("event") == "commit"]
            self.commits.extend(new)
            self.by_node.setdefault(node, []).extend(new)

    def wait_for(self, cond: Callable[[], bool], what: str, timeout: float = PHASE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.poll()
            if cond():
                return
            for node, a in self.agents.items():
                if not a.alive() and node not in self.expected_gone:
                    raise BenchError(
                        f"agent {node} exited {a.proc.returncode if a.proc else '?'} while "
                        f"waiting for {what}; see {a.log_path}"
                    )
            time.sleep(POLL_S)
        raise BenchError(f"timed out after {timeout:g} s waiting for {what}")

    def commits_since(self, t: float, world: int | None = None) -> list[Record]:
        return [
            r
            for r in self.commits
            if float(r["t"]) > t  # type: ignore[arg-type]
            and (world is None or r["world_size"] == world)
        ]

    def generation(self) -> int:
        return max((int(r["generation"]) for r in self.commits), default=0)  # type: ignore[call-overload]

    def worker_pid(self, node: str) -> int:
        """The pid of ``node``'s one worker in the current generation (not a waiting spare)."""
        snap = parse_snapshot(self.keys, self.store.get_prefix(self.keys.prefix))
        training = set(snap.generation.members) if snap.generation else set()
        pids = [m.pid for mid, m in snap.members.items() if m.node == node and mid in training]
        if len(pids) != 1:
            raise BenchError(f"expected one member of node {node} in etcd, found {pids}")
        return pids[0]

    def audit(self) -> tuple[int, list[str]]:
        """Committed steps lost or repeated, and the audit checker's violations, over every node's log."""
        rep = check_dir(self.dir, DATASET_SIZE)
        return lost_steps(rep), list(rep.violations)

    def stop(self) -> None:
        self.watch.stop()
        for a in self.agents.values():
            a.stop()
        self.store.close()


def steps_at(commits: list[Record], world: int) -> set[int]:
    return {int(r["step"]) for r in commits if r["world_size"] == world}  # type: ignore[call-overload]


def step_time(commits: list[Record], world: int) -> float | None:
    """Median time between consecutive committed steps at ``world`` (first commit line of each step)."""
    first: dict[int, float] = {}
    for r in commits:
        if r["world_size"] == world:
            first.setdefault(int(r["step"]), float(r["t"]))  # type: ignore[call-overload, arg-type]
    steps = sorted(first)
    deltas = [first[b] - first[a] for a, b in zip(steps, steps[1:]) if b == a + 1]
    return statistics.median(deltas[-50:]) if deltas else None
