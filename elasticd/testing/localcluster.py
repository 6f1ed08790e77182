"""An embedded local cluster: worker and agent processes of a local job, all tracked by PID.

Owns starting and stopping the processes of a local job (used by the README's main command, the
tests and the benchmarks): ``WorkerProcess`` runs one training program with the ``ELASTICD_*``
environment, or (``new_session=True``, with ``agent_program``) one ``elasticd`` node agent in a
session of its own, so that ``kill_group`` ends the agent and every worker it started at once.
``AuditTail`` follows the workers' audit files as they grow; ``group_pids`` and ``process_state``
read ``/proc``. The etcd they talk to is ``testing.etcd``'s. Everything it starts it stops by PID
(or by the process group it created), and nothing else; it never decides what a run does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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
            self.proc = subprocess.Popen(
                list(self.program),
                env=full_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO_ROOT,
                start_new_session=self.new_session,
            )
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


def events_in(log_text: str, name: str) -> Iterator[dict[str, object]]:
    """The JSON log lines of event ``name`` in a log's text (pure); a line garbled by a concurrent
    writer, cut short by a kill, or a traceback, is skipped."""
    for line in log_text.splitlines():
        if f'"{name}"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == name:
            yield rec


def log_events(log_path: Path, name: str) -> list[dict[str, object]]:
    """The JSON log lines of event ``name`` in a process's log file (an agent's log holds its
    workers' lines too): ``events_in`` of the file."""
    return list(events_in(log_path.read_text(errors="replace"), name)) if log_path.exists() else []


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


def duty_cycle(pid: int, duty_s: float, until: float, stop: threading.Event | None = None) -> None:
    """Slow ``pid`` as a straggler: SIGSTOP, ``duty_s``, SIGCONT, ``duty_s``, over and over until
    ``until`` (monotonic) or ``stop``; it is left running. Returns early once it is gone."""
    try:
        while time.monotonic() < until and not (stop is not None and stop.is_set()):
            os.kill(pid, signal.SIGSTOP)
            time.sleep(duty_s)
            os.kill(pid, signal.SIGCONT)
            time.sleep(duty_s)
    except ProcessLookupError:
        return
    finally:
        signal_pid(pid, signal.SIGCONT)


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name: [state, ppid, pgrp, ...]."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()


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


def local_agent_argv(
    config_file: Path,
    endpoints: Sequence[str],
    job_id: str,
    node: str,
    nnodes: str,
    lease_ttl_s: float,
    keepalive_s: float,
    program: Sequence[str],
    *flags: str,
) -> list[str]:
    """The command line of a local ``elasticd`` agent that runs one gloo worker of ``program``,
    taking its settings from these flags and ``config_file`` only (never /etc/elasticd's)."""
    return agent_program(
        "--config",
        str(config_file),
        "--etcd",
        ",".join(endpoints),
        "--job-id",
        job_id,
        "--node-id",
        node,
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--backend",
        "gloo",  # every worker on this one machine's CPU, even where CUDA exists
        "--lease-ttl-s",
        str(lease_ttl_s),
        "--keepalive-s",
        str(keepalive_s),
        *flags,
        "--",
        *program,
    )


def agent_program(*args: str) -> list[str]:
    """The command line that runs the ``elasticd`` node agent with this interpreter."""
    return [sys.executable, "-c", "import sys; from elasticd.cli import agent_main; sys.exit(agent_main())", *args]


def python_program(script: str | Path, *args: str) -> list[str]:
    """The command line that runs ``script`` (path relative to the repo) with this interpreter."""
    path = Path(script)
    if not path.is_absolute():
        path = REPO_ROOT / path
    return [sys.executable, str(path), *args]
