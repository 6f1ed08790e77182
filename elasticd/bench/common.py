"""What the benchmarks share: the workload, the records they read, and a local job they watch.

Owns what ``python -m elasticd.bench``'s subcommands (``recovery``, ``agent``, ``checkpoint``,
``outage``) use alike: ``BenchError``; reading JSON lines (whole files, or ``Tail`` for what was
appended since the last read); the figures' arithmetic (``median_of``, ``lost_steps`` from an audit
report, ``fmt``); ``LeaseSettings``, the lease every subcommand's settings extend, and the
``ELASTICD_*`` environment that carries it to the workers; ``BenchJob``, the workers of one elastic
job of the default workload (``agents/mlp.py``), all tracked by PID, whose audit logs it follows
while they run; and a subcommand's shell (``run_subcommand``: its work directory, its output, its exit
code; ``progress``).

It measures nothing itself, never imports a subcommand (nor ``__main__``), and never changes how
elasticd behaves: settings reach the workers only through their ``ELASTICD_*`` environment.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path

from elasticd.config import Timeouts
from elasticd.testing.audit import AuditReport
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import WorkerProcess, python_program

Record = dict[str, object]

WORKLOAD = "agents/mlp.py"
DATASET_SIZE = 2048  # agents/mlp.py --samples default; the audit checks each epoch with it
POLL_S = 0.05  # how often the bench reads the audit logs (it shares the 2 cores)
PHASE_TIMEOUT_S = 90.0  # bound on every wait of a phase


class BenchError(RuntimeError):
    """A repetition could not be measured (a phase timed out, or a worker died unexpectedly)."""


@dataclass(frozen=True)
class LeaseSettings:
    """The lease a benchmark's workers hold; every subcommand's settings extend it."""

    lease_ttl_s: float = 2.0
    keepalive_s: float = 0.5

    def timeouts(self) -> Timeouts:
        """The worker timeouts these settings give (defaults for everything not set here).

        Raises:
            ConfigError: the TTL and keepalive do not fit together.
        """
        return Timeouts(lease_ttl_s=self.lease_ttl_s, keepalive_s=self.keepalive_s)

    def worker_env(self, min_workers: int, max_workers: int | None = None) -> dict[str, str]:
        """The ``ELASTICD_*`` environment that gives a job's workers this lease and job size."""
        env = {
            "ELASTICD_LEASE_TTL_S": str(self.lease_ttl_s),
            "ELASTICD_KEEPALIVE_S": str(self.keepalive_s),
            "ELASTICD_MIN_WORKERS": str(min_workers),
        }
        if max_workers is not None:
            env["ELASTICD_MAX_WORKERS"] = str(max_workers)
        return env


# ---------------------------------------------------------------------------------------------
# Small helpers over JSON records


def host_stolen_s(stat: str = "/proc/stat") -> float:
    """CPU seconds the hypervisor took from this machine's cores so far (``steal`` in ``stat``: a
    virtual machine whose host is oversubscribed or caps its CPU), all cores together; 0.0 where it
    is not reported. A benchmark prints its growth beside its figures: on a shared host, time
    stolen during a round lengthens it as if the round had cost that much more."""
    try:
        with open(stat, encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0
    if len(fields) < 9 or fields[0] != "cpu":
        return 0.0
    return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def field_float(rec: Mapping[str, object], key: str) -> float:
    """A record's numeric field (an audit or log line's)."""
    value = rec[key]
    assert isinstance(value, (int, float)), f"{key}={value!r} is not a number"
    return float(value)


def field_int(rec: Mapping[str, object], key: str) -> int:
    """A record's numeric field, as an int."""
    return int(field_float(rec, key))


def median_of(values: Iterable[float | None]) -> float | None:
    """The median of the values measured (None: none was)."""
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def dist_version(dist_name: str) -> str:
    """An installed distribution's version (printed next to the figures), or \"unknown\"."""
    try:
        return metadata.version(dist_name)
    except metadata.PackageNotFoundError:
        return "unknown"


def log_time(rec: Mapping[str, object]) -> float | None:
    """A JSON log line's ``timestamp`` as wall-clock seconds (None: none, or not ISO 8601)."""
    ts = rec.get("timestamp")
    if not isinstance(ts, str):
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def json_records(lines: Iterable[str]) -> list[Record]:
    """The lines that are JSON objects, parsed (tracebacks and partial lines are skipped)."""
    out: list[Record] = []
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def read_json_lines(path: Path) -> list[Record]:
    """Every JSON-object line of ``path`` (tracebacks and partial lines are skipped)."""
    return json_records(path.read_text(errors="replace").splitlines()) if path.exists() else []


class Tail:
    """Reads only what was appended to a file since the last call (the bench polls every 50 ms)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = ""

    def read_new(self) -> list[Record]:
        """The complete JSON-object lines appended since the last call."""
        if not self.path.exists():
            return []
        with self.path.open("rb") as f:
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        lines = (self._partial + data.decode(errors="replace")).split("\n")
        self._partial = lines.pop()
        return json_records(lines)


def lost_steps(rep: AuditReport) -> int:
    """Committed steps that are missing (gaps) or were committed twice (rolled back after commit)."""
    missing = set(range(1, rep.last_step + 1)) - set(rep.steps)
    repeated = sum(1 for v in rep.violations if "committed in several generations" in v)
    return len(missing) + repeated


def fmt(x: float | int | None, digits: int = 3) -> str:
    """A figure in a table: ``digits`` decimals for a float, \"n/a\" for one not measured."""
    if x is None:
        return "n/a"
    if isinstance(x, int):
        return str(x)
    return f"{x:.{digits}f}"


def figure_rows(figures: Mapping[str, object], targets: Mapping[str, str], width: int) -> list[str]:
    """A table's header and one row per figure: its name, its value (``fmt``), its target."""
    rows = [f"{'figure':<{width}} {'value':>10}  target"]
    for name, value in figures.items():
        shown = fmt(value) if isinstance(value, (int, float)) or value is None else str(value)
        rows.append(f"{name:<{width}} {shown:>10}  {targets.get(name, '')}")
    return rows


def figures_table(title: str, result: Mapping[str, object], targets: Mapping[str, str], width: int) -> str:
    """A benchmark's printed result: ``title``, its figures against ``targets``, and the audit's
    violations, if any."""
    fig = result["figures"]
    assert isinstance(fig, dict)
    lines = [title, *figure_rows(fig, targets, width)]
    if result.get("violations"):
        lines.append(f"audit violations: {result['violations']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# A local job whose audit logs are followed while it runs


class BenchWorker:
    """One worker of a ``BenchJob``: its process, and what its audit log said so far."""

    def __init__(self, index: int, proc: WorkerProcess, audit: Path) -> None:
        self.index = index
        self.proc = proc
        self.audit = audit
        self.tail = Tail(audit)
        self.start_t: float | None = None
        self.final_seen: float | None = None  # when the bench read the "final" line (bench clock)
        self.commits: list[Record] = []
        self.expected_dead = False

    @property
    def last(self) -> Record | None:
        return self.commits[-1] if self.commits else None


class BenchJob:
    """Workers of one elastic job, all tracked by PID; their audit logs are tailed by ``poll``."""

    def __init__(
        self, etcd: EtcdServer, workdir: Path, job_id: str, env: Mapping[str, str], program: str = WORKLOAD
    ) -> None:
        self.etcd = etcd
        self.program = program  # the workload's script: the short form's, or the drop-in form's
        self.dir = workdir
        self.job_id = job_id
        self.env = dict(env)
        self.workers: list[BenchWorker] = []
        workdir.mkdir(parents=True, exist_ok=True)

    def spawn(self, *args: str, prefix: Sequence[str] = (), env: Mapping[str, str] | None = None) -> BenchWorker:
        """Start a worker of the workload with ``args``; ``prefix`` runs it elsewhere (``ip netns
        exec NS``), ``env`` overrides its ``ELASTICD_*`` variables (its address, its node)."""
        i = len(self.workers)
        audit = self.dir / f"audit{i}.jsonl"
        full_env = {
            **self.env,
            "ELASTICD_ETCD_ENDPOINTS": self.etcd.endpoint,
            "ELASTICD_JOB_ID": self.job_id,
            "ELASTICD_NODE_ID": "bench",
            "ELASTICD_LOCAL_RANK": str(i),
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        proc = WorkerProcess(
            [*prefix, *python_program(self.program, *args, "--audit", str(audit))],
            full_env,
            self.dir / f"worker{i}.log",
        )
        w = BenchWorker(i, proc, audit)
        self.workers.append(w)
        proc.start()
        return w

    def poll(self) -> None:
        for w in self.workers:
            for rec in w.tail.read_new():
                if rec.get("event") == "commit":
                    w.commits.append(rec)
                elif rec.get("event") == "start":
                    w.start_t = field_float(rec, "t")
                elif rec.get("event") == "final":
                    w.final_seen = time.time()

    def max_step(self) -> int:
        return max((field_int(w.last, "step") for w in self.workers if w.last), default=0)

    def generation(self) -> int:
        return max((field_int(w.last, "generation") for w in self.workers if w.last), default=0)

    def world_size(self) -> int:
        """The world size of the newest committed step."""
        last = max((w.last for w in self.workers if w.last), key=lambda c: field_int(c, "step"), default=None)
        return field_int(last, "world_size") if last else 0

    def worker_at_rank(self, rank: int) -> BenchWorker:
        gen = self.generation()
        for w in self.workers:
            if (
                w.proc.alive()
                and w.last
                and field_int(w.last, "generation") == gen
                and field_int(w.last, "rank") == rank
            ):
                return w
        raise BenchError(f"no live worker holds rank {rank} of generation {gen}")

    def wait_until(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            if cond():
                return
            for w in self.workers:
                if not w.expected_dead and not w.proc.alive():
                    raise BenchError(
                        f"worker {w.index} exited with {w.proc.wait(0)} while waiting for {what}\n{self.logs_tail()}"
                    )
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs_tail()}")
            time.sleep(POLL_S)

    def first_commit_after(self, t: float, generation: int, timeout: float, what: str) -> Record:
        """The earliest commit with ``t`` later than ``t`` in a generation newer than ``generation``."""

        def found() -> list[Record]:
            return [
                c
                for w in self.workers
                for c in w.commits
                if field_float(c, "t") > t and field_int(c, "generation") > generation
            ]

        self.wait_until(lambda: bool(found()), timeout, what)
        time.sleep(0.2)  # let the other survivors write their line of the same step
        self.poll()
        return min(found(), key=lambda c: field_float(c, "t"))

    def kill(self, w: BenchWorker) -> None:
        """SIGKILL a worker (also a stopped one) by PID and reap it."""
        w.expected_dead = True
        if w.proc.alive():
            os.kill(w.proc.pid, signal.SIGKILL)
            w.proc.wait(10)

    def wait_exit(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        codes = []
        for w in self.workers:
            if w.expected_dead:
                continue
            codes.append(w.proc.wait(max(0.1, deadline - time.monotonic())))
        return codes

    def wait_exit_after_final(self, grace_s: float) -> float:
        """Give the finished workers ``grace_s`` to exit; return the slowest exit after its final line.

        A worker still running after that is killed by ``stop`` (the figure is then ``grace_s``).

        Raises:
            BenchError: a worker exited with a non-zero code.
        """
        deadline = time.monotonic() + grace_s
        pending = {w.index: w for w in self.workers if not w.expected_dead and w.final_seen is not None}
        lag = 0.0
        while pending and time.monotonic() < deadline:
            for i, w in list(pending.items()):
                code = w.proc.wait(0)
                if code is None:
                    continue
                if code != 0:
                    raise BenchError(f"worker {w.index} exited with {code}\n{self.logs_tail()}")
                assert w.final_seen is not None
                lag = max(lag, time.time() - w.final_seen)
                del pending[i]
            time.sleep(0.02)
        return grace_s if pending else lag

    def stop(self) -> None:
        for w in self.workers:
            w.proc.stop()  # SIGCONT + SIGKILL by PID, if still alive

    def logs_tail(self, n: int = 8) -> str:
        return "\n".join(
            f"--- worker {w.index}\n" + "\n".join(w.proc.log_text().splitlines()[-n:]) for w in self.workers
        )

    def log_events(self) -> list[Record]:
        out: list[Record] = []
        for w in self.workers:
            for rec in read_json_lines(w.proc.log_path):
                rec["_worker"] = w.index
                rec["_t"] = log_time(rec)
                out.append(rec)
        return out


# ---------------------------------------------------------------------------------------------
# A subcommand's shell


def progress(msg: str) -> None:
    """One progress line, on stderr (stdout holds only the result: a table, or ``--json``'s object),
    with the wall clock (UTC, as the logs' timestamps)."""
    print(f"[bench {time.strftime('%H:%M:%S', time.gmtime())}] {msg}", file=sys.stderr, flush=True)


def run_subcommand(
    args: argparse.Namespace,
    prefix: str,
    run: Callable[[Path], dict[str, object]],
    render: Callable[[Mapping[str, object]], str],
) -> int:
    """Run a subcommand's ``run`` in its work directory and print the result; return the exit code.

    The work directory is ``--workdir`` (created and kept), or a new temporary one (``prefix``),
    removed afterwards. The result goes to stdout as one JSON object (``--json``) or ``render``'s
    table. The exit code is 1 when the result lists errors or audit violations, or lost a step.
    """
    keep = args.workdir is not None
    workdir = Path(args.workdir) if keep else Path(tempfile.mkdtemp(prefix=prefix))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        result = run(workdir)
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(result) if args.json else render(result))
    fig = result.get("figures")
    lost = fig.get("steps_lost") if isinstance(fig, dict) else None
    return 1 if result.get("errors") or result.get("violations") or lost else 0
