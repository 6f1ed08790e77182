"""A real Slurm cluster on this machine: a private munged, one slurmctld, and one slurmd per node,
each node a network-namespace host (``chaos.netns``) with an address of its own on a bridge.

Owns the cluster's configuration (``slurm_conf``, pure), why such a cluster cannot be had here
(``slurm_unusable``), and ``SlurmCluster``: it starts the daemons in the foreground, each under a
private config, state, spool and log directory and a private munge socket (``SLURM_CONF`` and
``AuthInfo=socket=``), so that a Slurm or munge the machine already runs is never touched; it
submits batch scripts, reads job states, loses a node (SIGKILL to every process in the node's
namespace: its slurmd, slurmstepd and tasks), and stops everything it started, by PID, then
deletes the namespaces and the bridge by name. It never decides what a test does.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from elasticd.chaos.netns import NetnsHosts, ip_addresses_and_routes, netns_plan, subnets_in_use

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")
PACKAGES = "slurmctld slurmd munge"
COMMAND_S = 20.0  # bound on one client command (sbatch, scontrol, squeue, mungekey)
READY_S = 60.0  # bound on the daemons coming up and every node registering as idle
STOP_S = 10.0  # bound on a daemon exiting after SIGTERM, before SIGKILL
SLURMD_TIMEOUT_S = 10  # a silent slurmd is declared DOWN after this (its job steps are told)


def slurm_unusable(euid: int, missing: Sequence[str], netns_error: str) -> str:
    """Why a Slurm cluster cannot be made here ("" when it can)."""
    if missing:
        return f"no {', '.join(missing)} (apt-get install {PACKAGES}, as .ci/bootstrap does)"
    if euid != 0:
        return "not root (slurmd runs every node's tasks as root, each node in a network namespace)"
    if netns_error:
        return f"no network namespaces: {netns_error}"
    return ""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


@dataclass(frozen=True)
class SlurmNode:
    name: str  # the Slurm node name (SLURMD_NODENAME), also the node id its agent takes
    addr: str  # its namespace's address (NodeAddr)
    ns: str  # its network namespace


def slurm_conf(
    root: Path,
    host: str,
    ctld_addr: str,
    ctld_port: int,
    slurmd_port: int,
    munge_socket: Path,
    nodes: Sequence[SlurmNode],
) -> str:
    """slurm.conf of the cluster: every path under ``root``; every node on ``host`` (one host name,
    one address per namespace); no cgroups (process groups track the tasks); root may run jobs;
    a node that comes back returns to service."""
    lines = [
        "ClusterName=elasticd",
        f"SlurmctldHost={host}({ctld_addr})",
        f"SlurmctldPort={ctld_port}",
        f"SlurmdPort={slurmd_port}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={munge_socket}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/run/slurmctld.pid",
        f"SlurmdPidFile={root}/run/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/log/slurmctld.log",
        f"SlurmdLogFile={root}/log/slurmd-%n.log",
        "ProctrackType=proctrack/pgid",
        "TaskPlugin=task/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SelectType=select/linear",
        "ReturnToService=2",
        f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
        "MessageTimeout=10",
        "InactiveLimit=0",
        "KillWait=5",
        "SlurmdParameters=config_overrides",
    ]
    lines += [
        f"NodeName={n.name} NodeAddr={n.addr} NodeHostname={host} CPUs=2 RealMemory=1000 State=UNKNOWN" for n in nodes
    ]
    lines.append("PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    return "\n".join(lines) + "\n"


def sbatch_job_id(output: str) -> int:
    """The job id in sbatch's ``--parsable`` answer (``<id>`` or ``<id>;<cluster>``).

    Raises:
        ValueError: no job id there.
    """
    m = re.match(r"\s*(\d+)", output)
    if m is None:
        raise ValueError(f"sbatch gave no job id: {output!r}")
    return int(m.group(1))


class SlurmCluster:
    """munged, slurmctld and ``len(names)`` slurmd, each in a namespace of its own; ``stop`` ends
    them all (idempotent). ``say`` reports what was made."""

    def __init__(self, root: Path, names: Sequence[str], say: Callable[[str], None] = print) -> None:
        self.root = root
        self.names = list(names)
        self.say = say
        self.ip = shutil.which("ip") or "/usr/sbin/ip"
        self.net = NetnsHosts(netns_plan(os.getpid(), subnets_in_use(ip_addresses_and_routes(self.ip))), self.ip, say)
        self.nodes: dict[str, SlurmNode] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}  # daemon name -> process
        self.conf = root / "etc" / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.socket"

    @property
    def bridge_addr(self) -> str:
        return self.net.plan.bridge_addr

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a Slurm client (or daemon) of this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra or {})
        return env

    def start(self) -> SlurmCluster:
        """Make the network, start munged, slurmctld and every slurmd; wait until every node is idle.

        Raises:
            RuntimeError: a daemon or an ``ip`` command failed, or the nodes did not come up in READY_S.
        """
        for d in ("etc", "state", "spool", "run", "log", "munge"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.net.setup()
        for i, name in enumerate(self.names):
            h = self.net.host(i)
            self.nodes[name] = SlurmNode(name, h.addr, h.ns)
        host = socket.gethostname().split(".")[0]
        ctld_port, slurmd_port = _free_port(self.bridge_addr), _free_port(self.bridge_addr)
        (self.root / "etc" / "cgroup.conf").write_text("CgroupPlugin=autodetect\n")
        self.conf.write_text(
            slurm_conf(
                self.root, host, self.bridge_addr, ctld_port, slurmd_port, self.munge_socket, list(self.nodes.values())
            )
        )
        self._start_munged()
        self._daemon("slurmctld", [binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes.values():
            (self.root / "spool" / node.name).mkdir(exist_ok=True)
            # nsenter, not `ip netns exec`: the latter mounts a fresh /sys, without the cgroup
            # hierarchy slurmd's cgroup plugin looks for at its start.
            prefix = [binary("nsenter"), f"--net=/run/netns/{node.ns}"]
            self._daemon(
                f"slurmd-{node.name}", [*prefix, binary("slurmd"), "-D", "-N", node.name, "-f", str(self.conf)]
            )
        self._wait_idle()
        return self

    def _start_munged(self) -> None:
        key = self.root / "munge" / "munge.key"
        self._run([binary("mungekey"), "--create", f"--keyfile={key}"])
        key.chmod(0o600)
        self._daemon(
            "munged",
            [
                binary("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={key}",
                f"--pid-file={self.root / 'munge' / 'munged.pid'}",
                f"--log-file={self.root / 'log' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + READY_S
        while not self.munge_socket.exists():
            if time.monotonic() > deadline or self.procs["munged"].poll() is not None:
                raise RuntimeError(f"munged did not start:\n{self.log_tail('munged')}")
            time.sleep(0.1)

    def _daemon(self, name: str, argv: list[str]) -> None:
        with (self.root / "log" / f"{name}.out").open("ab") as out:
            self.procs[name] = subprocess.Popen(
                argv, env=self.env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.say(f"{name}: pid {self.procs[name].pid}")

    def _run(self, argv: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None) -> str:
        """Run a client command; its stdout.

        Raises:
            RuntimeError: it failed or ran past COMMAND_S.
        """
        try:
            done = subprocess.run(
                list(argv),
                env=dict(env or self.env()),
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=COMMAND_S,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"{' '.join(argv)}: {exc}") from exc
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
        return done.stdout

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo shows it (``idle``, ``alloc``, ``down*``...)."""
        out = self._run([binary("sinfo"), "-N", "-h", "-o", "%N %t"])
        return dict(line.split() for line in out.splitlines() if line.strip())

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + READY_S
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
            try:
                states = self.node_states()
            except RuntimeError:
                states = {}
            if states and all(states.get(n) == "idle" for n in self.names):
                self.say(f"slurm: every node idle: {states}")
                return
            time.sleep(0.5)
        raise RuntimeError(f"the nodes did not come up in {READY_S} s: {states}\n{self.log_tail('slurmctld')}")

    def sbatch(
        self, options: Sequence[str], script: Path, args: Sequence[str], env: Mapping[str, str], cwd: Path
    ) -> int:
        """Submit ``script`` (with its ``args``) with sbatch ``options`` under ``env`` (on top of the
        cluster's), from ``cwd`` (the job's submit directory); its job id."""
        argv = [binary("sbatch"), "--parsable", *options, str(script), *args]
        return sbatch_job_id(self._run(argv, self.env(env), cwd))

    def job_state(self, job_id: int) -> str:
        """The job's state (``PENDING``, ``RUNNING``, ``COMPLETED``, ``FAILED``...; "" when unknown)."""
        try:
            out = self._run([binary("scontrol"), "-o", "show", "job", str(job_id)])
        except RuntimeError:
            return ""
        m = re.search(r"\bJobState=(\S+)", out)
        return m.group(1) if m else ""

    def job_nodes(self, job_id: int) -> list[str]:
        """The nodes allocated to the job, expanded."""
        out = self._run([binary("scontrol"), "-o", "show", "job", str(job_id)])
        m = re.search(r"\bNodeList=(\S+)", out)
        if m is None or m.group(1) == "(null)":
            return []
        return self._run([binary("scontrol"), "show", "hostnames", m.group(1)]).split()

    def node_pids(self, name: str) -> list[int]:
        """Every process in the node's namespace: its slurmd, slurmstepd and their tasks."""
        ino = os.stat(f"/run/netns/{self.nodes[name].ns}").st_ino
        pids = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.stat(d / "ns" / "net").st_ino == ino:
                    pids.append(int(d.name))
            except OSError:
                continue
        return pids

    def lose_node(self, name: str) -> list[int]:
        """SIGKILL every process on the node (slurmd, slurmstepd, the job's tasks): the node is lost
        with everything on it. Returns the PIDs signalled."""
        pids = self.node_pids(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs.pop(f"slurmd-{name}", None)
        return pids

    def log_tail(self, name: str, n: int = 30) -> str:
        text = ""
        for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
            if path.exists():
                text += f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-n:]) + "\n"
        return text

    def stop(self) -> None:
        """End every process of every node (by its namespace), then the daemons it started (by PID,
        SIGTERM then SIGKILL), then delete the namespaces and the bridge."""
        for name in list(self.nodes):
            if Path(f"/run/netns/{self.nodes[name].ns}").exists():
                self.lose_node(name)
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(STOP_S)
            self.say(f"{name}: stopped ({proc.returncode})")
        self.procs.clear()
        self.net.remove()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
