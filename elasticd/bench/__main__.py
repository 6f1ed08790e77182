"""``python -m elasticd.bench <subcommand> [--json]``: benchmarks of elasticd on this machine.

Each subcommand measures elasticd end to end against real processes (a real etcd, real workers or
node agents) and prints its figures: a table, or one JSON object with ``--json``.

* ``recovery``: fault recovery (SIGKILL, SIGSTOP), a newcomer's join, step time vs plain torch DDP
  and the newcomer's state transfer vs a raw gloo broadcast (``bench.recovery``);
* ``agent``: under real node agents, crash detection, drain and node-loss recovery (``bench.agent``);
* ``straggler``: a slowed worker found and its node replaced by a standby node's spare
  (``bench.straggler``);
* ``checkpoint``: durable checkpoints' step overhead, write throughput and resume time
  (``bench.checkpoint``);
* ``outage``: what an etcd outage with no membership change costs (``bench.outage``);
* ``leader``: what the loss of the etcd leader costs, in a 3-member cluster (``bench.leader``);
* ``host-loss``: a host gone from the network (its link cut, on netns hosts), the reach check
  against the lease alone (``bench.hostloss``);
* ``rendezvous``: the rendezvous with many lightweight members on one local etcd, and a model of
  its cost at fleet scale (``bench.rendezvous``).

Owns the command line only: the registry of subcommands, their parser and ``main``. Nothing imports
this module; it holds no measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from elasticd.bench import agent, checkpoint, hostloss, leader, outage, recovery, rendezvous, sharded, straggler


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {
    "recovery": Subcommand(
        "fault recovery, join, step overhead vs DDP and state-transfer throughput of a 3-worker job",
        recovery.add_args,
        recovery.run_cmd,
    ),
    "agent": Subcommand(
        "under real node agents: crash detection, drain and node-loss recovery (elasticd.bench.agent)",
        agent.add_args,
        agent.run_cmd,
    ),
    "straggler": Subcommand(
        "under real node agents: a worker slowed by a stop/continue duty cycle, found and its node replaced by a "
        "standby node's spare (detection time, step rate while slowed and after, elasticd.bench.straggler)",
        straggler.add_args,
        straggler.run_cmd,
    ),
    "checkpoint": Subcommand(
        "durable checkpoints with ~100 MB of state: step overhead, write throughput vs a plain "
        "write+fsync, resume time vs a fresh start (on --workdir's filesystem)",
        checkpoint.add_args,
        checkpoint.run_cmd,
    ),
    "outage": Subcommand(
        "an etcd outage with no membership change: commit rate during it vs before, steps lost, "
        "regroups (elasticd.bench.outage)",
        outage.add_args,
        outage.run_cmd,
    ),
    "leader": Subcommand(
        "the etcd leader SIGKILLed in a 3-member cluster while a job trains: commit rate after each kill "
        "vs before, time lost per kill, steps lost, regroups (elasticd.bench.leader)",
        leader.add_args,
        leader.run_cmd,
    ),
    "host-loss": Subcommand(
        "a host's link cut (network-namespace hosts, as root): the survivors' recovery with the reach "
        "check against the lease alone, in the same run (elasticd.bench.hostloss)",
        hostloss.add_args,
        hostloss.run_cmd,
    ),
    "sharded": Subcommand(
        "sharded training (replicas of 2 FSDP2 ranks under real agents) next to data parallel: a rank "
        "SIGKILLed -> the survivors' next commit, a newcomer replica's state sync, step time vs plain HSDP "
        "(elasticd.bench.sharded)",
        sharded.add_args,
        sharded.run_cmd,
    ),
    "rendezvous": Subcommand(
        "N lightweight members (threads in processes, no torch) on one local etcd: a join round and a "
        "leave timed and counted, and a model of their cost at 1,000-16,000 members (elasticd.bench.rendezvous)",
        rendezvous.add_args,
        rendezvous.run_cmd,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    # The docstring less its last paragraph (what this module owns: for readers of the code).
    description = (__doc__ or "").split("\n\nOwns ", 1)[0]
    parser = argparse.ArgumentParser(
        prog="python -m elasticd.bench", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
        p.add_argument(
            "--workdir", default=None, help="keep the logs and audit files here (default: a temporary dir, removed)"
        )
        cmd.add_args(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Set before any worker or transfer process starts: they inherit it (one thread per process,
    # as the workers run on a shared node).
    os.environ["OMP_NUM_THREADS"] = "1"
    return SUBCOMMANDS[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
