"""The ``elasticctl`` and ``elasticd`` entry points: argparse, logging setup, exit codes.

Owns turning a command line into settings, wiring an ``EtcdClient`` to ``status.read_status``, and
turning the outcome into output and an exit code. Holds no logic that tests cannot reach without
argv: the read model and its renderers live in ``status.py``. Imports no torch.

Usage::

    elasticctl [--etcd HOST:PORT[,HOST:PORT]] [--prefix /elasticd] status [--job ID] [--json]
               [--watch [--interval S]] [--min-workers N] [--max-workers N]

``--etcd``, ``--prefix`` and ``--job`` default to ``ELASTICD_ETCD_ENDPOINTS``,
``ELASTICD_ETCD_PREFIX`` and ``ELASTICD_JOB_ID`` (read by ``config.WorkerEnv.from_environ``, only
when a flag is not given), and then to the library defaults (``127.0.0.1:2379``, ``/elasticd``,
``default``: the job a worker joins when ``ELASTICD_JOB_ID`` is unset).

Exit codes of ``elasticctl``:

* 0: the job is healthy or finished;
* 1: the job is degraded (running below ``--max-workers``, or with live members left out);
* 2: the job is down or does not exist, etcd did not answer (within about 2 s), or the command
  line or an ``ELASTICD_*`` variable is invalid (one line on stderr says which).

With ``--watch`` the report is redrawn every ``--interval`` seconds until Ctrl-C, and the exit code
is that of the last report. ``elasticd`` (the node agent) is not built yet: it says so and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TextIO

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts, WorkerEnv, WorldConfig, parse_endpoint
from elasticd.errors import ConfigError, EtcdUnavailable
from elasticd.log import configure_logging
from elasticd.membership import Keys
from elasticd.status import EXIT_DOWN, PrefixReader, read_status, render_json, render_table

PROG = "elasticctl"
# A status query is one idempotent read: answer fast or say etcd is not there. Each attempt is
# bounded by the request timeout; a refused connection fails at once, a silent host after it.
CTL_TIMEOUTS = Timeouts(etcd_request_s=0.75)
CTL_BACKOFF_S = 0.1
CLEAR_SCREEN = "\x1b[H\x1b[2J"


@dataclass(frozen=True)
class StatusQuery:
    """A validated ``elasticctl status`` command line."""

    etcd: EtcdConfig
    job_id: str
    json: bool
    watch: bool
    interval_s: float
    count: int | None  # frames to draw in --watch mode (None: until Ctrl-C)
    min_workers: int | None
    max_workers: int | None


def ctl_main(
    argv: Sequence[str] | None = None,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """``elasticctl``: report on a job (see the module docstring for flags and exit codes).

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
        stdout: where reports go (default: ``sys.stdout``).
        stderr: where errors go (default: ``sys.stderr``).
        sleep: waits between ``--watch`` frames.

    Returns:
        The exit code.
    """
    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    parser = build_ctl_parser()
    args = parser.parse_args(argv)
    # Retries of etcd calls would log to stdout, in the middle of a report (or of --json output);
    # a failure is reported once, on stderr, below.
    configure_logging(json=False, level=logging.CRITICAL)
    try:
        query = status_query(parser, args)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=err)
        return EXIT_DOWN
    return run_status(query, out, err, sleep)


def build_ctl_parser() -> argparse.ArgumentParser:
    """The ``elasticctl`` argument parser (flag defaults are None: the environment fills them)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect elastic training jobs in etcd. Exit codes: 0 healthy or finished, "
        "1 degraded, 2 down, no such job, etcd unreachable, or bad input.",
    )
    parser.add_argument("--etcd", type=_endpoints, default=None, metavar="HOST:PORT[,HOST:PORT]",
                        help="etcd endpoints (default: $ELASTICD_ETCD_ENDPOINTS, else 127.0.0.1:2379)")
    parser.add_argument("--prefix", type=_prefix, default=None,
                        help="key prefix of all jobs (default: $ELASTICD_ETCD_PREFIX, else /elasticd)")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    status = commands.add_parser("status", help="show a job's generation, members and health",
                                 description="Show a job's generation, members and health.")
    status.add_argument("--job", type=_job_id, default=None,
                        help="job id (default: $ELASTICD_JOB_ID, else 'default')")
    status.add_argument("--json", action="store_true", help="print one JSON object (per frame)")
    status.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    status.add_argument("--interval", type=_positive_float, default=2.0, metavar="S",
                        help="seconds between --watch frames (default: 2)")
    status.add_argument("--count", type=_positive_int, default=None, help=argparse.SUPPRESS)
    status.add_argument("--min-workers", type=_positive_int, default=None, metavar="N",
                        help="the job's min_workers (not stored in etcd): below it is 'down'")
    status.add_argument("--max-workers", type=_positive_int, default=None, metavar="N",
                        help="the job's max_workers (not stored in etcd): below it is 'degraded'")
    return parser


def status_query(parser: argparse.ArgumentParser, args: argparse.Namespace) -> StatusQuery:
    """Validate parsed flags and fill the missing ones from the environment.

    Raises:
        ConfigError: an ``ELASTICD_*`` variable that a missing flag falls back on is invalid.
    """
    if args.min_workers is not None and args.max_workers is not None and args.min_workers > args.max_workers:
        parser.error(f"--min-workers ({args.min_workers}) must be <= --max-workers ({args.max_workers})")
    if args.count is not None and not args.watch:
        parser.error("--count only applies with --watch")
    endpoints: tuple[str, ...] | None = args.etcd
    prefix: str | None = args.prefix
    job_id: str | None = args.job
    if endpoints is None or prefix is None or job_id is None:
        env = WorkerEnv.from_environ()  # only when a flag is missing: a bad variable cannot block flags
        endpoints = endpoints or env.etcd.endpoints
        prefix = prefix or env.etcd.prefix
        job_id = job_id or env.world.job_id
    return StatusQuery(
        etcd=EtcdConfig(endpoints=endpoints, prefix=prefix),
        job_id=job_id,
        json=args.json,
        watch=args.watch,
        interval_s=args.interval,
        count=args.count,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
    )


def run_status(query: StatusQuery, out: TextIO, err: TextIO, sleep: Callable[[float], None]) -> int:
    """Print one report (or, with ``--watch``, one per interval) and return the last exit code."""
    from elasticd.etcd import EtcdClient  # the entry point wires the concrete client

    keys = Keys(query.etcd.prefix, query.job_id)
    # One attempt per endpoint plus one, so that failover can reach every endpoint once.
    retry = RetryPolicy(etcd_attempts=len(query.etcd.endpoints) + 1,
                        etcd_backoff_initial_s=CTL_BACKOFF_S, etcd_backoff_max_s=CTL_BACKOFF_S)
    client = EtcdClient(query.etcd, CTL_TIMEOUTS, retry)
    clear = query.watch and not query.json and out.isatty()
    code = EXIT_DOWN
    frames = 0
    try:
        while True:
            code = _report(client, keys, query, out, err, clear)
            frames += 1
            if not query.watch or (query.count is not None and frames >= query.count):
                return code
            sleep(query.interval_s)
    except KeyboardInterrupt:
        return code
    finally:
        client.close()


def _report(
    store: PrefixReader, keys: Keys, query: StatusQuery, out: TextIO, err: TextIO, clear: bool
) -> int:
    try:
        status = read_status(store, keys, now=time.time(),
                             min_workers=query.min_workers, max_workers=query.max_workers)
    except EtcdUnavailable as exc:
        print(unreachable_message(query.etcd, exc), file=err, flush=True)
        return EXIT_DOWN
    if query.json:
        text = render_json(status) + "\n"
    else:
        text = render_table(status)
        if query.watch:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            text = f"every {query.interval_s:g}s, {stamp} (Ctrl-C stops)\n\n{text}"
            text = (CLEAR_SCREEN + text) if clear else (text + "\n")
    out.write(text)
    out.flush()
    return status.exit_code


def unreachable_message(etcd: EtcdConfig, exc: EtcdUnavailable) -> str:
    """One line for stderr: which etcd did not answer, why (abridged), and where to change it."""
    why = " ".join(str(exc).split())
    if len(why) > 240:
        why = why[:237] + "..."
    where = ",".join(etcd.endpoints)
    head = f"{PROG}: {why}" if why.startswith(f"etcd at {where} did not answer") else (
        f"{PROG}: etcd at {where} did not answer: {why}")
    return f"{head} (set --etcd or ELASTICD_ETCD_ENDPOINTS)"


# -- argparse types (an error here is an argparse error: usage on stderr, exit 2) ---------------


def _endpoints(text: str) -> tuple[str, ...]:
    endpoints = tuple(e.strip() for e in text.split(",") if e.strip())
    if not endpoints:
        raise argparse.ArgumentTypeError("expected host:port[,host:port]")
    try:
        for e in endpoints:
            parse_endpoint(e)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return endpoints


def _prefix(text: str) -> str:
    try:
        return EtcdConfig(prefix=text).prefix
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _job_id(text: str) -> str:
    try:
        return WorldConfig(job_id=text).job_id
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from exc
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from exc
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


# -- the node agent ----------------------------------------------------------------------------

AGENT_NOT_BUILT = (
    "elasticd: the node agent is not built yet, so this command does nothing.\n"
    "To run an elastic job today, run the workers directly:\n"
    "  python -m elasticd.demo            a local job on a private etcd (kills a worker, adds one)\n"
    "  ELASTICD_ETCD_ENDPOINTS=HOST:PORT ELASTICD_JOB_ID=ID python agents/mlp.py\n"
    "                                     one worker of a job (start one per process you want)\n"
    "and watch the job with: elasticctl status --job ID"
)


def agent_main(argv: Sequence[str] | None = None, *, stderr: TextIO | None = None) -> int:
    """``elasticd``: the node agent is not built yet; say so, and how to run workers instead.

    Returns:
        2 (nothing was done); 0 for ``--help``.
    """
    parser = argparse.ArgumentParser(
        prog="elasticd",
        description="The elasticd node agent (not built yet). " + AGENT_NOT_BUILT.split("\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.parse_known_args(argv)  # only --help means something; any other flag is not built either
    print(AGENT_NOT_BUILT, file=stderr if stderr is not None else sys.stderr)
    return EXIT_DOWN


if __name__ == "__main__":
    sys.exit(ctl_main())
