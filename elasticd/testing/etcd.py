"""A real etcd on loopback for tests and dev tooling: one server, or a cluster of members.

Owns running the real ``etcd`` binary: ``EtcdServer`` on free loopback ports with a temporary data
directory (optionally TLS, optionally listening on further local addresses), and ``EtcdCluster``,
three (or more) such members as one cluster, for faults that need quorum. Each member can be killed
(as a power loss would) and started again on its data. It starts and stops only its own etcd
processes, by PID, and never talks etcd's protocol beyond the health and status checks it waits on.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from elasticd.errors import ConfigError
from elasticd.agent.restart import pick_free_port

ETCD_START_TIMEOUT_S = 20.0  # etcd usually answers in well under a second


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

    def __init__(
        self,
        host: str = "127.0.0.1",
        data_dir: str | None = None,
        tls: EtcdTls | None = None,
        name: str = "elasticd-test",
        extra_hosts: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.extra_hosts = tuple(extra_hosts)
        self.tls = tls
        self.name = name
        # Below the kernel's ephemeral range: a test that kills and restarts etcd on the same ports
        # must not find one taken meanwhile by an outgoing connection (a worker's, to its peers),
        # as a port the kernel handed out (bind to 0) was, now and then (EADDRINUSE at restart).
        self.client_port = pick_free_port()
        self.peer_port = pick_free_port()
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
            etcd_binary(),
            "--name",
            self.name,
            "--data-dir",
            self.data_dir,
            "--listen-client-urls",
            url_c,
            "--advertise-client-urls",
            url_c,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.initial_cluster,
            "--log-level",
            "error",
        ]
        if self.cluster_token:
            cmd += ["--initial-cluster-token", self.cluster_token]
        if self.tls is not None:
            cmd += [
                "--cert-file",
                str(self.tls.cert),
                "--key-file",
                str(self.tls.key),
                "--trusted-ca-file",
                str(self.tls.ca),
                "--client-cert-auth",
            ]
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
                raise RuntimeError(f"etcd exited with {self.proc.returncode}; its log ends:\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.05)
        tail = self.log_tail()  # stop() removes the log with the data
        self.stop()
        raise RuntimeError(
            f"etcd did not answer on {self.endpoint} within {ETCD_START_TIMEOUT_S} s; its log ends:\n{tail}"
        )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        """The end of etcd's output (its log file beside the data directory)."""
        try:
            return self.log_path.read_bytes()[-chars:].decode(errors="replace")
        except OSError:
            return "(no log)"

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
            with urllib.request.urlopen(
                f"{scheme}://{self.endpoint}{path}", data=body, timeout=0.5, context=context
            ) as r:
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
            self.log_path.unlink(missing_ok=True)  # its log goes with the data it made

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

    def __init__(
        self, size: int = 3, host: str = "127.0.0.1", data_root: str | None = None, extra_hosts: Sequence[str] = ()
    ) -> None:
        assert size >= 1
        self._own_root = data_root is None
        self.data_root = data_root or tempfile.mkdtemp(prefix="elasticd-etcd-cluster-")
        os.makedirs(self.data_root, exist_ok=True)
        self.members = [
            EtcdServer(
                host, data_dir=os.path.join(self.data_root, f"member-{i}"), name=f"member-{i}", extra_hosts=extra_hosts
            )
            for i in range(size)
        ]
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

    def wait_for_leader(self, deadline: float) -> int:
        """The index of the member that leads, once one does (``leader_index``), polled until
        ``deadline`` (monotonic).

        Raises:
            RuntimeError: no member led by then.
        """
        while time.monotonic() < deadline:
            found = self.leader_index()
            if found is not None:
                return found
            time.sleep(0.1)
        raise RuntimeError("the etcd cluster has no leader")

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
