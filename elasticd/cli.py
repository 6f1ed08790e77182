"""The ``elasticctl`` and ``elasticd`` entry points: argparse, logging setup, exit codes.

Owns turning a command line into settings, wiring an ``EtcdClient`` to ``status.read_status`` (and,
for ``elasticd``, to an ``agent.Agent``), and turning the outcome into output and an exit code.
Holds no logic that tests cannot reach without argv: the read model and its renderers live in
``status.py``, the agent in ``agent.py``. Imports no torch.

Usage::

    elasticctl [--etcd [https://]HOST:PORT[,...]] [--prefix /elasticd] [--etcd-ca-cert FILE]
               [--etcd-cert-cert FILE --etcd-cert-key FILE] [--etcd-user NAME [--etcd-password-file FILE]]
               [--insecure]
               status [--job ID] [--json] [--watch [--interval S]] [--min-workers N] [--max-workers N]
                      [--stall-after-s S]
    elasticctl [...] drain NODE [--job ID] [--wait [--timeout S]]
    elasticctl [...] events [--job ID] [--json] [--limit N]
    elasticctl [...] timeline [--job ID] --out FILE.png|FILE.svg|FILE.html
    elasticctl [...] --etcd-user root --etcd-password-file FILE auth setup-job JOB [--user NAME]
               [--password-file FILE] [--prefix /elasticd]

The etcd TLS and auth flags default to ``ELASTICD_ETCD_CA_CERT``, ``..._CERT_CERT``,
``..._CERT_KEY``, ``..._USER`` and ``..._PASSWORD_FILE``; the password can also come from
``ELASTICD_ETCD_PASSWORD`` (there is no password flag: a command line is visible to every user).
``https://`` endpoints talk TLS (trusting the system's CA bundle unless ``--etcd-ca-cert`` is
given). A user's password is not sent in plaintext to an etcd off loopback unless ``--insecure``
(or ``ELASTICD_ETCD_INSECURE=true``) allows it.

``--etcd``, ``--prefix`` and ``--job`` default to ``ELASTICD_ETCD_ENDPOINTS``,
``ELASTICD_ETCD_PREFIX`` and ``ELASTICD_JOB_ID`` (read by ``settings.worker_env_from_environ``, only
when a flag is not given), and then to the library defaults (``127.0.0.1:2379``, ``/elasticd``,
``default``: the job a worker joins when ``ELASTICD_JOB_ID`` is unset).

Exit codes of ``elasticctl``:

* 0: the job is healthy or finished;
* 1: the job is degraded (running below ``--max-workers``, or with live members left out);
* 2: the job is down, stalled (no step committed for ``--stall-after-s``, default
  ``status.STALL_AFTER_S``) or does not exist, etcd did not answer (within about 2 s), or the command
  line or an ``ELASTICD_*`` variable is invalid (one line on stderr says which).

With ``--watch`` the report is redrawn every ``--interval`` seconds until Ctrl-C, and the exit code
is that of the last report; with ``--watch --json`` each report is one JSON object on one line.

Exit codes of ``elasticctl drain NODE``: 0 the request was written (with ``--wait``: and the node's
members have left the generation, or the job finished); 2 no agent record for NODE (unknown node),
``--wait`` timed out, etcd did not answer, or bad input. Exit codes of ``elasticctl events``: 0 the
events were listed (possibly none); 2 no such job, etcd did not answer, or bad input; of
``elasticctl timeline`` (``ops.timeline``: the job's events as one picture; needs matplotlib, the
``elasticd[plot]`` extra): 0 written (its path on stdout), 2 no such job, etcd did not answer, no
matplotlib, the file could not be written, or bad input. etcd's
"permission denied" (the etcd user's role does not cover ``<prefix>/<job>/``) is one line naming the
job and the user, and exit 2 for every command, as any bad setting. ``elasticctl auth setup-job``
(``ops.jobauth``) creates a job's own role and user: 0 done, 1 etcd refused or did not answer, 2
bad input.

``elasticd [--config FILE] [flags] -- PROGRAM [ARGS...]`` runs the node agent (``agent.py``). Every
setting is a flag, an ``ELASTICD_<NAME>`` variable and a key of the TOML file (default
``/etc/elasticd/elasticd.toml``, read only if it exists), in that order of precedence; torchrun's
``--nnodes MIN:MAX``, ``--nproc-per-node``, ``--rdzv-endpoint``, ``--rdzv-id`` and
``--max-restarts`` are accepted too. Exit codes of ``elasticd``: 0 the workers finished or the node
was drained; 1 restarts exhausted or another fatal error (the reason on stderr); 2 bad
configuration (one line on stderr per bad field, naming it), including an etcd user whose role does
not cover the job (etcd's "permission denied", naming the job and the user).
"""

from __future__ import annotations

import argparse
import getpass
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from elasticd.agent.sdnotify import Notifier, watchdog_interval
from elasticd.config import (
    AgentConfig,
    EtcdConfig,
    RetryPolicy,
    Timeouts,
    WorldConfig,
    check_name,
    parse_endpoint,
)
from elasticd.errors import ConfigError, EtcdUnavailable, PermissionDenied
from elasticd.log import configure_logging
from elasticd.ops.drain import (
    DEFAULT_DRAIN_WAIT_S,
    DRAIN_POLL_S,
    DrainStore,
    drain_progress,
    request_drain,
)
from elasticd.ops.health import EXIT_DOWN, EXIT_OK, STALL_AFTER_S, STALL_STEP_FACTOR
from elasticd.ops.render import (
    render_events_json,
    render_events_table,
    render_json,
    render_table,
)
from elasticd.ops.status import PrefixReader, job_events, read_status
from elasticd.settings import (
    AGENT_SETTINGS,
    DEFAULT_CONFIG_FILE,
    etcd_config,
    etcd_security_environ,
    load_agent_config,
    systemd_notify_environ,
    without_etcd_security,
    worker_env_from_environ,
)
from elasticd.wire.keys import Keys
from elasticd.wire.nodefaults import CordonRecord, encode_cordon

if TYPE_CHECKING:  # the client is imported where it is wired (etcd3 and grpc slow the start)
    from elasticd.ops.jobauth import SetupJobQuery
    from elasticd.store.etcd import EtcdClient

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
    stall_after_s: float = STALL_AFTER_S  # 0: stalls are not checked


@dataclass(frozen=True)
class DrainQuery:
    """A validated ``elasticctl drain`` command line."""

    etcd: EtcdConfig
    job_id: str
    node: str
    wait: bool
    timeout_s: float


@dataclass(frozen=True)
class EventsQuery:
    """A validated ``elasticctl events`` command line (``timeline``: ``out`` set, ``json`` False)."""

    etcd: EtcdConfig
    job_id: str
    json: bool
    limit: int | None
    out: str = ""  # timeline: the file to write


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
        if args.command == "drain":
            return run_drain(drain_query(parser, args), out, err, sleep)
        if args.command == "events":
            return run_events(events_query(args), out, err)
        if args.command in ("cordon", "uncordon"):
            etcd, job_id = _target(args)
            return run_cordon(etcd, job_id, args.node, args.command == "cordon", args.reason, out, err)
        if args.command == "timeline":
            from elasticd.ops.timeline_plot import output_format

            output_format(args.out)  # a bad suffix is bad input, before etcd is asked
            return run_events(replace(events_query(args), out=args.out), out, err)
        if args.command == "auth":
            from elasticd.ops.jobauth import run_setup_job  # imports etcd3: only for this command

            return run_setup_job(setup_job_query(args), out, err, PROG)
        query = status_query(parser, args)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=err)
        return EXIT_DOWN
    return run_status(query, out, err, sleep)


CTL_SECURITY_FLAGS = {
    "ca_cert": "CA bundle that signs etcd's certificate: talk TLS to etcd",
    "cert_cert": "client certificate for etcd mutual TLS",
    "cert_key": "private key of the client certificate",
    "user": "etcd user (its password from --etcd-password-file or $ELASTICD_ETCD_PASSWORD)",
    "password_file": "file whose first line is the etcd user's password",
}


CTL_DESCRIPTION = (
    "Inspect elastic training jobs in etcd, and drain or cordon nodes. Exit codes of status: 0 healthy or "
    "finished, 1 degraded, 2 down, failed, no such job, etcd unreachable, or bad input; of drain: 0 requested "
    "(with --wait: the node's members left the generation), 2 unknown node, timeout, etcd unreachable or bad "
    "input; of cordon and uncordon: 0 done, 2 etcd unreachable or bad input; of events: 0 listed, 2 no such "
    "job, etcd unreachable or bad input; etcd's permission denied: 2; of auth setup-job: 0 done, 1 etcd "
    "refused or unreachable, 2 bad input."
)


def _add_cordon_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``cordon NODE [--reason]`` and ``uncordon NODE``."""
    for name, what in (
        ("cordon", "keep NODE out of the job: its agent stops its workers and starts none until uncordon"),
        ("uncordon", "let a cordoned NODE (by an operator, or by its agent for its crashes) run workers again"),
    ):
        sub = commands.add_parser(
            name,
            help=what,
            description=f"{what[0].upper()}{what[1:]}. Exit codes: 0 done, 2 etcd unreachable or bad input.",
        )
        sub.add_argument("node", type=_node_id, metavar="NODE", help="the node id")
        sub.add_argument("--job", type=_job_id, default=None, help="job id (default: $ELASTICD_JOB_ID, else 'default')")
        sub.add_argument("--reason", default="", help=argparse.SUPPRESS if name == "uncordon" else "why, for status")


def build_ctl_parser() -> argparse.ArgumentParser:
    """The ``elasticctl`` argument parser (flag defaults are None: the environment fills them)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=CTL_DESCRIPTION,
    )
    parser.add_argument(
        "--etcd",
        type=_endpoints,
        default=None,
        metavar="[https://]HOST:PORT[,...]",
        help="etcd endpoints; https:// talks TLS, trusting the system's CA bundle unless "
        "--etcd-ca-cert is given (default: $ELASTICD_ETCD_ENDPOINTS, else 127.0.0.1:2379)",
    )
    parser.add_argument(
        "--prefix",
        type=_prefix,
        default=None,
        help="key prefix of all jobs (default: $ELASTICD_ETCD_PREFIX, else /elasticd)",
    )
    # TLS and auth, as the agent's etcd_* settings; the password only from a file or
    # $ELASTICD_ETCD_PASSWORD, never as a flag (a command line is visible to every local user).
    for name, help_text in CTL_SECURITY_FLAGS.items():
        parser.add_argument(
            "--etcd-" + name.replace("_", "-"),
            dest="etcd_" + name,
            default=None,
            metavar="FILE" if name != "user" else "NAME",
            help=f"{help_text} (default: $ELASTICD_ETCD_{name.upper()})",
        )
    parser.add_argument(
        "--insecure",
        dest="etcd_insecure",
        action="store_const",
        const=True,
        default=None,
        help="allow the etcd user's password in plaintext to an etcd off loopback "
        "(without TLS) (default: $ELASTICD_ETCD_INSECURE)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    status = commands.add_parser(
        "status",
        help="show a job's generation, members and health",
        description="Show a job's generation, members and health.",
    )
    status.add_argument("--job", type=_job_id, default=None, help="job id (default: $ELASTICD_JOB_ID, else 'default')")
    status.add_argument("--json", action="store_true", help="print one JSON object (per frame)")
    status.add_argument("--watch", action="store_true", help="redraw until Ctrl-C")
    status.add_argument(
        "--interval", type=_positive_float, default=2.0, metavar="S", help="seconds between --watch frames (default: 2)"
    )
    status.add_argument("--count", type=_positive_int, default=None, help=argparse.SUPPRESS)
    status.add_argument(
        "--min-workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the job's min_workers (not stored in etcd): below it is 'down'",
    )
    status.add_argument(
        "--max-workers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="the job's max_workers (not stored in etcd): below it is 'degraded'",
    )
    status.add_argument(
        "--stall-after-s",
        type=_non_negative_float,
        default=STALL_AFTER_S,
        metavar="S",
        help=f"no step committed for this long (or {STALL_STEP_FACTOR:g} step times if longer) "
        f"while every member is alive is 'stalled' (default: {STALL_AFTER_S:g}; 0: never)",
    )
    drain = commands.add_parser(
        "drain",
        help="ask a node's agent to drain (its workers finish their step and leave)",
        description="Ask the agent of NODE to drain, as on SIGTERM: its workers finish their step and "
        "leave, the job goes on without them, the agent exits 0. Exit codes: 0 requested (with --wait: "
        "the node's members have left the generation), 2 unknown node, --wait timed out, etcd unreachable "
        "or bad input.",
    )
    drain.add_argument("node", type=_node_id, metavar="NODE", help="the node id (as in the nodes section of status)")
    drain.add_argument("--job", type=_job_id, default=None, help="job id (default: $ELASTICD_JOB_ID, else 'default')")
    drain.add_argument(
        "--wait", action="store_true", help="return once the node's members have left the current generation"
    )
    drain.add_argument(
        "--timeout",
        type=_positive_float,
        default=None,
        metavar="S",
        help=f"with --wait: give up (exit 2) after S seconds (default: {DEFAULT_DRAIN_WAIT_S:g})",
    )
    _add_cordon_parsers(commands)
    events = commands.add_parser(
        "events",
        help="show the job's membership and recovery history",
        description="Show the job's events (generations published, recoveries, "
        "worker exits and restarts, drains), newest last. Exit codes: 0 listed, "
        "2 no such job, etcd unreachable or bad input.",
    )
    events.add_argument("--job", type=_job_id, default=None, help="job id (default: $ELASTICD_JOB_ID, else 'default')")
    events.add_argument("--json", action="store_true", help="print one JSON object")
    events.add_argument(
        "--limit",
        type=_positive_int,
        default=None,
        metavar="N",
        help="only the newest N events (default: all kept, see events_keep)",
    )
    timeline = commands.add_parser(
        "timeline",
        help="draw the job's history into one picture",
        description="Draw the job's events into a PNG, SVG or HTML file: committed "
        "steps and checkpoint saves, world size with each generation, fault and "
        "recovery marked, and throughput, over time. Needs matplotlib "
        "(pip install 'elasticd[plot]'). Exit codes: 0 written, 2 no such job, etcd "
        "unreachable, no matplotlib, or bad input.",
    )
    timeline.add_argument(
        "--job", type=_job_id, default=None, help="job id (default: $ELASTICD_JOB_ID, else 'default')"
    )
    timeline.add_argument("--out", required=True, metavar="FILE", help="where to write: FILE.png, .svg or .html")
    timeline.set_defaults(json=False, limit=None)
    auth = commands.add_parser("auth", help="etcd users and roles for elasticd jobs").add_subparsers(
        dest="auth_command", metavar="COMMAND", required=True
    )
    setup = auth.add_parser(
        "setup-job",
        help="create a job's own etcd role and user (as root)",
        description="As etcd's root user (--etcd-user root --etcd-password-file FILE before "
        "'auth'), create where missing the role elasticd-JOB with read-write on exactly "
        "PREFIX/JOB/ and the user JOB (or --user) with it; print how to use them. Exit codes: 0 "
        "done, 1 etcd refused (not root, authentication off) or unreachable, 2 bad input.",
    )
    setup.add_argument("job", type=_job_id, metavar="JOB", help="the job id")
    setup.add_argument(
        "--user", type=_user_name, default=None, metavar="NAME", help="the job's etcd user (default: the job id)"
    )
    setup.add_argument(
        "--password-file",
        default=None,
        metavar="FILE",
        help="file whose first line is the user's password, set on it (default: a new user gets a "
        "generated one, printed once; a user that exists keeps its own)",
    )
    setup.add_argument(
        "--prefix",
        dest="job_prefix",
        type=_prefix,
        default=None,
        metavar="PREFIX",
        help="key prefix of all jobs, as the global --prefix (default: $ELASTICD_ETCD_PREFIX, else /elasticd)",
    )
    return parser


def _target(args: argparse.Namespace) -> tuple[EtcdConfig, str]:
    """etcd (with its TLS/auth settings) and the job id from the flags, else from the environment
    (only for a missing flag).

    Raises:
        ConfigError: an ``ELASTICD_*`` variable that a missing flag falls back on is invalid, or the
            TLS/auth settings are.
    """
    endpoints: tuple[str, ...] | None = args.etcd
    prefix: str | None = args.prefix
    job_id: str | None = args.job
    if endpoints is None or prefix is None or job_id is None:
        # only when a flag is missing: a bad variable cannot block flags; TLS/auth are taken below
        env = worker_env_from_environ(without_etcd_security())
        endpoints = endpoints or env.etcd.endpoints
        prefix = prefix or env.etcd.prefix
        job_id = job_id or env.world.job_id
    security = etcd_security_environ()
    for name in (*CTL_SECURITY_FLAGS, "insecure"):
        given = getattr(args, "etcd_" + name)
        if given is not None:
            security[name] = given
            if name == "password_file":
                security.pop("password", None)  # the flag wins over the variable
    return etcd_config({"endpoints": endpoints, "prefix": prefix, **security}, "etcd"), job_id


def drain_query(parser: argparse.ArgumentParser, args: argparse.Namespace) -> DrainQuery:
    """Validate ``drain`` flags (see ``status_query``).

    Raises:
        ConfigError: an ``ELASTICD_*`` variable that a missing flag falls back on is invalid.
    """
    if args.timeout is not None and not args.wait:
        parser.error("--timeout only applies with --wait")
    etcd, job_id = _target(args)
    return DrainQuery(
        etcd=etcd,
        job_id=job_id,
        node=args.node,
        wait=args.wait,
        timeout_s=args.timeout if args.timeout is not None else DEFAULT_DRAIN_WAIT_S,
    )


def events_query(args: argparse.Namespace) -> EventsQuery:
    """Validate ``events`` flags (see ``status_query``).

    Raises:
        ConfigError: an ``ELASTICD_*`` variable that a missing flag falls back on is invalid.
    """
    etcd, job_id = _target(args)
    return EventsQuery(etcd=etcd, job_id=job_id, json=args.json, limit=args.limit)


def setup_job_query(args: argparse.Namespace) -> SetupJobQuery:
    """Validate ``auth setup-job`` flags (the etcd settings as ``status_query``'s).

    Raises:
        ConfigError: an ``ELASTICD_*`` variable that a missing flag falls back on is invalid.
    """
    from elasticd.ops.jobauth import SetupJobQuery

    if args.job_prefix is not None:
        args.prefix = args.job_prefix
    etcd, job_id = _target(args)
    return SetupJobQuery(etcd=etcd, job=job_id, user=args.user or job_id, password_file=args.password_file or "")


def _ctl_client(etcd: EtcdConfig, err: TextIO) -> EtcdClient | None:
    """A client for one elasticctl command, or None after printing why there is none (etcd did not
    answer, or refused the credentials: with a user, connecting authenticates)."""
    from elasticd.store.etcd import EtcdClient

    # One attempt per endpoint plus one, so that failover can reach every endpoint once.
    retry = RetryPolicy(
        etcd_attempts=len(etcd.endpoints) + 1, etcd_backoff_initial_s=CTL_BACKOFF_S, etcd_backoff_max_s=CTL_BACKOFF_S
    )
    try:
        return EtcdClient(etcd, CTL_TIMEOUTS, retry)
    except EtcdUnavailable as exc:
        print(unreachable_message(etcd, exc), file=err, flush=True)
    except ConfigError as exc:
        print(f"{PROG}: {exc}", file=err, flush=True)
    return None


def requester() -> str:
    """Who asks for a drain: ``user@host (pid N)``."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()} (elasticctl pid {os.getpid()})"


def run_cordon(etcd: EtcdConfig, job_id: str, node: str, cordon: bool, reason: str, out: TextIO, err: TextIO) -> int:
    """``cordon``: write ``cordon/<node>`` (who and why); ``uncordon``: delete it."""
    keys = Keys(etcd.prefix, job_id)
    client = _ctl_client(etcd, err)
    if client is None:
        return EXIT_DOWN
    try:
        if cordon:
            record = CordonRecord(node, requester(), reason or "by an operator", time.time())
            client.put(keys.cordon(node), encode_cordon(record))
            print(f"cordoned node {node} of job {job_id}: its agent stops its workers and starts none", file=out)
        else:
            client.delete(keys.cordon(node))
            print(f"uncordoned node {node} of job {job_id}: its agent may start its workers", file=out)
        return EXIT_OK
    except (EtcdUnavailable, PermissionDenied) as exc:
        print(unreachable_message(etcd, exc), file=err, flush=True)
        return EXIT_DOWN
    finally:
        client.close()


def run_drain(query: DrainQuery, out: TextIO, err: TextIO, sleep: Callable[[float], None]) -> int:
    """Request the drain; with ``--wait``, poll until the node's members left the generation."""
    keys = Keys(query.etcd.prefix, query.job_id)
    client = _ctl_client(query.etcd, err)
    if client is None:
        return EXIT_DOWN
    try:
        return execute_drain(client, keys, query, out, err, sleep)
    except (EtcdUnavailable, PermissionDenied) as exc:
        print(unreachable_message(query.etcd, exc), file=err, flush=True)
        return EXIT_DOWN
    except KeyboardInterrupt:
        return EXIT_DOWN
    finally:
        client.close()


def execute_drain(
    store: DrainStore, keys: Keys, query: DrainQuery, out: TextIO, err: TextIO, sleep: Callable[[float], None]
) -> int:
    """The drain command on a given store: request, then (``--wait``) poll until done or timed out.

    Raises:
        EtcdUnavailable: etcd could not be reached within the store's retry bound.
        PermissionDenied: the etcd user's role does not cover the job.
    """
    req = request_drain(store, keys, query.node, requester(), time.time())
    if not req.accepted:
        print(f"{PROG}: {req.message}", file=err, flush=True)
        return EXIT_DOWN
    print(req.message, file=out, flush=True)
    if not query.wait:
        return EXIT_OK
    tracked = set(req.members)
    deadline = time.monotonic() + query.timeout_s
    while True:
        done, why = drain_progress(keys, store.get_prefix(keys.prefix), query.node, tracked)
        if done:
            print(f"node {query.node!r} drained: {why}", file=out, flush=True)
            return EXIT_OK
        if time.monotonic() >= deadline:
            print(f"{PROG}: node {query.node!r} not drained after {query.timeout_s:g} s: {why}", file=err, flush=True)
            return EXIT_DOWN
        sleep(min(DRAIN_POLL_S, max(0.0, deadline - time.monotonic())))


def run_events(query: EventsQuery, out: TextIO, err: TextIO) -> int:
    """Print the job's events, newest last."""
    keys = Keys(query.etcd.prefix, query.job_id)
    client = _ctl_client(query.etcd, err)
    if client is None:
        return EXIT_DOWN
    try:
        rows = client.get_prefix(keys.prefix)
        ev = job_events(keys, rows, query.limit)
    except (EtcdUnavailable, PermissionDenied) as exc:
        print(unreachable_message(query.etcd, exc), file=err, flush=True)
        return EXIT_DOWN
    finally:
        client.close()
    if not ev.exists:
        print(f"{PROG}: no such job: nothing under {keys.prefix}", file=err, flush=True)
        return EXIT_DOWN
    if query.out:
        from elasticd.ops.parse import parse_samples
        from elasticd.ops.timeline import build_timeline
        from elasticd.ops.timeline_plot import render

        try:
            render(build_timeline(query.job_id, [e for _, e in ev.events] + parse_samples(keys, rows)), query.out)
        except OSError as exc:
            print(f"{PROG}: cannot write {query.out}: {exc}", file=err, flush=True)
            return EXIT_DOWN
        print(query.out, file=out, flush=True)
        return EXIT_OK
    out.write(render_events_json(ev) + "\n" if query.json else render_events_table(ev))
    out.flush()
    return EXIT_OK


def status_query(parser: argparse.ArgumentParser, args: argparse.Namespace) -> StatusQuery:
    """Validate parsed flags and fill the missing ones from the environment.

    Raises:
        ConfigError: an ``ELASTICD_*`` variable that a missing flag falls back on is invalid.
    """
    if args.min_workers is not None and args.max_workers is not None and args.min_workers > args.max_workers:
        parser.error(f"--min-workers ({args.min_workers}) must be <= --max-workers ({args.max_workers})")
    if args.count is not None and not args.watch:
        parser.error("--count only applies with --watch")
    etcd, job_id = _target(args)
    return StatusQuery(
        etcd=etcd,
        job_id=job_id,
        json=args.json,
        watch=args.watch,
        interval_s=args.interval,
        count=args.count,
        min_workers=args.min_workers,
        max_workers=args.max_workers,
        stall_after_s=args.stall_after_s,
    )


def run_status(query: StatusQuery, out: TextIO, err: TextIO, sleep: Callable[[float], None]) -> int:
    """Print one report (or, with ``--watch``, one per interval) and return the last exit code."""
    keys = Keys(query.etcd.prefix, query.job_id)
    client = _ctl_client(query.etcd, err)
    if client is None:
        return EXIT_DOWN
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


def _report(store: PrefixReader, keys: Keys, query: StatusQuery, out: TextIO, err: TextIO, clear: bool) -> int:
    try:
        status = read_status(
            store,
            keys,
            now=time.time(),
            min_workers=query.min_workers,
            max_workers=query.max_workers,
            stall_after_s=query.stall_after_s,
        )
    except (EtcdUnavailable, PermissionDenied) as exc:
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


def unreachable_message(etcd: EtcdConfig, exc: EtcdUnavailable | PermissionDenied) -> str:
    """One line for stderr: which etcd did not answer, why (abridged), and where to change it; or
    that the etcd user may not touch the job (``PermissionDenied`` names the job and the user)."""
    why = " ".join(str(exc).split())
    if isinstance(exc, PermissionDenied):
        return f"{PROG}: {why}"
    if len(why) > 240:
        why = why[:237] + "..."
    where = ",".join(etcd.endpoints)
    if " rejected " in why:  # it answered: the credentials or the request were refused
        return f"{PROG}: {why} (check --etcd-user and --etcd-password-file or ELASTICD_ETCD_PASSWORD)"
    head = (
        f"{PROG}: {why}"
        if why.startswith(f"etcd at {where} did not answer")
        else (f"{PROG}: etcd at {where} did not answer: {why}")
    )
    hint = "set --etcd or ELASTICD_ETCD_ENDPOINTS"
    if etcd.tls:
        hint += "; with TLS, check --etcd-ca-cert, --etcd-cert-cert and --etcd-cert-key"
        if not etcd.ca_cert:
            hint += " (without --etcd-ca-cert, etcd's certificate must be signed by a CA the system trusts)"
    elif "ssl" in why.lower() or "handshake" in why.lower() or "Socket closed" in why:
        hint += "; if etcd speaks TLS, write --etcd as https://HOST:PORT or set --etcd-ca-cert"
    return f"{head} ({hint})"


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


def _name(kind: str) -> Callable[[str], str]:
    """An argparse type: ``text`` checked as a name of ``kind`` (``config.check_name``)."""

    def parse(text: str) -> str:
        try:
            check_name(kind, text)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc
        return text

    return parse


_node_id, _user_name = _name("node_id"), _name("user")


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


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}") from exc
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
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

AGENT_PROG = "elasticd"
AGENT_EXIT_OK = 0  # the workers finished, or the node was drained (SIGTERM)
AGENT_EXIT_FATAL = 1  # restarts exhausted, etcd unreachable at start, or an internal failure
# a bad flag, variable or config file field (one line on stderr per field), a node id that another
# live agent of the job holds (``node_id_taken``; agent.EXIT_CONFIG), or an etcd user whose role does
# not cover the job (``PermissionDenied``)
AGENT_EXIT_BAD_CONFIG = 2
# torchrun's spellings of the same settings, so that a torchrun command line works with little change.
TORCHRUN_ALIASES: dict[str, list[str]] = {
    "job_id": ["--rdzv-id", "--rdzv_id"],
    "etcd_endpoints": ["--rdzv-endpoint", "--rdzv_endpoint", "--etcd"],
    "nproc_per_node": ["--nproc_per_node"],
    "max_restarts": ["--max_restarts"],
    "spares_per_node": ["--spares"],
}
# Boolean settings that also have a switch taking no value (the setting's own flag takes true|false).
SWITCHES = {"etcd_insecure": "--insecure", "standby_node": "--standby"}
_AGENT_GROUPS = {
    "world": "job",
    "etcd": "etcd",
    "timeouts": "timeouts (seconds)",
    "retry": "etcd retries",
    "checkpoint": "durable checkpoints",
    "agent": "node agent",
}


def build_agent_parser() -> argparse.ArgumentParser:
    """The ``elasticd`` parser: one flag per setting (``--lease-ttl-s`` for ``lease_ttl_s``), default
    None so that a flag not given leaves the variable, the file or the default in force."""
    parser = argparse.ArgumentParser(
        prog=AGENT_PROG,
        allow_abbrev=False,
        usage="%(prog)s [--config FILE] [flags] -- PROGRAM [ARGS...]",
        description="The elasticd node agent: runs this node's workers of an elastic training job, "
        "restarts a failed one (it rejoins as a newcomer), and drains them on SIGTERM. Every setting "
        "is a flag, an ELASTICD_<NAME> variable and a key of the TOML config file (in that order of "
        "precedence).",
        epilog="Exit codes: 0 the workers finished or the node was drained; 1 restarts exhausted, etcd "
        "unreachable, or another fatal error; 2 bad configuration (the message names the field), an etcd user whose "
        "role does not cover the job (permission denied), or the node id "
        "is held by another live agent of the job (node_id_taken, after waiting up to lease_ttl_s + 2 s).",
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=None,
        help=f"TOML config file (default: $ELASTICD_CONFIG, else {DEFAULT_CONFIG_FILE} if it exists)",
    )
    parser.add_argument(
        "--nnodes",
        metavar="MIN:MAX",
        default=None,
        help="torchrun's node bounds: min/max_workers become MIN/MAX times nproc_per_node",
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for s in AGENT_SETTINGS.values():
        if s.name == "program":
            continue
        if s.section not in groups:
            groups[s.section] = parser.add_argument_group(_AGENT_GROUPS[s.section])
        metavar = {int: "N", float: "S", bool: "true|false", tuple: "HOST:PORT[,...]"}.get(s.kind, "TEXT")
        groups[s.section].add_argument(
            s.flag,
            *TORCHRUN_ALIASES.get(s.name, []),
            dest=s.name,
            default=None,
            metavar=metavar,
            help=f"{s.doc} [{s.variable}]".replace("%", "%%"),
        )
        if s.name in SWITCHES:
            groups[s.section].add_argument(
                SWITCHES[s.name], dest=s.name, action="store_const", const="true", help=f"the same as {s.flag} true"
            )
    parser.add_argument("program", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    return parser


def parse_agent_command_line(
    argv: Sequence[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    default_config_file: Path = DEFAULT_CONFIG_FILE,
) -> AgentConfig:
    """Turn an ``elasticd`` command line (and the environment, and the config file) into settings.

    The program follows ``--``, or (as with torchrun) is the first argument that is not a flag.

    Raises:
        ConfigError: a setting is bad or missing; one line per field, naming it.
        SystemExit: ``--help``, or a flag argparse does not know (exit code 2).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    program: list[str] = []
    if "--" in args_list:
        cut = args_list.index("--")
        args_list, program = args_list[:cut], args_list[cut + 1 :]
    parser = build_agent_parser()
    args = parser.parse_args(args_list)
    if args.program:
        if program:
            parser.error(f"unrecognized arguments before --: {' '.join(args.program)}")
        program = list(args.program)
    flags = {s.name: getattr(args, s.name) for s in AGENT_SETTINGS.values() if s.name != "program"}
    return load_agent_config(
        flags,
        program=program,
        nnodes=args.nnodes,
        config_file=args.config,
        environ=environ,
        default_config_file=default_config_file,
    )


def agent_main(argv: Sequence[str] | None = None, *, stderr: TextIO | None = None) -> int:
    """``elasticd [--config FILE] [flags] -- PROGRAM [ARGS...]``: run the node agent.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).
        stderr: where configuration errors and the reason of a fatal exit go (default: ``sys.stderr``).

    Returns:
        0 the workers finished or the node was drained; 1 fatal (restarts exhausted, etcd
        unreachable); 2 bad configuration, etcd's permission denied on the job, or the node id is
        another live agent's (``node_id_taken``).
    """
    err = stderr if stderr is not None else sys.stderr
    try:
        config = parse_agent_command_line(argv)
    except ConfigError as exc:
        for line in str(exc).splitlines():
            print(f"{AGENT_PROG}: {line}", file=err)
        return AGENT_EXIT_BAD_CONFIG
    configure_logging()
    from elasticd.agent.elastic import (
        Agent,  # the entry point wires the concrete objects
    )
    from elasticd.agent.metrics import AgentMetrics, MetricsServer, serve
    from elasticd.store.etcd import EtcdClient

    try:
        client = EtcdClient(config.etcd, config.timeouts, config.retry)
    except EtcdUnavailable as exc:  # with a user, connecting authenticates
        print(f"{AGENT_PROG}: etcd_unreachable: {exc}", file=err)
        return AGENT_EXIT_FATAL
    except ConfigError as exc:  # a file it names cannot be read, or https:// and no CA bundle
        print(f"{AGENT_PROG}: {exc}", file=err)
        return AGENT_EXIT_BAD_CONFIG
    metrics: AgentMetrics | None = None
    server: MetricsServer | None = None
    if config.metrics_port:
        metrics = AgentMetrics(config.world.job_id, config.node_id)
        try:
            server = serve(metrics, config.metrics_addr, config.metrics_port)
        except OSError as exc:
            client.close()
            print(
                f"{AGENT_PROG}: metrics_port: cannot listen on {config.metrics_addr}:{config.metrics_port}: {exc}",
                file=err,
            )
            return AGENT_EXIT_FATAL
    systemd = systemd_notify_environ()
    notifier = Notifier(systemd["NOTIFY_SOCKET"])
    watchdog_s = watchdog_interval(systemd["WATCHDOG_USEC"], systemd["WATCHDOG_PID"])
    try:
        if config.mode == "restart":  # unmodified torchrun scripts: any failure restarts the whole group
            from elasticd.agent.restart import GroupRestartAgent

            outcome = GroupRestartAgent(config, client, notifier=notifier, watchdog_s=watchdog_s).run()
        else:
            outcome = Agent(config, client, notifier=notifier, metrics=metrics, watchdog_s=watchdog_s).run()
    finally:
        notifier.close()
        client.close()
        if server is not None:
            server.close()
    if outcome.exit_code != AGENT_EXIT_OK:
        print(f"{AGENT_PROG}: {outcome.reason}", file=err)
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(ctl_main())
