"""Fault injection as a product: a real local job under random faults, judged from the outside.

Owns ``python -m elasticd.chaos``. It starts a real etcd (one server, or ``--etcd-members 3`` on
loopback) and ``--nodes`` real ``elasticd`` node agents, each running one worker of the default
workload ``agents/mlp.py``. A fault-free warm-up measures the fault-free step time at each world size
from ``--nodes`` to ``--max-nodes``: a window of ``--warmup-s`` at each, and between two windows one
more agent, started as ``node_join`` starts one. Then, at ``--max-nodes``, it injects faults at
random (seeded) for ``--minutes``, never taking the job below ``--min-nodes`` ready nodes, and
starting a replacement for every node it removes (a ``node_join`` at ``--max-nodes`` is a standby
beyond ``max_workers``). Run as root where ``ip netns`` works, every node is a host of its own: a
network namespace on a bridge of a private /24 that the run creates (and deletes, by name), so that
a host's link can be taken down (``link_down``). Then it lets the job finish and checks, from the
audit files, the agents' logs and ``elasticctl status`` samples only:

- every committed step 1..N was committed exactly once across all generations (a step committed in
  two generations is a repeat, a missing one is lost), and the job finished;
- the final parameters (the audit ``final`` lines) are identical on every worker that finished;
- no interval without a commit is longer than lease TTL + 2 s, except the part of it while etcd was
  down (or had no quorum) when membership had to change (a link down excuses nothing: the other
  hosts must go on without the isolated one within the bound);
- a host whose link was down was dropped (the others committed in a newer generation while it was
  cut off) and its workers rejoined after the link came back;
- ``elasticctl status --json`` lists exactly the live workers, give or take lease TTL + 1 s;
- no Python traceback appears in any agent's or worker's log;
- ``elasticd.audit.check`` finds no violation; every agent that was not killed exits 0; an agent
  started with an existing node's id is refused (exits non-zero).

It also reports ETTR: the sum, over the steps committed in the faulted phase, of the fault-free step
time at the world size each was committed at, divided by the wall time of that phase. The baseline
is per world size because every node here shares the same few cores: a bigger world is slower per
step on this machine (on a real fleet each node brings its own hardware), and that is not time lost
to faults. A size the warm-up did not measure (below ``--nodes``, after losses) takes the nearest
measured size's time, and the report says so. The old figure, every step at the step time at
``--nodes``, is reported beside it (``ettr_single_baseline``).

The decisions are pure functions (``choose_fault`` picks the next fault from a ``ClusterView`` and a
``random.Random``; ``find_stalls``, ``step_findings``, ``final_findings``, ``status_findings``,
``traceback_hits`` and ``judge`` check the invariants over parsed records;
``fault_free_step_by_world`` and ``ettr_by_world`` make the ETTR figure); ``ChaosRun`` does the
I/O. It holds no training, rendezvous or supervision logic, and it ends every process it started,
by PID or by the process group it created, on every way out.

Usage::

    python -m elasticd.chaos [--minutes 5] [--mean-interval-s 10] [--seed S] [--faults a,b,...]
                             [--nodes 3] [--min-nodes 2] [--max-nodes N] [--etcd-members 1|3]
                             [--netns|--no-netns] [--link-down-s S] [--warmup-s 10] [--json]
                             [--workdir DIR]

Exit codes: 0 every invariant held; 1 an invariant failed (or the run could not be completed);
2 bad arguments, no etcd binary, or ``--netns`` where netns hosts cannot be had; 130 interrupted.
"""

from __future__ import annotations

import argparse
import atexit
import io
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from functools import partial
from pathlib import Path
from typing import TextIO

from elasticd.config import Timeouts
from elasticd.errors import ConfigError
from elasticd.testing.audit import check as audit_check
from elasticd.testing.localcluster import (
    AuditTail,
    EtcdCluster,
    EtcdServer,
    Terminated,
    WorkerProcess,
    group_pids,
    local_agent_argv,
    make_workdir,
    process_state,
    python_program,
    signal_pid,
    sigterm_raises,
)

JOB_ID = "chaos"
SAMPLES = 2048  # the workload's dataset size; the audit checks every epoch against it
GLOBAL_BATCH = 64
# The shortest lease etcd grants with its default election settings (its minimum TTL is ~2 s).
TIMEOUTS = Timeouts(lease_ttl_s=2.0, keepalive_s=0.5)
TICK_S = 0.1                # how often the loop polls the audit files, the processes and the clock
STATUS_EVERY_S = 5.0        # an `elasticctl status --json` sample this often during the faults
PROGRESS_EVERY_S = 10.0     # one progress line this often
STARTUP_BOUND_S = 150.0     # agents started -> the job trains at full size (torch imports under load)
STUCK_S = 60.0              # no commit for this long during the faults: stop injecting
AGENT_EXIT_WAIT_S = 30.0    # after the last step: how long the agents get to exit
DUPLICATE_BOUND_S = 20.0    # an agent with an existing node's id must have exited by then
ETCD_READY_BOUND_S = 30.0   # a restarted etcd must answer by then
TRACEBACK = "Traceback (most recent call last)"
STEP_OVERHEAD_S = 0.015     # per-step cost besides --step-sleep on a small machine (for the step estimate)
REJOIN_BOUND_S = 60.0       # after its link came back, an isolated host's worker must commit again by then
GROW_BOUND_S = 90.0         # warm-up: one more agent started -> a commit at the bigger world size by then
GROW_ESTIMATE_S = 10.0      # about how long that takes on a small machine (for the step estimate)
STANDBY_NODES = 1           # node_join may start this many agents beyond max_nodes: standbys waiting for a place
IP_TIMEOUT_S = 10.0         # bound on one `ip` command
NETNS_NET = "10.213"        # the private /16 whose /24s the run's bridges use (only addresses it creates)
NETNS_HOST_BASE = 10        # host i of a run has address <subnet>.<10 + i>
NETNS_MAX_HOSTS = 240       # so host addresses stay within .10-.249


# ---------------------------------------------------------------------------------------------
# Fault kinds


class FaultKind(StrEnum):
    WORKER_KILL = "worker_kill"
    NODE_LOSS = "node_loss"
    WORKER_STOP = "worker_stop"
    AGENT_STOP = "agent_stop"
    ETCD_RESTART = "etcd_restart"
    ETCD_OUTAGE = "etcd_outage"
    ETCD_FOLLOWER_KILL = "etcd_follower_kill"
    ETCD_LEADER_KILL = "etcd_leader_kill"
    DRAIN = "drain"
    AGENT_SIGTERM = "agent_sigterm"
    NODE_JOIN = "node_join"
    DUPLICATE_NODE = "duplicate_node"
    LINK_DOWN = "link_down"


@dataclass(frozen=True)
class KindSpec:
    """What a fault kind does and what it needs before it may be injected."""

    doc: str
    removes: bool = False      # takes one node's worker out of the job for a while
    on_node: bool = False      # acts on one ready node, picked at random
    etcd: bool = False         # acts on etcd: one etcd fault at a time
    etcd_members: int = 1      # the etcd cluster size it needs
    adds: bool = False         # starts a node (below max_nodes, or up to STANDBY_NODES beyond it)
    needs_etcd: bool = False   # needs etcd up (it writes there, or its outcome means nothing without)
    netns: bool = False        # needs every node on a network-namespace host (--netns)


KINDS: Mapping[FaultKind, KindSpec] = {
    FaultKind.WORKER_KILL: KindSpec("SIGKILL one worker; its agent restarts it", removes=True, on_node=True),
    FaultKind.NODE_LOSS: KindSpec("SIGKILL an agent's process group (the agent and its workers); the same "
                                  "node is started again after lease TTL + 1 s", removes=True, on_node=True),
    FaultKind.WORKER_STOP: KindSpec("SIGSTOP one worker for lease TTL + 1 s, then SIGCONT", removes=True,
                                    on_node=True),
    FaultKind.AGENT_STOP: KindSpec("SIGSTOP one agent for lease TTL + 1 s, then SIGCONT", removes=True,
                                   on_node=True),
    FaultKind.ETCD_RESTART: KindSpec("SIGKILL etcd (every member) and start it again at once on the same data",
                                     etcd=True),
    FaultKind.ETCD_OUTAGE: KindSpec("SIGKILL etcd (every member), start it again after --etcd-outage-s",
                                    etcd=True),
    FaultKind.ETCD_FOLLOWER_KILL: KindSpec("SIGKILL an etcd follower; start it again after --etcd-outage-s",
                                           etcd=True, etcd_members=3),
    FaultKind.ETCD_LEADER_KILL: KindSpec("SIGKILL the etcd leader; start it again after --etcd-outage-s",
                                         etcd=True, etcd_members=3),
    FaultKind.DRAIN: KindSpec("elasticctl drain NODE; the node is started again after its agent exited",
                              removes=True, on_node=True, needs_etcd=True),
    FaultKind.AGENT_SIGTERM: KindSpec("SIGTERM one agent (a drain); the node is started again after it exited",
                                      removes=True, on_node=True),
    FaultKind.NODE_JOIN: KindSpec("start an agent with a new node id (at max_nodes: a standby that waits for a "
                                  "place)", adds=True),
    FaultKind.DUPLICATE_NODE: KindSpec("start a second agent with an existing node's id: it must exit non-zero",
                                       on_node=True, needs_etcd=True),
    # needs_etcd: with etcd down, nobody could notice the lost host, so the fault would test nothing.
    FaultKind.LINK_DOWN: KindSpec("take a network-namespace host's link down (`ip link set VETH down`) for "
                                  "--link-down-s (> lease TTL), then up; its workers are dropped and rejoin",
                                  removes=True, on_node=True, needs_etcd=True, netns=True),
}


_KIND_NAMES = frozenset(k.value for k in FaultKind)


def kinds_possible(etcd_members: int, netns: bool = False) -> tuple[FaultKind, ...]:
    """The fault kinds that can be injected with an etcd cluster of this size, with (or without)
    network-namespace hosts."""
    return tuple(k for k, spec in KINDS.items()
                 if spec.etcd_members in (1, etcd_members) and (netns or not spec.netns))


def parse_faults(text: str | None, etcd_members: int, netns: bool = False) -> tuple[FaultKind, ...]:
    """``--faults a,b,c`` (None: every kind possible here).

    Raises:
        ConfigError: an unknown kind, or one that needs a larger etcd cluster or network namespaces.
    """
    possible = kinds_possible(etcd_members, netns)
    if text is None:
        return possible
    out: list[FaultKind] = []
    for name in (part.strip() for part in text.split(",")):
        if not name:
            continue
        try:
            kind = FaultKind(name)
        except ValueError:
            raise ConfigError(f"--faults: unknown fault kind {name!r}; "
                              f"known: {', '.join(k.value for k in FaultKind)}") from None
        if kind not in possible and KINDS[kind].netns and not netns:
            raise ConfigError(f"--faults: {name} needs network-namespace hosts (--netns: root, and `ip netns` "
                              f"works)")
        if kind not in possible:
            raise ConfigError(f"--faults: {name} needs --etcd-members {KINDS[kind].etcd_members}")
        if kind not in out:
            out.append(kind)
    if not out:
        raise ConfigError("--faults: no fault kind given")
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# The schedule (pure)


@dataclass(frozen=True)
class NodeView:
    name: str
    ready: bool  # its agent and worker run, its worker trains, and no fault is in flight on it


@dataclass(frozen=True)
class ClusterView:
    """What the scheduler knows of the cluster at one moment."""

    nodes: tuple[NodeView, ...]  # the live agents (not counting a duplicate)
    queued: int                  # replacements due to be started
    min_nodes: int
    max_nodes: int
    etcd_busy: bool              # an etcd fault is in flight (etcd or a member down)
    duplicate_running: bool
    injected: Mapping[FaultKind, int]

    @property
    def ready(self) -> tuple[str, ...]:
        return tuple(sorted(n.name for n in self.nodes if n.ready))


@dataclass(frozen=True)
class Choice:
    kind: FaultKind
    node: str | None  # the target node of an on-node kind


def allowed(kind: FaultKind, view: ClusterView) -> bool:
    """Whether ``kind`` may be injected now without taking the job below its minimum size."""
    spec = KINDS[kind]
    ready = view.ready
    if spec.on_node and not ready:
        return False
    if spec.removes and len(ready) - 1 < view.min_nodes:
        return False
    if (spec.etcd or spec.needs_etcd) and view.etcd_busy:
        return False
    # The faults begin at max_nodes (the warm-up measured every size up to it), so a join there is a
    # standby beyond max_workers: it forces no generation and takes the place of a member that leaves.
    if spec.adds and len(view.nodes) + view.queued >= view.max_nodes + STANDBY_NODES:
        return False
    return not (kind is FaultKind.DUPLICATE_NODE and view.duplicate_running)


def choose_fault(view: ClusterView, kinds: Sequence[FaultKind], rng: random.Random) -> Choice | None:
    """The next fault: a kind allowed now, among those injected least so far (so a short run covers
    every kind), picked at random; for an on-node kind, a ready node at random. None: none allowed."""
    possible = [k for k in kinds if allowed(k, view)]
    if not possible:
        return None
    least = min(view.injected.get(k, 0) for k in possible)
    kind = rng.choice(sorted(k for k in possible if view.injected.get(k, 0) == least))
    node = rng.choice(view.ready) if KINDS[kind].on_node else None
    return Choice(kind, node)


def next_delay(rng: random.Random, mean_s: float) -> float:
    """Seconds until the next fault: exponential with mean ``mean_s``, clipped to [0.1, 4] x mean."""
    return min(max(rng.expovariate(1.0 / mean_s), 0.1 * mean_s), 4.0 * mean_s)


def warmup_estimate_s(warmup_s: float, nodes: int, max_nodes: int) -> float:
    """About how long the warm-up lasts: a window at each world size from ``nodes`` to
    ``max_nodes``, and the growth by one node between two."""
    sizes = max_nodes - nodes + 1
    return warmup_s * sizes + GROW_ESTIMATE_S * (sizes - 1)


def estimate_steps(step_sleep_s: float, seconds: float) -> int:
    """Steps a fault-free job of this workload commits in ``seconds`` on a small machine."""
    return max(50, math.ceil(seconds / (step_sleep_s + STEP_OVERHEAD_S)))


# ---------------------------------------------------------------------------------------------
# Network-namespace hosts: the plan (pure)


@dataclass(frozen=True)
class NetnsHost:
    """One host: a namespace, joined to the run's bridge by a veth pair."""

    index: int
    ns: str         # the namespace (`ip netns`)
    root_veth: str  # the end enslaved to the bridge, in the root namespace: `link_down` takes it down
    ns_veth: str    # the end moved into the namespace, holding ``addr``
    addr: str


@dataclass(frozen=True)
class NetnsPlan:
    """The names and addresses of one run: every name starts with ``prefix`` (``ecd<pid>``), so
    that two runs never collide and cleanup deletes by name only what this run created. Interface
    names stay within Linux's 15 characters."""

    prefix: str
    subnet: int  # the third octet: the bridge is NETNS_NET.<subnet>.1/24

    @property
    def bridge(self) -> str:
        return f"{self.prefix}b"

    @property
    def bridge_addr(self) -> str:
        return f"{NETNS_NET}.{self.subnet}.1"

    def host(self, index: int) -> NetnsHost:
        """Host ``index`` (node-<index>).

        Raises:
            ValueError: the index is outside 0..NETNS_MAX_HOSTS - 1.
        """
        if not 0 <= index < NETNS_MAX_HOSTS:
            raise ValueError(f"host index {index} outside 0..{NETNS_MAX_HOSTS - 1}")
        return NetnsHost(index, f"{self.prefix}h{index}", f"{self.prefix}r{index}", f"{self.prefix}n{index}",
                         f"{NETNS_NET}.{self.subnet}.{NETNS_HOST_BASE + index}")


def subnets_in_use(ip_output: str) -> set[int]:
    """The /24s of NETNS_NET that addresses or routes already use (``ip -o -4 addr`` and ``ip -4
    route`` output), as their third octets."""
    return {int(m) for m in re.findall(rf"\b{re.escape(NETNS_NET)}\.(\d{{1,3}})\.", ip_output) if int(m) < 256}


def netns_plan(pid: int, in_use: Iterable[int]) -> NetnsPlan:
    """The plan of the run with this pid: the first /24 not in use, starting from one picked by the
    pid (so that concurrent runs start apart).

    Raises:
        ConfigError: every /24 of NETNS_NET is in use.
    """
    used = set(in_use)
    for offset in range(254):
        subnet = 1 + (pid + offset) % 254
        if subnet not in used:
            return NetnsPlan(f"ecd{pid}", subnet)
    raise ConfigError(f"--netns: every {NETNS_NET}.X.0/24 is in use on this machine")


def host_index(node: str) -> int:
    """The host index of a node id ``node-<i>``.

    Raises:
        ValueError: not a node id of this run.
    """
    prefix, _, number = node.rpartition("-")
    if prefix != "node" or not number.isdigit():
        raise ValueError(f"not a node id of a chaos run: {node!r}")
    return int(number)


def netns_unusable(euid: int, ip_binary: str | None, probe_error: str) -> str:
    """Why network-namespace hosts cannot be made here ("" when they can)."""
    if euid != 0:
        return "not root"
    if ip_binary is None:
        return "no `ip` binary (apt-get install iproute2)"
    if probe_error:
        return f"`ip netns` does not work here: {probe_error}"
    return ""


def use_netns(flag: bool | None, unusable: str) -> bool:
    """``--netns`` / ``--no-netns`` / neither (None: on when possible) against why it is not possible.

    Raises:
        ConfigError: ``--netns`` was asked for and cannot be had.
    """
    if flag is True and unusable:
        raise ConfigError(f"--netns: {unusable}")
    return flag is not False and not unusable


def link_down_s_default(lease_ttl_s: float) -> float:
    """How long a link stays down by default: past the lease TTL (so that the host's workers are
    lost to the job) and past the stall bound (TTL + 2 s), so that the others must have gone on
    without it while it is still cut off."""
    return lease_ttl_s + 3.0


# ---------------------------------------------------------------------------------------------
# Records and invariants (pure)


@dataclass(frozen=True)
class Window:
    start: float  # wall clock, as in the audit lines
    end: float


@dataclass(frozen=True)
class LinkDown:
    """A host's link was down over [start, end] (wall clock; end = inf while still down)."""

    node: str
    start: float
    end: float


@dataclass(frozen=True)
class Commit:
    node: str
    step: int
    generation: int
    rank: int
    world_size: int
    t: float


@dataclass(frozen=True)
class Final:
    node: str
    step: int
    checksum: str


@dataclass(frozen=True)
class FaultRecord:
    t: float
    kind: str
    target: str
    detail: str = ""


@dataclass(frozen=True)
class Stall:
    start: float
    length_s: float
    excused_s: float           # the part while etcd was down and membership had to change
    generations: tuple[int, int]  # the generation of the commit before and after
    faults: tuple[str, ...]    # the faults injected just before it (and during it)

    @property
    def counted_s(self) -> float:
        return self.length_s - self.excused_s


@dataclass(frozen=True)
class StepFindings:
    last_step: int
    repeats: Mapping[int, tuple[int, ...]]  # step -> the generations that committed it
    lost: tuple[int, ...]
    generations: tuple[int, ...]


@dataclass(frozen=True)
class StatusSample:
    t0: float  # wall clock before and after the call
    t1: float
    pids: tuple[int, ...]  # the members' pids it listed
    error: str = ""


@dataclass(frozen=True)
class WorkerLife:
    pid: int
    node: str
    registered_t: float | None       # when its audit start line (written once registered) was seen
    ended_t: float | None            # first seen gone
    paused: tuple[Window, ...] = ()  # SIGSTOP -> SIGCONT (end = inf while stopped)
    # Its host's link down -> up (end = inf while down): its lease expires meanwhile, so status may
    # leave it out, and must once its lease is surely gone.
    cut_off: tuple[Window, ...] = ()
    # Link up -> its next sync line (it re-registers in place and joins a generation): status may
    # list it or not.
    rejoining: tuple[Window, ...] = ()
    # It left the job (drained, finished, or gave up: its membership closed and its lease was
    # revoked) while its process still ran, e.g. waiting for abandoned groups to close.
    left_t: float | None = None


def membership_closed_times(log_text: str) -> dict[int, float]:
    """pid -> wall time of the worker's first ``membership_closed`` line in an agent's log (pure)."""
    out: dict[int, float] = {}
    for line in log_text.splitlines():
        if '"membership_closed"' not in line:
            continue
        try:
            rec = json.loads(line)
            pid = int(str(rec["member"]).split(".")[2])
            t = datetime.fromisoformat(str(rec["timestamp"]).replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        out[pid] = min(t, out.get(pid, t))
    return out


@dataclass(frozen=True)
class Invariant:
    name: str
    ok: bool
    detail: str


def _int(value: object) -> int:
    assert isinstance(value, (int, float, str)), value
    return int(value)


def _float(value: object) -> float:
    assert isinstance(value, (int, float, str)), value
    return float(value)


def parse_commits(pairs: Iterable[tuple[str, Mapping[str, object]]]) -> list[Commit]:
    """The commit lines of (node, audit record) pairs."""
    return [Commit(node, _int(r["step"]), _int(r["generation"]), _int(r["rank"]), _int(r["world_size"]),
                   _float(r["t"]))
            for node, r in pairs if r.get("event") == "commit"]


def parse_finals(pairs: Iterable[tuple[str, Mapping[str, object]]]) -> list[Final]:
    return [Final(node, _int(r["step"]), str(r["checksum"])) for node, r in pairs if r.get("event") == "final"]


def step_findings(commits: Sequence[Commit]) -> StepFindings:
    """Every step 1..N committed exactly once across all generations: the repeats and the gaps."""
    gens_of: dict[int, set[int]] = {}
    for c in commits:
        gens_of.setdefault(c.step, set()).add(c.generation)
    last = max(gens_of, default=0)
    repeats = {s: tuple(sorted(g)) for s, g in sorted(gens_of.items()) if len(g) > 1}
    lost = tuple(s for s in range(1, last + 1) if s not in gens_of)
    return StepFindings(last, repeats, lost, tuple(sorted({c.generation for c in commits})))


def commit_times(commits: Sequence[Commit]) -> list[tuple[float, int]]:
    """(time, generation) of each committed (step, generation), by its first line, in time order."""
    first: dict[tuple[int, int], float] = {}
    for c in commits:
        key = (c.step, c.generation)
        first[key] = min(first.get(key, c.t), c.t)
    return sorted((t, gen) for (_, gen), t in first.items())


def _overlap(a: float, b: float, windows: Sequence[Window]) -> float:
    """Seconds of [a, b] covered by the windows (which may overlap each other)."""
    cuts = sorted((max(a, w.start), min(b, w.end)) for w in windows if w.end > a and w.start < b)
    total, reach = 0.0, a
    for s, e in cuts:
        s = max(s, reach)
        if e > s:
            total += e - s
            reach = e
    return total


# Faults that take a member out of the job: a stall after one needs a membership change.
MEMBER_REMOVING = frozenset({FaultKind.WORKER_KILL, FaultKind.NODE_LOSS, FaultKind.WORKER_STOP, FaultKind.DRAIN,
                             FaultKind.AGENT_SIGTERM, FaultKind.LINK_DOWN})


def after_etcd_returns(etcd_down: Sequence[Window], lease_ttl_s: float) -> list[Window]:
    """The etcd-down windows, each extended by a lease TTL past its end (pure): an etcd that comes
    back (restart, new leader) gives every lease its whole TTL again, so a member that died meanwhile
    is seen gone only a TTL after etcd's return, whatever anybody does."""
    return [Window(w.start, w.end + lease_ttl_s) for w in etcd_down]


def find_stalls(times: Sequence[tuple[float, int]], limit_s: float, etcd_down: Sequence[Window],
                faults: Sequence[FaultRecord], end_t: float | None = None,
                lookback_s: float | None = None) -> list[Stall]:
    """Every interval without a commit longer than ``limit_s``, in time order.

    Args:
        times: (time, generation) of the commits, in time order (``commit_times``).
        limit_s: the longest interval allowed (lease TTL + 2 s).
        etcd_down: when etcd was down or had no quorum (pass ``after_etcd_returns`` of them to
            count the lease TTL etcd gives back at its return). Such time is excused only when
            membership had to change: the commit after the stall is in another generation than the
            one before, or a fault that takes a member out came just before or during the stall.
        faults: what was injected; each stall names those within ``lookback_s`` before it or during it.
        end_t: the end of the run when the job did not finish: the time after the last commit counts.
        lookback_s: default ``limit_s``.
    """
    back = limit_s if lookback_s is None else lookback_s
    spans = [(a, b, ga, gb) for (a, ga), (b, gb) in zip(times, times[1:], strict=False)]
    if end_t is not None and times and end_t > times[-1][0]:
        spans.append((times[-1][0], end_t, times[-1][1], -1))
    out = []
    for a, b, ga, gb in spans:
        if b - a <= limit_s:
            continue
        removing = any(f.kind in MEMBER_REMOVING and a - back <= f.t <= b for f in faults)
        excused = _overlap(a, b, etcd_down) if gb != ga or removing else 0.0
        near = tuple(f"{f.kind}({f.target})" for f in faults if a - back <= f.t <= b)
        out.append(Stall(a, b - a, excused, (ga, gb), near))
    return out


def final_findings(finals: Sequence[Final], last_step: int) -> list[str]:
    """Problems with the final parameters: workers that left at the same step differ, or no worker
    finished at the last step."""
    by_step: dict[int, set[str]] = {}
    for f in finals:
        by_step.setdefault(f.step, set()).add(f.checksum)
    out = [f"workers that ended at step {step} hold different parameters: {sorted(sums)}"
           for step, sums in sorted(by_step.items()) if len(sums) > 1]
    if last_step and last_step not in by_step:
        out.append(f"no worker wrote a final line at the last step {last_step}")
    return out


def status_findings(samples: Sequence[StatusSample], lives: Sequence[WorkerLife], slack_s: float,
                    seen_margin_s: float = 0.5, etcd_down: Sequence[Window] = ()) -> list[str]:
    """Where ``elasticctl status`` disagreed with the live workers by more than ``slack_s``.

    At a sample taken over [t0, t1], a worker registered before t0 - slack, alive until after t1 and
    not stopped (or cut off by a link down) since t0 - slack must be listed; one gone, or stopped
    (or cut off) the whole time, since before t0 - slack must not be; every listed pid must be a
    worker of this run. ``seen_margin_s`` covers the delay with which a death is seen (the loop
    polls).
    """
    out = []
    known = {w.pid: w for w in lives}
    for s in samples:
        if s.error:
            continue
        listed = set(s.pids)
        since = s.t0 - slack_s
        for w in lives:
            alive = ((w.ended_t is None or w.ended_t > s.t1 + seen_margin_s)
                     and (w.left_t is None or w.left_t > s.t1 + seen_margin_s))
            out_of_reach = (*w.paused, *w.cut_off)
            paused = any(p.end >= since and p.start <= s.t1 for p in (*out_of_reach, *w.rejoining))
            if (w.registered_t is not None and w.registered_t <= since and alive and not paused
                    and w.pid not in listed):
                out.append(f"at {s.t0:.1f}: worker {w.node} pid {w.pid} is live (registered "
                           f"{s.t0 - w.registered_t:.1f} s before) but not listed")
            # A worker that left while etcd was down keeps its lease (no revoke could land) until a
            # TTL after etcd's return: listing it meanwhile is right (``etcd_down`` is extended so).
            lease_kept = any(d.start <= s.t1 and d.end + slack_s >= s.t0 for d in etcd_down)
            gone = not lease_kept and ((w.ended_t is not None and w.ended_t <= since) or any(
                p.start <= since and p.end >= s.t1 for p in out_of_reach))
            if gone and w.pid in listed:
                out.append(f"at {s.t0:.1f}: worker {w.node} pid {w.pid} is listed but gone or stopped "
                           f"for more than {slack_s:g} s")
        for pid in sorted(listed - set(known)):
            out.append(f"at {s.t0:.1f}: status lists pid {pid}, which is no worker of this run")
    return out


def link_down_findings(downs: Sequence[LinkDown], commits: Sequence[Commit], rejoin_bound_s: float,
                       etcd_down: Sequence[Window] = ()) -> list[str]:
    """Problems with each link down: the isolated host must be dropped (the other hosts commit, in a
    newer generation than its last one before the cut, while its link is still down) and must rejoin
    (a commit of its own after the link came back, within ``rejoin_bound_s`` unless the job ended
    sooner). A stall on the isolated host itself is expected and not looked for. The host cannot be
    dropped while etcd is down, nor before a TTL after etcd's return (``after_etcd_returns``): a
    link down that overlaps such a window need not see the others go on."""
    out = []
    last_t = max((c.t for c in commits), default=0.0)
    for d in downs:
        if d.end == math.inf:
            out.append(f"{d.node}: its link was still down at the end")
            continue
        before = [c.generation for c in commits if c.node == d.node and c.t <= d.start]
        newer_than = max(before, default=-1)
        went_on = any(c.node != d.node and d.start < c.t <= d.end and c.generation > newer_than for c in commits)
        etcd_bound = any(w.start <= d.end and w.end >= d.start for w in etcd_down)
        if not went_on and not etcd_bound and last_t > d.end:
            out.append(f"{d.node}: the other hosts did not go on without it while its link was down "
                       f"({d.end - d.start:.1f} s)")
        back = [c.t for c in commits if c.node == d.node and c.t > d.end]
        if back:
            if back[0] - d.end > rejoin_bound_s:
                out.append(f"{d.node}: rejoined {back[0] - d.end:.1f} s after its link came back "
                           f"(bound {rejoin_bound_s:g} s)")
        elif last_t > d.end + rejoin_bound_s:
            out.append(f"{d.node}: did not rejoin after its link came back (the job went on for "
                       f"{last_t - d.end:.1f} s)")
    return out


def traceback_hits(name: str, text: str) -> list[str]:
    """Each Python traceback in a log (plain, or inside a JSON line's ``exception``), as
    ``name:line: what``."""
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if TRACEBACK not in line:
            continue
        what = line.strip()[:160]
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and isinstance(rec.get("exception"), str):
            last = rec["exception"].strip().splitlines()[-1:]
            what = f"event {rec.get('event')!r}: {last[0][:160] if last else ''}"
        else:
            for later in lines[i + 1:i + 200]:
                if later and not later[0].isspace() and TRACEBACK not in later:
                    what = later.strip()[:160]
                    break
        out.append(f"{name}:{i + 1}: {what}")
    return out


def fault_free_step_s(times: Sequence[tuple[float, int]], start: float, end: float) -> float | None:
    """Mean seconds per committed step over [start, end] (the warm-up); None with fewer than 2."""
    inside = [t for t, _ in times if start <= t <= end]
    if len(inside) < 2:
        return None
    return (inside[-1] - inside[0]) / (len(inside) - 1)


def ettr(steps: int, step_s: float | None, wall_s: float) -> float | None:
    """Effective training time ratio: committed steps x fault-free step time / wall time."""
    if step_s is None or wall_s <= 0:
        return None
    return steps * step_s / wall_s


def first_commits(commits: Sequence[Commit]) -> dict[int, Commit]:
    """step -> its first commit line (the earliest: a step committed again, by another rank or in
    another generation, counts once, at the generation and world size it was first committed in)."""
    out: dict[int, Commit] = {}
    for c in commits:
        if c.step not in out or c.t < out[c.step].t:
            out[c.step] = c
    return out


def fault_free_step_by_world(commits: Sequence[Commit], windows: Sequence[Window]) -> dict[int, float]:
    """world size -> mean seconds per step in the warm-up ``windows``, by the commit lines' world size.

    Each pair of consecutive steps whose first commits both fall in one window, in one generation
    at one world size, gives one step time of that size (a regroup between two generations is no
    step time). A world size with no such pair is absent.
    """
    first = first_commits(commits)
    sums: dict[int, tuple[float, int]] = {}
    for step, c in first.items():
        prev = first.get(step - 1)
        if prev is None or (prev.generation, prev.world_size) != (c.generation, c.world_size):
            continue
        if any(w.start <= prev.t and c.t <= w.end for w in windows):
            total, n = sums.get(c.world_size, (0.0, 0))
            sums[c.world_size] = (total + c.t - prev.t, n + 1)
    return {world: total / n for world, (total, n) in sorted(sums.items())}


def baseline_world(world: int, measured: Iterable[int]) -> int | None:
    """The measured world size whose fault-free step time stands for ``world``: itself, else the
    nearest (the smaller on a tie; below ``--nodes`` nothing is measured, so the smallest measured
    size stands for it). None: nothing was measured."""
    return min(measured, key=lambda m: (abs(m - world), m), default=None)


def steps_by_world(commits: Sequence[Commit], window: Window) -> dict[int, int]:
    """world size -> the steps first committed within ``window`` at that size (each step once)."""
    out: dict[int, int] = {}
    for c in first_commits(commits).values():
        if window.start <= c.t <= window.end:
            out[c.world_size] = out.get(c.world_size, 0) + 1
    return dict(sorted(out.items()))


def ettr_by_world(steps: Mapping[int, int], step_s: Mapping[int, float], wall_s: float) -> float | None:
    """ETTR with a fault-free step time per world size: the sum, over the committed steps, of the
    fault-free step time at each one's world size (``baseline_world`` for a size not measured),
    divided by the wall time. None: nothing was measured, or no wall time."""
    if not step_s or wall_s <= 0:
        return None
    total = 0.0
    for world, n in steps.items():
        used = baseline_world(world, step_s)
        assert used is not None  # step_s is not empty
        total += n * step_s[used]
    return total / wall_s


@dataclass(frozen=True)
class AgentEnd:
    """How one agent process ended, and how it was meant to."""

    node: str
    pid: int
    expected: str          # "" finish, "killed", "drain", "sigterm", "duplicate"
    code: int | None       # None: still running when the run ended (then it was killed)
    message: str = ""      # the last line of its log


def agent_findings(ends: Sequence[AgentEnd]) -> tuple[list[str], list[str]]:
    """(agents that should have exited 0 and did not, duplicates that were not refused)."""
    bad, dup = [], []
    for a in ends:
        if a.expected == "duplicate":
            if a.code is None or a.code == 0:
                how = "still running after its bound" if a.code is None else "exited 0"
                dup.append(f"second agent for {a.node} (pid {a.pid}) was not refused: {how}")
            elif a.node not in a.message:
                dup.append(f"second agent for {a.node} (pid {a.pid}) exited {a.code} without naming the "
                           f"node id: {a.message[:160]}")
        elif a.expected != "killed" and a.code != 0:
            how = "still running at the end" if a.code is None else f"exited {a.code}"
            bad.append(f"agent {a.node} (pid {a.pid}) {how}: {a.message[:200]}")
    return bad, dup


@dataclass(frozen=True)
class Evidence:
    """Everything the run observed, as the judge reads it."""

    target_steps: int
    commits: tuple[Commit, ...]
    finals: tuple[Final, ...]
    audit_violations: tuple[str, ...]
    faults: tuple[FaultRecord, ...]
    etcd_down: tuple[Window, ...]
    samples: tuple[StatusSample, ...]
    lives: tuple[WorkerLife, ...]
    tracebacks: tuple[str, ...]
    agents: tuple[AgentEnd, ...]
    warmup: Window | None           # the warm-up window at --nodes (the single baseline's)
    faulted: Window | None
    lease_ttl_s: float
    problems: tuple[str, ...] = ()  # what the executor could not do (a start failed, a bound passed)
    end_t: float | None = None      # the end of the run (for a job that did not finish)
    link_down: tuple[LinkDown, ...] = ()
    warmups: tuple[Window, ...] = ()  # every warm-up window, one per world size (``warmup`` first)


@dataclass(frozen=True)
class Verdict:
    invariants: tuple[Invariant, ...]
    stalls: tuple[Stall, ...]
    steps: StepFindings
    step_s: float | None            # the fault-free step time at --nodes (the single baseline)
    ettr: float | None              # by the fault-free step time at each step's world size
    faulted_steps: int
    step_s_by_world: Mapping[int, float] = field(default_factory=dict)  # measured in the warm-up
    faulted_steps_by_world: Mapping[int, int] = field(default_factory=dict)
    ettr_single: float | None = None  # every step at the fault-free step time at --nodes

    @property
    def ok(self) -> bool:
        return all(i.ok for i in self.invariants)

    @property
    def substituted(self) -> dict[int, int]:
        """world size of faulted steps with no fault-free measurement -> the measured size used."""
        out = {}
        for world in self.faulted_steps_by_world:
            used = baseline_world(world, self.step_s_by_world)
            if used is not None and used != world:
                out[world] = used
        return out


def _listed(items: Sequence[object], limit: int = 10) -> str:
    shown = ", ".join(str(i) for i in items[:limit])
    return shown + (f", ... ({len(items)} in all)" if len(items) > limit else "")


def _finals_summary(finals: Sequence[Final], last_step: int) -> str:
    at_last = sorted({f.checksum for f in finals if f.step == last_step})
    n = sum(1 for f in finals if f.step == last_step)
    earlier = sum(1 for f in finals if f.step != last_step)
    return (f"{n} worker(s) at step {last_step}: {_listed(at_last)}"
            + (f"; {earlier} that left earlier agree per step" if earlier else ""))


def judge(ev: Evidence) -> Verdict:
    """Check every invariant over the evidence of one run."""
    steps = step_findings(ev.commits)
    times = commit_times(ev.commits)
    limit = ev.lease_ttl_s + 2.0
    finished = steps.last_step >= ev.target_steps
    stalls = find_stalls(times, limit, after_etcd_returns(ev.etcd_down, ev.lease_ttl_s), ev.faults,
                         None if finished else ev.end_t)
    counted = [s for s in stalls if s.counted_s > limit]
    finals = final_findings(ev.finals, steps.last_step)
    status = status_findings(ev.samples, ev.lives, ev.lease_ttl_s + 1.0,
                             etcd_down=after_etcd_returns(ev.etcd_down, ev.lease_ttl_s))
    bad_agents, not_refused = agent_findings(ev.agents)
    inv = [
        Invariant("steps exactly once", not steps.repeats and not steps.lost,
                  f"1..{steps.last_step}, no repeat, no gap" if not steps.repeats and not steps.lost else
                  "; ".join(filter(None, [
                      f"repeated (step: generations) {_listed([f'{s}: {g}' for s, g in steps.repeats.items()])}"
                      if steps.repeats else "",
                      f"lost steps {_listed(list(steps.lost))}" if steps.lost else ""]))),
        Invariant("job finished", finished and not ev.problems,
                  "; ".join([f"committed {steps.last_step} of {ev.target_steps} steps", *ev.problems])),
        Invariant("final parameters identical", not finals, "; ".join(finals) or _finals_summary(ev.finals, steps.last_step)),
        Invariant(f"no stall > {limit:g} s", not counted,
                  f"{len(stalls)} stall(s), {len(counted)} not excused" if stalls else "none"),
        Invariant("status agrees with workers", not status,
                  "; ".join(status[:5]) if status else
                  f"{sum(1 for s in ev.samples if not s.error)} sample(s) agreed within {ev.lease_ttl_s + 1:g} s"),
        Invariant("no traceback in logs", not ev.tracebacks, "; ".join(ev.tracebacks[:5]) or "none"),
        Invariant("audit check", not ev.audit_violations, "; ".join(ev.audit_violations[:5]) or "no violation"),
        Invariant("agents exit 0", not bad_agents, "; ".join(bad_agents[:5]) or
                  f"{sum(1 for a in ev.agents if a.expected not in ('killed', 'duplicate'))} agent(s) exited 0"),
    ]
    if ev.link_down:
        isolated = link_down_findings(ev.link_down, ev.commits, REJOIN_BOUND_S,
                                      after_etcd_returns(ev.etcd_down, ev.lease_ttl_s))
        inv.append(Invariant("link down: dropped, rejoined", not isolated, "; ".join(isolated[:5]) or
                             f"{len(ev.link_down)} link down(s): the others went on, the host rejoined"))
    dups = [a for a in ev.agents if a.expected == "duplicate"]
    if dups:
        inv.append(Invariant("duplicate node refused", not not_refused, "; ".join(not_refused) or "; ".join(
            f"{a.node}: exit {a.code}: {a.message[:120]}" for a in dups[:3])))
    step_s = fault_free_step_s(times, ev.warmup.start, ev.warmup.end) if ev.warmup else None
    by_world = fault_free_step_by_world(ev.commits, ev.warmups)
    faulted_by_world: dict[int, int] = {}
    ratio = single = None
    if ev.faulted is not None:
        wall_s = ev.faulted.end - ev.faulted.start
        faulted_by_world = steps_by_world(ev.commits, ev.faulted)
        ratio = ettr_by_world(faulted_by_world, by_world, wall_s)
        single = ettr(sum(faulted_by_world.values()), step_s, wall_s)
    return Verdict(tuple(inv), tuple(stalls), steps, step_s, ratio, sum(faulted_by_world.values()),
                   by_world, faulted_by_world, single)


# ---------------------------------------------------------------------------------------------
# Output (pure)


@dataclass(frozen=True)
class Settings:
    minutes: float
    mean_interval_s: float
    seed: int
    kinds: tuple[FaultKind, ...]
    nodes: int
    min_nodes: int
    max_nodes: int
    etcd_members: int
    etcd_outage_s: float
    step_sleep_s: float
    steps: int
    warmup_s: float
    netns: bool = False       # every node a network-namespace host (else: loopback)
    link_down_s: float = 0.0


@dataclass(frozen=True)
class Report:
    settings: Settings
    evidence: Evidence
    verdict: Verdict
    started_t: float  # wall clock of the run's start (times are printed relative to it)
    workdir: str
    skipped: Mapping[str, str] = field(default_factory=dict)  # kinds not possible here -> why


def injected_counts(report: Report) -> dict[str, int]:
    counts = {k.value: 0 for k in report.settings.kinds}
    for f in report.evidence.faults:
        if f.kind in counts:
            counts[f.kind] += 1
    return counts


def render_table(report: Report) -> str:
    """The human summary: faults injected per kind, then the invariants and the figures."""
    s, v, ev = report.settings, report.verdict, report.evidence
    rel = report.started_t
    lines = [f"== chaos: seed {s.seed}, {s.minutes:g} min of faults (mean interval {s.mean_interval_s:g} s), "
             f"{s.nodes} nodes (min {s.min_nodes}, max {s.max_nodes}), etcd {s.etcd_members} member(s), "
             f"lease TTL {ev.lease_ttl_s:g} s, hosts {'netns' if s.netns else 'loopback'} ==", "",
             f"{'FAULT':<22}INJECTED"]
    for kind, n in injected_counts(report).items():
        lines.append(f"{kind:<22}{n}")
    for kind, why in report.skipped.items():
        lines.append(f"{kind:<22}-  (skipped: {why})")
    lines += ["", f"{'INVARIANT':<30}{'RESULT':<8}DETAIL"]
    for i in v.invariants:
        lines.append(f"{i.name:<30}{'PASS' if i.ok else 'FAIL':<8}{i.detail}")
    lines.append("")
    if v.stalls:
        lines.append(f"stalls (no commit for > {ev.lease_ttl_s + 2:g} s; times from the start of the run)")
        lines.append(f"  {'START':>8} {'LENGTH':>7} {'EXCUSED':>8}  GENERATIONS  FAULTS JUST BEFORE")
        for st in v.stalls:
            gens = f"{st.generations[0]}->{st.generations[1] if st.generations[1] >= 0 else 'end'}"
            lines.append(f"  {st.start - rel:7.1f}s {st.length_s:6.1f}s {st.excused_s:7.1f}s  {gens:<12} "
                         f"{', '.join(st.faults) or '-'}")
    else:
        lines.append("stalls            none")
    if ev.etcd_down:
        lines.append("etcd down         " + ", ".join(f"{w.start - rel:.1f}s+{w.end - w.start:.1f}s"
                                                      for w in ev.etcd_down))
    if ev.link_down:
        lines.append("link down         " + ", ".join(f"{d.node} {d.start - rel:.1f}s+{d.end - d.start:.1f}s"
                                                      for d in ev.link_down))
    ettr_text = f"{v.ettr:.3f}" if v.ettr is not None else "-"
    single_text = f"{v.ettr_single:.3f}" if v.ettr_single is not None else "-"
    step_text = f"{v.step_s * 1000:.1f} ms" if v.step_s is not None else "-"
    faulted = f"{ev.faulted.end - ev.faulted.start:.1f} s" if ev.faulted else "-"
    per_world = ", ".join(f"world {w}: {t * 1000:.1f} ms" for w, t in v.step_s_by_world.items()) or "-"
    at_world = ", ".join(f"{n} at world {w}" for w, n in v.faulted_steps_by_world.items()) or "no steps"
    unmeasured = "".join(f"; world {w}: no fault-free measurement, used world {u}'s"
                         for w, u in v.substituted.items())
    lines += [
        f"fault-free step   {per_world} (warm-up, {s.warmup_s:g} s per world size)",
        f"ETTR              {ettr_text} ({at_world}, each x its world size's fault-free step time / {faulted} "
        f"faulted{unmeasured})",
        f"ETTR 1 baseline   {single_text} ({v.faulted_steps} steps x {step_text} fault-free at world {s.nodes} / "
        f"{faulted} faulted)",
        f"steps             {v.steps.last_step}/{ev.target_steps}",
        f"generations       {len(v.steps.generations)}",
        f"status samples    {len(ev.samples)}",
        f"result            {'PASS' if v.ok else 'FAIL'}",
        f"work dir          {report.workdir}",
    ]
    return "\n".join(lines) + "\n"


def report_to_dict(report: Report) -> dict[str, object]:
    """The ``--json`` object: every key always present."""
    s, v, ev = report.settings, report.verdict, report.evidence
    rel = report.started_t
    return {
        "ok": v.ok,
        "seed": s.seed,
        "settings": {"minutes": s.minutes, "mean_interval_s": s.mean_interval_s, "faults": [k.value for k in s.kinds],
                     "nodes": s.nodes, "min_nodes": s.min_nodes, "max_nodes": s.max_nodes,
                     "etcd_members": s.etcd_members, "etcd_outage_s": s.etcd_outage_s,
                     "step_sleep_s": s.step_sleep_s, "steps": s.steps, "warmup_s": s.warmup_s,
                     "lease_ttl_s": ev.lease_ttl_s, "netns": s.netns, "link_down_s": s.link_down_s},
        "injected": injected_counts(report),
        "skipped": dict(report.skipped),
        "invariants": [{"name": i.name, "ok": i.ok, "detail": i.detail} for i in v.invariants],
        "stalls": [{"start_s": round(st.start - rel, 3), "length_s": round(st.length_s, 3),
                    "excused_s": round(st.excused_s, 3), "generations": list(st.generations),
                    "faults": list(st.faults)} for st in v.stalls],
        "etcd_down": [{"start_s": round(w.start - rel, 3), "length_s": round(w.end - w.start, 3)}
                      for w in ev.etcd_down],
        "link_down": [{"node": d.node, "start_s": round(d.start - rel, 3),
                       "length_s": None if d.end == math.inf else round(d.end - d.start, 3)} for d in ev.link_down],
        "faults": [{"t_s": round(f.t - rel, 3), "kind": f.kind, "target": f.target, "detail": f.detail}
                   for f in ev.faults],
        "ettr": v.ettr,
        "ettr_single_baseline": v.ettr_single,
        "fault_free_step_s": v.step_s,
        "fault_free_step_s_by_world": {str(w): t for w, t in v.step_s_by_world.items()},
        "faulted_steps": v.faulted_steps,
        "faulted_steps_by_world": {str(w): n for w, n in v.faulted_steps_by_world.items()},
        "ettr_baseline_substituted": {str(w): u for w, u in v.substituted.items()},
        "faulted_s": None if ev.faulted is None else ev.faulted.end - ev.faulted.start,
        "steps": v.steps.last_step,
        "target_steps": ev.target_steps,
        "generations": len(v.steps.generations),
        "repeats": {str(k): list(g) for k, g in v.steps.repeats.items()},
        "lost": list(v.steps.lost),
        "status_samples": len(ev.samples),
        "tracebacks": list(ev.tracebacks),
        "problems": list(ev.problems),
        "workdir": report.workdir,
    }


# ---------------------------------------------------------------------------------------------
# The executor


class Phase(StrEnum):
    STARTING = "starting"
    WARMUP = "warmup"      # measuring the fault-free step time at one world size
    GROWING = "growing"    # warm-up: one more agent started, waiting for commits at the next size
    FAULTS = "faults"
    FINISHING = "finishing"


@dataclass
class Node:
    """One agent process (a node, or a duplicate of one) and what the run did to it."""

    name: str
    proc: WorkerProcess
    expected: str = ""        # "" finish, "killed", "drain", "sigterm", "duplicate"
    busy_until: float = 0.0   # monotonic: a fault is in flight on it until then
    leaving: bool = False     # drained or SIGTERMed: it goes, and is replaced once it exited
    code: int | None = None
    replaced: bool = False
    log_offset: int = 0       # where this process's lines begin in its log (a node's restarts share one)
    message: str = ""         # its last log line when it exited

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
    registered_t: float | None = None
    ended_t: float | None = None
    paused: list[list[float]] = field(default_factory=list)
    cut_off: list[list[float]] = field(default_factory=list)    # [link down, link up]
    rejoining: list[list[float]] = field(default_factory=list)  # [link up, next sync line seen]

    def close_open(self, windows: list[list[float]], t: float) -> None:
        if windows and windows[-1][1] == math.inf:
            windows[-1][1] = t


def _ip(ip: str, *args: str) -> None:
    """Run one ``ip`` command.

    Raises:
        RuntimeError: it failed or ran past IP_TIMEOUT_S (the message holds its stderr).
    """
    try:
        done = subprocess.run([ip, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"ip {' '.join(args)}: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[:200]}")


def probe_netns(ip: str, pid: int) -> str:
    """Try what a run does (a namespace, a bridge, a veth pair), then delete them: "" when it
    works, else what failed."""
    ns, bridge, veth = f"ecd{pid}p", f"ecd{pid}pb", f"ecd{pid}pv"
    try:
        _ip(ip, "netns", "add", ns)
        _ip(ip, "link", "add", bridge, "type", "bridge")
        _ip(ip, "link", "add", veth, "type", "veth", "peer", "name", f"{veth}n")
        _ip(ip, "link", "set", f"{veth}n", "netns", ns)
        _ip(ip, "netns", "exec", ns, ip, "link", "set", "lo", "up")
    except RuntimeError as exc:
        return str(exc)
    finally:
        for args in (("link", "del", veth), ("link", "del", bridge), ("netns", "del", ns)):
            try:
                _ip(ip, *args)
            except RuntimeError:
                pass  # never made, or gone with its peer
    return ""


def ip_addresses_and_routes(ip: str) -> str:
    """``ip -o -4 addr`` and ``ip -4 route`` of the root namespace ("" when they fail)."""
    out = []
    for args in (("-o", "-4", "addr"), ("-4", "route")):
        try:
            done = subprocess.run([ip, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        out.append(done.stdout)
    return "\n".join(out)


class NetnsHosts:
    """The run's network: a bridge with ``plan.bridge_addr``/24 in the root namespace, and one
    namespace per host (made on first use), joined to the bridge by a veth pair. Everything is
    deleted by the names it was made under (``remove``, idempotent; also registered with atexit)."""

    def __init__(self, plan: NetnsPlan, ip: str, say: Callable[[str], None]) -> None:
        self.plan = plan
        self.ip = ip
        self.say = say
        self.hosts: dict[int, NetnsHost] = {}
        self._made: list[tuple[str, ...]] = []  # the delete command of each thing made, in order

    def setup(self) -> None:
        """Make the bridge (etcd listens on its address, so before etcd starts).

        Raises:
            RuntimeError: an ``ip`` command failed.
        """
        p = self.plan
        _ip(self.ip, "link", "add", p.bridge, "type", "bridge")
        self._made.append(("link", "del", p.bridge))
        _ip(self.ip, "addr", "add", f"{p.bridge_addr}/24", "dev", p.bridge)
        _ip(self.ip, "link", "set", p.bridge, "up")

    def host(self, index: int) -> NetnsHost:
        """Host ``index``, made now if it is new.

        Raises:
            ValueError: the index is out of the plan's range.
            RuntimeError: an ``ip`` command failed.
        """
        if index in self.hosts:
            return self.hosts[index]
        h = self.plan.host(index)
        _ip(self.ip, "netns", "add", h.ns)
        self._made.append(("netns", "del", h.ns))
        _ip(self.ip, "link", "add", h.root_veth, "type", "veth", "peer", "name", h.ns_veth)
        self._made.append(("link", "del", h.root_veth))  # takes its peer along
        _ip(self.ip, "link", "set", h.root_veth, "master", self.plan.bridge)
        _ip(self.ip, "link", "set", h.root_veth, "up")
        _ip(self.ip, "link", "set", h.ns_veth, "netns", h.ns)
        for args in (("addr", "add", f"{h.addr}/24", "dev", h.ns_veth), ("link", "set", h.ns_veth, "up"),
                     ("link", "set", "lo", "up")):
            _ip(self.ip, "netns", "exec", h.ns, self.ip, *args)
        self.hosts[index] = h
        self.say(f"host {h.ns}: {h.addr} (veth {h.root_veth} on {self.plan.bridge})")
        return h

    def set_link(self, host: NetnsHost, up: bool) -> None:
        """``ip link set <root-side veth> up|down``.

        Raises:
            RuntimeError: the command failed.
        """
        _ip(self.ip, "link", "set", host.root_veth, "up" if up else "down")

    def exec_prefix(self, host: NetnsHost) -> list[str]:
        """The command prefix that runs a program on ``host`` (``ip netns exec`` execs it in place,
        so the pid Popen returns is the program's)."""
        return [self.ip, "netns", "exec", host.ns]

    def remove(self) -> None:
        """Delete what was made, newest first, by name (run after the processes in it ended)."""
        while self._made:
            args = self._made.pop()
            try:
                _ip(self.ip, *args)
            except RuntimeError as exc:
                print(f"elasticd.chaos: cleanup: {exc}", file=sys.stderr, flush=True)


class ChaosRun:
    """One run in ``workdir``: etcd, the agents, the faults, the evidence."""

    def __init__(self, settings: Settings, workdir: Path, say: Callable[[str], None],
                 net: NetnsHosts | None = None) -> None:
        self.s = settings
        self.net = net
        self.link_downs: list[list[object]] = []  # [node, start, end (inf while down)], wall clock
        self.workdir = workdir
        self.audit_dir = workdir / "audit"
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
        self.down_since: float | None = None   # wall: etcd (or quorum) lost, not back yet
        self.etcd_busy_until: float | None = None  # monotonic; None: no etcd fault in flight
        self.samples: list[StatusSample] = []
        self.lives: dict[int, Life] = {}
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
        self.warm_world = 0              # the world size of the newest warm-up window
        self.grow_deadline = math.inf    # monotonic: GROWING must see the next size by then
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
            self.cluster = EtcdCluster(self.s.etcd_members, data_root=str(self.workdir / "etcd"),
                                       extra_hosts=extra).start()
            self.etcd_members = list(self.cluster.members)
        self.say(f"etcd {','.join(self.agent_endpoints)} ({len(self.etcd_members)} member(s))")

    def program(self, audit_name: str) -> list[str]:
        return python_program(
            "agents/mlp.py", "--steps", str(self.s.steps), "--samples", str(SAMPLES),
            "--global-batch", str(GLOBAL_BATCH), "--step-sleep", str(self.s.step_sleep_s),
            "--audit", str(self.audit_dir / f"{audit_name}.jsonl"),
        )

    def start_agent(self, name: str, duplicate: bool = False) -> Node:
        log_name = name
        if duplicate:
            self._dups += 1
            log_name = f"{name}-dup{self._dups}"
        flags = ["--max-restarts", "1000"]  # a worker killed again and again is restarted again
        prefix: list[str] = []
        if self.net is not None:
            host = self.net.host(host_index(name))
            flags += ["--advertise-addr", host.addr]
            prefix = self.net.exec_prefix(host)
        argv = prefix + local_agent_argv(self.config_file, self.agent_endpoints, JOB_ID, name,
                                         f"{self.s.min_nodes}:{self.s.max_nodes}", TIMEOUTS.lease_ttl_s,
                                         TIMEOUTS.keepalive_s, self.program(log_name), *flags)
        log_path = self.workdir / f"agent-{log_name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        proc = WorkerProcess(argv, {}, log_path, new_session=True).start()
        node = Node(name, proc, expected="duplicate" if duplicate else "", log_offset=offset)
        self.nodes.append(node)
        self.say(f"started agent {log_name} (pid {proc.pid})")
        return node

    def live_nodes(self) -> list[Node]:
        return [n for n in self.nodes if n.code is None and n.expected != "duplicate" and n.proc.alive()]

    def worker_pids(self, node: Node) -> list[int]:
        return [p for p in group_pids([node.proc.pid])[node.proc.pid] if p != node.proc.pid]

    def node_ready(self, node: Node, now: float) -> bool:
        if node.leaving or node.expected or now < node.busy_until or not node.proc.alive():
            return False
        if process_state(node.proc.pid) in (None, "T", "t", "Z"):
            return False
        pids = self.worker_pids(node)
        if len(pids) != 1 or process_state(pids[0]) in (None, "T", "t", "Z"):
            return False
        start_pid, synced = self.node_start.get(node.name, (0, False))
        return start_pid == pids[0] and synced

    def view(self, now: float) -> ClusterView:
        live = self.live_nodes()
        counts: dict[FaultKind, int] = {}
        for f in self.faults:
            if f.kind in _KIND_NAMES:
                counts[FaultKind(f.kind)] = counts.get(FaultKind(f.kind), 0) + 1
        dup_running = any(n.expected == "duplicate" and n.code is None for n in self.nodes)
        dup_names = {n.name for n in self.nodes if n.expected == "duplicate" and n.code is None}
        return ClusterView(
            nodes=tuple(NodeView(n.name, self.node_ready(n, now) and n.name not in dup_names) for n in live),
            queued=sum(1 for t in self.timed if t.what.startswith("replace")),
            min_nodes=self.s.min_nodes, max_nodes=self.s.max_nodes,
            etcd_busy=self.etcd_busy_until is not None, duplicate_running=dup_running, injected=counts,
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
        pids = self.worker_pids(node) if node is not None else []
        if node is not None and len(pids) != 1:
            self.say(f"skipped {kind} on {node.name}: it runs {len(pids)} workers now")
            return
        pid = pids[0] if pids else 0
        if kind is FaultKind.WORKER_KILL:
            assert node is not None
            signal_pid(pid, signal.SIGKILL)
            node.busy_until = now + 2.0
            self.record(kind, node.name, f"worker pid {pid}")
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
            assert node is not None and self.net is not None
            host = self.net.host(host_index(node.name))
            self.net.set_link(host, up=False)
            t = time.time()
            self.link_downs.append([node.name, t, math.inf])
            for p in self.worker_pids(node):
                self.lives.setdefault(p, Life(node.name)).cut_off.append([t, math.inf])
            self.node_start[node.name] = (pid, False)  # ready again once it synced in a new generation
            # Busy until it was dropped, the link came back and it rejoined (node_ready then also
            # waits for its worker's new start and sync lines).
            node.busy_until = now + self.s.link_down_s + 2 * ttl + 3.0
            self.record(kind, node.name, f"{host.root_veth} down for {self.s.link_down_s:g} s (worker pid {pid})")
            self.later(self.s.link_down_s, f"link up {node.name}", partial(self.link_up, node.name, host))

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

    def later(self, delay_s: float, what: str, action: Callable[[], None]) -> None:
        self.timed.append(Timed(time.monotonic() + delay_s, what, action))

    def pause(self, pid: int, node: str) -> None:
        if signal_pid(pid, signal.SIGSTOP):
            self.lives.setdefault(pid, Life(node)).paused.append([time.time(), math.inf])

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
            self.say(f"the second agent for {dup.name} (pid {dup.proc.pid}) still runs after "
                     f"{DUPLICATE_BOUND_S:g} s: not refused; killing its process group")
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
                life = self.lives.setdefault(pid, Life(node))
                # The line is written once the member is registered, but its "t" is when the worker
                # began to register (which may wait out an etcd outage): when it was seen is later.
                life.registered_t = now_t
            elif event == "sync":
                pid, _ = self.node_start.get(audit_name, (0, False))
                self.node_start[audit_name] = (pid, True)
                if pid in self.lives:
                    self.lives[pid].close_open(self.lives[pid].rejoining, now_t)
                if self.full_world_t is None and _int(rec["world_size"]) >= self.s.nodes:
                    self.full_world_t = _float(rec["t"])
            elif event == "commit":
                step = _int(rec["step"])
                if step > self.last_step:
                    self.last_step = step
                    self.generation, self.world = _int(rec["generation"]), _int(rec["world_size"])
                    self.last_commit_mono = time.monotonic()
        groups = group_pids([n.proc.pid for n in self.nodes])
        alive: set[int] = set()
        for n in self.nodes:
            for pid in groups[n.proc.pid]:
                if pid != n.proc.pid:
                    alive.add(pid)
                    self.lives.setdefault(pid, Life(n.name))
        for pid, life in self.lives.items():
            if life.ended_t is None and pid not in alive and process_state(pid) in (None, "Z"):
                life.ended_t = now_t
                life.close_open(life.cut_off, now_t)
                life.close_open(life.rejoining, now_t)
        for n in self.nodes:
            if n.code is None and n.proc.proc is not None and n.proc.proc.poll() is not None:
                n.code = n.proc.proc.returncode
                self.on_agent_exit(n)
        if self.etcd_busy_until is not None or self.down_since is not None:
            self.poll_etcd()

    def on_agent_exit(self, n: Node) -> None:
        message = n.message = n.last_line()
        self.say(f"agent {n.name} (pid {n.proc.pid}) exited {n.code}"
                 f"{' as expected (' + n.expected + ')' if n.expected else ''}")
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

    def run(self) -> None:
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text("# the chaos run's agents take every setting from their flags\n")
        if self.net is not None:
            self.net.setup()
        self.start_etcd()
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
                self.say(f"step {self.last_step}/{self.s.steps}  generation {self.generation}  world {self.world}  "
                         f"nodes ready {len(v.ready)}/{len(v.nodes)}  ({self.phase})")
            if self.phase is Phase.STARTING:
                if self.full_world_t is not None:
                    self.begin_warmup_window(self.s.nodes)
                elif now > start_deadline:
                    self.problems.append(f"the job did not train at world size {self.s.nodes} within "
                                         f"{STARTUP_BOUND_S:g} s")
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
                    self.say(f"faults end ({reason}); waiting (at most {finish_deadline - now:.0f} s) for the "
                             f"job to finish")
                else:
                    if now >= next_fault:
                        choice = choose_fault(self.view(now), self.s.kinds, self.rng)
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
                    self.problems.append(f"the job did not finish within {finish_deadline - now:.0f} s after "
                                         f"the faults ended")
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
            if self.warm_world >= self.s.max_nodes:
                return True
            name = self.new_node_name()
            if name is None:
                self.problems.append(f"warm-up: no host address left for a node to grow to world size "
                                     f"{self.warm_world + 1}")
                self.say(self.problems[-1])
                return True
            self.phase = Phase.GROWING
            self.grow_deadline = now + GROW_BOUND_S
            self.say(f"warm-up: starting {name} to measure world size {self.warm_world + 1}")
            self.start_agent(name)
            return False
        if self.world > self.warm_world:  # the newest commit is at the bigger size
            self.begin_warmup_window(self.warm_world + 1)
            return False
        if now > self.grow_deadline:
            self.problems.append(f"warm-up: the job did not commit at world size {self.warm_world + 1} within "
                                 f"{GROW_BOUND_S:g} s of starting one more agent")
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
        for t in self.timed:
            if t.what.startswith("SIGCONT"):
                t.action()
        self.timed.clear()
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
                    pairs.append((path.stem, rec))
        try:
            violations = tuple(audit_check([r for _, r in pairs], SAMPLES).violations)
        except (KeyError, TypeError, ValueError) as exc:
            violations = (f"audit check could not read the records: {exc!r}",)
        tracebacks: list[str] = []
        for log in sorted(self.workdir.glob("agent-*.log")):
            tracebacks += traceback_hits(log.name, log.read_text(errors="replace"))
        agents = tuple(AgentEnd(n.name, n.proc.pid, n.expected, n.code, n.message or n.last_line())
                       for n in self.nodes)
        left: dict[int, float] = {}
        for log in sorted(self.workdir.glob("agent-*.log")):
            for pid, t in membership_closed_times(log.read_text(errors="replace")).items():
                left[pid] = min(t, left.get(pid, t))
        lives = tuple(WorkerLife(pid, life.node, life.registered_t, life.ended_t,
                                 tuple(Window(a, b) for a, b in life.paused),
                                 tuple(Window(a, b) for a, b in life.cut_off),
                                 tuple(Window(a, b) for a, b in life.rejoining), left.get(pid))
                      for pid, life in sorted(self.lives.items()) if pid)
        down = list(self.down)
        if self.down_since is not None:
            down.append(Window(self.down_since, time.time()))
        return Evidence(
            target_steps=self.s.steps, commits=tuple(parse_commits(pairs)), finals=tuple(parse_finals(pairs)),
            audit_violations=violations, faults=tuple(self.faults), etcd_down=tuple(down),
            samples=tuple(self.samples), lives=lives, tracebacks=tuple(tracebacks), agents=agents,
            warmup=self.warmup, faulted=self.faulted, lease_ttl_s=TIMEOUTS.lease_ttl_s,
            problems=tuple(self.problems), end_t=time.time(), warmups=tuple(self.warmups),
            link_down=tuple(LinkDown(str(d[0]), _float(d[1]), _float(d[2])) for d in self.link_downs),
        )


# ---------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m elasticd.chaos",
        description="Fault injection: a local job run by real elasticd agents under random, seeded faults; "
        "the invariants are checked from the outside at the end.",
    )
    p.add_argument("--minutes", type=float, default=5.0, help="how long to inject faults (default 5)")
    p.add_argument("--mean-interval-s", type=float, default=10.0, help="mean seconds between faults (default 10)")
    p.add_argument("--seed", type=int, default=None, help="seed of the schedule (default: from the clock; printed)")
    p.add_argument("--faults", default=None, metavar="KIND[,KIND]",
                   help=f"fault kinds to inject (default: every kind possible here): {', '.join(k.value for k in FaultKind)}")
    p.add_argument("--nodes", type=int, default=3, help="agents at the start (default 3)")
    p.add_argument("--min-nodes", type=int, default=2, help="the job's min size; never taken below (default 2)")
    p.add_argument("--max-nodes", type=int, default=None, help="the job's max size (default --nodes + 1)")
    p.add_argument("--etcd-members", type=int, choices=(1, 3), default=1,
                   help="1: one etcd server; 3: a 3-member etcd cluster on loopback (default 1)")
    p.add_argument("--netns", action=argparse.BooleanOptionalAction, default=None,
                   help="run every node on a network-namespace host of its own, on a bridge the run creates "
                   "(needed by link_down; needs root and `ip netns`). Default: on when possible; --no-netns: "
                   "every node on loopback")
    p.add_argument("--link-down-s", type=float, default=None,
                   help=f"how long link_down keeps a host's link down; more than the lease TTL (default "
                   f"{link_down_s_default(TIMEOUTS.lease_ttl_s):g})")
    p.add_argument("--etcd-outage-s", type=float, default=5.0,
                   help="how long etcd (or a member) stays down in an outage (default 5)")
    p.add_argument("--step-sleep", type=float, default=0.05, help="extra seconds per step in each worker (default 0.05)")
    p.add_argument("--steps", type=int, default=None,
                   help="steps of the job (default: about what a fault-free job commits in the warm-up and --minutes)")
    p.add_argument("--warmup-s", type=float, default=10.0,
                   help="fault-free seconds at each world size from --nodes to --max-nodes before the faults "
                   "(measures the step time at each size; default 10)")
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="empty or new directory for logs, audit files and etcd data (kept); default: a temporary "
                   "directory, removed at the end unless --keep or the run failed")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    return p.parse_args(argv)


def make_settings(args: argparse.Namespace, netns: bool = False) -> Settings:
    """Validate the arguments (``netns``: whether the nodes run on network-namespace hosts).

    Raises:
        ConfigError: an argument is out of range; the message names it.
    """
    if args.minutes <= 0:
        raise ConfigError(f"--minutes: must be > 0, got {args.minutes}")
    if args.mean_interval_s <= 0:
        raise ConfigError(f"--mean-interval-s: must be > 0, got {args.mean_interval_s}")
    if args.nodes < 2:
        raise ConfigError(f"--nodes: at least 2, got {args.nodes}")
    if not 1 <= args.min_nodes < args.nodes:
        raise ConfigError(f"--min-nodes: must be in 1..{args.nodes - 1} (below --nodes), got {args.min_nodes}")
    max_nodes = args.nodes + 1 if args.max_nodes is None else args.max_nodes
    if max_nodes < args.nodes:
        raise ConfigError(f"--max-nodes: must be >= --nodes ({args.nodes}), got {max_nodes}")
    if args.etcd_outage_s < 0 or args.step_sleep < 0 or args.warmup_s < 1:
        raise ConfigError("--etcd-outage-s and --step-sleep must be >= 0, --warmup-s >= 1")
    steps = args.steps if args.steps is not None else estimate_steps(
        args.step_sleep, warmup_estimate_s(args.warmup_s, args.nodes, max_nodes) + args.minutes * 60.0 + 10.0)
    if steps < 20:
        raise ConfigError(f"--steps: at least 20, got {steps}")
    link_down_s = link_down_s_default(TIMEOUTS.lease_ttl_s) if args.link_down_s is None else args.link_down_s
    if link_down_s <= TIMEOUTS.lease_ttl_s:
        raise ConfigError(f"--link-down-s: must be more than the lease TTL ({TIMEOUTS.lease_ttl_s:g} s), "
                          f"got {link_down_s}")
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    return Settings(
        minutes=args.minutes, mean_interval_s=args.mean_interval_s, seed=seed,
        kinds=parse_faults(args.faults, args.etcd_members, netns), nodes=args.nodes, min_nodes=args.min_nodes,
        max_nodes=max_nodes, etcd_members=args.etcd_members, etcd_outage_s=args.etcd_outage_s,
        step_sleep_s=args.step_sleep, steps=steps, warmup_s=args.warmup_s, netns=netns, link_down_s=link_down_s,
    )


def skipped_kinds(etcd_members: int, no_netns: str = "") -> dict[str, str]:
    """Kinds not possible here, with the reason (printed in the table); ``no_netns``: why the nodes
    run on loopback ("" when they run on network-namespace hosts)."""
    return {k.value: (f"needs network-namespace hosts: {no_netns}" if KINDS[k].netns and no_netns
                      else f"needs --etcd-members {KINDS[k].etcd_members}")
            for k in FaultKind if k not in kinds_possible(etcd_members, not no_netns)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    ip = shutil.which("ip")
    pid = os.getpid()
    if args.netns is False:
        no_netns = "--no-netns"
    else:
        euid = os.geteuid()
        probed = probe_netns(ip, pid) if euid == 0 and ip is not None else ""
        no_netns = netns_unusable(euid, ip, probed)
    try:
        netns = use_netns(args.netns, no_netns)
        settings = make_settings(args, netns)
        plan = netns_plan(pid, subnets_in_use(ip_addresses_and_routes(ip))) if netns and ip else None
    except ConfigError as exc:
        print(f"elasticd.chaos: {exc}", file=sys.stderr)
        return 2
    try:
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

    say(f"elasticd chaos: seed {settings.seed}; faults {', '.join(k.value for k in settings.kinds)}; "
        f"{settings.steps} steps; work dir {workdir}")
    net = None
    if plan is not None:
        assert ip is not None
        net = NetnsHosts(plan, ip, say)
        atexit.register(net.remove)  # also on a way out that skips the finally below
        say(f"hosts: network namespaces {plan.prefix}h<i> at {NETNS_NET}.{plan.subnet}.<{NETNS_HOST_BASE}+i>, "
            f"bridge {plan.bridge} {plan.bridge_addr}/24")
    else:
        say(f"hosts: every node on loopback ({no_netns}); link_down is left out")
    run = ChaosRun(settings, workdir, say, net)
    code = 1
    try:
        with sigterm_raises():
            try:
                run.run()
            finally:
                run.stop_all()
            evidence = run.evidence()
            report = Report(settings, evidence, judge(evidence), run.started_t, str(workdir),
                            skipped_kinds(settings.etcd_members, "" if netns else no_netns))
            (workdir / "report.json").write_text(json.dumps(report_to_dict(report), indent=1) + "\n")
            (workdir / "report.txt").write_text(render_table(report))
            if args.json:
                print(json.dumps(report_to_dict(report)), flush=True)
            else:
                print("\n" + render_table(report), end="", flush=True)
            code = 0 if report.verdict.ok else 1
    except ConfigError as exc:  # no etcd binary
        print(f"elasticd.chaos: {exc}", file=sys.stderr)
        code = 2
    except RuntimeError as exc:  # etcd did not start, or an `ip` command failed
        print(f"elasticd.chaos: {exc}", file=sys.stderr)
        code = 1
    except (KeyboardInterrupt, Terminated):
        print("\nelasticd.chaos: interrupted; stopping every process it started", file=sys.stderr)
        code = 130
    finally:
        run.stop_all()
        if remove and code == 0:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            say(f"work dir kept: {workdir}")
    return code


if __name__ == "__main__":
    sys.exit(main())
