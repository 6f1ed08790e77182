"""The README's main command: a local elastic job run by real node agents, with faults, watched live.

Owns the demo only. It starts a real etcd on loopback and ``--nodes`` ``elasticd`` node agents
(``node-0``, ``node-1``, ...), each a separate process in a session of its own running one worker of
the default workload ``agents/mlp.py``. Then, going by the committed step:

1. at about 1/5 of the steps it SIGKILLs the last node's worker. Its agent ends the worker's lease
   at once (its node relay sees the worker's socket close), the survivors regroup without waiting
   for the TTL, and the agent restarts the worker,
   which rejoins as a newcomer and receives the state from rank 0;
2. once that worker is back, at about 2/5, it drains ``node-1`` with ``elasticctl drain node-1``:
   its agent sees the request in etcd, the worker finishes its step and leaves, the agent exits 0,
   and the job goes on at the smaller size;
3. early enough (by the measured start-up time of a node) to join at about 3/5, it starts a new
   agent, ``node-<nodes>``, whose worker joins;
4. it prints ``elasticctl status`` once the new node trains, and ``elasticctl status`` and
   ``elasticctl events`` at the end, and writes the job's history as one picture with ``elasticctl
   timeline`` (``<workdir>/timeline.png``; its path is printed; needs the ``elasticd[plot]`` extra).

A progress line about once a second comes from the workers' audit logs and the generation record in
etcd; the run ends with the verdict of ``audit.check`` and of the agents' exit codes. It holds no
training, rendezvous or supervision logic, and it stops everything it started, by process group, on
every way out (Ctrl-C included).

Usage::

    python -m elasticd.demo [--nodes 3] [--steps 300] [--step-sleep 0.1] [--keep] [--workdir DIR]

Exit codes: 0 every agent exited 0, the killed worker was restarted and rejoined, the drained node
left, the new node joined, all steps were committed and the audit found no violation; 1 the run
failed; 2 bad arguments or no etcd binary; 130 interrupted.
"""

from __future__ import annotations

import argparse
import io
import math
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.errors import ConfigError, ElasticdError
from elasticd.store.kv import KeyValueStore
from elasticd.testing.audit import AuditReport, as_float, as_int, check_dir
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import (
    AuditTail,
    WorkerProcess,
    local_agent_argv,
    log_events,
    python_program,
    signal_pid,
)
from elasticd.testing.runner import make_workdir, run_to_exit
from elasticd.wire.keys import Keys
from elasticd.wire.records import GenerationRecord, decode_generation
from elasticd.wire.snapshot import parse_snapshot

JOB_ID = "demo"
SAMPLES = 2048  # the workload's dataset size; the audit checks every epoch against it
GLOBAL_BATCH = 64
TICK_S = 0.1  # how often the demo polls the audit logs, etcd and the processes
STATUS_EVERY_S = 1.0  # one progress line this often
EVENTS_SHOWN = 30  # the last events printed at the end (elasticctl events --limit)
PROGRESS_EVENT_S = 1.0  # rank 0's progress events (the timeline's step points): a short job, a fine picture
AGENT_EXIT_WAIT_S = 30.0  # after the job finished: how long the agents get to exit
# Short lease so that a frozen or lost node is noticed within seconds (the library default is 3 s).
DEMO_TIMEOUTS = Timeouts(lease_ttl_s=2.0, keepalive_s=0.5)


# ---------------------------------------------------------------------------------------------
# Reading what the workers write


def lease_ended(agent_log: Path, pid: int) -> bool:
    """The agent whose log is ``agent_log`` ended worker ``pid``'s lease: revoked its etcd lease
    (relay off), or its relay ended its member lease (``relay.leases``)."""
    revoked = log_events(agent_log, "worker_lease_revoked")
    ended = log_events(agent_log, "member_leases_ended")
    return any(r.get("pid") == pid for r in revoked) or any(pid in (r.get("pids") or ()) for r in ended)  # type: ignore[operator]


@dataclass
class GenerationSeen:
    """One generation as the demo saw it: from the audit sync lines and the etcd record."""

    number: int
    world_size: int
    cause: str  # the trainer's cause on the first rank that synced
    reason: str = ""  # the published record's reason (etcd), when seen
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
    generations: dict[int, GenerationSeen] = field(default_factory=dict)
    reasons: dict[int, GenerationRecord] = field(default_factory=dict)
    syncs: dict[str, list[tuple[float, int, int]]] = field(default_factory=dict)  # node -> (t, generation, rank)
    last_commit_t: float = 0.0
    pauses: dict[int, float] = field(default_factory=dict)  # generation -> seconds without a commit
    finals: list[int] = field(default_factory=list)  # the step of each worker's "final" line

    def absorb(self, node: str, rec: dict[str, object], say: Callable[[str], None]) -> None:
        """Fold one audit record in; announce generations and joins through ``say``."""
        event = rec.get("event")
        if event == "sync":
            gen, rank, world = as_int(rec["generation"]), as_int(rec["rank"]), as_int(rec["world_size"])
            if gen not in self.generations:
                seen = GenerationSeen(gen, world, str(rec.get("cause", "")))
                known = self.reasons.get(gen)
                if known is not None:
                    seen.reason, seen.members = known.reason, known.members
                self.generations[gen] = seen
                who = f" = {', '.join(_node_of(m) for m in seen.members)}" if seen.members else ""
                say(f"generation {gen}: world {world}{who} ({seen.reason or seen.cause})")
            history = self.syncs.setdefault(node, [])
            if gen > 1 and (not history or history[-1][1] != gen - 1):
                say(f"{node}'s worker joined as a newcomer: generation {gen}, rank {rank}, step {as_int(rec['step'])}")
            history.append((as_float(rec["t"]), gen, rank))
        elif event == "final":
            self.finals.append(as_int(rec["step"]))
        elif event == "commit":
            step, gen = as_int(rec["step"]), as_int(rec["generation"])
            t = as_float(rec["t"])
            current = self.generations.get(gen)
            if current is not None:
                if not current.first_step or step < current.first_step:
                    current.first_step, current.first_commit_t = step, t
                    if gen > 1 and self.last_commit_t:
                        self.pauses[gen] = max(0.0, t - self.last_commit_t)
                current.last_step = max(current.last_step, step)
            if step > self.step:
                self.step, self.generation, self.world_size = step, gen, as_int(rec["world_size"])
                self.loss = as_float(rec["loss"])
                self.last_commit_t = max(self.last_commit_t, t)

    def note_record(self, record: GenerationRecord) -> None:
        """Remember a published generation record (polled from etcd)."""
        self.reasons.setdefault(record.generation, record)
        seen = self.generations.get(record.generation)
        if seen is not None and not seen.reason:
            seen.reason, seen.members = record.reason, record.members

    def synced_after(self, node: str, t: float) -> bool:
        """Whether ``node``'s worker joined a generation after wall-clock time ``t``."""
        return any(when > t for when, _, _ in self.syncs.get(node, ()))


def _node_of(member_id: str) -> str:
    """``node-2.0.4711`` -> ``node-2`` (member ids are node.local_rank.pid)."""
    return member_id.split(".", 1)[0]


# ---------------------------------------------------------------------------------------------
# The run


@dataclass(frozen=True)
class Plan:
    nodes: int
    steps: int
    step_sleep: float
    kill_at: int  # SIGKILL the last node's worker once this step is committed
    drain_at: int  # drain node-1 at this step (once the killed worker is back)
    join_at: int  # start the new node early enough that it joins near this step
    min_workers: int
    timeout_s: float

    @property
    def victim(self) -> str:
        return f"node-{self.nodes - 1}"

    @property
    def drained(self) -> str:
        return "node-1"

    @property
    def newcomer(self) -> str:
        return f"node-{self.nodes}"


@dataclass
class Outcome:
    """What happened, for the summary and the exit code."""

    codes: dict[str, int | None] = field(default_factory=dict)  # node -> the agent's exit code
    killed_pid: int | None = None
    killed_t: float | None = None  # wall clock, comparable with the audit lines
    rejoined: bool = False
    drained_t: float | None = None
    newcomer_started: bool = False
    newcomer_joined: bool = False
    problems: list[str] = field(default_factory=list)
    report: AuditReport | None = None


class Demo:
    """One demo run in ``workdir``: an etcd, the agents, the display."""

    def __init__(self, plan: Plan, workdir: Path, out: TextIO) -> None:
        self.plan = plan
        self.workdir = workdir
        self.audit_dir = workdir / "audit"
        self.config_file = workdir / "elasticd.toml"
        self.out = out
        self.started = time.monotonic()
        self.etcd: EtcdServer | None = None
        self.store: KeyValueStore | None = None
        self._close_store: Callable[[], None] | None = None
        self.agents: dict[str, WorkerProcess] = {}
        self.progress = Progress()
        self.outcome = Outcome()
        self.startup_s: float | None = None  # agents spawned -> the first synced generation
        self._rate_samples: deque[tuple[float, int]] = deque()
        self._generation_at_kill = 0
        self._status_printed = False

    # -- output -----------------------------------------------------------------------------

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {text}", file=self.out, flush=True)

    def status_line(self) -> None:
        p = self.progress
        loss = f"{p.loss:.3g}" if p.loss is not None else "-"
        alive = [n for n, a in self.agents.items() if a.alive()]
        self.say(
            f"step {p.step:4d}/{self.plan.steps}  generation {p.generation}  world {p.world_size}  "
            f"loss {loss}  agents running: {', '.join(alive) or 'none'}"
        )

    def elasticctl(self, *args: str, when: str = "") -> int:
        """Run ``elasticctl`` as an operator would (in this process) and print what it printed."""
        assert self.etcd is not None
        from elasticd.cli import ctl_main  # an entry point's wiring, as in start_etcd

        buf = io.StringIO()
        argv = ["--etcd", self.etcd.endpoint, *args]
        code = ctl_main(argv, stdout=buf, stderr=buf)
        self.say(f"$ elasticctl {' '.join(argv)}   ({when + '; ' if when else ''}exit {code})")
        self.out.write("".join(f"    {line}\n" for line in buf.getvalue().splitlines()))
        self.out.flush()
        return code

    def print_status(self, when: str) -> None:
        """``elasticctl status`` of the job."""
        self.elasticctl(
            "status",
            "--job",
            JOB_ID,
            "--min-workers",
            str(self.plan.min_workers),
            "--max-workers",
            str(self.plan.nodes),
            when=when,
        )

    # -- processes --------------------------------------------------------------------------

    def start_etcd(self) -> None:
        self.etcd = EtcdServer(data_dir=str(self.workdir / "etcd"))
        self.etcd.start()
        self.say(
            f"etcd {self.etcd.endpoint} (pid {self.etcd.proc.pid if self.etcd.proc else '?'}), log {self.etcd.log_path}"
        )
        from elasticd.store.etcd import EtcdClient

        client = EtcdClient(EtcdConfig(endpoints=(self.etcd.endpoint,)), DEMO_TIMEOUTS, RetryPolicy(etcd_attempts=2))
        self.store, self._close_store = client, client.close

    def agent_argv(self, node: str) -> list[str]:
        assert self.etcd is not None
        program = python_program(
            "agents/mlp.py",
            "--steps",
            str(self.plan.steps),
            "--samples",
            str(SAMPLES),
            "--global-batch",
            str(GLOBAL_BATCH),
            "--step-sleep",
            str(self.plan.step_sleep),
            "--audit",
            str(self.audit_dir / f"{node}.jsonl"),
        )
        return local_agent_argv(
            self.config_file,
            [self.etcd.endpoint],
            JOB_ID,
            node,
            f"{self.plan.min_workers}:{self.plan.nodes}",
            DEMO_TIMEOUTS.lease_ttl_s,
            DEMO_TIMEOUTS.keepalive_s,
            program,
        )

    def start_agent(self, node: str) -> WorkerProcess:
        a = WorkerProcess(
            self.agent_argv(node),
            {"ELASTICD_PROGRESS_EVENT_S": str(PROGRESS_EVENT_S)},
            self.workdir / f"agent-{node}.log",
            new_session=True,
        ).start()
        self.agents[node] = a
        self.say(f"started agent {node} (pid {a.pid}), log {a.log_path}")
        return a

    def worker_pid(self, node: str) -> int | None:
        """The pid of ``node``'s worker, from its member record in etcd."""
        assert self.store is not None
        keys = Keys(EtcdConfig().prefix, JOB_ID)
        try:
            snap = parse_snapshot(keys, self.store.get_prefix(keys.prefix))
        except ElasticdError:
            return None
        pids = [m.pid for m in snap.members.values() if m.node == node]
        return pids[0] if len(pids) == 1 else None

    def stop_all(self) -> None:
        """Stop every process this demo started (each agent with its workers), and etcd (idempotent)."""
        for a in self.agents.values():
            a.stop()
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
        for node, rec in tail.read():
            self.progress.absorb(node, rec, self.say)
        for node, a in self.agents.items():
            if node not in self.outcome.codes and a.proc is not None and a.proc.poll() is not None:
                code = a.proc.returncode
                self.outcome.codes[node] = code
                stopped = log_events(a.log_path, "agent_stopped")
                why = str(stopped[-1].get("reason", "")) if stopped else "no agent_stopped line"
                self.say(f"agent {node} exited {code} ({why})")

    def step_plan(self) -> None:
        """Inject the next fault or change when its step has come."""
        p, o, plan = self.progress, self.outcome, self.plan
        if o.killed_pid is None and p.step >= plan.kill_at:
            pid = self.worker_pid(plan.victim)
            if pid is not None:
                o.killed_pid, o.killed_t = pid, time.time()
                self._generation_at_kill = p.generation
                signal_pid(pid, signal.SIGKILL)
                self.say(
                    f"killed {plan.victim}'s worker (pid {pid}) with SIGKILL at step {p.step}; "
                    f"its agent ends its lease and restarts it"
                )
        if o.killed_t is not None and not o.rejoined and p.synced_after(plan.victim, o.killed_t):
            o.rejoined = True
        if o.rejoined and o.drained_t is None and p.step >= plan.drain_at:
            o.drained_t = time.time()
            self.say(f"draining {plan.drained} at step {p.step}:")
            self.elasticctl("drain", plan.drained, "--job", JOB_ID)
        if o.drained_t is not None and not o.newcomer_started and plan.drained in o.codes:
            lead = math.ceil((self.startup_s or 0.0) * self.steps_per_s())
            if p.step >= plan.join_at - lead:
                o.newcomer_started = True
                self.say(
                    f"adding {plan.newcomer} at step {p.step} so that it joins near step {plan.join_at} "
                    f"(nodes took {self.startup_s or 0:.1f} s to start; {self.steps_per_s():.1f} steps/s)"
                )
                self.start_agent(plan.newcomer)
        if o.newcomer_started and not o.newcomer_joined and plan.newcomer in p.syncs:
            o.newcomer_joined = True
        if o.newcomer_joined and not self._status_printed and p.world_size == plan.nodes:
            self._status_printed = True
            self.print_status("the new node trains")

    def run(self) -> Outcome:
        plan = self.plan
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text("# the demo's agents take every setting from their flags\n")
        self.start_etcd()
        for i in range(plan.nodes):
            self.start_agent(f"node-{i}")
        tail = AuditTail(self.audit_dir)
        deadline = time.monotonic() + plan.timeout_s
        next_status = time.monotonic() + STATUS_EVERY_S
        spawned_at = time.monotonic()
        finished_at: float | None = None
        while time.monotonic() < deadline:
            self.poll(tail)
            self._sample_rate()
            if self.startup_s is None and self.progress.generations:
                self.startup_s = time.monotonic() - spawned_at
            self.step_plan()
            if not any(a.alive() for a in self.agents.values()):
                break
            if self.progress.step >= plan.steps:
                finished_at = finished_at or time.monotonic()
                if time.monotonic() - finished_at > AGENT_EXIT_WAIT_S:
                    self.outcome.problems.append(
                        f"agents still running {AGENT_EXIT_WAIT_S:g} s after the last step was committed"
                    )
                    break
            if time.monotonic() >= next_status:
                self.status_line()
                next_status += STATUS_EVERY_S
            time.sleep(TICK_S)
        else:
            self.outcome.problems.append(f"the job did not finish within --timeout {plan.timeout_s:g} s")
        self.poll(tail)
        self.status_line()
        if self.store is not None:
            self.print_status("the end")
            self.elasticctl("events", "--job", JOB_ID, "--limit", str(EVENTS_SHOWN), when="the job's history")
            self.elasticctl(
                "timeline",
                "--job",
                JOB_ID,
                "--out",
                str(self.workdir / "timeline.png"),
                when="the same history as one picture",
            )
        for node, a in self.agents.items():
            if a.alive():
                a.stop()
            self.outcome.codes.setdefault(node, a.proc.returncode if a.proc is not None else None)
        self.outcome.report = check_dir(self.audit_dir, SAMPLES)
        return self.outcome

    # -- the verdict ------------------------------------------------------------------------

    def verdict(self) -> bool:
        """Print the summary; True iff the run passed."""
        o, p, plan = self.outcome, self.progress, self.plan
        rep = o.report
        assert rep is not None
        problems = list(o.problems)
        for node, code in sorted(o.codes.items()):
            if code != 0:
                problems.append(f"agent {node} exited with {code} (log: {self.workdir / f'agent-{node}.log'})")
        if o.killed_pid is None:
            problems.append("no worker was killed (the job never reached the kill step)")
        elif not o.rejoined:
            problems.append(f"{plan.victim}'s restarted worker never rejoined")
        else:
            if not lease_ended(self.workdir / f"agent-{plan.victim}.log", o.killed_pid):
                problems.append(f"agent {plan.victim} did not end the killed worker's lease")
        if o.drained_t is None:
            problems.append(f"{plan.drained} was never drained")
        else:
            stopped = log_events(self.workdir / f"agent-{plan.drained}.log", "agent_stopped")
            if not stopped or stopped[-1].get("reason") != "drained":
                problems.append(f"agent {plan.drained} did not stop as drained: {stopped[-1:] or 'no line'}")
        if not o.newcomer_started:
            problems.append(f"{plan.newcomer} was never started")
        elif not o.newcomer_joined:
            problems.append(f"{plan.newcomer} never joined")
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
            who = ", ".join(_node_of(m) for m in seen.members) if seen and seen.members else ""
            span = f"steps {seen.first_step}-{seen.last_step}" if seen and seen.first_step else "no step committed"
            pause = f"; no commit for {p.pauses[gen]:.2f} s before its first step" if gen in p.pauses else ""
            w(f"  {gen:3d}  world {world}  {cause:<12} {span}{pause}   {who}\n")
        regroups = [g for g in sorted(rep.generations) if g > min(rep.generations, default=0)]
        w(f"recoveries        {len(regroups)} (generations after the first: {regroups})\n")
        last_loss = rep.losses.get(rep.last_step)
        if last_loss is not None:
            first = rep.losses.get(1)
            w(
                f"loss              {first:.4g} at step 1 -> {last_loss:.4g} at step {rep.last_step}\n"
                if first is not None
                else f"final loss        {last_loss:.4g}\n"
            )
        w(f"agents            {', '.join(f'{n}: exit {c}' for n, c in sorted(o.codes.items()))}\n")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m elasticd.demo",
        description="A local elastic job on loopback run by real node agents: a real etcd, --nodes agents "
        "with one worker of agents/mlp.py each; one worker is SIGKILLed (its agent restarts it), "
        "node-1 is drained with elasticctl drain, a new node joins; elasticctl status is printed; the audit checks the "
        "invariants at the end.",
    )
    p.add_argument("--nodes", type=int, default=3, help="agents at the start (>= 3; default 3)")
    p.add_argument("--steps", type=int, default=300, help="steps to commit (>= 30; default 300)")
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.1,
        help="extra seconds per step in each worker, so the run can be watched (default 0.1)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds (default 600)")
    p.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="empty or new directory for logs, audit files and etcd data (kept afterwards); "
        "default: a temporary directory, removed at the end unless --keep or the run failed",
    )
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    """Validate the arguments.

    Raises:
        ConfigError: an argument is out of range; the message names it.
    """
    if args.nodes < 3:
        raise ConfigError(f"--nodes: at least 3 (one loses its worker, one is drained), got {args.nodes}")
    if args.steps < 30:
        raise ConfigError(f"--steps: at least 30, got {args.steps}")
    if args.step_sleep < 0:
        raise ConfigError(f"--step-sleep: must be >= 0, got {args.step_sleep}")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout: must be > 0, got {args.timeout}")
    return Plan(
        nodes=args.nodes,
        steps=args.steps,
        step_sleep=args.step_sleep,
        kill_at=args.steps // 5,
        drain_at=2 * args.steps // 5,
        join_at=3 * args.steps // 5,
        # One node at a time is short of its worker (killed, then drained), and the job goes on.
        min_workers=args.nodes - 1,
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        plan = make_plan(args)
        workdir, remove = make_workdir(args.workdir, args.keep, "elasticd-demo-")
    except ConfigError as exc:
        print(f"elasticd.demo: {exc}", file=sys.stderr)
        return 2
    out = sys.stdout
    demo = Demo(plan, workdir, out)
    print(
        f"elasticd demo: {plan.nodes} node agents (1 worker each), {plan.steps} steps, world "
        f"{plan.min_workers}..{plan.nodes}, lease TTL {DEMO_TIMEOUTS.lease_ttl_s:g} s; SIGKILL {plan.victim}'s "
        f"worker at step {plan.kill_at}, drain {plan.drained} at step {plan.drain_at}, add {plan.newcomer} "
        f"near step {plan.join_at}",
        file=out,
    )
    print(
        f"work dir {workdir} (agent-<node>.log: each agent's and its workers' logs, audit/<node>.jsonl: "
        f"audit, etcd.log)",
        file=out,
        flush=True,
    )

    def body() -> int:
        demo.run()
        return 0 if demo.verdict() else 1

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    return run_to_exit("elasticd.demo", body, demo.stop_all, workdir, remove, say)


if __name__ == "__main__":
    sys.exit(main())
