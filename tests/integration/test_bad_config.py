"""Bad configuration stops the real entry points with exit 2 and one line naming what is wrong, before
they reach etcd or write anything: a config file that cannot be read as TOML, a job or
node id that is not a name, ``https://`` mixed with plaintext endpoints, and a password that would
cross the network in plaintext."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elasticd.testing.localcluster import REPO_ROOT

pytestmark = pytest.mark.timeout(60)

AGENT = [sys.executable, "-c", "import sys; from elasticd.cli import agent_main; sys.exit(agent_main())"]
CTL = [sys.executable, "-c", "import sys; from elasticd.cli import ctl_main; sys.exit(ctl_main())"]
CLI_TIMEOUT_S = 30  # bound on one run; each answers in about a second
# A file that even root cannot read: the kernel refuses reads of write-only sysctls to everyone.
WRITE_ONLY_FILE = Path("/proc/sys/vm/compact_memory")


def _run(argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    base.update(PYTHONPATH=str(REPO_ROOT), **env)
    return subprocess.run(argv, cwd=REPO_ROOT, env=base, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def _one_error_line(proc: subprocess.CompletedProcess[str], prog: str) -> str:
    assert proc.returncode == 2, proc
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{prog}: "), proc.stderr
    return lines[0]


def _unreadable_file(tmp_path: Path) -> Path:
    """A regular file whose read raises PermissionError (mode 000; as root, a write-only sysctl)."""
    path = tmp_path / "unreadable.toml"
    path.write_text("max_restarts = 1\n")
    path.chmod(0)
    for candidate in (path, WRITE_ONLY_FILE):
        try:
            candidate.open("rb").close()
        except PermissionError:
            return candidate
        except OSError:
            continue
    pytest.skip("no file here that this user cannot read")


# -- the config file ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "case", ["not utf-8", "directory", "directory from ELASTICD_CONFIG", "unreadable", "invalid toml"]
)
def test_a_config_file_that_is_not_toml_text_is_a_config_error_naming_it(tmp_path: Path, case: str) -> None:
    path = tmp_path / "elasticd.toml"
    env: dict[str, str] = {}
    argv = ["--config", str(path)]
    if case == "not utf-8":
        path.write_bytes(b"program = ['true']\njob_id = '\xff\xfejob'\n")
        expected = f"elasticd: config: {path} is not UTF-8 text (byte "
    elif case.startswith("directory"):
        path.mkdir()
        where = "ELASTICD_CONFIG" if case.endswith("ELASTICD_CONFIG") else "--config"
        if where == "ELASTICD_CONFIG":
            argv, env = [], {"ELASTICD_CONFIG": str(path)}
        expected = f"elasticd: config: a directory, not a TOML file: {str(path)!r} (from {where})"
    elif case == "unreadable":
        path = _unreadable_file(tmp_path)
        argv = ["--config", str(path)]
        expected = f"elasticd: config: cannot read {path}: Permission denied"
    else:
        path.write_text("program = ['true']\nlease_ttl_s = \n")
        expected = f"elasticd: config: {path} is not valid TOML: "
    line = _one_error_line(_run(AGENT + argv + ["--", "true"], **env), "elasticd")
    assert line.startswith(expected), line


# -- job and node ids are names -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--job-id", ".."], {}, "job_id"),
        (["--job-id", "a/b"], {}, "job_id"),
        ([], {"ELASTICD_JOB_ID": "."}, "job_id"),
        (["--node-id", "../n"], {}, "node_id"),
        ([], {"ELASTICD_NODE_ID": "node 1"}, "node_id"),
    ],
)
def test_the_agent_refuses_a_job_or_node_id_that_is_not_a_name(
    argv: list[str], env: dict[str, str], named: str
) -> None:
    line = _one_error_line(_run(AGENT + ["--etcd", "127.0.0.1:9", *argv, "--", "true"], **env), "elasticd")
    assert line.startswith(f"elasticd: {named}: must be 1 to 128 of the characters A-Z a-z 0-9 . _ -"), line


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["status", "--job", ".."], {}, "argument --job: job_id: must be 1 to 128"),
        (["events", "--job", "a/b"], {}, "argument --job: job_id: must be 1 to 128"),
        (["drain", "../n"], {}, "argument NODE: node_id: must be 1 to 128"),
        (["status"], {"ELASTICD_JOB_ID": ".."}, "elasticctl: job_id: must be 1 to 128"),
    ],
)
def test_elasticctl_refuses_a_job_or_node_id_that_is_not_a_name(
    argv: list[str], env: dict[str, str], expected: str
) -> None:
    proc = _run(CTL + ["--etcd", "127.0.0.1:9", *argv], **env)  # nothing listens there: never reached
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert expected in proc.stderr, proc.stderr


def test_a_worker_with_job_id_dotdot_writes_nothing_outside_its_checkpoint_dir(local_job, tmp_path: Path) -> None:
    """``<checkpoint_dir>/<job_id>/`` with job id ``..`` was the directory's parent."""
    area = tmp_path / "area"
    ckpt = area / "ckpt"
    ckpt.mkdir(parents=True)
    job = local_job()
    w = job.spawn("--steps", "3", job_id="..", checkpoint_dir=ckpt, checkpoint_every_steps=1, audit=False)
    assert w.wait(60) == 2, w.log_text()[-2000:]
    text = w.log_text()
    assert "ConfigError: job_id: must be 1 to 128" in text and "got '..'" in text, text[-2000:]
    assert sorted(p.relative_to(area) for p in area.rglob("*")) == [Path("ckpt")]


# -- https:// and plaintext passwords -------------------------------------------------------------


def test_https_mixed_with_plaintext_endpoints_is_a_config_error() -> None:
    line = _one_error_line(_run(CTL + ["--etcd", "https://127.0.0.1:9,127.0.0.1:10", "status"]), "elasticctl")
    assert line.startswith("elasticctl: etcd_endpoints: https:// and plaintext endpoints mixed in one list"), line
    line = _one_error_line(
        _run(AGENT + ["--etcd", "http://127.0.0.1:9,https://127.0.0.1:10", "--", "true"]), "elasticd"
    )
    assert line.startswith("elasticd: etcd_endpoints: https:// and plaintext endpoints mixed in one list"), line


@pytest.mark.parametrize("prog", ["elasticd", "elasticctl"])
def test_a_password_in_plaintext_to_a_remote_etcd_is_refused_before_it_is_sent(tmp_path: Path, prog: str) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text("s3cret\n")
    # 192.0.2.1 (TEST-NET-1) is never routed: a client that tried to connect would hang, not fail.
    flags = ["--etcd", "192.0.2.1:2379", "--etcd-user", "u", "--etcd-password-file", str(password_file)]
    argv = AGENT + flags + ["--", "true"] if prog == "elasticd" else CTL + flags + ["status"]
    line = _one_error_line(_run(argv), prog)
    assert line.startswith(
        f"{prog}: etcd_user: its password would cross the network in plaintext to 192.0.2.1:2379; "
    ), line
    assert "set etcd_insecure (--insecure) to allow it" in line, line


# -- the program ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("program", "expected"),
    [
        (["train_missing.py"], "elasticd: program: 'train_missing.py': no such file (the script "),
        ([sys.executable, "-u", "missing/train.py"], "elasticd: program: 'missing/train.py': no such file"),
        ([sys.executable, "agents"], "elasticd: program: 'agents': is a directory, not a script"),
        (["no-such-command-here"], "elasticd: program: 'no-such-command-here' is not an executable file"),
    ],
    ids=["script", "script after an option", "a directory", "command"],
)
def test_a_program_that_cannot_start_is_refused_before_any_worker_starts(program: list[str], expected: str) -> None:
    """Found at the start with exit 2 (systemd does not restart it), not after the restart budget."""
    proc = _run(AGENT + ["--etcd", "127.0.0.1:9", "--", *program])
    line = _one_error_line(proc, "elasticd")
    assert line.startswith(expected), line
