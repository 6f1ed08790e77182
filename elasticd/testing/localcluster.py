"""An embedded local cluster: a real etcd on loopback and worker processes, all tracked by PID.

Owns starting and stopping the processes of a local job (used by the README's main command, the
tests and the benchmarks): ``EtcdServer`` runs the real ``etcd`` binary on free loopback ports with
a temporary data directory; ``WorkerProcess`` runs one training program with the ``ELASTICD_*``
environment, or (``new_session=True``, with ``agent_program``) one ``elasticd`` node agent in a
session of its own, so that ``kill_group`` ends the agent and every worker it started at once.
``EtcdCluster`` runs three (or more) such etcd members as one cluster on loopback, for faults that
need quorum. ``AuditTail`` follows the workers' audit files as they grow.
Everything it starts it stops by PID (or by the process group it created), and nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from elasticd.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
ETCD_START_TIMEOUT_S = 20.0  # etcd usually answers in well under a second


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def etcd_binary() -> str:
    """The etcd server on PATH (or /usr/bin/etcd).

    Raises:
        ConfigError: no etcd binary is installed.
    """
    found = shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
    if not found:
        raise ConfigError("etcd: no etcd binary on PATH (apt-get install etcd-server)")
    return found


@dataclass(frozen=True)
class EtcdTls:
    """TLS for a local etcd's client port: its certificate and key (also presented by the health
    check as a client certificate, so make it good for both), and the CA that clients must be signed by."""

    ca: Path
    cert: Path
    key: Path


class EtcdServer:
    """A real single-node etcd on loopback, on free ports, with a temporary data dir.

    With ``tls``, clients talk HTTPS/TLS and must present a certificate signed by ``tls.ca``.
    ``extra_hosts``: further local addresses the client port also listens on (and advertises), on
    the same port, for clients that cannot reach loopback (a network namespace's host on a bridge).
    """

    def __init__(self, host: str = "127.0.0.1", data_dir: str | None = None, tls: EtcdTls | None = None,
                 name: str = "elasticd-test", extra_hosts: Sequence[str] = ()) -> None:
        self.host = host
        self.extra_hosts = tuple(extra_hosts)
        self.tls = tls
        self.name = name
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="elasticd-etcd-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(self.data_dir + ".log")
        # ``name=peer_url,...`` of every member, and the cluster's token; set by ``EtcdCluster``.
        self.initial_cluster = f"{name}={self.peer_url}"
        self.cluster_token = ""

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def endpoint_on(self, host: str) -> str:
        """The client endpoint on ``host``: ``host`` itself or one of ``extra_hosts``."""
        assert host == self.host or host in self.extra_hosts, host
        return f"{host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def start(self) -> EtcdServer:
        """Start etcd and wait until it answers.

        Raises:
            RuntimeError: etcd did not answer within ``ETCD_START_TIMEOUT_S``.
        """
        self.launch()
        self.wait_ready(time.monotonic() + ETCD_START_TIMEOUT_S)
        return self

    def launch(self) -> None:
        """Start the etcd process without waiting for it (a cluster member answers only once a
        quorum of members runs)."""
        scheme = "https" if self.tls else "http"
        url_c = ",".join(f"{scheme}://{h}:{self.client_port}" for h in (self.host, *self.extra_hosts))
        cmd = [
            etcd_binary(), "--name", self.name, "--data-dir", self.data_dir,
            "--listen-client-urls", url_c, "--advertise-client-urls", url_c,
            "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", self.initial_cluster,
            "--log-level", "error",
        ]
        if self.cluster_token:
            cmd += ["--initial-cluster-token", self.cluster_token]
        if self.tls is not None:
            cmd += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                    "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, deadline: float) -> None:
        """Wait until etcd answers its health check, until ``deadline`` (monotonic).

        Raises:
            RuntimeError: etcd exited, or did not answer in time (then it is stopped).
        """
        assert self.proc is not None, "launch() first"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            if self._answers():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not answer on {self.endpoint} within {ETCD_START_TIMEOUT_S} s")

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL etcd (as a power loss would) and reap it; the data dir stays for a restart."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def _answers(self) -> bool:
        answer = self._request("/health", None)
        return answer is not None and b"true" in answer

    def _request(self, path: str, body: bytes | None) -> bytes | None:
        """GET (or, with ``body``, POST) ``path`` on the client port; None when etcd does not answer."""
        import ssl
        import urllib.request

        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        scheme = "https" if self.tls else "http"
        try:
            with urllib.request.urlopen(f"{scheme}://{self.endpoint}{path}", data=body, timeout=0.5,
                                        context=context) as r:
                return bytes(r.read())
        except OSError:
            return None

    def healthy(self) -> bool:
        """Whether etcd runs and answers its health check (for a cluster member: it sees a leader)."""
        return self.running() and self._answers()

    def leader_status(self) -> tuple[int, int] | None:
        """(this member's id, the leader's id) from etcd's v3 status call; None when it does not
        answer or knows no leader."""
        raw = self._request("/v3/maintenance/status", b"{}")
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            me, leader = int(data["header"]["member_id"]), int(data.get("leader", 0))
        except (ValueError, KeyError, TypeError):
            return None
        return (me, leader) if leader else None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, remove_data: bool = True) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if remove_data and self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self) -> None:
        """Stop and start again on the same ports and data (leases and keys survive)."""
        self.stop(remove_data=False)
        self.start()

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """A real etcd cluster of ``size`` members on loopback: free ports, temporary data dirs, each
    member a separate process stopped by its PID. Members can be killed and started again on the
    same data dir (they rejoin the cluster from it). ``extra_hosts``: as for ``EtcdServer`` (client
    ports only; the members talk to each other on loopback)."""

    def __init__(self, size: int = 3, host: str = "127.0.0.1", data_root: str | None = None,
                 extra_hosts: Sequence[str] = ()) -> None:
        assert size >= 1
        self._own_root = data_root is None
        self.data_root = data_root or tempfile.mkdtemp(prefix="elasticd-etcd-cluster-")
        os.makedirs(self.data_root, exist_ok=True)
        self.members = [EtcdServer(host, data_dir=os.path.join(self.data_root, f"member-{i}"), name=f"member-{i}",
                                   extra_hosts=extra_hosts)
                        for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        token = f"elasticd-{os.getpid()}-{os.path.basename(self.data_root)}"
        for m in self.members:
            m.initial_cluster, m.cluster_token = initial, token

    @property
    def endpoints(self) -> tuple[str, ...]:
        return tuple(m.endpoint for m in self.members)

    def start(self) -> EtcdCluster:
        """Start every member and wait until each answers (a quorum elected a leader).

        Raises:
            RuntimeError: a member exited or did not answer within ``ETCD_START_TIMEOUT_S``.
        """
        for m in self.members:
            m.launch()
        deadline = time.monotonic() + ETCD_START_TIMEOUT_S
        try:
            for m in self.members:
                m.wait_ready(deadline)
        except RuntimeError:
            self.stop()
            raise
        return self

    def kill(self, index: int) -> None:
        """SIGKILL one member (its data dir stays)."""
        self.members[index].kill()

    def start_member(self, index: int, deadline: float) -> None:
        """Start a killed member again on its data dir and wait (until ``deadline``) until it answers.

        Raises:
            RuntimeError: it exited or did not answer in time.
        """
        m = self.members[index]
        m.launch()
        m.wait_ready(deadline)

    def leader_index(self) -> int | None:
        """The index of the member that leads, as a running member reports it; None when no running
        member answers with a leader."""
        for m in self.members:
            if not m.running():
                continue
            status = m.leader_status()
            if status is None:
                continue
            leader = status[1]
            for i, other in enumerate(self.members):
                other_status = other.leader_status() if other.running() else None
                if other_status is not None and other_status[0] == leader:
                    return i
        return None

    def has_quorum(self) -> bool:
        """Whether some running member answers its health check (which needs a leader)."""
        return any(m.healthy() for m in self.members)

    def stop(self) -> None:
        for m in self.members:
            m.stop(remove_data=False)
        if self._own_root:
            shutil.rmtree(self.data_root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class WorkerProcess:
    """One training program run as a separate process with the ``ELASTICD_*`` environment."""

    program: Sequence[str]
    env: Mapping[str, str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = field(default=0.0)
    new_session: bool = False  # its own session and process group (an agent and its workers)

    def start(self) -> WorkerProcess:
        full_env = dict(os.environ)
        full_env.update(self.env)
        full_env.setdefault("OMP_NUM_THREADS", "1")
        full_env["PYTHONUNBUFFERED"] = "1"
        full_env.setdefault("PYTHONFAULTHANDLER", "1")  # a native crash prints its stacks
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH", "")]))
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(list(self.program), env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=REPO_ROOT, start_new_session=self.new_session)
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int | None:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGKILL the process (and, with ``new_session``, everything in its process group)."""
        if self.new_session and self.proc is not None:
            self.kill_group()
            return
        if self.alive():
            assert self.proc is not None
            os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(5)

    def kill_group(self) -> None:
        """SIGKILL the process group this process leads (only with ``new_session``: an agent and the
        workers it started, which stay in its group), then reap the leader."""
        assert self.new_session, "kill_group needs a process started with new_session=True"
        if self.proc is None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def log_events(log_path: Path, name: str) -> list[dict[str, object]]:
    """The JSON log lines of event ``name`` in a process's log file (an agent's log holds its
    workers' lines too); a line garbled by a concurrent writer, or a traceback, is skipped."""
    if not log_path.exists():
        return []
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        if f'"{name}"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == name:
            out.append(rec)
    return out


class AuditTail:
    """Follows the ``<node>.jsonl`` audit files as they grow; yields complete JSON lines only."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}

    def read(self) -> Iterator[tuple[str, dict[str, object]]]:
        """New records since the last call, as (node, record)."""
        for path in sorted(self.directory.glob("*.jsonl")):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
            self._offsets[path] = self._offsets.get(path, 0) + len(chunk)
            data = self._partial.pop(path, b"") + chunk
            *lines, rest = data.split(b"\n")
            if rest:
                self._partial[path] = rest
            for line in lines:
                if line.strip():
                    try:
                        yield path.stem, json.loads(line)
                    except ValueError:
                        continue  # a killed worker's last line may be cut short; the audit says so


def signal_pid(pid: int, sig: int) -> bool:
    """Signal one process by PID; False when it is gone already."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: [state, ppid, pgrp, ...]."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2:].split()


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of a process (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...);
    None when there is no such process (Linux ``/proc``)."""
    fields = _proc_stat(pid)
    return fields[0] if fields else None


def group_pids(pgids: Collection[int]) -> dict[int, list[int]]:
    """The live processes of each process group in ``pgids`` (an agent started with ``new_session``
    leads one, with the workers it started), zombies left out; one pass over Linux ``/proc``."""
    wanted = {str(g): g for g in pgids}
    out: dict[int, list[int]] = {g: [] for g in pgids}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _proc_stat(int(entry))
        if fields and len(fields) > 2 and fields[2] in wanted and fields[0] != "Z":
            out[wanted[fields[2]]].append(int(entry))
    for pids in out.values():
        pids.sort()
    return out


def local_agent_argv(config_file: Path, endpoints: Sequence[str], job_id: str, node: str, nnodes: str,
                     lease_ttl_s: float, keepalive_s: float, program: Sequence[str], *flags: str) -> list[str]:
    """The command line of a local ``elasticd`` agent that runs one gloo worker of ``program``,
    taking its settings from these flags and ``config_file`` only (never /etc/elasticd's)."""
    return agent_program(
        "--config", str(config_file),
        "--etcd", ",".join(endpoints), "--job-id", job_id, "--node-id", node,
        "--nnodes", nnodes, "--nproc-per-node", "1",
        "--backend", "gloo",  # every worker on this one machine's CPU, even where CUDA exists
        "--lease-ttl-s", str(lease_ttl_s), "--keepalive-s", str(keepalive_s),
        *flags, "--", *program,
    )


def make_workdir(workdir: Path | None, keep: bool, prefix: str) -> tuple[Path, bool]:
    """The work directory of a demo or chaos run: ``workdir`` (created; it must be empty), or a new
    temporary one. Returns it and whether to remove it at the end (a temporary one, unless ``keep``).

    Raises:
        ConfigError: ``workdir`` is not empty.
    """
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix=prefix)), not keep
    workdir = workdir.resolve()
    if workdir.exists() and any(workdir.iterdir()):
        raise ConfigError(f"--workdir: {workdir} is not empty")
    workdir.mkdir(parents=True, exist_ok=True)
    return workdir, False


class Terminated(Exception):
    """SIGTERM arrived (inside ``sigterm_raises``): leave through the same cleanup as Ctrl-C."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Terminated`` in the main thread, so that a runner of a
    local cluster stops every process it started on that way out too."""
    def handler(_signum: int, _frame: FrameType | None) -> None:
        raise Terminated()

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def agent_program(*args: str) -> list[str]:
    """The command line that runs the ``elasticd`` node agent with this interpreter."""
    return [sys.executable, "-c", "import sys; from elasticd.cli import agent_main; sys.exit(agent_main())", *args]


def python_program(script: str | Path, *args: str) -> list[str]:
    """The command line that runs ``script`` (path relative to the repo) with this interpreter."""
    path = Path(script)
    if not path.is_absolute():
        path = REPO_ROOT / path
    return [sys.executable, str(path), *args]
