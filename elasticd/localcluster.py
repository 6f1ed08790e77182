"""An embedded local cluster: a real etcd on loopback and worker processes, all tracked by PID.

Owns starting and stopping the processes of a local job (used by the README's main command, the
tests and the benchmarks): ``EtcdServer`` runs the real ``etcd`` binary on free loopback ports with
a temporary data directory; ``WorkerProcess`` runs one training program with the ``ELASTICD_*``
environment, or (``new_session=True``, with ``agent_program``) one ``elasticd`` node agent in a
session of its own, so that ``kill_group`` ends the agent and every worker it started at once.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from elasticd.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parent.parent
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
    """

    def __init__(self, host: str = "127.0.0.1", data_dir: str | None = None, tls: EtcdTls | None = None) -> None:
        self.host = host
        self.tls = tls
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="elasticd-etcd-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(self.data_dir + ".log")

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self) -> EtcdServer:
        """Start etcd and wait until it answers.

        Raises:
            RuntimeError: etcd did not answer within ``ETCD_START_TIMEOUT_S``.
        """
        url_c = f"{'https' if self.tls else 'http'}://{self.host}:{self.client_port}"
        url_p = f"http://{self.host}:{self.peer_port}"
        cmd = [
            etcd_binary(), "--name", "elasticd-test", "--data-dir", self.data_dir,
            "--listen-client-urls", url_c, "--advertise-client-urls", url_c,
            "--listen-peer-urls", url_p, "--initial-advertise-peer-urls", url_p,
            "--initial-cluster", f"elasticd-test={url_p}",
            "--log-level", "error",
        ]
        if self.tls is not None:
            cmd += ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key),
                    "--trusted-ca-file", str(self.tls.ca), "--client-cert-auth"]
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + ETCD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
            if self._answers():
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not answer on {self.endpoint} within {ETCD_START_TIMEOUT_S} s")

    def _answers(self) -> bool:
        import ssl
        import urllib.request

        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.cert), str(self.tls.key))
        scheme = "https" if self.tls else "http"
        try:
            with urllib.request.urlopen(f"{scheme}://{self.endpoint}/health", timeout=0.5, context=context) as r:
                return b"true" in r.read()
        except OSError:
            return False

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


def agent_program(*args: str) -> list[str]:
    """The command line that runs the ``elasticd`` node agent with this interpreter."""
    return [sys.executable, "-c", "import sys; from elasticd.cli import agent_main; sys.exit(agent_main())", *args]


def python_program(script: str | Path, *args: str) -> list[str]:
    """The command line that runs ``script`` (path relative to the repo) with this interpreter."""
    path = Path(script)
    if not path.is_absolute():
        path = REPO_ROOT / path
    return [sys.executable, str(path), *args]
