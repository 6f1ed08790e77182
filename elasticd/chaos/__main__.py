"""``python -m elasticd.chaos``: the command line and the executor of a chaos run.

Owns ``ChaosRun``, the I/O of one run: it starts etcd and the agents, measures the warm-up,
injects the faults ``choose_fault`` picks, samples ``elasticctl status``, follows the audit files
and the processes, stops everything it started (by PID, or by the process group it created) on
every way out (a checkpoint filesystem it faulted restored and unmounted), and gathers the
``Evidence``; ``run_bug``, the bug scenario over a ``ChaosRun``; and ``main``: the flags, the netns
hosts, the checkpoint filesystem, the report. The decisions are the pure modules' (``schedule``,
``judge``, ``kinds_judge``, ``bug``, ``ettr``, ``report``); it holds no training, rendezvous or
supervision logic. Nothing imports it.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import io
import json
import math
import os
import random
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import TextIO

from elasticd.chaos.ckptfs import CheckpointFs, complete_checkpoints
from elasticd.chaos.ckptfs import unusable_here as no_mount_here
from elasticd.chaos.evidence import (
    AgentEnd,
    CheckpointFault,
    Evidence,
    FaultRecord,
    LinkDown,
    Mark,
    StatusSample,
    Window,
    WorkerLife,
    discarded_steps,
    membership_closed_times,
    parse_commits,
    parse_finals,
    parse_marks,
    traceback_hits,
)
from elasticd.chaos.bug import BugEvidence, bug_timestamp, judge_bug, render_bug
from elasticd.chaos.judge import judge
from elasticd.chaos.netns import (
    IP_TIMEOUT_S,
    NETNS_HOST_BASE,
    NETNS_MAX_HOSTS,
    NETNS_NET,
    NetnsHost,
    NetnsHosts,
    NetnsPlan,
    host_index,
    ip_addresses_and_routes,
    netns_plan,
    subnets_in_use,
    unusable_here,
    use_netns,
)
from elasticd.chaos.report import Report, render_table, report_to_dict
from elasticd.chaos.schedule import (
    CHECKPOINT_EVERY_STEPS,
    CHECKPOINT_FAULT_S,
    KIND_NAMES,
    KINDS,
    LINK_FLAP_CYCLES,
    LINK_FLAP_DOWN_S,
    LINK_FLAP_UP_S,
    HANG_TIMEOUT_S,
    NAN_GRAD_STEPS,
    STEP_OVERHEAD_S,
    STRAGGLER_DUTY_S,
    STRAGGLER_FAULT_S,
    TIMEOUTS,
    Choice,
    ClusterView,
    FaultKind,
    NodeView,
    Place,
    Settings,
    choose_fault,
    make_settings,
    mix_weights,
    next_delay,
    no_hang,
    no_poison,
    parse_args,
    relayed,
    skipped_kinds,
)
from elasticd.errors import ConfigError
from elasticd.testing.audit import as_float, as_int
from elasticd.testing.audit import check as audit_check
from elasticd.testing.etcd import EtcdCluster, EtcdServer
from elasticd.testing.localcluster import (
    AuditTail,
    log_events,
    duty_cycle,
    WorkerProcess,
    group_pids,
    local_agent_argv,
    process_state,
    python_program,
    signal_pid,
)
from elasticd.testing.runner import make_workdir, run_to_exit

JOB_ID = "chaos"
SAMPLES = 2048  # the workload's dataset size; the audit checks every epoch against it
GLOBAL_BATCH = 64
TICK_S = 0.1  # how often the loop polls the audit files, the processes and the clock
STATUS_EVERY_S = 5.0  # an `elasticctl status --json` sample this often during the faults
PROGRESS_EVERY_S = 10.0  # one progress line this often
STARTUP_BOUND_S = 150.0  # agents started -> the job trains at full size (torch imports under load)
STUCK_S = 60.0  # no commit for this long during the faults: stop injecting
AGENT_EXIT_WAIT_S = 30.0  # after the last step: how long the agents get to exit
DUPLICATE_BOUND_S = 20.0  # an agent with an existing node's id must have exited by then
ETCD_READY_BOUND_S = 30.0  # a restarted etcd must answer by then
BUG_BOUND_S = 240.0  # --scenario bug: agents started -> every agent exited (the start, S steps, the stop)
GROW_BOUND_S = 90.0  # warm-up: one more agent started -> a commit at the bigger world size by then
NAN_BUSY_S = 5.0  # after nan_grads, no fault on its node for this long: its poisoned steps pass first
FLAP_JOIN_S = 2 * IP_TIMEOUT_S  # a flapping link's thread has ended by then once its cycles are over


# ---------------------------------------------------------------------------------------------
# The executor


class Phase(StrEnum):
    STARTING = "starting"
    WARMUP = "warmup"  # measuring the fault-free step time at one world size
    GROWING = "growing"  # warm-up: one more agent started, waiting for commits at the next size
    FAULTS = "faults"
    FINISHING = "finishing"


@dataclass
class Node:
    """One agent process (a node, or a duplicate of one) and what the run did to it."""

    name: str
    proc: WorkerProcess
    expected: str = ""  # "" finish, "killed", "drain", "sigterm", "duplicate"
    busy_until: float = 0.0  # monotonic: a fault is in flight on it until then
    leaving: bool = False  # drained or SIGTERMed: it goes, and is replaced once it exited
    code: int | None = None
    replaced: bool = False
    log_offset: int = 0  # where this process's lines begin in its log (a node's restarts share one)
    message: str = ""  # its last log line when it exited

    def last_line(self) -> str:
        """The last line this agent process (or its workers) wrote to its log."""
        try:
            with self.proc.log_path.open("rb") as f:
                f.seek(self.log_offset)
                text = f.read().decode(errors="replace")
        except OSError:
            return ""
        lines = [ln for ln in text.splitlines() if ln.strip()]
        return lines[-1] if lines else ""


@dataclass
class Timed:
    due: float  # monotonic
    what: str
    action: Callable[[], None]


@dataclass
class Life:
    node: str
    seen_t: float = field(default_factory=time.time)  # first seen (a reused pid starts a new life)
    registered_t: float | None = None
    ended_t: float | None = None
    paused: list[list[float]] = field(default_factory=list)
    cut_off: list[list[float]] = field(default_factory=list)  # [link down, link up]
    rejoining: list[list[float]] = field(default_factory=list)  # [link up or hung, next sync line seen or end]

    def close_open(self, windows: list[list[float]], t: float) -> None:
        if windows and windows[-1][1] == math.inf:
            windows[-1][1] = t


class ChaosRun:
    """One run in ``workdir``: etcd, the agents, the faults, the evidence."""

    def __init__(
        self,
        settings: Settings,
        workdir: Path,
        say: Callable[[str], None],
        net: NetnsHosts | None = None,
        ckptfs: CheckpointFs | None = None,
    ) -> None:
        self.s = settings
        self.net = net
        self.ckptfs = ckptfs  # the checkpoint filesystem (settings.checkpoints)
        self.link_downs: list[list[object]] = []  # [node, start, end (inf while down)], wall clock
        self.link_flaps: list[list[object]] = []  # [node, first down, last up (inf while flapping)]
        self.flappers: dict[str, tuple[threading.Thread, threading.Event, list[str]]] = {}  # node -> its flap
        self.ckpt_faults: list[CheckpointFault] = []  # closed ones; the open one in ckpt_open
        self.ckpt_open: CheckpointFault | None = None
        self.workdir = workdir
        self.audit_root = workdir / "audit"
        # one file per node (<node>.jsonl), or with replica_size > 1 per worker (the agents' --audit-dir:
        # <job>/<node>.<local rank>.jsonl)
        self.audit_dir = self.audit_root / JOB_ID if settings.replica_size > 1 else self.audit_root
        self.config_file = workdir / "elasticd.toml"
        self._say = say
        self.rng = random.Random(settings.seed)
        self.started_mono = time.monotonic()
        self.started_t = time.time()
        self.etcd_members: list[EtcdServer] = []
        self.cluster: EtcdCluster | None = None
        self.nodes: list[Node] = []
        self.timed: list[Timed] = []
        self.faults: list[FaultRecord] = []
        self.down: list[Window] = []
        self.down_since: float | None = None  # wall: etcd (or quorum) lost, not back yet
        self.etcd_busy_until: float | None = None  # monotonic; None: no etcd fault in flight
        self.samples: list[StatusSample] = []
        self.lives: dict[int, Life] = {}  # each pid's current (or last) life
        self.past_lives: list[tuple[int, Life]] = []  # ended lives whose pid the kernel gave out again
        self.problems: list[str] = []
        self.tail = AuditTail(self.audit_dir)
        self.last_step = 0
        self.generation = self.world = 0
        self.last_commit_mono = 0.0
        self.full_world_t: float | None = None
        self.node_start: dict[str, tuple[int, bool]] = {}  # audit file -> (last start pid, synced since)
        self.phase = Phase.STARTING
        self.warmup: Window | None = None
        self.warmups: list[Window] = []  # one per world size, from nodes to max_nodes
        self.warm_world = 0  # the world size of the newest warm-up window
        self.grow_deadline = math.inf  # monotonic: GROWING must see the next size by then
        self.faulted: Window | None = None
        self._joins = settings.nodes
        self._dups = 0

    # -- output -------------------------------------------------------------------------------

    def say(self, text: str) -> None:
        self._say(f"[{time.monotonic() - self.started_mono:6.1f}s] {text}")

    def record(self, kind: FaultKind | str, target: str, detail: str = "") -> None:
        self.faults.append(FaultRecord(time.time(), str(kind), target, detail))
        self.say(f"fault {kind} on {target}{': ' + detail if detail else ''}")

    # -- processes ----------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.etcd_members]

    @property
    def agent_endpoints(self) -> list[str]:
        """Where the agents reach etcd: loopback, or on netns hosts the bridge address."""
        if self.net is None:
            return self.endpoints
        return [m.endpoint_on(self.net.plan.bridge_addr) for m in self.etcd_members]

    def start_etcd(self) -> None:
        extra = (self.net.plan.bridge_addr,) if self.net is not None else ()
        if self.s.etcd_members == 1:
            server = EtcdServer(data_dir=str(self.workdir / "etcd"), extra_hosts=extra).start()
            self.etcd_members = [server]
        else:
            self.cluster = EtcdCluster(
                self.s.etcd_members, data_root=str(self.workdir / "etcd"), extra_hosts=extra
            ).start()
            self.etcd_members = list(self.cluster.members)
        self.say(f"etcd {','.join(self.agent_endpoints)} ({len(self.etcd_members)} member(s))")

    def program(self, audit_name: str) -> list[str]:
        common = ("--steps", str(self.s.steps), "--samples", str(SAMPLES), "--step-sleep", str(self.s.step_sleep_s))
        if self.s.replica_size > 1:  # its workers' audit files: the agent's --audit-dir
            return python_program("agents/mlp_sharded.py", *common, "--global-batch", str(GLOBAL_BATCH))
        audit = ("--audit", str(self.audit_dir / f"{audit_name}.jsonl"))
        if self.s.form == "dropin":  # its own loop; the global batch follows the world size
            return python_program("agents/mlp_dropin.py", *common, *audit, "--batch-size", str(GLOBAL_BATCH // 3))
        device = ("--device", self.s.device, *(["--fp16"] if self.s.fp16 else []))
        faulty = (
            *(("--nan-steps-on-sigusr2", str(NAN_GRAD_STEPS)) if self.s.nan_poison else ()),
            *(("--hang-on-sigusr1",) if self.s.hang_fault else ()),
            *(("--raise-at-step", str(self.s.raise_at_step)) if self.s.raise_at_step else ()),
        )
        return python_program("agents/mlp.py", *common, "--global-batch", str(GLOBAL_BATCH), *audit, *device, *faulty)

    def start_agent(self, name: str, duplicate: bool = False) -> Node:
        log_name = name
        if duplicate:
            self._dups += 1
            log_name = f"{name}-dup{self._dups}"
        # a worker killed again and again is restarted again, and its node never cordoned for it: the
        # crashes are the run's own
        flags = ["--max-restarts", "1000", "--cordon-crashes", "0"]
        if self.s.hang_fault:  # a hung worker is ended (and restarted) within the run
            flags += ["--hang-timeout-s", f"{HANG_TIMEOUT_S:g}"]
        if self.s.replica_size > 1:
            k = str(self.s.replica_size)
            flags += ["--nproc-per-node", k, "--replica-size", k, "--audit-dir", str(self.audit_root)]
        flags += ["--relay", "true" if relayed(self.s.relay, host_index(name)) else "false"]
        if self.ckptfs is not None:
            flags += [
                "--checkpoint-dir",
                str(self.ckptfs.path),
                "--checkpoint-every-steps",
                str(CHECKPOINT_EVERY_STEPS),
            ]
        prefix: list[str] = []
        if self.net is not None:
            host = self.net.host(host_index(name))
            flags += ["--advertise-addr", host.addr]
            prefix = self.net.exec_prefix(host)
        argv = prefix + local_agent_argv(
            self.config_file,
            self.agent_endpoints,
            JOB_ID,
            name,
            f"{self.s.min_nodes}:{self.s.max_nodes}",
            TIMEOUTS.lease_ttl_s,
            TIMEOUTS.keepalive_s,
            self.program(log_name),
            *flags,
        )
        log_path = self.workdir / f"agent-{log_name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        proc = WorkerProcess(argv, {}, log_path, new_session=True).start()
        node = Node(name, proc, expected="duplicate" if duplicate else "", log_offset=offset)
        self.nodes.append(node)
        self.say(f"started agent {log_name} (pid {proc.pid})")
        return node

    def reap_agents(self) -> None:
        """Record the exit code of every agent that has exited since the last call (once each)."""
        for n in self.nodes:
            if n.code is None and n.proc.proc is not None and n.proc.proc.poll() is not None:
                n.code = n.proc.proc.returncode
                self.on_agent_exit(n)

    def live_nodes(self) -> list[Node]:
        """The agents still running. An agent found exited here has its exit recorded first: the run
        ends when this list is empty, and an exit seen only by ``alive()`` would reach the judge as
        "still running at the end"."""
        self.reap_agents()
        return [n for n in self.nodes if n.code is None and n.expected != "duplicate" and n.proc.alive()]

    def worker_pids(self, node: Node) -> list[int]:
        return [p for p in group_pids([node.proc.pid])[node.proc.pid] if p != node.proc.pid]

    def node_of(self, audit_name: str) -> str:
        """The node an audit file's name belongs to (``audit_names``)."""
        return audit_name.rsplit(".", 1)[0] if self.s.replica_size > 1 else audit_name

    def audit_names(self, node: str) -> list[str]:
        """The names of ``node``'s audit files: its own, or its workers' (``<node>.<local rank>``)."""
        k = self.s.replica_size
        return [node] if k == 1 else [f"{node}.{i}" for i in range(k)]

    def node_ready(self, node: Node, now: float) -> bool:
        if node.leaving or node.expected or now < node.busy_until or not node.proc.alive():
            return False
        if process_state(node.proc.pid) in (None, "T", "t", "Z"):
            return False
        pids = self.worker_pids(node)
        if len(pids) != self.s.replica_size or any(process_state(p) in (None, "T", "t", "Z") for p in pids):
            return False
        starts = [self.node_start.get(name, (0, False)) for name in self.audit_names(node.name)]
        return sorted(pid for pid, _ in starts) == sorted(pids) and all(synced for _, synced in starts)

    def unsynced(self, node: Node) -> None:
        """``node`` is ready again only once its workers synced in a new generation."""
        for name in self.audit_names(node.name):
            pid, _ = self.node_start.get(name, (0, False))
            self.node_start[name] = (pid, False)

    def view(self, now: float) -> ClusterView:
        live = self.live_nodes()
        counts: dict[FaultKind, int] = {}
        for f in self.faults:
            if f.kind in KIND_NAMES:
                counts[FaultKind(f.kind)] = counts.get(FaultKind(f.kind), 0) + 1
        dup_running = any(n.expected == "duplicate" and n.code is None for n in self.nodes)
        dup_names = {n.name for n in self.nodes if n.expected == "duplicate" and n.code is None}
        return ClusterView(
            nodes=tuple(NodeView(n.name, self.node_ready(n, now) and n.name not in dup_names) for n in live),
            queued=sum(1 for t in self.timed if t.what.startswith("replace")),
            min_nodes=self.s.min_nodes,
            max_nodes=self.s.max_nodes,
            etcd_busy=self.etcd_busy_until is not None,
            duplicate_running=dup_running,
            injected=counts,
            checkpoint_busy=self.ckpt_open is not None,
        )

    def find(self, name: str) -> Node:
        (node,) = [n for n in self.live_nodes() if n.name == name]
        return node

    # -- faults -------------------------------------------------------------------------------

    def inject(self, choice: Choice) -> None:
        now = time.monotonic()
        ttl = TIMEOUTS.lease_ttl_s
        kind = choice.kind
        node = self.find(choice.node) if choice.node is not None else None
        pids = sorted(self.worker_pids(node)) if node is not None else []
        if node is not None and len(pids) != self.s.replica_size:
            self.say(f"skipped {kind} on {node.name}: it runs {len(pids)} workers now")
            return
        # a fault hits one worker; one alone is no draw (a data-parallel run's schedule stays the seed's)
        pid = self.rng.choice(pids) if len(pids) > 1 else pids[0] if pids else 0
        if kind in (
            FaultKind.WORKER_KILL,
            FaultKind.WORKER_ABORT,
            FaultKind.STRAGGLER,
            FaultKind.NAN_GRADS,
            FaultKind.WORKER_HANG,
        ):
            assert node is not None
            self.signal_worker(kind, node, pid, now)
        elif kind is FaultKind.NODE_LOSS:
            assert node is not None
            node.expected = "killed"
            node.proc.kill_group()
            self.record(kind, node.name, f"agent pid {node.proc.pid} and its workers")
            self.later(ttl + 1.0, f"replace {node.name}", partial(self.replace, node.name))
            node.replaced = True
        elif kind is FaultKind.WORKER_STOP:
            assert node is not None
            self.pause(pid, node.name)
            node.busy_until = now + 2 * ttl + 3.0
            self.record(kind, node.name, f"worker pid {pid} for {ttl + 1:g} s")
            self.later(ttl + 1.0, f"SIGCONT worker {pid}", partial(self.resume, pid))
        elif kind is FaultKind.AGENT_STOP:
            assert node is not None
            agent = node.proc.pid
            signal_pid(agent, signal.SIGSTOP)
            node.busy_until = now + 2 * ttl + 3.0
            self.record(kind, node.name, f"agent pid {agent} for {ttl + 1:g} s")
            self.later(ttl + 1.0, f"SIGCONT agent {agent}", partial(self.resume, agent))
        elif kind in (FaultKind.ETCD_RESTART, FaultKind.ETCD_OUTAGE):
            outage = 0.0 if kind is FaultKind.ETCD_RESTART else self.s.etcd_outage_s
            for m in self.etcd_members:
                m.kill()
            self.down_since = time.time()
            self.etcd_busy_until = math.inf
            self.record(kind, "etcd", f"every member SIGKILLed; back after {outage:g} s")
            self.later(outage, "restart etcd", self.relaunch_etcd)
        elif kind in (FaultKind.ETCD_FOLLOWER_KILL, FaultKind.ETCD_LEADER_KILL):
            assert self.cluster is not None
            leader = self.cluster.leader_index()
            if leader is None:
                self.say(f"skipped {kind}: no etcd member names a leader")
                return
            if kind is FaultKind.ETCD_LEADER_KILL:
                index = leader
                self.down_since = time.time()  # no quorum until the others elect a leader
            else:
                index = self.rng.choice([i for i in range(len(self.etcd_members)) if i != leader])
            self.etcd_members[index].kill()
            self.etcd_busy_until = math.inf
            self.record(kind, f"etcd member-{index}", f"back after {self.s.etcd_outage_s:g} s")
            self.later(self.s.etcd_outage_s, f"restart etcd member-{index}", partial(self.relaunch_etcd, index))
        elif kind is FaultKind.DRAIN:
            assert node is not None
            code, out = self.elasticctl("drain", node.name, "--job", JOB_ID)
            if code == 0:
                node.leaving, node.expected = True, "drain"
            self.record(kind, node.name, f"elasticctl drain exit {code}: {out.strip()[:120]}")
        elif kind is FaultKind.AGENT_SIGTERM:
            assert node is not None
            signal_pid(node.proc.pid, signal.SIGTERM)
            node.leaving, node.expected = True, "sigterm"
            self.record(kind, node.name, f"agent pid {node.proc.pid}")
        elif kind is FaultKind.NODE_JOIN:
            name = self.new_node_name()
            if name is None:
                self.say(f"skipped {kind}: no host address left for node-{self._joins}")
                return
            self.record(kind, name)
            self.start_agent(name)
        elif kind is FaultKind.DUPLICATE_NODE:
            assert node is not None
            dup = self.start_agent(node.name, duplicate=True)
            node.busy_until = now + DUPLICATE_BOUND_S
            self.record(kind, node.name, f"second agent pid {dup.proc.pid}")
            self.later(DUPLICATE_BOUND_S, f"end duplicate {dup.proc.pid}", partial(self.end_duplicate, dup))

        elif kind is FaultKind.LINK_DOWN:
            assert node is not None
            self.cut_link(node, pid, now)
        elif kind is FaultKind.LINK_FLAP:
            assert node is not None
            self.flap_link(node, pid, now)
        elif KINDS[kind].mount:
            self.fault_checkpoints(kind)

    def cut_link(self, node: Node, pid: int, now: float) -> None:
        """link_down: the host's link down for --link-down-s, then up (``link_up``)."""
        assert self.net is not None
        ttl = TIMEOUTS.lease_ttl_s
        host = self.net.host(host_index(node.name))
        self.net.set_link(host, up=False)
        t = time.time()
        self.link_downs.append([node.name, t, math.inf])
        for p in self.worker_pids(node):
            self.life_of(p, node.name).cut_off.append([t, math.inf])
        self.unsynced(node)  # ready again once it synced in a new generation
        # Busy until it was dropped, the link came back and it rejoined (node_ready then also
        # waits for its worker's new start and sync lines).
        node.busy_until = now + self.s.link_down_s + 2 * ttl + 3.0
        self.record(
            FaultKind.LINK_DOWN, node.name, f"{host.root_veth} down for {self.s.link_down_s:g} s (worker pid {pid})"
        )
        self.later(self.s.link_down_s, f"link up {node.name}", partial(self.link_up, node.name, host))

    def flap_link(self, node: Node, pid: int, now: float) -> None:
        """link_flap: the host's link down and up LINK_FLAP_CYCLES times, on a thread of its own
        (the loop's tick is too coarse for sub-second downs); ``flap_ended`` joins it. Its workers
        may be listed by status or not from the first down until their next sync after the last up."""
        assert self.net is not None
        host = self.net.host(host_index(node.name))
        cycles_s = LINK_FLAP_CYCLES * (LINK_FLAP_DOWN_S + LINK_FLAP_UP_S)
        stop, errors = threading.Event(), []
        self.link_flaps.append([node.name, time.time(), math.inf])
        for p in self.worker_pids(node):
            self.life_of(p, node.name).rejoining.append([time.time(), math.inf])
        args = (host, LINK_FLAP_CYCLES, LINK_FLAP_DOWN_S, LINK_FLAP_UP_S, stop)
        thread = threading.Thread(target=self._flap, args=(args, errors), name="chaos-link-flap", daemon=True)
        self.flappers[node.name] = (thread, stop, errors)
        thread.start()
        node.busy_until = now + cycles_s + 2 * TIMEOUTS.lease_ttl_s + 3.0
        self.record(
            FaultKind.LINK_FLAP,
            node.name,
            f"{host.root_veth} down {LINK_FLAP_DOWN_S:g} s / up {LINK_FLAP_UP_S:g} s, {LINK_FLAP_CYCLES} times "
            f"(worker pid {pid})",
        )
        self.later(cycles_s, f"flap ends {node.name}", partial(self.flap_ended, node.name))

    def _flap(self, args: tuple[NetnsHost, int, float, float, threading.Event], errors: list[str]) -> None:
        assert self.net is not None
        try:
            self.net.flap(*args)
        except RuntimeError as exc:
            errors.append(str(exc))

    def flap_ended(self, name: str) -> None:
        """Join the flap's thread (bounded), close its window, report a failed `ip` command."""
        thread, stop, errors = self.flappers.pop(name)
        thread.join(FLAP_JOIN_S)
        if thread.is_alive():
            stop.set()
            thread.join(FLAP_JOIN_S)
            errors.append(f"its link still flapped {FLAP_JOIN_S:g} s after its last cycle")
        for d in self.link_flaps:
            if d[0] == name and d[2] == math.inf:
                d[2] = time.time()
        for e in errors:
            self.problems.append(f"link_flap on {name}: {e}")
            self.say(self.problems[-1])
        self.say(f"link of {name} stopped flapping")

    def fault_checkpoints(self, kind: FaultKind) -> None:
        """checkpoint_readonly (remount read-only) or checkpoint_full (fill it) for CHECKPOINT_FAULT_S;
        ``restore_checkpoints`` undoes it."""
        assert self.ckptfs is not None
        before = complete_checkpoints(self.ckptfs.path / JOB_ID)
        try:
            if kind is FaultKind.CHECKPOINT_READONLY:
                self.ckptfs.set_read_only(True)
                how = "remounted read-only"
            else:
                how = f"filled ({self.ckptfs.fill()} bytes)"
        except (RuntimeError, OSError) as exc:
            self.problems.append(f"{kind}: could not fault the checkpoint filesystem: {exc}")
            self.say(self.problems[-1])
            return
        self.ckpt_open = CheckpointFault(kind.value, time.time(), math.inf, before, ())
        self.record(kind, "checkpoints", f"{how} for {CHECKPOINT_FAULT_S:g} s; complete checkpoints {list(before)}")
        self.later(CHECKPOINT_FAULT_S, f"restore checkpoints ({kind})", self.restore_checkpoints)

    def restore_checkpoints(self) -> None:
        """End the checkpoint fault in flight: note the checkpoints it left, then restore the filesystem."""
        fault, self.ckpt_open = self.ckpt_open, None
        if fault is None or self.ckptfs is None:
            return
        after = complete_checkpoints(self.ckptfs.path / JOB_ID)
        try:
            if fault.kind == FaultKind.CHECKPOINT_READONLY:  # agents started meanwhile hold read-only copies
                self.ckptfs.set_read_only(False, [n.proc.pid for n in self.live_nodes()])
            else:
                self.ckptfs.free()
        except (RuntimeError, OSError) as exc:
            self.problems.append(f"{fault.kind}: could not restore the checkpoint filesystem: {exc}")
            self.say(self.problems[-1])
        self.ckpt_faults.append(dataclasses.replace(fault, end=time.time(), after=after))
        self.say(f"checkpoint filesystem restored after {fault.kind}; complete checkpoints {list(after)}")

    def signal_worker(self, kind: FaultKind, node: Node, pid: int, now: float) -> None:
        """worker_kill (SIGKILL), worker_abort (SIGABRT), straggler (a SIGSTOP/SIGCONT duty cycle),
        nan_grads (SIGUSR2: the workload's poison) or worker_hang (SIGUSR1: the workload's hang)."""
        if kind is FaultKind.WORKER_HANG:
            signal_pid(pid, signal.SIGUSR1)
            # the others leave it out within unresponsive_s while its process lives on until its agent
            # ends it: status may list it or not meanwhile
            self.life_of(pid, node.name).rejoining.append([time.time(), math.inf])
            # its agent ends it after hang_timeout_s, and it restarts (imports) and rejoins
            node.busy_until = now + 2 * HANG_TIMEOUT_S + 8.0
            self.record(kind, node.name, f"worker pid {pid} hung holding the GIL")
            return
        if kind is FaultKind.STRAGGLER:
            node.busy_until = now + STRAGGLER_FAULT_S + 1.0
            stop = time.monotonic() + STRAGGLER_FAULT_S
            args = (pid, STRAGGLER_DUTY_S, stop)
            threading.Thread(target=duty_cycle, args=args, name="chaos-straggler", daemon=True).start()
            self.record(kind, node.name, f"worker pid {pid} at half speed for {STRAGGLER_FAULT_S:g} s")
            return
        if kind is FaultKind.NAN_GRADS:
            signal_pid(pid, signal.SIGUSR2)
            node.busy_until = now + NAN_BUSY_S  # a second poison at once would make its steps in a row 4
            self.record(kind, node.name, f"worker pid {pid}: its next {NAN_GRAD_STEPS} backward passes give NaN")
            return
        signal_pid(pid, signal.SIGKILL if kind is FaultKind.WORKER_KILL else signal.SIGABRT)
        node.busy_until = now + 2.0
        self.record(kind, node.name, f"worker pid {pid}")

    def link_up(self, name: str, host: NetnsHost) -> None:
        assert self.net is not None
        try:
            self.net.set_link(host, up=True)
        except RuntimeError as exc:
            self.problems.append(f"could not bring {name}'s link up again: {exc}")
            self.say(self.problems[-1])
            return
        t = time.time()
        for d in self.link_downs:
            if d[0] == name and d[2] == math.inf:
                d[2] = t
        for life in self.lives.values():
            if life.node == name and life.cut_off and life.cut_off[-1][1] == math.inf:
                life.close_open(life.cut_off, t)
                if life.ended_t is None:
                    life.rejoining.append([t, math.inf])
        self.say(f"link of {name} up again")

    def new_node_name(self) -> str | None:
        """The id of the next new node (node_join, and the warm-up's growth); None when no host
        address is left for it."""
        if self.net is not None and self._joins >= NETNS_MAX_HOSTS:
            return None
        self._joins += 1
        return f"node-{self._joins - 1}"

    def life_of(self, pid: int, node: str) -> Life:
        """The life of the live process ``pid``: a new one when its last life ended (the kernel
        gave the pid out again: a 30-minute run starts more processes than ``pid_max`` here)."""
        life = self.lives.get(pid)
        if life is None or life.ended_t is not None:
            if life is not None:
                self.past_lives.append((pid, life))
            life = self.lives[pid] = Life(node)
        return life

    def later(self, delay_s: float, what: str, action: Callable[[], None]) -> None:
        self.timed.append(Timed(time.monotonic() + delay_s, what, action))

    def pause(self, pid: int, node: str) -> None:
        if signal_pid(pid, signal.SIGSTOP):
            self.life_of(pid, node).paused.append([time.time(), math.inf])

    def resume(self, pid: int) -> None:
        signal_pid(pid, signal.SIGCONT)
        life = self.lives.get(pid)
        if life is not None and life.paused and life.paused[-1][1] == math.inf:
            life.paused[-1][1] = time.time()

    def relaunch_etcd(self, index: int | None = None) -> None:
        for i, m in enumerate(self.etcd_members):
            if (index is None or i == index) and not m.running():
                m.launch()
        self.etcd_busy_until = time.monotonic() + ETCD_READY_BOUND_S  # closed once every member answers

    def replace(self, name: str) -> None:
        if self.phase is Phase.FINISHING and self.last_step >= self.s.steps:
            return
        self.say(f"replacing {name}")
        self.start_agent(name)

    def end_duplicate(self, dup: Node) -> None:
        if dup.proc.alive():
            self.say(
                f"the second agent for {dup.name} (pid {dup.proc.pid}) still runs after "
                f"{DUPLICATE_BOUND_S:g} s: not refused; killing its process group"
            )
            dup.proc.kill_group()

    def elasticctl(self, *args: str) -> tuple[int, str]:
        """Run ``elasticctl`` as an operator would (in this process); (exit code, what it printed)."""
        from elasticd.cli import ctl_main  # an entry point's wiring

        out, err = io.StringIO(), io.StringIO()
        code = ctl_main(["--etcd", ",".join(self.endpoints), *args], stdout=out, stderr=err)
        return code, out.getvalue() + err.getvalue()

    def sample_status(self) -> None:
        t0 = time.time()
        code, out = self.elasticctl("status", "--job", JOB_ID, "--json")
        t1 = time.time()
        try:
            data = json.loads(out.splitlines()[0])
            pids = tuple(int(m["pid"]) for m in data["members"])
            self.samples.append(StatusSample(t0, t1, pids))
        except (ValueError, KeyError, TypeError, IndexError):
            self.samples.append(StatusSample(t0, t1, (), error=f"exit {code}: {out.strip()[:200]}"))
            self.say(f"elasticctl status --json failed (exit {code}): {out.strip()[:200]}")

    # -- polling ------------------------------------------------------------------------------

    def poll(self) -> None:
        now_t = time.time()
        for audit_name, rec in self.tail.read():
            event = rec.get("event")
            if event == "start":
                member = str(rec.get("member", ""))
                pid = int(member.rsplit(".", 1)[-1]) if member.rsplit(".", 1)[-1].isdigit() else 0
                self.node_start[audit_name] = (pid, False)
                node = member.split(".", 1)[0]
                life = self.life_of(pid, node)
                # The line is written once the member is registered, but its "t" is when the worker
                # began to register (which may wait out an etcd outage): when it was seen is later.
                life.registered_t = now_t
            elif event == "sync":
                pid, _ = self.node_start.get(audit_name, (0, False))
                self.node_start[audit_name] = (pid, True)
                if pid in self.lives and self.lives[pid].node not in self.flappers:  # not while it flaps
                    self.lives[pid].close_open(self.lives[pid].rejoining, now_t)
                if self.full_world_t is None and as_int(rec["world_size"]) >= self.s.workers(self.s.nodes):
                    self.full_world_t = as_float(rec["t"])
            elif event == "commit":
                step = as_int(rec["step"])
                if step > self.last_step:
                    self.last_step = step
                    self.generation, self.world = as_int(rec["generation"]), as_int(rec["world_size"])
                    self.last_commit_mono = time.monotonic()
        groups = group_pids([n.proc.pid for n in self.nodes])
        alive: set[int] = set()
        for n in self.nodes:
            for pid in groups[n.proc.pid]:
                if pid != n.proc.pid:
                    alive.add(pid)
                    self.life_of(pid, n.name)
        for pid, life in self.lives.items():
            if life.ended_t is None and pid not in alive and process_state(pid) in (None, "Z"):
                life.ended_t = now_t
                life.close_open(life.cut_off, now_t)
                life.close_open(life.rejoining, now_t)
        self.reap_agents()
        if self.etcd_busy_until is not None or self.down_since is not None:
            self.poll_etcd()

    def on_agent_exit(self, n: Node) -> None:
        message = n.message = n.last_line()
        self.say(
            f"agent {n.name} (pid {n.proc.pid}) exited {n.code}"
            f"{' as expected (' + n.expected + ')' if n.expected else ''}"
        )
        if n.expected == "duplicate":
            verdict = "refused" if n.code not in (0, None) else "NOT refused"
            self.say(f"  duplicate {verdict}: {message[:200]}")
            return
        if n.expected in ("", "drain", "sigterm") and n.code != 0:
            self.say(f"  unexpected exit: {message[:200]}")
        finished = self.last_step >= self.s.steps
        if not n.replaced and not finished and n.expected != "killed":
            n.replaced = True
            self.later(TIMEOUTS.lease_ttl_s + 1.0, f"replace {n.name}", partial(self.replace, n.name))

    def poll_etcd(self) -> None:
        """While an etcd fault is in flight: close the down window once a quorum answers, and the
        fault once every member answers again."""
        now = time.monotonic()
        health = [m.healthy() for m in self.etcd_members]  # once: a member may come up between two looks
        if self.down_since is not None and any(health):
            self.down.append(Window(self.down_since, time.time()))
            self.say(f"etcd answers again after {self.down[-1].end - self.down[-1].start:.1f} s")
            self.down_since = None
        if all(health):
            self.etcd_busy_until = None
        elif self.etcd_busy_until is not None and now > self.etcd_busy_until:
            self.problems.append(f"etcd did not answer within {ETCD_READY_BOUND_S:g} s of its restart")
            self.say(self.problems[-1])
            self.etcd_busy_until = None

    def run_due(self) -> None:
        now = time.monotonic()
        due = [t for t in self.timed if t.due <= now]
        self.timed = [t for t in self.timed if t.due > now]
        for t in due:
            t.action()

    # -- the run ------------------------------------------------------------------------------

    def prepare(self) -> None:
        """The work directory's files, the netns hosts and the checkpoint filesystem (where the run
        has them), etcd."""
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text("# the chaos run's agents take every setting from their flags\n")
        if self.net is not None:
            self.net.setup()
        if self.ckptfs is not None:
            self.ckptfs.mount()
            self.say(
                f"checkpoints on a {self.ckptfs.path} tmpfs of the run's own, every {CHECKPOINT_EVERY_STEPS} steps"
            )
        self.start_etcd()

    def run(self) -> None:
        self.prepare()
        for i in range(self.s.nodes):
            self.start_agent(f"node-{i}")
        start_deadline = time.monotonic() + STARTUP_BOUND_S
        next_fault = next_status = 0.0
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        finish_deadline = math.inf
        finished_at: float | None = None
        while True:
            self.poll()
            self.run_due()
            now = time.monotonic()
            if now >= next_progress:
                next_progress = now + PROGRESS_EVERY_S
                v = self.view(now)
                self.say(
                    f"step {self.last_step}/{self.s.steps}  generation {self.generation}  world {self.world}  "
                    f"nodes ready {len(v.ready)}/{len(v.nodes)}  ({self.phase})"
                )
            if self.phase is Phase.STARTING:
                if self.full_world_t is not None:
                    self.begin_warmup_window(self.s.workers(self.s.nodes))
                elif now > start_deadline:
                    self.problems.append(
                        f"the job did not train at world size {self.s.workers(self.s.nodes)} within "
                        f"{STARTUP_BOUND_S:g} s"
                    )
                    self.say(self.problems[-1])
                    break
            elif self.phase in (Phase.WARMUP, Phase.GROWING):
                if self.advance_warmup(now):
                    self.phase = Phase.FAULTS
                    self.faulted = Window(time.time(), time.time() + self.s.minutes * 60.0)
                    next_fault = now + next_delay(self.rng, self.s.mean_interval_s)
                    next_status = now + STATUS_EVERY_S
                    self.say(f"faults begin at step {self.last_step} (target {self.s.steps})")
            elif self.phase is Phase.FAULTS:
                assert self.faulted is not None
                tail_steps = max(10, int(5.0 / max(self.step_estimate(), 1e-3)))
                reason = ""
                if time.time() >= self.faulted.end:
                    reason = "time is up"
                elif self.last_step >= self.s.steps - tail_steps:
                    reason = f"step {self.last_step} is near the last step {self.s.steps}"
                elif now - self.last_commit_mono > STUCK_S:
                    reason = f"no commit for {STUCK_S:g} s"
                    self.problems.append(f"the job stopped committing at step {self.last_step} for {STUCK_S:g} s")
                if reason:
                    self.phase = Phase.FINISHING
                    self.faulted = Window(self.faulted.start, time.time())
                    remaining = max(0, self.s.steps - self.last_step)
                    finish_deadline = now + remaining * self.step_estimate() * 3 + 90.0
                    self.say(
                        f"faults end ({reason}); waiting (at most {finish_deadline - now:.0f} s) for the job to finish"
                    )
                else:
                    if now >= next_fault:
                        choice = choose_fault(self.view(now), self.s.kinds, self.rng, mix_weights(self.s.mix))
                        if choice is not None:
                            self.inject(choice)
                        next_fault = now + next_delay(self.rng, self.s.mean_interval_s)
                    if now >= next_status:
                        next_status = now + STATUS_EVERY_S
                        if self.etcd_busy_until is None:
                            self.sample_status()
            elif self.phase is Phase.FINISHING:
                if self.last_step >= self.s.steps:
                    finished_at = finished_at or now
                    if not self.live_nodes() and not self.timed:
                        break
                    if now - finished_at > AGENT_EXIT_WAIT_S:
                        self.problems.append(f"agents still running {AGENT_EXIT_WAIT_S:g} s after the last step")
                        self.say(self.problems[-1])
                        break
                elif now > finish_deadline:
                    self.problems.append(
                        f"the job did not finish within {finish_deadline - now:.0f} s after the faults ended"
                    )
                    self.say(self.problems[-1])
                    break
            if self.phase is not Phase.FAULTS and self.phase is not Phase.STARTING and not self.alive_anything():
                if self.last_step < self.s.steps and not self.timed:
                    self.problems.append("every agent exited before the job finished")
                    self.say(self.problems[-1])
                    break
            time.sleep(TICK_S)
        if self.faulted is not None and self.faulted.end > time.time():
            self.faulted = Window(self.faulted.start, time.time())

    def begin_warmup_window(self, world: int) -> None:
        t = time.time()
        self.warmups.append(Window(t, t + self.s.warmup_s))
        self.warmup = self.warmups[0]
        self.warm_world = world
        self.phase = Phase.WARMUP
        self.say(f"the job trains at world size {world}; {self.s.warmup_s:g} s fault-free warm-up at this size")

    def advance_warmup(self, now: float) -> bool:
        """One tick of the warm-up (WARMUP or GROWING): a window at each world size from nodes to
        max_nodes, and between two windows one more agent, started as node_join starts one (but part
        of the warm-up, not a fault). True once the warm-up is over: every size measured, or the job
        did not grow within GROW_BOUND_S (a problem; the faults begin at the size it has)."""
        if self.phase is Phase.WARMUP:
            if time.time() < self.warmups[-1].end:
                return False
            if self.warm_world >= self.s.workers(self.s.max_nodes):
                return True
            name = self.new_node_name()
            grown = self.warm_world + self.s.replica_size
            if name is None:
                self.problems.append(f"warm-up: no host address left for a node to grow to world size {grown}")
                self.say(self.problems[-1])
                return True
            self.phase = Phase.GROWING
            self.grow_deadline = now + GROW_BOUND_S
            self.say(f"warm-up: starting {name} to measure world size {grown}")
            self.start_agent(name)
            return False
        if self.world > self.warm_world:  # the newest commit is at the bigger size
            self.begin_warmup_window(self.warm_world + self.s.replica_size)
            return False
        if now > self.grow_deadline:
            self.problems.append(
                f"warm-up: the job did not commit at world size {self.warm_world + self.s.replica_size} within "
                f"{GROW_BOUND_S:g} s of starting one more agent"
            )
            self.say(self.problems[-1])
            return True
        return False

    def alive_anything(self) -> bool:
        return any(n.proc.alive() for n in self.nodes if n.expected != "duplicate")

    def step_estimate(self) -> float:
        return self.s.step_sleep_s + STEP_OVERHEAD_S

    def stop_all(self) -> None:
        """Stop every process this run started: each agent with its workers (by process group; a
        stopped one is continued first so that it dies), and etcd (idempotent)."""
        self.reap_agents()  # an agent that exited on its own is judged by its code, not killed here
        for t in self.timed:
            if t.what.startswith("SIGCONT"):
                t.action()
        self.timed.clear()
        for name in list(self.flappers):
            self.flappers[name][1].set()
            self.flap_ended(name)
        self.restore_checkpoints()
        for n in self.nodes:
            if n.proc.proc is not None and n.code is None and n.proc.alive():
                n.proc.kill_group()
        for pid, life in self.lives.items():
            if life.paused and life.paused[-1][1] == math.inf:
                self.resume(pid)
        if self.cluster is not None:
            self.cluster.stop()
        else:
            for m in self.etcd_members:
                m.stop(remove_data=False)
        for d in self.link_downs:
            if d[2] == math.inf:
                d[2] = time.time()  # the link goes with the network below
        if self.net is not None:
            self.net.remove()
        if self.ckptfs is not None:
            self.ckptfs.remove()

    # -- the evidence -------------------------------------------------------------------------

    def evidence(self) -> Evidence:
        pairs: list[tuple[str, dict[str, object]]] = []
        for path in sorted(self.audit_dir.glob("*.jsonl")):
            for line in path.read_text(errors="replace").splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a killed worker's last line may be cut short
                if isinstance(rec, dict):
                    pairs.append((self.node_of(path.stem), rec))
        try:
            violations = tuple(audit_check([r for _, r in pairs], SAMPLES).violations)
        except (KeyError, TypeError, ValueError) as exc:
            violations = (f"audit check could not read the records: {exc!r}",)
        tracebacks: list[str] = []
        for log in sorted(self.workdir.glob("agent-*.log")):
            tracebacks += traceback_hits(log.name, log.read_text(errors="replace"))
        agents = tuple(AgentEnd(n.name, n.proc.pid, n.expected, n.code, n.message or n.last_line()) for n in self.nodes)
        left, discarded, marks = self.log_evidence()
        lives = self.worker_lives(left)
        down = list(self.down)
        if self.down_since is not None:
            down.append(Window(self.down_since, time.time()))
        return Evidence(
            target_steps=self.s.steps,
            commits=tuple(parse_commits(pairs)),
            finals=tuple(parse_finals(pairs)),
            audit_violations=violations,
            faults=tuple(self.faults),
            etcd_down=tuple(down),
            samples=tuple(self.samples),
            lives=lives,
            tracebacks=tuple(tracebacks),
            agents=agents,
            warmup=self.warmup,
            faulted=self.faulted,
            lease_ttl_s=TIMEOUTS.lease_ttl_s,
            problems=tuple(self.problems),
            end_t=time.time(),
            warmups=tuple(self.warmups),
            link_down=tuple(LinkDown(str(d[0]), as_float(d[1]), as_float(d[2])) for d in self.link_downs),
            max_world=self.s.workers(self.s.max_nodes),
            discarded=discarded,
            marks=tuple(marks),
            link_flaps=tuple(LinkDown(str(d[0]), as_float(d[1]), as_float(d[2])) for d in self.link_flaps),
            checkpoint_faults=tuple(self.ckpt_faults),
        )

    def worker_lives(self, left: dict[int, list[float]]) -> tuple[WorkerLife, ...]:
        """Every worker life the run saw, a reused pid's lives in order; ``left``: when each pid's
        memberships closed (a life takes the first at or after it was seen)."""
        return tuple(
            WorkerLife(
                pid,
                life.node,
                life.registered_t,
                life.ended_t,
                tuple(Window(a, b) for a, b in life.paused),
                tuple(Window(a, b) for a, b in life.cut_off),
                tuple(Window(a, b) for a, b in life.rejoining),
                next((t for t in left.get(pid, ()) if t >= life.seen_t), None),
                life.seen_t,
            )
            for pid, life in sorted([*self.past_lives, *self.lives.items()], key=lambda pl: (pl[0], pl[1].seen_t))
            if pid
        )

    def log_evidence(self) -> tuple[dict[int, list[float]], dict[str, int], list[Mark]]:
        """From the agents' logs (their workers' lines are in them): when the memberships of each
        pid's workers closed (oldest first), the steps discarded by reason, and the workers' marks."""
        left: dict[int, list[float]] = {}
        discarded: dict[str, int] = {}
        marks: list[Mark] = []
        for log in sorted(self.workdir.glob("agent-*.log")):
            text = log.read_text(errors="replace")
            for pid, times in membership_closed_times(text).items():
                left[pid] = sorted([*left.get(pid, []), *times])
            for reason, n in discarded_steps(text).items():
                discarded[reason] = discarded.get(reason, 0) + n
            marks += parse_marks(log.stem.removeprefix("agent-"), text)
        return left, discarded, sorted(marks, key=lambda m: m.t)


# ---------------------------------------------------------------------------------------------
# Entry point


def run_bug(run: ChaosRun, as_json: bool) -> int:
    """Start etcd and the agents, wait (at most BUG_BOUND_S) for every agent to exit, read
    ``elasticctl status --json``, judge and print; the exit code (0: every invariant held). The
    caller stops every process on every way out (``ChaosRun.stop_all``)."""
    run.prepare()
    for i in range(run.s.nodes):
        node = run.start_agent(f"node-{i}")
        node.expected, node.replaced = "bug", True  # its exit is judged here, never replaced
    deadline = time.monotonic() + BUG_BOUND_S
    while run.live_nodes() and time.monotonic() < deadline:
        run.poll()
        time.sleep(TICK_S)
    run.poll()
    code, out = run.elasticctl("status", "--job", JOB_ID, "--json")
    status: dict[str, object] | None = None
    try:
        status = json.loads(out.splitlines()[0])
    except (ValueError, IndexError):
        pass
    failures = status.get("failures") if status is not None else None
    times = [float(f["time"]) for f in failures if isinstance(f, dict)] if isinstance(failures, list) else []
    stopped: dict[str, float] = {}
    for n in run.nodes:
        stamps = [bug_timestamp(e.get("timestamp")) for e in log_events(n.proc.log_path, "agent_stopped")]
        if stamps and stamps[-1] is not None:
            stopped[n.name] = stamps[-1]
    evidence = BugEvidence(
        step=run.s.raise_at_step,
        codes={n.name: n.code for n in run.nodes},
        stopped_t=stopped,
        first_failure_t=min(times, default=None),
        status=status,
        status_error="" if status is not None else f"elasticctl status --json: exit {code}: {out.strip()[:200]}",
        last_step=run.last_step,
        lease_ttl_s=TIMEOUTS.lease_ttl_s,
    )
    invariants = judge_bug(evidence)
    text = render_bug(invariants, run.s.raise_at_step, run.s.nodes, str(run.workdir))
    (run.workdir / "report.txt").write_text(text)
    if as_json:
        obj = {"ok": all(i.ok for i in invariants), "scenario": "bug", "step": run.s.raise_at_step}
        obj["invariants"] = [{"name": i.name, "ok": i.ok, "detail": i.detail} for i in invariants]
        print(json.dumps(obj), flush=True)
    else:
        print("\n" + text, end="", flush=True)
    return 0 if all(i.ok for i in invariants) else 1


def place_here(args: argparse.Namespace, netns: bool, no_netns: str) -> Place:
    """What this run has for the kinds that need more than agents and etcd (probes a mount as root)."""
    no_mount = no_mount_here() if args.scenario == "faults" else "--scenario bug"
    return Place(
        args.etcd_members,
        "" if netns else no_netns,
        no_mount,
        no_poison(args.form, args.fp16, args.replica_size),
        no_hang(args.form, args.replica_size),
    )


def hosts(plan: NetnsPlan | None, ip: str | None, no_netns: str, say: Callable[[str], None]) -> NetnsHosts | None:
    """The network-namespace hosts of the plan (None: every node on loopback), said."""
    if plan is None or ip is None:
        say(f"hosts: every node on loopback ({no_netns}); link_down and link_flap are left out")
        return None
    net = NetnsHosts(plan, ip, say)
    atexit.register(net.remove)  # also on a way out that skips the run's finally
    say(
        f"hosts: network namespaces {plan.prefix}h<i> at {NETNS_NET}.{plan.subnet}.<{NETNS_HOST_BASE}+i>, "
        f"bridge {plan.bridge} {plan.bridge_addr}/24"
    )
    return net


def report_run(run: ChaosRun, place: Place, as_json: bool) -> int:
    """Judge the run's evidence, write report.json and report.txt, print the table (or the JSON
    object); the exit code."""
    evidence = run.evidence()
    settings, workdir = run.s, run.workdir
    skipped = skipped_kinds(settings.etcd_members, place=place)
    report = Report(settings, evidence, judge(evidence), run.started_t, str(workdir), skipped)
    (workdir / "report.json").write_text(json.dumps(report_to_dict(report), indent=1) + "\n")
    (workdir / "report.txt").write_text(render_table(report))
    if as_json:
        print(json.dumps(report_to_dict(report)), flush=True)
    else:
        print("\n" + render_table(report), end="", flush=True)
    return 0 if report.verdict.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ip = shutil.which("ip")
    pid = os.getpid()
    bug = args.scenario == "bug"
    no_netns = "--no-netns" if args.netns is False else "--scenario bug" if bug else unusable_here(pid)
    try:
        netns = use_netns(args.netns, no_netns)
        place = place_here(args, netns, no_netns)
        settings = make_settings(args, netns, place)
        plan = netns_plan(pid, subnets_in_use(ip_addresses_and_routes(ip))) if netns and ip else None
        workdir, remove = make_workdir(args.workdir, args.keep, "elasticd-chaos-")
    except ConfigError as exc:
        print(f"elasticd.chaos: {exc}", file=sys.stderr)
        return 2
    progress: TextIO = sys.stderr if args.json else sys.stdout
    log_path = workdir / "chaos.log"

    def say(text: str) -> None:
        print(text, file=progress, flush=True)
        with log_path.open("a") as f:  # kept with the work dir, for a post-mortem
            f.write(text + "\n")

    if bug:
        run = ChaosRun(settings, workdir, say)
        return run_to_exit("elasticd.chaos", partial(run_bug, run, args.json), run.stop_all, workdir, remove, say)
    say(
        f"elasticd chaos: seed {settings.seed}; faults {', '.join(k.value for k in settings.kinds)}; "
        f"{settings.steps} steps; relay {settings.relay}; work dir {workdir}"
    )
    net = hosts(plan, ip, no_netns, say)
    ckptfs = CheckpointFs(workdir / "checkpoints", say) if settings.checkpoints else None
    if ckptfs is not None:
        atexit.register(ckptfs.remove)  # also on a way out that skips the run's finally
    run = ChaosRun(settings, workdir, say, net, ckptfs)

    def body() -> int:
        try:
            run.run()
        finally:
            run.stop_all()
        return report_run(run, place, args.json)

    return run_to_exit("elasticd.chaos", body, run.stop_all, workdir, remove, say)


if __name__ == "__main__":
    sys.exit(main())
