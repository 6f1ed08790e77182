"""WorkerEnv.from_environ: every ELASTICD_* variable, validation that names the setting, round trip."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from elasticd.config import (
    CheckpointConfig,
    EtcdConfig,
    RetryPolicy,
    Timeouts,
    WorkerEnv,
    WorldConfig,
    parse_endpoint,
)
from elasticd.errors import ConfigError

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
    "ELASTICD_LEASE_TTL_S": "4",
    "ELASTICD_KEEPALIVE_S": "1.5",
    "ELASTICD_COLLECTIVE_S": "11",
    "ELASTICD_GROUP_BUILD_S": "12",
    "ELASTICD_CHECKPOINT_TRANSFER_S": "13",
    "ELASTICD_ETCD_REQUEST_S": "1.25",
    "ELASTICD_ETCD_OUTAGE_S": "300",
    "ELASTICD_STANDBY_S": "3600",
    "ELASTICD_ABORT_POLL_S": "0.05",
    "ELASTICD_SHUTDOWN_GRACE_S": "14",
    "ELASTICD_ETCD_ATTEMPTS": "3",
    "ELASTICD_ETCD_BACKOFF_INITIAL_S": "0.1",
    "ELASTICD_ETCD_BACKOFF_MAX_S": "2",
    "ELASTICD_ETCD_RECONNECT_MAX_S": "0.25",
    "ELASTICD_STEP_RETRIES": "4",
    "ELASTICD_NODE_ID": "node-7",
    "ELASTICD_LOCAL_RANK": "3",
    "ELASTICD_ADVERTISE_ADDR": "10.1.2.3",
    "ELASTICD_BACKEND": "gloo",
    "ELASTICD_EVENTS_KEEP": "42",
    "ELASTICD_CHECKPOINT_DIR": "/data/ckpt",
    "ELASTICD_CHECKPOINT_EVERY_STEPS": "50",
    "ELASTICD_CHECKPOINT_EVERY_S": "30",
    "ELASTICD_CHECKPOINT_KEEP": "5",
    "ELASTICD_CHECKPOINT_WAIT_S": "20",
    "ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL": "true",
}


def test_from_environ_parses_every_variable() -> None:
    env = WorkerEnv.from_environ(FULL_ENV)
    assert [parse_endpoint(e) for e in env.etcd.endpoints] == [("10.0.0.1", 2379), ("10.0.0.2", 2380)]
    assert env.etcd.prefix == "/custom"
    assert env.world == WorldConfig(job_id="job-42", min_workers=2, max_workers=6)
    assert env.timeouts == Timeouts(
        join_s=50.0, join_window_s=0.5, last_call_s=0.6, lease_ttl_s=4.0, keepalive_s=1.5,
        collective_s=11.0, group_build_s=12.0, checkpoint_transfer_s=13.0, etcd_request_s=1.25, etcd_outage_s=300.0, standby_s=3600.0,
        abort_poll_s=0.05, shutdown_grace_s=14.0,
    )
    assert env.retry == RetryPolicy(etcd_attempts=3, etcd_backoff_initial_s=0.1, etcd_backoff_max_s=2.0, etcd_reconnect_max_s=0.25,
                                    step_retries=4)
    assert (env.node_id, env.local_rank, env.advertise_addr, env.backend) == ("node-7", 3, "10.1.2.3", "gloo")
    assert env.events_keep == 42
    assert isinstance(env.local_rank, int) and isinstance(env.timeouts.join_s, float)
    assert env.checkpoint == CheckpointConfig(checkpoint_dir="/data/ckpt", checkpoint_every_steps=50,
                                              checkpoint_every_s=30.0, checkpoint_keep=5, checkpoint_wait_s=20.0,
                                              checkpoint_allow_new_model=True)


def test_every_field_has_a_variable_in_the_test() -> None:
    """If a setting is added, this test makes the parse test above cover it."""
    names = {"ELASTICD_ETCD_ENDPOINTS", "ELASTICD_ETCD_PREFIX"}
    for cls in (WorldConfig, Timeouts, RetryPolicy, CheckpointConfig, WorkerEnv):
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in ("world", "etcd", "timeouts", "retry", "checkpoint"):
                names.add("ELASTICD_" + f.name.upper())
    assert names == set(FULL_ENV)


def test_defaults_when_nothing_is_set() -> None:
    env = WorkerEnv.from_environ({"ELASTICD_NODE_ID": "n"})
    assert env == WorkerEnv(node_id="n")
    assert env.timeouts == Timeouts() and env.retry == RetryPolicy() and env.world == WorldConfig()
    assert env.etcd.endpoints == ("127.0.0.1:2379",)


def test_unrelated_variables_are_ignored() -> None:
    env = WorkerEnv.from_environ({"ELASTICD_NODE_ID": "n", "ELASTICD_NOT_A_SETTING": "x", "PATH": "/bin"})
    assert env == WorkerEnv(node_id="n")


def test_timeouts_as_timedelta() -> None:
    t = WorkerEnv.from_environ(FULL_ENV).timeouts
    assert t.td("collective") == timedelta(seconds=11)
    assert t.td("keepalive") == timedelta(seconds=1.5)


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
        ("ELASTICD_LEASE_TTL_S", "nan", "lease_ttl_s"),
        ("ELASTICD_COLLECTIVE_S", "nan", "collective_s"),
        ("ELASTICD_LEASE_TTL_S", "inf", "lease_ttl_s"),
    ],
)
def test_malformed_values_raise_config_error_naming_the_setting(variable: str, value: str, named: str) -> None:
    env = {"ELASTICD_NODE_ID": "n", variable: value}
    with pytest.raises(ConfigError) as info:
        WorkerEnv.from_environ(env)
    assert named in str(info.value), str(info.value)
    assert not isinstance(info.value.__cause__, ConfigError)  # raised once, not re-wrapped


def test_keepalive_relative_to_a_configured_ttl() -> None:
    ok = WorkerEnv.from_environ({"ELASTICD_LEASE_TTL_S": "10", "ELASTICD_KEEPALIVE_S": "5"})
    assert ok.timeouts.keepalive_s == 5.0
    with pytest.raises(ConfigError, match="keepalive_s"):
        WorkerEnv.from_environ({"ELASTICD_LEASE_TTL_S": "10", "ELASTICD_KEEPALIVE_S": "5.01"})


def test_min_greater_than_max_names_both() -> None:
    with pytest.raises(ConfigError) as info:
        WorkerEnv.from_environ({"ELASTICD_MIN_WORKERS": "5", "ELASTICD_MAX_WORKERS": "4"})
    assert "min_workers" in str(info.value) and "max_workers" in str(info.value)


def test_value_is_quoted_in_the_message() -> None:
    with pytest.raises(ConfigError, match="'abc'"):
        WorkerEnv.from_environ({"ELASTICD_LEASE_TTL_S": "abc"})


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("http://etcd.example:2379", ("etcd.example", 2379)),
        ("https://etcd:1", ("etcd", 1)),
        ("[::1]:2379", ("::1", 2379)),
        (" host:65535 ", ("host", 65535)),
    ],
)
def test_parse_endpoint(text: str, parsed: tuple[str, int]) -> None:
    assert parse_endpoint(text) == parsed


@pytest.mark.parametrize(
    "env",
    [
        WorkerEnv(node_id="n"),
        WorkerEnv.from_environ(FULL_ENV),
        WorkerEnv(
            world=WorldConfig(job_id="j", min_workers=3, max_workers=3),
            etcd=EtcdConfig(endpoints=("a:1", "b:2", "[::1]:3"), prefix="/p/q"),
            timeouts=Timeouts(join_window_s=0.1, keepalive_s=0.3, lease_ttl_s=1.0, abort_poll_s=0.001),
            retry=RetryPolicy(etcd_attempts=1, etcd_backoff_initial_s=0.001, step_retries=1),
            node_id="host.example.com", local_rank=15, advertise_addr="::1", backend="nccl",
        ),
    ],
    ids=["defaults", "full", "edges"],
)
def test_to_environ_round_trips(env: WorkerEnv) -> None:
    variables = env.to_environ()
    assert all(k.startswith("ELASTICD_") and isinstance(v, str) for k, v in variables.items())
    assert WorkerEnv.from_environ(variables) == env
    assert WorkerEnv.from_environ(variables).to_environ() == variables


def test_to_environ_covers_every_variable() -> None:
    assert set(WorkerEnv(node_id="n").to_environ()) == set(FULL_ENV)


def test_config_error_is_fatal() -> None:
    from elasticd.errors import FatalError

    assert issubclass(ConfigError, FatalError)


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
    variables = env.to_environ()
    assert variables["ELASTICD_ETCD_PASSWORD_FILE"] == pw and "ELASTICD_ETCD_PASSWORD" not in variables
    assert WorkerEnv.from_environ(variables) == env
    assert etcd.tls and etcd.resolved_password() == "x"
    by_value = EtcdConfig(user="u", password="secret")
    assert "secret" not in repr(by_value)  # never in a log line that prints the settings
    assert WorkerEnv.from_environ(WorkerEnv(node_id="n", etcd=by_value).to_environ()).etcd == by_value


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(ca_cert="/absent.pem"), "etcd_ca_cert: no such file: '/absent.pem'"),
        (dict(cert_cert="CERT"), "etcd_cert_cert: a client certificate needs its key"),
        (dict(cert_key="KEY"), "etcd_cert_cert: a client certificate needs its key"),
        (dict(cert_cert="CERT", cert_key="KEY"), "etcd_cert_cert: a client certificate needs etcd_ca_cert"),
        (dict(user="u"), "etcd_user: a user needs a password"),
        (dict(password="p"), "etcd_user: a user needs a password"),
        (dict(user="u", password="p", password_file="PW"), "etcd_password: give etcd_password or etcd_password_file"),
    ],
)
def test_etcd_security_settings_are_validated(tmp_path, fields: dict[str, str], message: str) -> None:
    real = dict(zip(("CERT", "KEY", "PW"), _files(tmp_path, "c.pem", "c.key", "pw"), strict=True))
    with pytest.raises(ConfigError) as info:
        EtcdConfig(**{k: real.get(v, v) for k, v in fields.items()})
    assert str(info.value).startswith(message)


def test_an_empty_password_file_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "pw").write_text("")
    with pytest.raises(ConfigError, match="etcd_password_file: .* is empty"):
        EtcdConfig(user="u", password_file=str(tmp_path / "pw")).resolved_password()


@pytest.mark.parametrize("variable, value, message", [
    ("ELASTICD_CHECKPOINT_EVERY_STEPS", "-1", r"^checkpoint_every_steps: must be an integer >= 0"),
    ("ELASTICD_CHECKPOINT_EVERY_S", "-2", r"^checkpoint_every_s: must be a finite number >= 0"),
    ("ELASTICD_CHECKPOINT_EVERY_S", "nan", r"^checkpoint_every_s: must be a finite number >= 0"),
    ("ELASTICD_CHECKPOINT_KEEP", "0", r"^checkpoint_keep: must be an integer >= 1"),
    ("ELASTICD_CHECKPOINT_WAIT_S", "0", r"^checkpoint_wait_s: must be a positive"),
    ("ELASTICD_CHECKPOINT_KEEP", "three", r"^ELASTICD_CHECKPOINT_KEEP: expected a int"),
])
def test_bad_checkpoint_settings_name_the_setting(variable: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        WorkerEnv.from_environ({"ELASTICD_NODE_ID": "n", variable: value})


def test_checkpoint_settings_round_trip_and_switches() -> None:
    env = WorkerEnv(node_id="n", checkpoint=CheckpointConfig(checkpoint_dir="/c", checkpoint_every_s=2.5))
    assert WorkerEnv.from_environ(env.to_environ()) == env
    assert env.checkpoint.enabled and env.checkpoint.saves
    assert not CheckpointConfig().enabled and not CheckpointConfig(checkpoint_dir="/c").saves


def test_agent_passes_checkpoint_settings_to_its_workers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from elasticd.config import load_agent_config

    cfg = load_agent_config({"checkpoint_dir": str(tmp_path / "ck"), "checkpoint_every_steps": "25",
                             "checkpoint_keep": "2"}, program=["/bin/true"], environ={"ELASTICD_CHECKPOINT_EVERY_S": "9"},
                            default_config_file=tmp_path / "none.toml")
    env = WorkerEnv.from_environ(cfg.worker_environ(0))
    assert env.checkpoint == CheckpointConfig(checkpoint_dir=str(tmp_path / "ck"), checkpoint_every_steps=25,
                                              checkpoint_every_s=9.0, checkpoint_keep=2)
    with pytest.raises(ConfigError, match=r"^checkpoint_keep: must be an integer >= 1"):
        load_agent_config({"checkpoint_keep": "0"}, program=["/bin/true"], environ={},
                          default_config_file=tmp_path / "none.toml")


@pytest.mark.parametrize(("source", "raw", "expected"), [
    ("flag", "true", True), ("flag", "0", False), ("env", "yes", True), ("env", "off", False),
    ("toml", "true", True), ("toml", "false", False), ("none", "", False),
])
def test_checkpoint_allow_new_model_is_one_setting_from_flag_env_or_file(  # type: ignore[no-untyped-def]
        tmp_path, source: str, raw: str, expected: bool) -> None:
    from elasticd.config import AGENT_SETTINGS, load_agent_config

    setting = AGENT_SETTINGS["checkpoint_allow_new_model"]
    assert (setting.variable, setting.flag, setting.kind) == (
        "ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL", "--checkpoint-allow-new-model", bool)
    toml = tmp_path / "elasticd.toml"
    toml.write_text(f"checkpoint_allow_new_model = {raw}\n" if source == "toml" else "")
    cfg = load_agent_config({"checkpoint_allow_new_model": raw} if source == "flag" else {},
                            program=["/bin/true"], config_file=toml,
                            environ={"ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL": raw} if source == "env" else {})
    env = WorkerEnv.from_environ(cfg.worker_environ(0))
    assert env.checkpoint.checkpoint_allow_new_model is expected


def test_checkpoint_allow_new_model_refuses_what_is_not_a_boolean(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from elasticd.config import load_agent_config

    with pytest.raises(ConfigError, match=r"^checkpoint_allow_new_model: expected true or false, got 'maybe'"):
        load_agent_config({"checkpoint_allow_new_model": "maybe"}, program=["/bin/true"], environ={},
                          default_config_file=tmp_path / "none.toml")
    toml = tmp_path / "bad.toml"
    toml.write_text("checkpoint_allow_new_model = 1\n")
    with pytest.raises(ConfigError, match=r"^checkpoint_allow_new_model: expected true or false, got 1"):
        load_agent_config({}, program=["/bin/true"], environ={}, config_file=toml)
    with pytest.raises(ConfigError, match="ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL"):
        WorkerEnv.from_environ({"ELASTICD_NODE_ID": "n", "ELASTICD_CHECKPOINT_ALLOW_NEW_MODEL": "maybe"})
