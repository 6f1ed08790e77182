"""``python -m elasticd.bench host-loss``: a host gone from the network, noticed by the reach check
(``rendezvous.reach``) against the lease alone, measured in the same run.

Owns the ``host-loss`` benchmark. Needs root and a working ``ip netns``: every worker of
``agents/mlp.py`` runs on a network-namespace host of its own, joined to a bridge by a veth pair
(``chaos.netns``: made by the bench, deleted on every way out; traffic only to those addresses), and
etcd also listens on the bridge's address. Two jobs of ``workers`` workers, one after the other:

* ``reach``: the default settings (``reach_check_s`` 0.5 s, ``probe_s`` 0.25 s);
* ``lease``: the baseline, ``reach_check_s = 0``: the survivors wait for the cut host's lease.

In each, ``reps`` times, the link of host ``rep % workers`` is taken down (``ip link set ...
down`` on its bridge-side veth): ``host_loss_recovery_s`` is the cut -> the survivors' first commit
in a newer generation (one without it). The link comes back up once they committed; the host's
worker rejoins (``rejoin_s``: link up -> its first commit in the full-size generation) before the
next cut. Then the workers drain, and the audit logs of both jobs are checked.

Figures: ``host_loss_recovery_s`` (median, reach), ``host_loss_recovery_lease_s`` (median, lease),
``recovery_ratio`` = reach / lease (target <= 0.6 at a 2 s lease; the lease's part grows with the
TTL, the reach check's does not), ``rejoin_s`` (median, reach), ``steps_lost`` (both jobs).

``--agents``: the same cuts of a job whose workers real ``elasticd`` agents run, one agent and its
worker on each host (the link cut is the node's), in two jobs: ``relay_off`` (each worker holds
its own etcd lease) and ``relay_on`` (the agents' default: the node relay, one etcd lease per
node). Figures ``host_loss_recovery_s_relay_off`` and ``_relay_on``, ``relay_ratio`` = on / off
(target <= 1: a cut host is found no later under the node's one lease), ``rejoin_s`` (relay on),
``steps_lost``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from elasticd.bench.agentjob import AgentBenchSettings, AgentJob
from elasticd.bench.common import (
    DATASET_SIZE,
    PHASE_TIMEOUT_S,
    BenchError,
    BenchJob,
    LeaseSettings,
    Record,
    field_float,
    field_int,
    figure_rows,
    lost_steps,
    median_of,
    progress,
    run_subcommand,
)
from elasticd.chaos.netns import NetnsHosts, ip_addresses_and_routes, netns_plan, subnets_in_use, unusable_here
from elasticd.testing.audit import check_dir
from elasticd.testing.etcd import EtcdServer

MODES = {"reach": {}, "lease": {"ELASTICD_REACH_CHECK_S": "0"}}  # the baseline: the reach check off
TARGETS = {"recovery_ratio": "<= 0.6", "steps_lost": "0"}
AGENT_MODES = {"relay_off": False, "relay_on": True}  # --agents: the agents' --relay (relay off: the baseline)
AGENT_TARGETS = {"relay_ratio": "<= 1", "steps_lost": "0"}
WARMUP_STEPS = 30  # committed at full size before the first cut
SETTLE_S = 1.0  # after a rejoin, before the next cut


@dataclass(frozen=True)
class JobRun:
    """What one job measured."""

    recovery_s: list[float]
    rejoin_s: list[float]
    steps_lost: int
    violations: list[str]
    errors: list[str]


@dataclass(frozen=True)
class HostLossSettings(LeaseSettings):
    """What ``host-loss`` runs; printed next to the figures."""

    workers: int = 3
    reps: int = 5
    step_sleep_s: float = 0.02
    agents: bool = False  # the workers run under agents, relay off and on (else bare workers, reach and lease)


class CutJob(Protocol):
    """What ``_cuts`` asks of a running job (``BenchJob``, or ``_UnderAgents``)."""

    def generation(self) -> int: ...

    def wait_until(self, cond: Callable[[], bool], timeout: float, what: str) -> None: ...

    def first_commit_after(self, t: float, generation: int, timeout: float, what: str) -> Record: ...


class _UnderAgents:
    """An ``AgentJob`` with the calls ``_cuts`` makes of a ``BenchJob``."""

    def __init__(self, job: AgentJob) -> None:
        self.job = job

    def generation(self) -> int:
        self.job.poll()
        return self.job.generation()

    def wait_until(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        self.job.wait_for(cond, what, timeout)

    def first_commit_after(self, t: float, generation: int, timeout: float, what: str) -> Record:
        def found() -> list[Record]:
            return [c for c in self.job.commits if field_float(c, "t") > t and field_int(c, "generation") > generation]

        self.wait_until(lambda: bool(found()), timeout, what)
        time.sleep(0.2)  # let the other survivors write their line of the same step
        self.job.poll()
        return min(found(), key=lambda c: field_float(c, "t"))

    def world_size(self) -> int:
        last = max(self.job.commits, key=lambda c: field_int(c, "step"), default=None)
        return field_int(last, "world_size") if last else 0

    def max_step(self) -> int:
        return max((field_int(c, "step") for c in self.job.commits), default=0)


def _cuts(
    job: CutJob, commits_of: Callable[[int], list[Record]], net: NetnsHosts, s: HostLossSettings
) -> tuple[list[float], list[float]]:
    """``reps`` cuts of one running job (``commits_of(i)``: host ``i``'s commit lines so far):
    (recovery times, rejoin times)."""
    recoveries, rejoins = [], []
    for rep in range(s.reps):
        i = rep % s.workers
        host, cut = net.host(i), commits_of(i)
        generation = job.generation()
        net.set_link(host, up=False)
        cut_at = time.time()
        try:
            first = job.first_commit_after(cut_at, generation, PHASE_TIMEOUT_S, f"the survivors without host {i}")
        finally:
            net.set_link(host, up=True)
        up_at = time.time()
        recoveries.append(field_float(first, "t") - cut_at)
        job.wait_until(
            lambda: any(field_float(c, "t") > up_at and field_int(c, "world_size") == s.workers for c in cut),
            PHASE_TIMEOUT_S,
            f"host {i} rejoining",
        )
        rejoins.append(min(field_float(c, "t") for c in cut if field_float(c, "t") > up_at) - up_at)
        progress(
            f"cut {rep + 1}/{s.reps} (host {i}): the survivors went on after {recoveries[-1]:.3f} s, "
            f"it rejoined {rejoins[-1]:.3f} s after its link came back"
        )
        time.sleep(SETTLE_S)
    return recoveries, rejoins


def _job(mode: str, etcd: EtcdServer, net: NetnsHosts, s: HostLossSettings, workdir: Path) -> JobRun:
    bridge = net.plan.bridge_addr
    job = BenchJob(etcd, workdir / mode, f"hostloss-{mode}", {**s.worker_env(2), **MODES[mode]})
    try:
        for i in range(s.workers):
            host = net.host(i)
            job.spawn(
                "--steps",
                "100000000",
                "--step-sleep",
                str(s.step_sleep_s),
                prefix=net.exec_prefix(host),
                env={
                    "ELASTICD_ETCD_ENDPOINTS": etcd.endpoint_on(bridge),
                    "ELASTICD_NODE_ID": f"host{i}",
                    "ELASTICD_ADVERTISE_ADDR": host.addr,
                },
            )
        job.wait_until(
            lambda: job.world_size() == s.workers and job.max_step() >= WARMUP_STEPS,
            PHASE_TIMEOUT_S,
            f"{s.workers} workers training",
        )
        progress(f"{mode}: {s.workers} workers on netns hosts train; cutting links")
        recoveries, rejoins = _cuts(job, lambda i: job.workers[i].commits, net, s)
        for w in job.workers:
            w.proc.signal(signal.SIGTERM)  # drain: finish the step, leave
        codes = job.wait_exit(PHASE_TIMEOUT_S)
        rep = check_dir(job.dir, DATASET_SIZE)
        failed = [f"worker {i} exited {c}" for i, c in enumerate(codes) if c not in (0, None)]
        return JobRun(
            [round(r, 3) for r in recoveries], [round(r, 3) for r in rejoins], lost_steps(rep), rep.violations, failed
        )
    finally:
        job.stop()


def _agent_job(mode: str, etcd: EtcdServer, net: NetnsHosts, s: HostLossSettings, workdir: Path) -> JobRun:
    """One job under agents, one agent and its worker on each netns host; the agents' relay per
    ``mode`` (``AGENT_MODES``)."""
    relay = AGENT_MODES[mode]
    settings = AgentBenchSettings(
        lease_ttl_s=s.lease_ttl_s,
        keepalive_s=s.keepalive_s,
        nodes=s.workers,
        step_sleep_s=s.step_sleep_s,
        spare_reps=0,
        relay="on" if relay else "off",
        relay_on=relay,
    )
    job = AgentJob(etcd, workdir / mode, f"hostloss-{mode}", settings)
    under = _UnderAgents(job)
    names = [f"host{i}" for i in range(s.workers)]
    try:
        for i, name in enumerate(names):
            host = net.host(i)
            job.start(
                name,
                "--advertise-addr",
                host.addr,
                prefix=net.exec_prefix(host),
                etcd_endpoint=etcd.endpoint_on(net.plan.bridge_addr),
            )
        under.wait_until(
            lambda: under.world_size() == s.workers and under.max_step() >= WARMUP_STEPS,
            PHASE_TIMEOUT_S,
            f"{s.workers} agents' workers training",
        )
        progress(f"{mode}: {s.workers} agents on netns hosts train; cutting links")
        recoveries, rejoins = _cuts(under, lambda i: job.by_node.get(names[i], []), net, s)
        job.expected_gone.update(names)
        for name in names:
            job.agents[name].signal(signal.SIGTERM)  # drain: each agent's worker finishes its step and leaves
        codes = [job.agents[name].wait(PHASE_TIMEOUT_S) for name in names]
        lost, violations = job.audit()
        failed = [f"agent {n} exited {c}" for n, c in zip(names, codes, strict=True) if c != 0]
        return JobRun([round(r, 3) for r in recoveries], [round(r, 3) for r in rejoins], lost, violations, failed)
    finally:
        job.stop()


# by --agents: (the measured mode, its baseline, their figures' names, the ratio's name)
FIGURE_NAMES = {
    False: ("reach", "lease", "host_loss_recovery_s", "host_loss_recovery_lease_s", "recovery_ratio"),
    True: ("relay_on", "relay_off", "host_loss_recovery_s_relay_on", "host_loss_recovery_s_relay_off", "relay_ratio"),
}


def _figures(s: HostLossSettings, runs: Mapping[str, JobRun]) -> dict[str, object]:
    """The figures of the jobs ``runs`` (by mode): the measured mode's recovery, its baseline's,
    their ratio, the measured mode's rejoin, and the steps lost in both."""
    mode, base, name, base_name, ratio = FIGURE_NAMES[s.agents]
    got, against = median_of(runs[mode].recovery_s), median_of(runs[base].recovery_s)
    return {
        name: got,
        base_name: against,
        ratio: round(got / against, 3) if got is not None and against else None,
        "rejoin_s": median_of(runs[mode].rejoin_s),
        "steps_lost": sum(r.steps_lost for r in runs.values()),
    }


def run_host_loss(s: HostLossSettings, workdir: Path) -> dict[str, object]:
    """Both jobs, on netns hosts made for the run.

    Raises:
        BenchError: netns hosts cannot be had here, or a phase timed out.
    """
    why = unusable_here(os.getpid())
    ip = shutil.which("ip")
    if why or ip is None:
        raise BenchError(f"host-loss needs network-namespace hosts: {why or 'no ip binary'}")
    net = NetnsHosts(netns_plan(os.getpid(), subnets_in_use(ip_addresses_and_routes(ip))), ip, progress)
    etcd: EtcdServer | None = None
    try:
        net.setup()
        etcd = EtcdServer(extra_hosts=[net.plan.bridge_addr]).start()
        if s.agents:
            runs = {mode: _agent_job(mode, etcd, net, s, workdir) for mode in AGENT_MODES}
        else:
            runs = {mode: _job(mode, etcd, net, s, workdir) for mode in MODES}
    finally:
        if etcd is not None:
            etcd.stop()
        net.remove()
    return {
        "settings": asdict(s),
        "figures": _figures(s, runs),
        "targets": AGENT_TARGETS if s.agents else TARGETS,
        "runs": {mode: asdict(r) for mode, r in runs.items()},
        "violations": [v for r in runs.values() for v in r.violations],
        "errors": [e for r in runs.values() for e in r.errors],
    }


def render(result: Mapping[str, object]) -> str:
    fig, runs, st, targets = result["figures"], result["runs"], result["settings"], result["targets"]
    assert isinstance(fig, dict) and isinstance(runs, dict) and isinstance(st, dict) and isinstance(targets, dict)
    against = (
        "under agents, the node relay on against off (each worker its own lease)"
        if st["agents"]
        else "the reach check against the lease alone (reach_check_s = 0)"
    )
    lines = [
        f"a host's link cut, {st['reps']} times per job, {st['workers']} workers on netns hosts, "
        f"lease TTL {st['lease_ttl_s']:g} s: {against}",
        *figure_rows(fig, targets, 32),
    ]
    for mode, r in runs.items():
        lines.append(f"{mode}: recovery {r['recovery_s']}, rejoin {r['rejoin_s']}")
    for key in ("violations", "errors"):
        if result[key]:
            lines.append(f"{key}: {result[key]}")
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    """``host-loss``'s flags."""
    d = HostLossSettings()
    p.add_argument("--workers", type=int, default=d.workers)
    p.add_argument("--reps", type=int, default=d.reps, help="cuts per job")
    p.add_argument("--lease-ttl-s", type=float, default=d.lease_ttl_s)
    p.add_argument("--keepalive-s", type=float, default=d.keepalive_s)
    p.add_argument("--step-sleep", type=float, default=d.step_sleep_s)
    p.add_argument(
        "--agents",
        action="store_true",
        help="run each host's worker under an elasticd agent, the node relay off and on (ratio on/off)",
    )


def run_cmd(args: argparse.Namespace) -> int:
    """``host-loss``: run it, print the figures; 1 when a step was lost or a worker failed."""
    s = HostLossSettings(
        workers=args.workers,
        reps=args.reps,
        lease_ttl_s=args.lease_ttl_s,
        keepalive_s=args.keepalive_s,
        step_sleep_s=args.step_sleep,
        agents=args.agents,
    )
    return run_subcommand(args, "elasticd-bench-hostloss-", lambda workdir: run_host_loss(s, workdir), render)
