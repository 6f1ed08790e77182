"""What a chaos run injects, and when: the fault kinds, the pure choice of the next fault, and the
run's settings.

Owns ``FaultKind`` and what each kind needs (``KINDS``), ``--faults`` parsing, ``choose_fault`` (the
next fault from a ``ClusterView`` and a seeded ``random.Random``), the delay between faults, the
step estimate, and ``Settings`` from the command line (``parse_args``, ``make_settings``: the flags
and their validation). Pure but for the default seed, which ``make_settings`` takes from the clock:
it never touches a process or a file, and never injects anything.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from elasticd.config import Timeouts
from elasticd.errors import ConfigError

# The shortest lease etcd grants with its default election settings (its minimum TTL is ~2 s).
TIMEOUTS = Timeouts(lease_ttl_s=2.0, keepalive_s=0.5)
STEP_OVERHEAD_S = 0.015  # per-step cost besides --step-sleep on a small machine (for the step estimate)
SHARDED_STEP_OVERHEAD_S = 0.09  # the same with --replica-size 2 (FSDP2's collectives in each replica, 8 workers)
GROW_ESTIMATE_S = 10.0  # warm-up: about how long one more agent takes to join (for the step estimate)
STANDBY_NODES = 1  # node_join may start this many agents beyond max_nodes: standbys waiting for a place


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
    WORKER_ABORT = "worker_abort"
    STRAGGLER = "straggler"
    NAN_GRADS = "nan_grads"
    LINK_FLAP = "link_flap"
    CHECKPOINT_READONLY = "checkpoint_readonly"
    CHECKPOINT_FULL = "checkpoint_full"
    WORKER_HANG = "worker_hang"


@dataclass(frozen=True)
class KindSpec:
    """What a fault kind does and what it needs before it may be injected."""

    doc: str
    removes: bool = False  # takes one node's worker out of the job for a while
    on_node: bool = False  # acts on one ready node, picked at random
    etcd: bool = False  # acts on etcd: one etcd fault at a time
    etcd_members: int = 1  # the etcd cluster size it needs
    adds: bool = False  # starts a node (below max_nodes, or up to STANDBY_NODES beyond it)
    needs_etcd: bool = False  # needs etcd up (it writes there, or its outcome means nothing without)
    netns: bool = False  # needs every node on a network-namespace host (--netns)
    mount: bool = False  # acts on the checkpoint filesystem the run mounts (root, and mount works)
    poison: bool = False  # needs the workload's NaN poison (agents/mlp.py without a GradScaler)
    hang: bool = False  # needs the workload's hang (agents/mlp.py --hang-on-sigusr1)


# How long a straggler fault slows its worker, and the duty cycle that slows it: stopped this long,
# then running this long, over and over (shorter than a step: its compute takes about twice as long).
STRAGGLER_FAULT_S = 5.0
STRAGGLER_DUTY_S = 0.005

# nan_grads: the worker's next NAN_GRAD_STEPS backward passes give NaN gradients. Below the
# workers' nonfinite_steps (3: at that many in a row a worker exits 78 and its node is out), so the
# steps are skipped everywhere and the worker stays: the job goes on at its size.
NAN_GRAD_STEPS = 2
NONFINITE_STEPS = 3  # the workers' retry.nonfinite_steps (its default: the chaos agents keep it)
# link_flap: the host's link goes down and up LINK_FLAP_CYCLES times, down LINK_FLAP_DOWN_S, then up
# LINK_FLAP_UP_S: each down shorter than a lease TTL, together longer.
LINK_FLAP_CYCLES = 5
LINK_FLAP_DOWN_S = 0.3
LINK_FLAP_UP_S = 0.7
# checkpoint_readonly / checkpoint_full: the checkpoint filesystem stays read-only (or full) this
# long, then is restored; the agents save every CHECKPOINT_EVERY_STEPS steps, so a few saves fail.
CHECKPOINT_FAULT_S = 5.0
CHECKPOINT_EVERY_STEPS = 20
# worker_hang: the agents end a worker hung this long while the job moved on (their hang_timeout_s)
HANG_TIMEOUT_S = 6.0

KINDS: Mapping[FaultKind, KindSpec] = {
    FaultKind.WORKER_KILL: KindSpec("SIGKILL one worker; its agent restarts it", removes=True, on_node=True),
    FaultKind.NODE_LOSS: KindSpec(
        "SIGKILL an agent's process group (the agent and its workers); the same "
        "node is started again after lease TTL + 1 s",
        removes=True,
        on_node=True,
    ),
    FaultKind.WORKER_STOP: KindSpec("SIGSTOP one worker for lease TTL + 1 s, then SIGCONT", removes=True, on_node=True),
    FaultKind.AGENT_STOP: KindSpec("SIGSTOP one agent for lease TTL + 1 s, then SIGCONT", removes=True, on_node=True),
    FaultKind.ETCD_RESTART: KindSpec(
        "SIGKILL etcd (every member) and start it again at once on the same data", etcd=True
    ),
    FaultKind.ETCD_OUTAGE: KindSpec("SIGKILL etcd (every member), start it again after --etcd-outage-s", etcd=True),
    FaultKind.ETCD_FOLLOWER_KILL: KindSpec(
        "SIGKILL an etcd follower; start it again after --etcd-outage-s", etcd=True, etcd_members=3
    ),
    FaultKind.ETCD_LEADER_KILL: KindSpec(
        "SIGKILL the etcd leader; start it again after --etcd-outage-s", etcd=True, etcd_members=3
    ),
    FaultKind.DRAIN: KindSpec(
        "elasticctl drain NODE; the node is started again after its agent exited",
        removes=True,
        on_node=True,
        needs_etcd=True,
    ),
    FaultKind.AGENT_SIGTERM: KindSpec(
        "SIGTERM one agent (a drain); the node is started again after it exited", removes=True, on_node=True
    ),
    FaultKind.NODE_JOIN: KindSpec(
        "start an agent with a new node id (at max_nodes: a standby that waits for a place)", adds=True
    ),
    FaultKind.DUPLICATE_NODE: KindSpec(
        "start a second agent with an existing node's id: it must exit non-zero", on_node=True, needs_etcd=True
    ),
    FaultKind.WORKER_ABORT: KindSpec(
        "SIGABRT one worker (it dies as a CUDA error or an assertion in native code ends a process); "
        "its agent restarts it",
        removes=True,
        on_node=True,
    ),
    FaultKind.STRAGGLER: KindSpec(
        f"slow one worker for {STRAGGLER_FAULT_S:g} s by a SIGSTOP/SIGCONT duty cycle "
        f"({STRAGGLER_DUTY_S * 1000:g} ms each): it computes half the time, and every all_reduce waits for it",
        on_node=True,
    ),
    # needs_etcd: with etcd down, nobody could notice the lost host, so the fault would test nothing.
    FaultKind.LINK_DOWN: KindSpec(
        "take a network-namespace host's link down (`ip link set VETH down`) for "
        "--link-down-s (> lease TTL), then up; its workers are dropped and rejoin",
        removes=True,
        on_node=True,
        needs_etcd=True,
        netns=True,
    ),
    FaultKind.NAN_GRADS: KindSpec(
        f"SIGUSR2 one worker: its next {NAN_GRAD_STEPS} backward passes give NaN gradients "
        f"(agents/mlp.py --nan-steps-on-sigusr2); every member skips those steps, none applies a NaN",
        on_node=True,
        poison=True,
    ),
    FaultKind.LINK_FLAP: KindSpec(
        f"take a network-namespace host's link down and up {LINK_FLAP_CYCLES} times (down "
        f"{LINK_FLAP_DOWN_S:g} s, up {LINK_FLAP_UP_S:g} s); its workers may be dropped and rejoin",
        removes=True,
        on_node=True,
        needs_etcd=True,
        netns=True,
    ),
    FaultKind.CHECKPOINT_READONLY: KindSpec(
        f"remount the checkpoint filesystem read-only for {CHECKPOINT_FAULT_S:g} s, then read-write: "
        "the saves meanwhile fail (EROFS), training goes on, the saves after succeed",
        mount=True,
    ),
    FaultKind.CHECKPOINT_FULL: KindSpec(
        f"fill the checkpoint filesystem for {CHECKPOINT_FAULT_S:g} s, then free it: the saves "
        "meanwhile fail (ENOSPC), training goes on, the saves after succeed",
        mount=True,
    ),
    FaultKind.WORKER_HANG: KindSpec(
        "SIGUSR1 one worker: it hangs with every thread (agents/mlp.py --hang-on-sigusr1: a C call "
        "that keeps the GIL); the others leave it out (its lease, or the reach check behind the "
        f"relay), its agent ends it as hung (hang_timeout_s {HANG_TIMEOUT_S:g}) and restarts it",
        removes=True,
        on_node=True,
        hang=True,
    ),
}


KIND_NAMES = frozenset(k.value for k in FaultKind)

# ``--mix production``: each kind's weight, from the causes of the 419 unplanned interruptions of
# Llama 3's pre-training on 16k GPUs (Meta, "The Llama 3 Herd of Models", 2024, table 5): GPU and
# GPU-memory faults 58.7 % (a worker dying as a CUDA error ends it, or killed), software bugs
# 13.4 % (a worker crash; a bug at the same step on every rank is its own scenario, which ends the
# job), host and maintenance 11 % (a node lost, drained or stopped for maintenance), network
# 10.1 % (a link down, or one that flaps: split alike), NCCL watchdog hangs 1.7 % (a worker stopped,
# or one hung holding the GIL: split alike), silent data corruption 1.4 % (a bad node: a slow one, a straggler here, and one
# whose gradients turn NaN, split alike). Host and maintenance keep 1 % of their 11 % for the
# checkpoint storage turning read-only or full (0.5 % each). The etcd faults are the control plane's,
# absent from that table; they keep a small weight so that every run meets them.
PRODUCTION_MIX: Mapping[FaultKind, float] = {
    FaultKind.WORKER_ABORT: 35.2,
    FaultKind.WORKER_KILL: 23.5 + 13.4,
    FaultKind.NODE_LOSS: 4.0,
    FaultKind.DRAIN: 2.0,
    FaultKind.AGENT_SIGTERM: 2.0,
    FaultKind.AGENT_STOP: 2.0,
    FaultKind.CHECKPOINT_READONLY: 0.5,
    FaultKind.CHECKPOINT_FULL: 0.5,
    FaultKind.LINK_DOWN: 5.05,
    FaultKind.LINK_FLAP: 5.05,
    FaultKind.WORKER_STOP: 0.85,
    FaultKind.WORKER_HANG: 0.85,
    FaultKind.STRAGGLER: 0.7,
    FaultKind.NAN_GRADS: 0.7,
    FaultKind.NODE_JOIN: 2.0,
    FaultKind.DUPLICATE_NODE: 0.5,
    FaultKind.ETCD_RESTART: 0.5,
    FaultKind.ETCD_OUTAGE: 0.5,
    FaultKind.ETCD_FOLLOWER_KILL: 0.5,
    FaultKind.ETCD_LEADER_KILL: 0.5,
}
MIXES = ("uniform", "production")
SCENARIOS = ("faults", "bug")
BUG_STEP = 30  # --scenario bug: the default step every rank raises at


def mix_weights(mix: str) -> Mapping[FaultKind, float] | None:
    """The weights ``choose_fault`` draws by for ``--mix`` (None: uniform, every kind covered alike)."""
    return PRODUCTION_MIX if mix == "production" else None


@dataclass(frozen=True)
class Place:
    """What this run has that some kinds need: an etcd cluster of ``etcd_members``, network-namespace
    hosts, a checkpoint filesystem of its own, a workload with the NaN poison. Each reason is why
    it lacks one ("" when it has it)."""

    etcd_members: int = 1
    no_netns: str = "--no-netns"
    no_mount: str = ""
    no_poison: str = ""
    no_hang: str = ""

    def missing(self, kind: FaultKind) -> str:
        """Why ``kind`` cannot be injected here ("" when it can)."""
        spec = KINDS[kind]
        if spec.etcd_members not in (1, self.etcd_members):
            return f"needs --etcd-members {spec.etcd_members}"
        if spec.netns and self.no_netns:
            return f"needs network-namespace hosts: {self.no_netns}"
        if spec.mount and self.no_mount:
            return f"needs a checkpoint filesystem of the run's own: {self.no_mount}"
        if spec.poison and self.no_poison:
            return f"needs the workload's NaN poison: {self.no_poison}"
        if spec.hang and self.no_hang:
            return f"needs the workload's hang: {self.no_hang}"
        return ""


def kinds_possible(etcd_members: int, netns: bool = False, place: Place | None = None) -> tuple[FaultKind, ...]:
    """The fault kinds that can be injected with an etcd cluster of this size, with (or without)
    network-namespace hosts; ``place`` (when given) says the rest of what the run has."""
    where = place or Place(etcd_members, "" if netns else "--no-netns")
    return tuple(k for k in KINDS if not where.missing(k))


def parse_faults(
    text: str | None, etcd_members: int, netns: bool = False, place: Place | None = None
) -> tuple[FaultKind, ...]:
    """``--faults a,b,c`` (None: every kind possible here).

    Raises:
        ConfigError: an unknown kind, or one that needs what the run lacks (a larger etcd cluster,
            network namespaces, a checkpoint filesystem, the workload's NaN poison).
    """
    where = place or Place(etcd_members, "" if netns else "--no-netns")
    possible = kinds_possible(etcd_members, netns, where)
    if text is None:
        return possible
    out: list[FaultKind] = []
    for name in (part.strip() for part in text.split(",")):
        if not name:
            continue
        try:
            kind = FaultKind(name)
        except ValueError:
            raise ConfigError(
                f"--faults: unknown fault kind {name!r}; known: {', '.join(k.value for k in FaultKind)}"
            ) from None
        why = where.missing(kind)
        if KINDS[kind].netns and where.no_netns:
            why = "needs network-namespace hosts (--netns: root, and `ip netns` works)"
        if why:
            raise ConfigError(f"--faults: {name} {why}")
        if kind not in out:
            out.append(kind)
    if not out:
        raise ConfigError("--faults: no fault kind given")
    return tuple(out)


def skipped_kinds(etcd_members: int, no_netns: str = "", place: Place | None = None) -> dict[str, str]:
    """Kinds not possible here, with the reason (printed in the table); ``no_netns``: why the nodes
    run on loopback ("" when they run on network-namespace hosts); ``place`` (when given) says the
    rest of what the run has."""
    where = place or Place(etcd_members, no_netns)
    return {k.value: where.missing(k) for k in FaultKind if where.missing(k)}


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
    queued: int  # replacements due to be started
    min_nodes: int
    max_nodes: int
    etcd_busy: bool  # an etcd fault is in flight (etcd or a member down)
    duplicate_running: bool
    injected: Mapping[FaultKind, int]
    checkpoint_busy: bool = False  # a checkpoint filesystem fault is in flight

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
    if spec.mount and view.checkpoint_busy:
        return False
    # The faults begin at max_nodes (the warm-up measured every size up to it), so a join there is a
    # standby beyond max_workers: it forces no generation and takes the place of a member that leaves.
    if spec.adds and len(view.nodes) + view.queued >= view.max_nodes + STANDBY_NODES:
        return False
    return not (kind is FaultKind.DUPLICATE_NODE and view.duplicate_running)


def choose_fault(
    view: ClusterView,
    kinds: Sequence[FaultKind],
    rng: random.Random,
    weights: Mapping[FaultKind, float] | None = None,
) -> Choice | None:
    """The next fault: a kind allowed now, among those injected least so far (so a short run covers
    every kind), picked at random; with ``weights`` (``--mix production``), any allowed kind, drawn
    by its weight. For an on-node kind, a ready node at random. None: none allowed.

    Among the least injected, an etcd kind goes first when etcd is free: etcd faults come one at a
    time and each holds etcd for seconds, so left to chance the last of them may not fit a short
    run's window."""
    possible = [k for k in kinds if allowed(k, view)]
    if not possible:
        return None
    if weights is not None:
        weighted = sorted(k for k in possible if weights.get(k, 0.0) > 0)
        if not weighted:
            return None
        kind = rng.choices(weighted, [weights[k] for k in weighted])[0]
    else:
        least = min(view.injected.get(k, 0) for k in possible)
        candidates = sorted(k for k in possible if view.injected.get(k, 0) == least)
        kind = rng.choice([k for k in candidates if KINDS[k].etcd] or candidates)
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


def estimate_steps(step_sleep_s: float, seconds: float, overhead_s: float = STEP_OVERHEAD_S) -> int:
    """Steps a fault-free job of this workload commits in ``seconds`` on a small machine."""
    return max(50, math.ceil(seconds / (step_sleep_s + overhead_s)))


def link_down_s_default(lease_ttl_s: float) -> float:
    """How long a link stays down by default: past the lease TTL (so that the host's workers are
    lost to the job) and past the stall bound (TTL + 2 s), so that the others must have gone on
    without it while it is still cut off."""
    return lease_ttl_s + 3.0


# ---------------------------------------------------------------------------------------------
# Settings


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
    netns: bool = False  # every node a network-namespace host (else: loopback)
    link_down_s: float = 0.0
    relay: str = "on"  # the agents' relay setting: on (their default), off, or mixed (on for even node numbers)
    device: str = "cpu"  # the workload's --device: cpu, or cuda (the model on the GPU; groups stay gloo)
    fp16: bool = False  # the workload's --fp16: autocast and a GradScaler (cuda only)
    form: str = "short"  # the workload's form: short (agents/mlp.py) or dropin (agents/mlp_dropin.py)
    mix: str = "uniform"  # uniform (every kind covered alike) or production (PRODUCTION_MIX's weights)
    scenario: str = "faults"  # faults (random faults) or bug (the same exception at one step on every rank)
    raise_at_step: int = 0  # the bug scenario's step
    replica_size: int = 1  # workers per node, one replica sharding the model (agents/mlp_sharded.py); 1: agents/mlp.py

    def workers(self, nodes: int) -> int:
        """The world size of ``nodes`` nodes (each runs ``replica_size`` workers)."""
        return nodes * self.replica_size

    @property
    def checkpoints(self) -> bool:
        """Whether the agents save durable checkpoints (on the run's filesystem): a kind acts on it."""
        return any(KINDS[k].mount for k in self.kinds)

    @property
    def nan_poison(self) -> bool:
        """Whether the workers take SIGUSR2 as nan_grads' poison (else it keeps its default action)."""
        return FaultKind.NAN_GRADS in self.kinds

    @property
    def hang_fault(self) -> bool:
        """Whether the workers take SIGUSR1 as worker_hang's hang (else it keeps its default action)."""
        return FaultKind.WORKER_HANG in self.kinds


RELAY_CHOICES = ("off", "on", "mixed")


def relayed(relay: str, node_number: int) -> bool:
    """Whether node ``node_number``'s agent runs with relay on (``Settings.relay``). Pure."""
    return relay == "on" or (relay == "mixed" and node_number % 2 == 0)


def _workload_args(p: argparse.ArgumentParser) -> None:
    """The flags that choose the workload: its device, fp16, its worker API, the bug scenario's."""
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where each worker's model trains (agents/mlp.py --device): cuda puts every worker's model "
        "on a GPU (several may share one); the groups stay gloo. Default cpu",
    )
    p.add_argument(
        "--fp16",
        action="store_true",
        help="fp16 autocast with a GradScaler (agents/mlp.py --fp16; needs --device cuda)",
    )
    p.add_argument(
        "--form",
        choices=("short", "dropin"),
        default="short",
        help="the workload's worker API: short (agents/mlp.py, ElasticTrainer) or dropin "
        "(agents/mlp_dropin.py: its own loop, elasticd's DistributedDataParallel); default short",
    )
    p.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="faults",
        help="faults: random faults, judged by the invariants; bug: no fault, a workload that raises the same "
        "exception at --raise-at-step on every rank, judged by how the job stops (every agent exits 3, "
        "elasticctl status names the step and the exception). Default faults",
    )
    p.add_argument(
        "--replica-size",
        type=int,
        default=1,
        metavar="K",
        help="each node's agent runs K workers that shard the model among themselves with FSDP2 "
        "(agents/mlp_sharded.py, --replica-size K; docs/sharded.md), data parallel across the nodes; "
        "a worker fault hits one of them. Default 1: one worker per node (agents/mlp.py)",
    )
    p.add_argument(
        "--raise-at-step",
        type=int,
        default=BUG_STEP,
        metavar="S",
        help=f"--scenario bug: the step every rank raises at (default {BUG_STEP})",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m elasticd.chaos",
        description="Fault injection: a local job run by real elasticd agents under random, seeded faults; "
        "the invariants are checked from the outside at the end.",
    )
    p.add_argument("--minutes", type=float, default=5.0, help="how long to inject faults (default 5)")
    p.add_argument("--mean-interval-s", type=float, default=10.0, help="mean seconds between faults (default 10)")
    p.add_argument("--seed", type=int, default=None, help="seed of the schedule (default: from the clock; printed)")
    p.add_argument(
        "--faults",
        default=None,
        metavar="KIND[,KIND]",
        help=f"fault kinds to inject (default: every kind possible here): {', '.join(k.value for k in FaultKind)}",
    )
    p.add_argument(
        "--mix",
        choices=MIXES,
        default="uniform",
        help="uniform: every kind alike (a short run covers each); production: kinds drawn by the shares of "
        "Llama 3's unplanned interruptions (GPU 58.7 %%, software 13.4 %%, host 11 %%, network 10.1 %%, ...; "
        "elasticd.chaos.schedule.PRODUCTION_MIX). Default uniform",
    )
    p.add_argument("--nodes", type=int, default=3, help="agents at the start (default 3)")
    p.add_argument("--min-nodes", type=int, default=2, help="the job's min size; never taken below (default 2)")
    p.add_argument("--max-nodes", type=int, default=None, help="the job's max size (default --nodes + 1)")
    p.add_argument(
        "--etcd-members",
        type=int,
        choices=(1, 3),
        default=1,
        help="1: one etcd server; 3: a 3-member etcd cluster on loopback (default 1)",
    )
    p.add_argument(
        "--netns",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run every node on a network-namespace host of its own, on a bridge the run creates "
        "(needed by link_down; needs root and `ip netns`). Default: on when possible; --no-netns: "
        "every node on loopback",
    )
    p.add_argument(
        "--link-down-s",
        type=float,
        default=None,
        help=f"how long link_down keeps a host's link down; more than the lease TTL (default "
        f"{link_down_s_default(TIMEOUTS.lease_ttl_s):g})",
    )
    p.add_argument(
        "--etcd-outage-s",
        type=float,
        default=5.0,
        help="how long etcd (or a member) stays down in an outage (default 5)",
    )
    p.add_argument(
        "--step-sleep", type=float, default=0.05, help="extra seconds per step in each worker (default 0.05)"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps of the job (default: about what a fault-free job commits in the warm-up and --minutes)",
    )
    p.add_argument(
        "--warmup-s",
        type=float,
        default=10.0,
        help="fault-free seconds at each world size from --nodes to --max-nodes before the faults "
        "(measures the step time at each size; default 10)",
    )
    p.add_argument(
        "--relay",
        choices=RELAY_CHOICES,
        default="on",
        help="the agents' relay setting (relay.node: one etcd lease per node): on (the agents' "
        "default), off, or mixed (on for the even node numbers: both paths under the same faults); "
        "default on",
    )
    _workload_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="empty or new directory for logs, audit files and etcd data (kept); default: a temporary "
        "directory, removed at the end unless --keep or the run failed",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    return p.parse_args(argv)


def _check_workload(args: argparse.Namespace) -> None:
    """The workload's flags agree with each other.

    Raises:
        ConfigError: they do not; the message names the flag.
    """
    if args.fp16 and args.device != "cuda":
        raise ConfigError("--fp16: needs --device cuda")
    if args.form == "dropin" and (args.device != "cpu" or args.fp16):
        raise ConfigError("--form dropin: runs on the CPU without --fp16")
    if args.raise_at_step < 1:
        raise ConfigError(f"--raise-at-step: at least 1, got {args.raise_at_step}")
    if args.scenario == "bug" and (args.form != "short" or args.fp16):
        raise ConfigError("--scenario bug: runs agents/mlp.py (--form short) without --fp16")
    if args.replica_size < 1:
        raise ConfigError(f"--replica-size: at least 1, got {args.replica_size}")
    if args.replica_size > 1 and (args.form != "short" or args.device != "cpu" or args.scenario != "faults"):
        raise ConfigError(
            "--replica-size: more than 1 runs agents/mlp_sharded.py on the CPU, with --form short and --scenario faults"
        )


def no_poison(form: str, fp16: bool, replica_size: int = 1) -> str:
    """Why the workload cannot take nan_grads' poison ("" when it can)."""
    if replica_size > 1:
        return f"--replica-size {replica_size} (agents/mlp_sharded.py has none)"
    if form != "short":
        return "--form dropin (agents/mlp_dropin.py has none)"
    if fp16:
        return "--fp16 (the GradScaler skips non-finite steps itself)"
    return ""


def no_hang(form: str, replica_size: int = 1) -> str:
    """Why the workload cannot hang on worker_hang's signal ("" when it can)."""
    if replica_size > 1:
        return f"--replica-size {replica_size} (agents/mlp_sharded.py has none)"
    if form != "short":
        return "--form dropin (agents/mlp_dropin.py has none)"
    return ""


def make_settings(args: argparse.Namespace, netns: bool = False, place: Place | None = None) -> Settings:
    """Validate the arguments (``netns``: whether the nodes run on network-namespace hosts;
    ``place``: what else the run has, for the kinds that need it).

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
    steps = (
        args.steps
        if args.steps is not None
        else estimate_steps(
            args.step_sleep,
            warmup_estimate_s(args.warmup_s, args.nodes, max_nodes) + args.minutes * 60.0 + 10.0,
            SHARDED_STEP_OVERHEAD_S if args.replica_size > 1 else STEP_OVERHEAD_S,
        )
    )
    if steps < 20:
        raise ConfigError(f"--steps: at least 20, got {steps}")
    link_down_s = link_down_s_default(TIMEOUTS.lease_ttl_s) if args.link_down_s is None else args.link_down_s
    if link_down_s <= TIMEOUTS.lease_ttl_s:
        raise ConfigError(
            f"--link-down-s: must be more than the lease TTL ({TIMEOUTS.lease_ttl_s:g} s), got {link_down_s}"
        )
    _check_workload(args)
    if args.scenario == "bug" and args.steps is None:
        steps = args.raise_at_step + BUG_STEP  # never reached: the job stops at --raise-at-step
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000
    return Settings(
        minutes=args.minutes,
        mean_interval_s=args.mean_interval_s,
        seed=seed,
        kinds=parse_faults(args.faults, args.etcd_members, netns, place),
        nodes=args.nodes,
        min_nodes=args.min_nodes,
        max_nodes=max_nodes,
        etcd_members=args.etcd_members,
        etcd_outage_s=args.etcd_outage_s,
        step_sleep_s=args.step_sleep,
        steps=steps,
        warmup_s=args.warmup_s,
        netns=netns,
        link_down_s=link_down_s,
        relay=args.relay,
        device=args.device,
        fp16=args.fp16,
        form=args.form,
        mix=args.mix,
        scenario=args.scenario,
        raise_at_step=args.raise_at_step if args.scenario == "bug" else 0,
        replica_size=args.replica_size,
    )
