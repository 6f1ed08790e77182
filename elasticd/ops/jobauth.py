"""``elasticctl auth setup-job``: a job's own etcd role and user, as a command's text and exit code.

Owns the command's outcome: reading the password file, running ``store.auth.setup_job`` as the
etcd root user, and telling the operator what was created and how to run the job's agents and
elasticctl with the new credentials (``render_setup``, pure). A role covers exactly
``<prefix>/<job>/``, so a job's user can neither read nor change another job. etcd's users and
roles themselves live in ``store.auth``.

Exit codes: 0 done (also when everything was already there), 1 etcd refused (the admin is not
root, authentication is off, wrong credentials) or did not answer, 2 bad input.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.errors import ConfigError, EtcdRefused, EtcdUnavailable
from elasticd.store.auth import JobAccess, setup_job

EXIT_OK = 0
EXIT_REFUSED = 1  # etcd refused, or did not answer
EXIT_BAD_INPUT = 2
DEFAULT_PREFIX = EtcdConfig().prefix
PASSWORD_FILE_PLACEHOLDER = "PASSWORD_FILE"


@dataclass(frozen=True)
class SetupJobQuery:
    """A validated ``elasticctl auth setup-job`` command line."""

    etcd: EtcdConfig  # with the admin's (root's) credentials
    job: str
    user: str  # the job's etcd user (default: the job id)
    password_file: str = ""  # "": a new user gets a generated password; one that exists keeps its own


def read_password_file(path: str) -> str:
    """The first line of ``path``.

    Raises:
        ConfigError: it cannot be read, or its first line is empty.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--password-file: cannot read {path!r}: {exc}") from exc
    if not lines or not lines[0]:
        raise ConfigError(f"--password-file: the first line of {path!r} is empty")
    return lines[0]


def run_setup_job(query: SetupJobQuery, out: TextIO, err: TextIO, prog: str = "elasticctl") -> int:
    """Set up the job's role and user; print what was done, and how to use them. Returns the exit code."""
    retry = RetryPolicy(etcd_attempts=len(query.etcd.endpoints) + 1, etcd_backoff_initial_s=0.1, etcd_backoff_max_s=0.5)
    try:
        password = read_password_file(query.password_file) if query.password_file else None
        access = setup_job(query.etcd, Timeouts(), retry, query.job, query.user, password)
    except ConfigError as exc:
        print(f"{prog}: {exc}", file=err, flush=True)
        return EXIT_BAD_INPUT
    except (EtcdRefused, EtcdUnavailable) as exc:
        print(f"{prog}: {' '.join(str(exc).split())}", file=err, flush=True)
        return EXIT_REFUSED
    out.write(render_setup(access, query.etcd, query.password_file))
    out.flush()
    return EXIT_OK


def render_setup(access: JobAccess, etcd: EtcdConfig, password_file: str) -> str:
    """What was done, warnings about grants beyond the job, and the commands to use it. Pure."""
    a = access
    perm = f"read-write on [{a.key}, {a.range_end})"
    lines = [
        f"role {a.role}: {'created' if a.role_created else 'exists'}; {perm} "
        f"{'granted' if a.permission_granted else 'already granted'}"
    ]
    if a.user_created:
        how = "a generated password" if a.generated_password else f"the password in {password_file}"
        lines.append(f"user {a.user}: created with {how}")
    elif a.password_set:
        lines.append(f"user {a.user}: exists; password set to the one in {password_file}")
    else:
        lines.append(f"user {a.user}: exists; password unchanged (give --password-file to set it)")
    lines.append(f"user {a.user}: role {a.role} {'granted' if a.role_granted else 'already granted'}")
    for extra in a.other_permissions:
        lines.append(f"warning: role {a.role} also grants {extra}: its users reach beyond {a.key}")
    if a.other_roles:
        lines.append(
            f"warning: user {a.user} also has the role(s) {', '.join(a.other_roles)}: it may reach beyond {a.key}"
        )
    if a.generated_password:
        lines += [
            "",
            f"password of user {a.user} (shown this once; put it in a file that only the job's "
            "agents and operators can read, e.g. with mode 0600):",
            f"  {a.generated_password}",
        ]
    lines += ["", "Run the job's agents and elasticctl with these credentials:"]
    lines += ["  " + line for line in usage_lines(a, etcd, password_file or PASSWORD_FILE_PLACEHOLDER)]
    if etcd.cert_cert:
        lines.append("  (with the job's own client certificate: --etcd-cert-cert FILE --etcd-cert-key FILE)")
    return "\n".join(lines) + "\n"


def usage_lines(access: JobAccess, etcd: EtcdConfig, password_file: str) -> list[str]:
    """The ``elasticd`` and ``elasticctl`` command lines of the job's user. Pure."""
    endpoints = ",".join(etcd.endpoints)
    agent = [f"--etcd-endpoints {endpoints}"]
    ctl = [f"--etcd {endpoints}"]
    if etcd.prefix != DEFAULT_PREFIX:
        agent.append(f"--etcd-prefix {etcd.prefix}")
        ctl.append(f"--prefix {etcd.prefix}")
    if etcd.ca_cert:
        agent.append(f"--etcd-ca-cert {etcd.ca_cert}")
        ctl.append(f"--etcd-ca-cert {etcd.ca_cert}")
    if etcd.insecure:
        agent.append("--insecure")
        ctl.append("--insecure")
    cred = f"--etcd-user {access.user} --etcd-password-file {password_file}"
    return [
        f"elasticd {' '.join(agent)} --job-id {access.job} {cred} -- PROGRAM [ARGS...]",
        f"elasticctl {' '.join(ctl)} {cred} status --job {access.job}",
    ]
