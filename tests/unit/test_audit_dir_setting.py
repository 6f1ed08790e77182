"""The audit directory: ``ELASTICD_AUDIT_DIR`` read into ``WorkerEnv``, and the agent's ``audit_dir``
(flag ``--audit-dir``, variable, TOML key) handed to the workers it starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.cli import parse_agent_command_line
from elasticd.config import AgentConfig, WorkerEnv, WorldConfig
from elasticd.errors import ConfigError
from elasticd.settings import worker_env_from_environ, worker_env_to_environ


def _agent(tmp_path: Path, *argv: str, environ: dict[str, str] | None = None, toml: str | None = None) -> AgentConfig:
    if toml is not None:
        (tmp_path / "elasticd.toml").write_text(toml)
        argv = ("--config", str(tmp_path / "elasticd.toml"), *argv)
    return parse_agent_command_line(
        [*argv, "--", "true"], environ=environ or {}, default_config_file=tmp_path / "absent.toml"
    )


def test_the_variable_is_read_into_worker_env_and_names_this_workers_file() -> None:
    env = worker_env_from_environ(
        {
            "ELASTICD_AUDIT_DIR": "/data/audit",
            "ELASTICD_JOB_ID": "jj",
            "ELASTICD_NODE_ID": "gpu-3",
            "ELASTICD_LOCAL_RANK": "2",
        }
    )
    assert env.audit_dir == "/data/audit"
    assert env.audit_file == Path("/data/audit/jj/gpu-3.2.jsonl")
    assert worker_env_from_environ(worker_env_to_environ(env)) == env
    assert worker_env_from_environ({"ELASTICD_NODE_ID": "n"}).audit_file is None  # unset: no audit file
    assert WorkerEnv(node_id="n", world=WorldConfig(job_id="j"), audit_dir="").audit_file is None
    with pytest.raises(ConfigError, match=r"^audit_dir: not a valid path"):
        worker_env_from_environ({"ELASTICD_NODE_ID": "n", "ELASTICD_AUDIT_DIR": "a\0b"})


@pytest.mark.parametrize(
    ("argv", "environ", "toml", "expected"),
    [
        (("--audit-dir", "{d}/flag"), {"ELASTICD_AUDIT_DIR": "{d}/env"}, "audit_dir = '{d}/toml'\n", "flag"),
        ((), {"ELASTICD_AUDIT_DIR": "{d}/env"}, "audit_dir = '{d}/toml'\n", "env"),
        ((), {}, "audit_dir = '{d}/toml'\n", "toml"),
    ],
    ids=["flag", "variable", "file"],
)
def test_the_agent_sets_the_variable_for_its_workers(
    tmp_path: Path, argv: tuple[str, ...], environ: dict[str, str], toml: str, expected: str
) -> None:
    d = str(tmp_path)
    cfg = _agent(
        tmp_path,
        *(a.format(d=d) for a in argv),
        "--node-id",
        "gpu-3",
        "--job-id",
        "jj",
        "--nproc-per-node",
        "2",
        environ={k: v.format(d=d) for k, v in environ.items()},
        toml=toml.format(d=d),
    )
    variables = worker_env_to_environ(cfg.worker_env(1))
    assert variables["ELASTICD_AUDIT_DIR"] == f"{d}/{expected}"
    assert worker_env_from_environ(variables).audit_file == tmp_path / expected / "jj" / "gpu-3.1.jsonl"


def test_without_the_setting_the_workers_get_no_audit_dir(tmp_path: Path) -> None:
    env = worker_env_from_environ(worker_env_to_environ(_agent(tmp_path).worker_env(0)))
    assert env.audit_dir == "" and env.audit_file is None


def test_bad_agent_audit_dirs_name_the_setting(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match=r"^audit_dir: .*a-file exists and is not a directory \(from --audit-dir\)"):
        _agent(tmp_path, "--audit-dir", str(tmp_path / "a-file"))
    with pytest.raises(ConfigError, match=r"^audit_dir: the audit files are written by the elastic worker API"):
        _agent(tmp_path, "--audit-dir", str(tmp_path / "audit"), "--mode", "restart")
