"""settings.py: the worker environment contract (every ``ELASTICD_*`` variable, validation that
names the setting, round trip), the checks of the files a setting names, and the node agent's
loader (precedence flag > variable > file > default, validation, torchrun flags) and the
environment of its workers."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from elasticd.cli import TORCHRUN_ALIASES, build_agent_parser, parse_agent_command_line
from elasticd.config import (
    AgentConfig,
    CheckpointConfig,
    EtcdConfig,
    RetryPolicy,
    Timeouts,
    WorkerEnv,
    WorldConfig,
    parse_endpoint,
)
from elasticd.errors import ConfigError
from elasticd.settings import (
    AGENT_SETTINGS,
    child_environ,
    default_nproc_per_node,
    etcd_config,
    etcd_security_environ,
    from_text,
    load_agent_config,
    parse_nnodes,
    worker_env_from_environ,
    worker_env_to_environ,
)
from elasticd.store.etcd import read_password

pytestmark = pytest.mark.timeout(60)

# A value for every variable, each different from its default (so a variable that is ignored shows).
FULL_ENV = {
    "ELASTICD_ETCD_ENDPOINTS": "10.0.0.1:2379, http://10.0.0.2:2380 ,",
    "ELASTICD_ETCD_PREFIX": "/custom",
    "ELASTICD_JOB_ID": "job-42",
    "ELASTICD_MIN_WORKERS": "2",
    "ELASTICD_MAX_WORKERS": "6",
    "ELASTICD_JOIN_S": "50",
    "ELASTICD_JOIN_WINDOW_S": "0.5",
    "ELASTICD_LAST_CALL_S": "0.6",
    "ELASTICD_COORDINATOR_GRACE_S": "0.4",
    "ELASTICD_DEPUTY_STEP_S": "0.8",
    "ELASTICD_VIEW_POLL_S": "4.0",
    "ELASTICD_LEASE_TTL_S": "4",
    "ELASTICD_KEEPALIVE_S": "1.5",
    "ELASTICD_COLLECTIVE_S": "11",
    "ELASTICD_GROUP_BUILD_S": "12",
    "ELASTICD_GROUP_ABORT_S": "16",
    "ELASTICD_CHECKPOINT_TRANSFER_S": "13",
    "ELASTICD_ETCD_REQUEST_S": "1.25",
    "ELASTICD_LEASE_RENEW_S": "0.4",
    "ELASTICD_ETCD_OUTAGE_S": "300",
    "ELASTICD_RESUME_HOLD_S": "20",
    "ELASTICD_STANDBY_S": "3600",
    "ELASTICD_ABORT_POLL_S": "0.05",
    "ELASTICD_SHUTDOWN_GRACE_S": "14",
    "ELASTICD_PROGRESS_EVENT_S": "3",
    "ELASTICD_ETCD_ATTEMPTS": "3",
    "ELASTICD_ETCD_BACKOFF_INITIAL_S": "0.1",
    "ELASTICD_ETCD_BACKOFF_MAX_S": "2",
    "ELASTICD_ETCD_RECONNECT_MAX_S": "0.25",
    "ELASTICD_STEP_RETRIES": "4",
    "ELASTICD_NONFINITE_STEPS": "5",
    "ELASTICD_NODE_ID": "node-7",
    "ELASTICD_LOCAL_RANK": "3",
    "ELASTICD_ADVERTISE_ADDR": "10.1.2.3",
    "ELASTICD_BACKEND": "gloo",
    "ELASTICD_EVENTS_KEEP": "42",
    "ELASTICD_SPARE": "true",
    "ELASTICD_STANDBY": "yes",
    "ELASTICD_RELAY_SOCKET": "/run/elasticd-relay/relay.sock",
    "ELASTICD_AUDIT_DIR": "/data/audit",
    "ELASTICD_REPLICA_SIZE": "4",
    "ELASTICD_REPLICA": "node-7.r0.12.1",
    "ELASTICD_SHARD": "3",
    "ELASTICD_REPLICA_STORE": "10.1.2.3:29400",
    "ELASTICD_STOP_AFTER_SUM": "17",
    "ELASTICD_MISS_SUM_AT": "18",
    "ELASTICD_KILL_AFTER_APPLY": "19",
    "ELASTICD_RELAY_HEARTBEAT_S": "0.4",
    "ELASTICD_ROUND_POLL_S": "0.3",
    "ELASTICD_PROBE_S": "0.07",
    "ELASTICD_REACH_CHECK_S": "0.9",
    "ELASTICD_REACH_CHECK_MIN_S": "0.15",
    "ELASTICD_REACH_HOLD_S": "4.5",
    "ELASTICD_UNRESPONSIVE_S": "2.5",
    "ELASTICD_RELAY_STALE_S": "1.7",
    "ELASTICD_CHECKPOINT_DIR": "/data/ckpt",
    "ELASTICD_CHECKPOINT_EVERY_STEPS": "50",
    "ELASTICD_CHECKPOINT_EVERY_S": "30",
    "ELASTICD_CHECKPOINT_KEEP": "5",
    "ELASTICD_CHECKPOINT_WAIT_S": "20",
    "ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL": "true",
}


def test_from_environ_parses_every_variable() -> None:
    env = worker_env_from_environ(FULL_ENV)
    assert [parse_endpoint(e) for e in env.etcd.endpoints] == [("10.0.0.1", 2379), ("10.0.0.2", 2380)]
    assert env.etcd.prefix == "/custom"
    assert env.world == WorldConfig(job_id="job-42", min_workers=2, max_workers=6)
    assert env.timeouts == Timeouts(
        join_s=50.0,
        join_window_s=0.5,
        last_call_s=0.6,
        coordinator_grace_s=0.4,
        view_poll_s=4.0,
        lease_ttl_s=4.0,
        keepalive_s=1.5,
        collective_s=11.0,
        group_build_s=12.0,
        group_abort_s=16.0,
        checkpoint_transfer_s=13.0,
        etcd_request_s=1.25,
        lease_renew_s=0.4,
        etcd_outage_s=300.0,
        resume_hold_s=20.0,
        standby_s=3600.0,
        abort_poll_s=0.05,
        shutdown_grace_s=14.0,
        progress_event_s=3.0,
        relay_heartbeat_s=0.4,
        relay_stale_s=1.7,
        round_poll_s=0.3,
        probe_s=0.07,
        reach_check_s=0.9,
        reach_check_min_s=0.15,
        reach_hold_s=4.5,
        unresponsive_s=2.5,
        deputy_step_s=0.8,
    )
    assert env.retry == RetryPolicy(
        etcd_attempts=3,
        etcd_backoff_initial_s=0.1,
        etcd_backoff_max_s=2.0,
        etcd_reconnect_max_s=0.25,
        step_retries=4,
        nonfinite_steps=5,
    )
    assert (env.node_id, env.local_rank, env.advertise_addr, env.backend) == ("node-7", 3, "10.1.2.3", "gloo")
    assert env.events_keep == 42
    assert (env.spare, env.standby) == (True, True)
    assert env.relay_socket == "/run/elasticd-relay/relay.sock"
    assert env.audit_dir == "/data/audit"
    assert (env.replica_size, env.replica, env.shard, env.replica_store) == (4, "node-7.r0.12.1", 3, "10.1.2.3:29400")
    assert (env.stop_after_sum, env.miss_sum_at, env.kill_after_apply) == (17, 18, 19)
    assert isinstance(env.local_rank, int) and isinstance(env.timeouts.join_s, float)
    assert env.checkpoint == CheckpointConfig(
        checkpoint_dir="/data/ckpt",
        checkpoint_every_steps=50,
        checkpoint_every_s=30.0,
        checkpoint_keep=5,
        checkpoint_wait_s=20.0,
        checkpoint_allow_new_model=True,
    )


def test_every_field_has_a_variable_in_the_test() -> None:
    """If a setting is added, this test makes the parse test above cover it."""
    names = {"ELASTICD_ETCD_ENDPOINTS", "ELASTICD_ETCD_PREFIX"}
    for cls in (WorldConfig, Timeouts, RetryPolicy, CheckpointConfig, WorkerEnv):
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in ("world", "etcd", "timeouts", "retry", "checkpoint"):
                names.add("ELASTICD_" + f.name.upper())
    assert names == set(FULL_ENV)


def test_defaults_when_nothing_is_set() -> None:
    env = worker_env_from_environ({"ELASTICD_NODE_ID": "n"})
    assert env == WorkerEnv(node_id="n")
    assert env.timeouts == Timeouts() and env.retry == RetryPolicy() and env.world == WorldConfig()
    assert env.etcd.endpoints == ("127.0.0.1:2379",)


def test_unrelated_variables_are_ignored() -> None:
    env = worker_env_from_environ({"ELASTICD_NODE_ID": "n", "ELASTICD_NOT_A_SETTING": "x", "PATH": "/bin"})
    assert env == WorkerEnv(node_id="n")


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("ELASTICD_LEASE_TTL_S", "abc", "ELASTICD_LEASE_TTL_S"),
        ("ELASTICD_JOIN_S", "", "ELASTICD_JOIN_S"),
        ("ELASTICD_JOIN_S", "-1", "join_s"),
        ("ELASTICD_COLLECTIVE_S", "0", "collective_s"),
        ("ELASTICD_LEASE_TTL_S", "0.5", "lease_ttl_s"),
        ("ELASTICD_KEEPALIVE_S", "2", "keepalive_s"),  # lease TTL defaults to 3: keepalive > ttl / 2
        ("ELASTICD_MIN_WORKERS", "two", "ELASTICD_MIN_WORKERS"),
        ("ELASTICD_MIN_WORKERS", "1.5", "ELASTICD_MIN_WORKERS"),
        ("ELASTICD_MIN_WORKERS", "0", "min_workers"),
        ("ELASTICD_MAX_WORKERS", "-3", "max_workers"),
        ("ELASTICD_MIN_WORKERS", "2000", "min_workers"),  # > max_workers (1024)
        ("ELASTICD_JOB_ID", "a/b", "job_id"),
        ("ELASTICD_JOB_ID", "", "job_id"),
        ("ELASTICD_JOB_ID", "..", "job_id"),  # <checkpoint_dir>/.. is the directory's parent
        ("ELASTICD_JOB_ID", ".", "job_id"),
        ("ELASTICD_ETCD_ENDPOINTS", "https://a:1,b:2", "etcd_endpoints: https:// and plaintext endpoints mixed"),
        ("ELASTICD_ETCD_ENDPOINTS", "unix://a:1", "etcd_endpoints"),
        ("ELASTICD_ETCD_INSECURE", "maybe", "ELASTICD_ETCD_INSECURE"),
        ("ELASTICD_ETCD_ENDPOINTS", "nohost", "etcd_endpoints"),
        ("ELASTICD_ETCD_ENDPOINTS", "host:0", "etcd_endpoints"),
        ("ELASTICD_ETCD_ENDPOINTS", "host:99999", "etcd_endpoints"),
        ("ELASTICD_ETCD_ENDPOINTS", "host:port", "etcd_endpoints"),
        ("ELASTICD_ETCD_ENDPOINTS", ":2379", "etcd_endpoints"),
        ("ELASTICD_ETCD_ENDPOINTS", " , ", "etcd_endpoints"),
        ("ELASTICD_ETCD_PREFIX", "noslash", "etcd_prefix"),
        ("ELASTICD_ETCD_PREFIX", "/trailing/", "etcd_prefix"),
        ("ELASTICD_ETCD_ATTEMPTS", "0", "etcd_attempts"),
        ("ELASTICD_ETCD_ATTEMPTS", "x", "ELASTICD_ETCD_ATTEMPTS"),
        ("ELASTICD_ETCD_BACKOFF_MAX_S", "0", "etcd_backoff_max_s"),
        ("ELASTICD_STEP_RETRIES", "-1", "step_retries"),
        ("ELASTICD_LOCAL_RANK", "-1", "local_rank"),
        ("ELASTICD_LOCAL_RANK", "zero", "ELASTICD_LOCAL_RANK"),
        ("ELASTICD_BACKEND", "mpi", "backend"),
        ("ELASTICD_NODE_ID", "a/b", "node_id"),
        ("ELASTICD_NODE_ID", "..", "node_id"),
        ("ELASTICD_NODE_ID", "gpu 1", "node_id"),
        ("ELASTICD_LEASE_TTL_S", "nan", "lease_ttl_s"),
        ("ELASTICD_COLLECTIVE_S", "nan", "collective_s"),
        ("ELASTICD_LEASE_TTL_S", "inf", "lease_ttl_s"),
    ],
)
def test_malformed_values_raise_config_error_naming_the_setting(variable: str, value: str, named: str) -> None:
    env = {"ELASTICD_NODE_ID": "n", variable: value}
    with pytest.raises(ConfigError) as info:
        worker_env_from_environ(env)
    assert named in str(info.value), str(info.value)
    assert not isinstance(info.value.__cause__, ConfigError)  # raised once, not re-wrapped


def test_keepalive_relative_to_a_configured_ttl() -> None:
    ok = worker_env_from_environ({"ELASTICD_LEASE_TTL_S": "10", "ELASTICD_KEEPALIVE_S": "5"})
    assert ok.timeouts.keepalive_s == 5.0
    with pytest.raises(ConfigError, match="keepalive_s"):
        worker_env_from_environ({"ELASTICD_LEASE_TTL_S": "10", "ELASTICD_KEEPALIVE_S": "5.01"})


def test_min_greater_than_max_names_both() -> None:
    with pytest.raises(ConfigError) as info:
        worker_env_from_environ({"ELASTICD_MIN_WORKERS": "5", "ELASTICD_MAX_WORKERS": "4"})
    assert "min_workers" in str(info.value) and "max_workers" in str(info.value)


def test_value_is_quoted_in_the_message() -> None:
    with pytest.raises(ConfigError, match="'abc'"):
        worker_env_from_environ({"ELASTICD_LEASE_TTL_S": "abc"})


@pytest.mark.parametrize(
    "env",
    [
        WorkerEnv(node_id="n"),
        worker_env_from_environ(FULL_ENV),
        WorkerEnv(
            world=WorldConfig(job_id="j", min_workers=3, max_workers=3),
            etcd=EtcdConfig(endpoints=("a:1", "b:2", "[::1]:3"), prefix="/p/q"),
            timeouts=Timeouts(join_window_s=0.1, keepalive_s=0.3, lease_ttl_s=1.0, abort_poll_s=0.001),
            retry=RetryPolicy(etcd_attempts=1, etcd_backoff_initial_s=0.001, step_retries=1),
            node_id="host.example.com",
            local_rank=15,
            advertise_addr="::1",
            backend="nccl",
        ),
    ],
    ids=["defaults", "full", "edges"],
)
def test_to_environ_round_trips(env: WorkerEnv) -> None:
    variables = worker_env_to_environ(env)
    assert all(k.startswith("ELASTICD_") and isinstance(v, str) for k, v in variables.items())
    assert worker_env_from_environ(variables) == env
    assert worker_env_to_environ(worker_env_from_environ(variables)) == variables


def test_to_environ_covers_every_variable() -> None:
    assert set(worker_env_to_environ(WorkerEnv(node_id="n"))) == set(FULL_ENV)


# -- etcd TLS and auth ----------------------------------------------------------------------------


def _files(tmp_path, *names: str) -> list[str]:
    out = []
    for n in names:
        (tmp_path / n).write_text("x\n")
        out.append(str(tmp_path / n))
    return out


def test_etcd_security_settings_round_trip_to_workers(tmp_path) -> None:
    ca, cert, key, pw = _files(tmp_path, "ca.pem", "c.pem", "c.key", "pw")
    etcd = EtcdConfig(ca_cert=ca, cert_cert=cert, cert_key=key, user="u", password_file=pw)
    env = WorkerEnv(node_id="n", etcd=etcd)
    variables = worker_env_to_environ(env)
    assert variables["ELASTICD_ETCD_PASSWORD_FILE"] == pw and "ELASTICD_ETCD_PASSWORD" not in variables
    assert worker_env_from_environ(variables) == env
    assert etcd.tls and read_password(etcd) == "x"
    by_value = EtcdConfig(user="u", password="secret")
    assert "secret" not in repr(by_value)  # never in a log line that prints the settings
    assert worker_env_from_environ(worker_env_to_environ(WorkerEnv(node_id="n", etcd=by_value))).etcd == by_value


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(ca_cert="/absent.pem"), "etcd_ca_cert: no such file: '/absent.pem'"),
        (dict(ca_cert="/absent.pem", cert_cert="CERT"), "etcd_ca_cert: no such file: '/absent.pem'"),  # before pairing
        (dict(endpoints=("nohost",), ca_cert="/absent.pem"), "etcd_endpoints: expected host:port"),  # after the address
        (dict(cert_cert="CERT"), "etcd_cert_cert: a client certificate needs its key"),
    ],
)
def test_etcd_files_are_checked_by_the_loader_in_order(tmp_path, fields: dict[str, object], message: str) -> None:
    real = dict(zip(("CERT",), _files(tmp_path, "c.pem"), strict=True))
    values = {k: real.get(v, v) if isinstance(v, str) else v for k, v in fields.items()}
    with pytest.raises(ConfigError) as info:
        etcd_config(values)
    assert str(info.value).startswith(message)
    EtcdConfig(ca_cert="/absent.pem")  # the value object itself touches no file


@pytest.mark.parametrize(
    ("kind", "raw", "value"),
    [
        (int, " 7 ", 7),
        (float, "2", 2.0),
        (bool, "Yes", True),
        (bool, "off", False),
        (str, " x ", "x"),
        (tuple, "a:1, b:2 ,", ("a:1", "b:2")),
    ],
)
def test_one_text_converter(kind: type, raw: str, value: object) -> None:
    assert from_text(kind, raw) == value and type(from_text(kind, raw)) is type(value)


@pytest.mark.parametrize(("kind", "raw"), [(int, "1.5"), (float, "x"), (bool, "maybe"), (int, "")])
def test_one_text_converter_refuses(kind: type, raw: str) -> None:
    with pytest.raises(ValueError):
        from_text(kind, raw)


def test_an_empty_password_file_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "pw").write_text("")
    with pytest.raises(ConfigError, match="etcd_password_file: .* is empty"):
        read_password(EtcdConfig(user="u", password_file=str(tmp_path / "pw")))


@pytest.mark.parametrize(
    "variable, value, message",
    [
        ("ELASTICD_CHECKPOINT_EVERY_STEPS", "-1", r"^checkpoint_every_steps: must be an integer >= 0"),
        ("ELASTICD_CHECKPOINT_EVERY_S", "-2", r"^checkpoint_every_s: must be a finite number >= 0"),
        ("ELASTICD_CHECKPOINT_EVERY_S", "nan", r"^checkpoint_every_s: must be a finite number >= 0"),
        ("ELASTICD_CHECKPOINT_KEEP", "0", r"^checkpoint_keep: must be an integer >= 1"),
        ("ELASTICD_CHECKPOINT_WAIT_S", "0", r"^checkpoint_wait_s: must be a positive"),
        ("ELASTICD_CHECKPOINT_KEEP", "three", r"^ELASTICD_CHECKPOINT_KEEP: expected a int"),
        ("ELASTICD_STOP_AFTER_SUM", "-1", r"^stop_after_sum: must be >= 0 \(0: never\)"),
        ("ELASTICD_MISS_SUM_AT", "-3", r"^miss_sum_at: must be >= 0 \(0: never\), got -3"),
        ("ELASTICD_KILL_AFTER_APPLY", "-2", r"^kill_after_apply: must be >= 0"),
    ],
)
def test_bad_checkpoint_settings_name_the_setting(variable: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        worker_env_from_environ({"ELASTICD_NODE_ID": "n", variable: value})


def test_checkpoint_settings_round_trip() -> None:
    env = WorkerEnv(node_id="n", checkpoint=CheckpointConfig(checkpoint_dir="/c", checkpoint_every_s=2.5))
    assert worker_env_from_environ(worker_env_to_environ(env)) == env


def test_agent_passes_checkpoint_settings_to_its_workers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cfg = load_agent_config(
        {"checkpoint_dir": str(tmp_path / "ck"), "checkpoint_every_steps": "25", "checkpoint_keep": "2"},
        program=["/bin/true"],
        environ={"ELASTICD_CHECKPOINT_EVERY_S": "9"},
        default_config_file=tmp_path / "none.toml",
    )
    env = worker_env_from_environ(worker_env_to_environ(cfg.worker_env(0)))
    assert env.checkpoint == CheckpointConfig(
        checkpoint_dir=str(tmp_path / "ck"), checkpoint_every_steps=25, checkpoint_every_s=9.0, checkpoint_keep=2
    )
    with pytest.raises(ConfigError, match=r"^checkpoint_keep: must be an integer >= 1"):
        load_agent_config(
            {"checkpoint_keep": "0"}, program=["/bin/true"], environ={}, default_config_file=tmp_path / "none.toml"
        )


@pytest.mark.parametrize(
    ("source", "raw", "expected"),
    [
        ("flag", "true", True),
        ("flag", "0", False),
        ("env", "yes", True),
        ("env", "off", False),
        ("toml", "true", True),
        ("toml", "false", False),
        ("none", "", False),
    ],
)
def test_checkpoint_allow_new_model_is_one_setting_from_flag_env_or_file(  # type: ignore[no-untyped-def]
    tmp_path, source: str, raw: str, expected: bool
) -> None:
    setting = AGENT_SETTINGS["checkpoint_allow_new_model"]
    assert (setting.variable, setting.flag, setting.kind) == (
        "ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL",
        "--checkpoint-allow-new-model",
        bool,
    )
    toml = tmp_path / "elasticd.toml"
    toml.write_text(f"checkpoint_allow_new_model = {raw}\n" if source == "toml" else "")
    cfg = load_agent_config(
        {"checkpoint_allow_new_model": raw} if source == "flag" else {},
        program=["/bin/true"],
        config_file=toml,
        environ={"ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL": raw} if source == "env" else {},
    )
    env = worker_env_from_environ(worker_env_to_environ(cfg.worker_env(0)))
    assert env.checkpoint.checkpoint_allow_new_model is expected


def test_checkpoint_allow_new_model_refuses_what_is_not_a_boolean(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=r"^checkpoint_allow_new_model: expected true or false, got 'maybe'"):
        load_agent_config(
            {"checkpoint_allow_new_model": "maybe"},
            program=["/bin/true"],
            environ={},
            default_config_file=tmp_path / "none.toml",
        )
    toml = tmp_path / "bad.toml"
    toml.write_text("checkpoint_allow_new_model = 1\n")
    with pytest.raises(ConfigError, match=r"^checkpoint_allow_new_model: expected true or false, got 1"):
        load_agent_config({}, program=["/bin/true"], environ={}, config_file=toml)
    with pytest.raises(ConfigError, match="ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL"):
        worker_env_from_environ({"ELASTICD_NODE_ID": "n", "ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL": "maybe"})


# -- the node agent's configuration --------------------------------------------------------------


def _load(
    tmp_path: Path,
    toml: str | None = None,
    environ: dict[str, str] | None = None,
    flags: dict[str, str | None] | None = None,
    **kw: object,
) -> AgentConfig:
    config_file = None
    if toml is not None:
        config_file = tmp_path / "elasticd.toml"
        config_file.write_text(toml)
    kw.setdefault("program", ["true"])
    return load_agent_config(
        flags,
        config_file=config_file,
        environ=environ or {},  # type: ignore[arg-type]
        default_config_file=tmp_path / "absent.toml",
        **kw,
    )


@pytest.mark.parametrize(
    ("toml", "env", "flag", "ttl"),
    [
        (False, False, False, 3.0),
        (True, False, False, 5.0),
        (True, True, False, 6.0),
        (True, True, True, 7.0),
        (False, True, False, 6.0),
        (False, False, True, 7.0),
        (True, False, True, 7.0),
    ],
)
def test_precedence_flag_over_env_over_file_over_default(
    tmp_path: Path, toml: bool, env: bool, flag: bool, ttl: float
) -> None:
    cfg = _load(
        tmp_path,
        "lease_ttl_s = 5\njob_id = 'from-file'\n" if toml else None,
        {"ELASTICD_LEASE_TTL_S": "6"} if env else None,
        {"lease_ttl_s": "7"} if flag else None,
    )
    assert cfg.timeouts.lease_ttl_s == ttl
    assert cfg.world.job_id == ("from-file" if toml else "default")


def test_every_setting_from_a_file(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    cfg = _load(
        tmp_path,
        f"""
job_id = "j1"
min_workers = 2
max_workers = 8
etcd_endpoints = ["10.0.0.1:2379", "10.0.0.2:2379"]
etcd_prefix = "/x"
lease_ttl_s = 4
keepalive_s = 1.5
shutdown_grace_s = 20.5
etcd_attempts = 3
program = ["true", "--flag"]
nproc_per_node = 2
node_id = "gpu-7"
advertise_addr = "10.1.1.1"
backend = "gloo"
checkpoint_dir = "{ckpt}"
max_restarts = 5
restart_window_s = 600
restart_backoff_initial_s = 0.25
restart_backoff_max_s = 10
""",
        program=[],
    )
    assert cfg.world == WorldConfig(job_id="j1", min_workers=2, max_workers=8)
    assert cfg.etcd.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379") and cfg.etcd.prefix == "/x"
    assert (cfg.timeouts.lease_ttl_s, cfg.timeouts.keepalive_s, cfg.timeouts.shutdown_grace_s) == (4.0, 1.5, 20.5)
    assert isinstance(cfg.timeouts.lease_ttl_s, float) and cfg.retry.etcd_attempts == 3
    assert cfg.program == ("true", "--flag")
    assert (cfg.nproc_per_node, cfg.node_id, cfg.advertise_addr, cfg.backend) == (2, "gpu-7", "10.1.1.1", "gloo")
    assert cfg.checkpoint.checkpoint_dir == str(ckpt)
    assert (cfg.max_restarts, cfg.restart_window_s, cfg.restart_backoff_initial_s, cfg.restart_backoff_max_s) == (
        5,
        600.0,
        0.25,
        10.0,
    )


def test_the_default_file_is_read_only_if_it_exists(tmp_path: Path) -> None:
    default = tmp_path / "default.toml"
    assert load_agent_config(program=["true"], environ={}, default_config_file=default).max_restarts == 3
    default.write_text("max_restarts = 9\n")
    assert load_agent_config(program=["true"], environ={}, default_config_file=default).max_restarts == 9
    via_env = tmp_path / "env.toml"
    via_env.write_text("max_restarts = 4\n")
    cfg = load_agent_config(program=["true"], environ={"ELASTICD_CONFIG": str(via_env)}, default_config_file=default)
    assert cfg.max_restarts == 4


@pytest.mark.parametrize(
    ("toml", "named"),
    [
        ("lease_tll_s = 5", "lease_tll_s: unknown setting in "),
        ("lease_tll_s = 5", "(did you mean lease_ttl_s?)"),
        ("[timeouts]\nlease_ttl_s = 5", "timeouts: unknown setting"),
        ("lease_ttl_s = 'ten'", "lease_ttl_s: expected a number, got 'ten' (str) in "),
        ("nproc_per_node = 1.5", "nproc_per_node: expected an integer, got 1.5 (float)"),
        ("max_restarts = true", "max_restarts: expected an integer, got True (bool)"),
        ("program = 'python train.py'", "program: expected a list of strings"),
        ("program = ['python', 3]", "program: expected a list of strings"),
        ("etcd_endpoints = 'h:1'", "etcd_endpoints: expected a list of strings"),
        ("node_id = 3", "node_id: expected a string, got 3 (int)"),
        ("lease_ttl_s = ", "is not valid TOML"),
        ("lease_ttl_s = 0.5\nkeepalive_s = 0.2", "lease_ttl_s: etcd grants leases of at least 1 s, got 0.5 (in "),
        ("lease_ttl_s = 1", "keepalive_s: must be at most half of lease_ttl_s (1.0), got 0.75 (lease_ttl_s in "),
        ("max_restarts = -1", "max_restarts: must be an integer >= 0, got -1 (in "),
        ("restart_backoff_initial_s = 5\nrestart_backoff_max_s = 1", "restart_backoff_max_s: must be >= "),
        ("min_workers = 4\nmax_workers = 2", "min_workers: must be <= max_workers"),
        ("nproc_per_node = 4\nmax_workers = 2", "nproc_per_node: must be <= max_workers (2)"),
        ("backend = 'mpi'", "backend: must be one of auto, gloo, nccl"),
        ("etcd_endpoints = ['nohost']", "etcd_endpoints: expected host:port"),
    ],
)
def test_bad_file_fields_name_the_field(tmp_path: Path, toml: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, toml)
    assert named in str(info.value), str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_each_bad_field_gets_its_own_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "bogus = 1\nlease_ttl_s = 'x'", {"ELASTICD_MAX_RESTARTS": "many"}, {"restart_window_s": "soon"})
    lines = str(info.value).splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("bogus: unknown setting")
    assert lines[1].startswith("lease_ttl_s: expected a number")
    assert lines[2] == "max_restarts: expected an integer, got 'many' (from ELASTICD_MAX_RESTARTS)"
    assert lines[3] == "restart_window_s: expected a number, got 'soon' (from --restart-window-s)"


def test_a_validation_error_says_where_the_value_came_from(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"keepalive_s: must be at most half .* \(from ELASTICD_KEEPALIVE_S\)"):
        _load(tmp_path, environ={"ELASTICD_KEEPALIVE_S": "2"})


def test_missing_config_file_and_checkpoint_dir_that_is_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config: no such file: .*nope.toml.* \(from --config\)"):
        load_agent_config(program=["true"], config_file=tmp_path / "nope.toml", environ={})
    afile = tmp_path / "file"
    afile.write_text("")
    with pytest.raises(ConfigError, match=r"^checkpoint_dir: .* exists and is not a directory"):
        _load(tmp_path, flags={"checkpoint_dir": str(afile)})


def test_missing_or_unrunnable_program(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^program: no training program given"):
        _load(tmp_path, program=[])
    with pytest.raises(ConfigError, match=r"^program: 'no-such-program-x' is not an executable"):
        _load(tmp_path, program=["no-such-program-x"])
    assert _load(tmp_path, program=["agents/mlp.py", "--steps", "3"]).program == (
        sys.executable,
        "agents/mlp.py",
        "--steps",
        "3",
    )


@pytest.mark.parametrize(("visible", "nproc"), [(None, 1), ("", 1), ("0", 1), ("0,1,2", 3), ("GPU-a,GPU-b", 2)])
def test_nproc_per_node_defaults_to_the_visible_devices(tmp_path: Path, visible: str | None, nproc: int) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert default_nproc_per_node(env) == nproc
    assert _load(tmp_path, environ=env).nproc_per_node == nproc
    assert _load(tmp_path, environ=env, flags={"nproc_per_node": "1"}).nproc_per_node == 1


@pytest.mark.parametrize(("text", "bounds"), [("2", (2, 2)), ("1:4", (1, 4)), (" 3:3 ", (3, 3))])
def test_parse_nnodes(text: str, bounds: tuple[int, int]) -> None:
    assert parse_nnodes(text) == bounds


@pytest.mark.parametrize("text", ["0", "2:1", "a", "1:b", "", "1:2:3", "-1:2"])
def test_parse_nnodes_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="^nnodes: "):
        parse_nnodes(text)


def _cli(tmp_path: Path, *argv: str, environ: dict[str, str] | None = None) -> AgentConfig:
    return parse_agent_command_line(list(argv), environ=environ or {}, default_config_file=tmp_path / "absent.toml")


def test_torchrun_flags(tmp_path: Path) -> None:
    cfg = _cli(
        tmp_path,
        "--nnodes",
        "1:3",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        "10.0.0.9:2379",
        "--rdzv-id",
        "run-1",
        "--max-restarts",
        "7",
        "--",
        "true",
        "--lr",
        "0.1",
    )
    assert (cfg.world.min_workers, cfg.world.max_workers) == (2, 6)
    assert cfg.nproc_per_node == 2 and cfg.etcd.endpoints == ("10.0.0.9:2379",)
    assert cfg.world.job_id == "run-1" and cfg.max_restarts == 7
    assert cfg.program == ("true", "--lr", "0.1")
    # torchrun's underscore spellings, and the program as the first non-flag argument (no --)
    cfg = _cli(
        tmp_path,
        "--nproc_per_node",
        "3",
        "--rdzv_id",
        "r",
        "--max_restarts",
        "0",
        "--nnodes",
        "2",
        "true",
        "--steps",
        "5",
    )
    assert (cfg.nproc_per_node, cfg.world.job_id, cfg.max_restarts) == (3, "r", 0)
    assert (cfg.world.min_workers, cfg.world.max_workers) == (6, 6)
    assert cfg.program == ("true", "--steps", "5")


def test_nnodes_uses_the_nproc_from_any_source_and_conflicts_with_explicit_bounds(tmp_path: Path) -> None:
    cfg = _cli(tmp_path, "--nnodes", "1:2", "--", "true", environ={"ELASTICD_NPROC_PER_NODE": "4"})
    assert (cfg.world.min_workers, cfg.world.max_workers) == (4, 8)
    cfg = _cli(tmp_path, "--nnodes", "2", "--", "true", environ={"ELASTICD_MIN_WORKERS": "1"})
    assert cfg.world.min_workers == 2  # a flag beats a variable
    with pytest.raises(ConfigError, match="^nnodes: give either"):
        _cli(tmp_path, "--nnodes", "1:2", "--min-workers", "1", "--", "true")


def test_every_setting_has_a_flag_and_unknown_flags_are_usage_errors(tmp_path: Path) -> None:
    parser = build_agent_parser()
    flags = {opt for action in parser._actions for opt in action.option_strings}
    for s in AGENT_SETTINGS.values():
        if s.name != "program":
            assert s.flag in flags, s.name
    assert {a for aliases in TORCHRUN_ALIASES.values() for a in aliases} <= flags
    with pytest.raises(SystemExit) as info:
        _cli(tmp_path, "--lease-ttl", "3", "--", "true")  # no abbreviations: a typo must not guess
    assert info.value.code == 2


def test_worker_environ_is_the_worker_contract(tmp_path: Path) -> None:
    cfg = _cli(
        tmp_path, "--node-id", "gpu-3", "--job-id", "jj", "--lease-ttl-s", "9", "--nproc-per-node", "2", "--", "true"
    )
    variables = worker_env_to_environ(cfg.worker_env(1))
    env = worker_env_from_environ(variables)
    assert env == cfg.worker_env(1)
    assert (env.node_id, env.local_rank, env.world.job_id, env.timeouts.lease_ttl_s) == ("gpu-3", 1, "jj", 9.0)
    assert variables["ELASTICD_LOCAL_RANK"] == "1" and variables["ELASTICD_NODE_ID"] == "gpu-3"


def test_workers_do_not_inherit_systemds_notify_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")
    env = child_environ({"ELASTICD_LOCAL_RANK": "0"})
    assert not {"NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"} & set(env)
    assert env["ELASTICD_LOCAL_RANK"] == "0"


# -- https:// means TLS; a password in plaintext only to loopback, or with --insecure -----------------

_REMOTE_AUTH = ("--etcd", "10.0.0.1:2379", "--etcd-user", "u")


@pytest.mark.parametrize(
    ("argv", "environ", "toml"),
    [
        (("--etcd-insecure", "true"), {}, None),
        (("--insecure",), {}, None),
        ((), {"ELASTICD_ETCD_INSECURE": "yes"}, None),
        ((), {}, "etcd_insecure = true\n"),
    ],
    ids=["flag", "switch", "variable", "file"],
)
def test_insecure_allows_a_password_in_plaintext_to_a_remote_etcd(
    tmp_path: Path, argv: tuple[str, ...], environ: dict[str, str], toml: str | None
) -> None:
    if toml is not None:
        (tmp_path / "e.toml").write_text(toml)
        argv = ("--config", str(tmp_path / "e.toml"), *argv)
    cfg = _cli(tmp_path, *_REMOTE_AUTH, *argv, "--", "true", environ={"ELASTICD_ETCD_PASSWORD": "pw", **environ})
    assert cfg.etcd.insecure and not cfg.etcd.tls
    variables = worker_env_to_environ(cfg.worker_env(0))  # the workers are allowed too
    assert variables["ELASTICD_ETCD_INSECURE"] == "True"
    assert worker_env_from_environ(variables).etcd == cfg.etcd


@pytest.mark.parametrize(
    ("argv", "environ"),
    [
        ((), {}),
        (("--etcd-insecure", "false"), {"ELASTICD_ETCD_INSECURE": "true"}),  # the flag wins
    ],
)
def test_a_password_in_plaintext_to_a_remote_etcd_is_refused(
    tmp_path: Path, argv: tuple[str, ...], environ: dict[str, str]
) -> None:
    with pytest.raises(ConfigError) as info:
        _cli(tmp_path, *_REMOTE_AUTH, *argv, "--", "true", environ={"ELASTICD_ETCD_PASSWORD": "pw", **environ})
    message = str(info.value)
    assert message.startswith("etcd_user: its password would cross the network in plaintext to 10.0.0.1:2379; "), (
        message
    )
    assert "etcd_insecure (--insecure)" in message and "(etcd_user from --etcd-user" in message, message


@pytest.mark.parametrize("endpoints", ["127.0.0.1:2379", "localhost:2379", "[::1]:2379", "https://10.0.0.1:2379"])
def test_a_password_goes_to_loopback_or_over_tls_without_insecure(tmp_path: Path, endpoints: str) -> None:
    cfg = _cli(
        tmp_path, "--etcd", endpoints, "--etcd-user", "u", "--", "true", environ={"ELASTICD_ETCD_PASSWORD": "pw"}
    )
    assert not cfg.etcd.insecure and cfg.etcd.tls is endpoints.startswith("https://")


def test_https_endpoints_reach_the_workers_as_tls(tmp_path: Path) -> None:
    cfg = _cli(tmp_path, "--etcd", "https://e1:2379,https://e2:2379", "--", "true")
    env = worker_env_from_environ(worker_env_to_environ(cfg.worker_env(0)))
    assert env.etcd.endpoints == ("https://e1:2379", "https://e2:2379") and env.etcd.tls and not env.etcd.ca_cert


@pytest.mark.parametrize(
    ("environ", "found"),
    [
        ({}, {}),
        (
            {"ELASTICD_ETCD_INSECURE": "on", "ELASTICD_ETCD_USER": "u", "ELASTICD_JOB_ID": "j"},
            {"insecure": True, "user": "u"},
        ),
        (
            {"ELASTICD_ETCD_INSECURE": "0", "ELASTICD_ETCD_CA_CERT": "/ca.pem"},
            {"insecure": False, "ca_cert": "/ca.pem"},
        ),
    ],
)
def test_etcd_security_environ(environ: dict[str, str], found: dict[str, object]) -> None:
    assert etcd_security_environ(environ) == found


def test_etcd_security_environ_refuses_a_bad_boolean() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^etcd_insecure: expected true or false, got 'maybe' "
        r"\(from ELASTICD_ETCD_INSECURE\)$",
    ):
        etcd_security_environ({"ELASTICD_ETCD_INSECURE": "maybe"})


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (("--job-id", ".."), "job_id"),
        (("--rdzv-id", "a/b"), "job_id"),
        (("--node-id", "."), "node_id"),
        (("--node-id=-n",), "node_id"),
    ],
)
def test_the_agent_refuses_ids_that_are_not_names(tmp_path: Path, argv: tuple[str, ...], named: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{named}: must be 1 to 128 of the characters A-Z a-z 0-9 \. _ -"):
        _cli(tmp_path, *argv, "--", "true")


@pytest.mark.parametrize(
    ("program", "script"),
    [
        (("python3", "train.py", "--lr", "1"), "train.py"),
        (("/usr/bin/python3.11", "-u", "-W", "error", "-X", "dev", "t.py"), "t.py"),
        (("python", "-m", "pkg.train"), None),
        (("python", "-c", "pass"), None),
        (("python", "-mpkg"), None),
        (("python", "-"), None),
        (("python",), None),
        (("torchrun", "train.py"), None),  # not an interpreter: its own arguments are not checked
        (("./train.sh", "x.py"), None),
    ],
)
def test_python_script_finds_the_script_an_interpreter_would_run(program: tuple[str, ...], script: str | None) -> None:
    from elasticd.settings import python_script

    assert python_script(program) == script
