"""``python -m elasticd.bench agent``: what the node agent adds to recovery, measured end to end.

Owns the ``agent`` benchmark. Each repetition runs one job of the default workload
(``agents/mlp.py``) under ``nodes`` real ``elasticd`` agents (one worker each, separate processes in
sessions of their own) on a real local etcd, and injects three faults in turn:

* ``crash_detect_s``: SIGKILL of one node's worker -> the next generation record published in etcd
  (seen through an etcd watch on the generation key, stamped with the wall clock on arrival). The
  agent revokes the dead worker's lease at once, so nobody waits for the TTL;
* ``stop_detect_s``: once that worker is back (its agent restarted it and it rejoined), SIGSTOP of
  it -> the next generation published (its agent sees it stopped and revokes its lease, or ends its
  member lease of the relay, after ``stopped_worker_s``); it is continued and rejoins;
* ``hang_detect_s``: once that worker is back, SIGUSR1 of it (``agents/mlp.py --hang-on-sigusr1``:
  it hangs with every thread, a C call that keeps the GIL) -> the next generation published. With
  the relay off its own etcd lease ends after the TTL (its renewing thread cannot run); with the
  relay on its process and socket live on, and the survivors' reach check finds its Python silent
  for ``unresponsive_s`` (``rendezvous.answer``). Its agent then ends it as hung (``hang_timeout_s``
  ``HANG_TIMEOUT_S``) and restarts it;
* ``drain_s``: once that worker is back (its agent restarted it and it rejoined), SIGTERM of another
  node's agent -> the job's first commit at the smaller world size (audit ``commit`` lines' ``t``).
  Reported next to ``drain_step_time_s``, the median step time before the drain, because the target
  is 2 step times + 1 s;
* ``node_loss_recovery_s``: SIGKILL of a third agent's whole process group (the agent and its
  worker: a lost node) -> the survivor's next commit. Nobody revokes the lost worker's lease, so this
  includes waiting for it to expire (``lease_ttl_s``);
* ``steps_lost``: committed steps missing or repeated, by ``audit.check`` over every node's audit log.

``--relay both`` runs each repetition twice, the agents' relay off and on (``relay.node``: one etcd
lease per node, each worker a member lease of the relay), and prints the figures side by side with
their ratios on/off: a fault must be seen no later under the node's one lease.

Before those, ``spare_reps`` repetitions of the warm-spare figures (``bench.spares``: ``full_size_s``,
``node_replace_s`` and ``overhead_ratio``, with spares and without, in the same run).

Every process it starts is tracked by PID (the agents by process group) and killed in ``finally``.
It never changes how elasticd behaves: the agents get their settings as flags.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from elasticd.bench.agentjob import SETTLE_STEPS, AgentBenchSettings, AgentJob, step_time, steps_at
from elasticd.bench.common import (
    PHASE_TIMEOUT_S,
    WORKLOAD,
    BenchError,
    dist_version,
    fmt,
    median_of,
    progress,
    run_subcommand,
)
from elasticd.bench.spares import render_spares, run_spare_reps
from elasticd.errors import ElasticdError
from elasticd.testing.etcd import EtcdServer

HANG_TIMEOUT_S = 3.0  # the agents' --hang-timeout-s: the hung worker is ended and restarted soon after

AGENT_TARGETS = {
    "crash_detect_s": "<= 0.2 s",
    "hang_detect_s": "<= lease TTL + 1 s",
    "node_loss_recovery_s": "<= lease TTL + 1 s",
    "drain_s": "<= 2 step times + 1 s",
    "steps_lost": "0",
}


@dataclass
class AgentRep:
    relay: bool = False
    crash_detect_s: float | None = None
    stop_detect_s: float | None = None
    hang_detect_s: float | None = None
    drain_s: float | None = None
    drain_step_time_s: float | None = None
    node_loss_recovery_s: float | None = None
    steps_lost: int = 0
    violations: list[str] = field(default_factory=list)
    error: str | None = None


def run_agent_rep(etcd: EtcdServer, workdir: Path, rep: int, s: AgentBenchSettings) -> AgentRep:
    out = AgentRep(relay=s.relay_on)
    name = f"rep{rep}{'-relay' if s.relay_on else ''}"
    job_id = f"agentbench{rep}{'r' if s.relay_on else ''}x{int(time.time())}"
    job = AgentJob(etcd, workdir / name, job_id, s, workload=("--hang-on-sigusr1",))
    nodes = [f"node-{i}" for i in range(s.nodes)]
    victim, drained, lost = nodes[-1], nodes[-2], nodes[0]
    try:
        job.watch.start()
        for node in nodes:
            job.start(node, "--hang-timeout-s", str(HANG_TIMEOUT_S))
        job.wait_for(lambda: len(steps_at(job.commits, s.nodes)) >= SETTLE_STEPS, f"{s.nodes} workers to train")

        # 1. a worker crashes, stops, hangs under its agent
        out.crash_detect_s = _detect(job, victim, s, signal.SIGKILL, "crash", "the restarted worker")
        out.stop_detect_s = _detect(job, victim, s, signal.SIGSTOP, "stop", "the continued worker", signal.SIGCONT)
        out.hang_detect_s = _detect(job, victim, s, signal.SIGUSR1, "hang", "the hung worker's restart")

        # 2. a node is drained (SIGTERM to its agent)
        out.drain_step_time_s = step_time(job.commits, s.nodes)
        job.expected_gone.add(drained)
        drain_t = time.time()
        job.agents[drained].signal(signal.SIGTERM)
        job.wait_for(lambda: bool(job.commits_since(drain_t, s.nodes - 1)), "a commit at the smaller size")
        out.drain_s = min(float(r["t"]) for r in job.commits_since(drain_t, s.nodes - 1)) - drain_t  # type: ignore[arg-type]
        if job.agents[drained].wait(PHASE_TIMEOUT_S) != 0:
            raise BenchError(f"the drained agent {drained} did not exit 0; see {job.agents[drained].log_path}")
        job.wait_for(
            lambda: len(steps_at(job.commits_since(drain_t), s.nodes - 1)) >= SETTLE_STEPS, "steps at the smaller size"
        )

        # 3. a node is lost: its agent and its worker are SIGKILLed together
        job.expected_gone.add(lost)
        lost_t = time.time()
        job.agents[lost].kill_group()
        job.wait_for(lambda: bool(job.commits_since(lost_t, s.nodes - 2)), "the survivor's commit after the node loss")
        out.node_loss_recovery_s = min(float(r["t"]) for r in job.commits_since(lost_t, s.nodes - 2)) - lost_t  # type: ignore[arg-type]
        job.wait_for(
            lambda: len(steps_at(job.commits_since(lost_t), s.nodes - 2)) >= SETTLE_STEPS, "steps after the node loss"
        )
    except (BenchError, ElasticdError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    finally:
        job.stop()
    out.steps_lost, out.violations = job.audit()
    return out


def _detect(
    job: AgentJob, node: str, s: AgentBenchSettings, fault: int, what: str, back: str, resume: int | None = None
) -> float:
    """Signal ``fault`` to ``node``'s worker -> the next generation published (seconds); ``resume``
    (if any) is signalled once it is out. Then waits until ``back`` rejoined and the job trained at
    its full size again: SIGKILL (its agent restarts it), SIGSTOP and SIGCONT (it rejoins), SIGUSR1
    (``--hang-on-sigusr1``: it hangs holding the GIL; its agent ends it as hung and restarts it)."""
    gen = job.generation()
    pid = job.worker_pid(node)
    t = time.time()
    os.kill(pid, fault)
    try:
        job.wait_for(lambda: job.watch.first_after(gen) is not None, f"the generation after the {what}")
    finally:
        if resume is not None:
            os.kill(pid, resume)
    published = job.watch.first_after(gen)
    assert published is not None
    job.wait_for(lambda: len(steps_at(job.commits_since(t), s.nodes)) >= SETTLE_STEPS, f"{back} to rejoin and train")
    return published[1] - t


DETECTION = ("crash_detect_s", "stop_detect_s", "hang_detect_s", "node_loss_recovery_s", "drain_s")


def _figures(reps: list[AgentRep]) -> dict[str, float | int | None]:
    return {
        **{name: median_of(getattr(r, name) for r in reps) for name in DETECTION},
        "drain_step_time_s": median_of(r.drain_step_time_s for r in reps),
        "steps_lost": sum(r.steps_lost for r in reps),
    }


def relay_modes(relay: str) -> tuple[bool, ...]:
    """The relay settings each repetition runs with: ``--relay`` off, on or both. Pure."""
    return {"off": (False,), "on": (True,), "both": (False, True)}[relay]


def run_agent_bench(s: AgentBenchSettings, workdir: Path, progress: Callable[[str], None]) -> dict[str, object]:
    reps: list[AgentRep] = []
    spares: dict[str, object] = {"figures": {}, "targets": {}, "reps": [], "errors": [], "violations": []}
    with EtcdServer(data_dir=str(workdir / "etcd")) as etcd:
        if s.spare_reps:
            spares = run_spare_reps(etcd, workdir, s, s.spare_reps, progress)
        for i in range(s.reps):
            for relay in relay_modes(s.relay):  # alternating: both ways meet the same machine load
                r = run_agent_rep(etcd, workdir, i, replace(s, relay_on=relay))
                progress(
                    f"rep {i + 1}/{s.reps}{' (relay)' if relay else ''}: crash_detect {fmt(r.crash_detect_s)} s, "
                    f"stop_detect {fmt(r.stop_detect_s)} s, hang_detect {fmt(r.hang_detect_s)} s, "
                    f"drain {fmt(r.drain_s)} s "
                    f"(step {fmt(r.drain_step_time_s, 4)} s), node_loss {fmt(r.node_loss_recovery_s)} s, "
                    f"steps_lost {r.steps_lost}" + (f", ERROR {r.error}" if r.error else "")
                )
                reps.append(r)

    def spread(name: str, of: list[AgentRep]) -> list[float]:
        return sorted(v for v in (getattr(r, name) for r in of) if v is not None)

    off, on = [r for r in reps if not r.relay], [r for r in reps if r.relay]
    figures: dict[str, object] = {**(_figures(off) if off else {})}
    if on:
        figures |= {f"{k}_relay": v for k, v in _figures(on).items()}
    if off and on:
        for name in DETECTION:
            a, b = figures[name], figures[f"{name}_relay"]
            figures[f"{name}_relay_ratio"] = b / a if isinstance(a, float) and isinstance(b, float) and a else None
    figures |= spares["figures"]  # type: ignore[arg-type]
    return {
        "benchmark": "agent",
        "settings": {**asdict(s), "workload": f"{WORKLOAD} (one worker per agent)", "torch": dist_version("torch")},
        "figures": figures,
        "targets": {**AGENT_TARGETS, **spares["targets"]},  # type: ignore[dict-item]
        "spread": {k: spread(k, off) for k in DETECTION if off}
        | {f"{k}_relay": spread(k, on) for k in DETECTION if on},
        "reps": [asdict(r) for r in reps],
        "spare_reps": spares["reps"],
        "errors": [r.error for r in reps if r.error] + spares["errors"],  # type: ignore[operator]
        "violations": [v for r in reps for v in r.violations] + spares["violations"],  # type: ignore[operator]
    }


def render_agent(result: Mapping[str, object]) -> str:
    fig, spread, s = result["figures"], result["spread"], result["settings"]
    assert isinstance(fig, dict) and isinstance(spread, dict) and isinstance(s, dict)
    ttl = float(s["lease_ttl_s"])
    step = fig.get("drain_step_time_s", fig.get("drain_step_time_s_relay"))
    rows = [
        ("crash_detect_s", "SIGKILL of a worker -> next generation published", "<= 0.2"),
        ("stop_detect_s", "SIGSTOP of a worker -> next generation published", f"<= {ttl:g}"),
        ("hang_detect_s", "a worker hung holding the GIL -> next generation published", f"<= {ttl + 1:g}"),
        ("node_loss_recovery_s", "SIGKILL of an agent + its worker -> survivors' next commit", f"<= {ttl + 1:g}"),
        (
            "drain_s",
            "SIGTERM of an agent -> first commit at the smaller size",
            f"<= {2 * step + 1:.3f}" if isinstance(step, float) else "<= 2 steps + 1",
        ),
    ]
    modes = [m for m in ("", "_relay") if f"steps_lost{m}" in fig]
    head = {"": "relay off", "_relay": "relay on"}
    lines = [
        f"elasticd agent benchmark: {s['nodes']} agents x 1 worker, {s['reps']} reps, lease TTL {ttl:g} s, "
        f"keepalive {s['keepalive_s']:g} s, step sleep {s['step_sleep_s']:g} s; medians (spread)",
        "",
        f"{'figure':<22} "
        + " ".join(f"{head[m]:>26}" for m in modes)
        + (f" {'on/off':>7}" if len(modes) == 2 else "")
        + f" {'target':<8} what",
    ]
    for name, what, target in rows:
        cells = []
        for m in modes:
            values = spread.get(f"{name}{m}") or []
            rng = f"{values[0]:.3f}..{values[-1]:.3f}" if values else "-"
            cells.append(f"{fmt(fig.get(f'{name}{m}')):>8} ({rng:>15})")
        ratio = f" {fmt(fig.get(f'{name}_relay_ratio')):>7}" if len(modes) == 2 else ""
        lines.append(f"{name:<22} " + " ".join(f"{c:>26}" for c in cells) + f"{ratio} {target:<8} {what}")
    lines.append(f"{'drain_step_time_s':<22} {fmt(step, 4):>26} median step time before the drain")
    lost = " + ".join(str(fig[f"steps_lost{m}"]) for m in modes)
    lines.append(f"{'steps_lost':<22} {lost:>26} by the audit checker, over every fault (target 0)")
    if "full_size_s" in fig:
        lines += [
            "",
            f"warm spares ({s['spare_reps']} reps each way, --spares 1 on every node and one --standby "
            "node, against none)",
        ] + render_spares(fig)
    errors, violations = result["errors"], result["violations"]
    assert isinstance(errors, list) and isinstance(violations, list)
    lines += [f"ERROR {e}" for e in errors] + [f"VIOLATION {v}" for v in violations]
    return "\n".join(lines)


def add_args(p: argparse.ArgumentParser) -> None:
    """``agent``'s flags."""
    d = AgentBenchSettings()
    p.add_argument("--reps", type=int, default=d.reps, help="repetitions (default %(default)s)")
    p.add_argument(
        "--lease-ttl", type=float, default=d.lease_ttl_s, help="the agents' --lease-ttl-s (default %(default)s)"
    )
    p.add_argument(
        "--keepalive", type=float, default=d.keepalive_s, help="the agents' --keepalive-s (default %(default)s)"
    )
    p.add_argument(
        "--step-sleep", type=float, default=d.step_sleep_s, help="the workers' --step-sleep (default %(default)s)"
    )
    p.add_argument(
        "--relay",
        choices=("off", "on", "both"),
        default=d.relay,
        help="the agents' node relay (one etcd lease per node): off, on, or both, each repetition once "
        "each way, with the ratios on/off (default %(default)s)",
    )
    p.add_argument(
        "--spare-reps",
        type=int,
        default=d.spare_reps,
        help="repetitions of the warm-spare figures, with spares and without (0: skip; default %(default)s)",
    )


def run_cmd(args: argparse.Namespace) -> int:
    """``agent``: run it, print the figures; 1 when a repetition failed or a step was lost."""
    s = AgentBenchSettings(
        reps=args.reps,
        lease_ttl_s=args.lease_ttl,
        keepalive_s=args.keepalive,
        step_sleep_s=args.step_sleep,
        spare_reps=args.spare_reps,
        relay=args.relay,
    )
    s.timeouts()  # validates the TTL/keepalive pair before anything starts
    return run_subcommand(
        args, "elasticd-bench-agent-", lambda workdir: run_agent_bench(s, workdir, progress), render_agent
    )
