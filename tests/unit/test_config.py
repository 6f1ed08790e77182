"""config.py: the value objects validate themselves (naming the setting) and touch no file. The
loading of these values is tested in test_settings.py."""

from __future__ import annotations

import pytest

from elasticd.config import (
    AgentConfig,
    CheckpointConfig,
    EtcdConfig,
    Timeouts,
    WorkerEnv,
    WorldConfig,
    endpoint_scheme,
    is_loopback,
    parse_endpoint,
)
from elasticd.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("fields", "ok"),
    [
        ({"reach_check_s": 0}, True),  # the reach check off
        ({"coordinator_grace_s": 0}, True),
        ({"reach_check_s": -0.5}, False),
        ({"reach_check_s": float("inf")}, False),
        ({"probe_s": 0}, False),  # a connect needs some time to be answered
        ({"last_call_s": 0}, False),
    ],
)
def test_only_some_timeouts_may_be_zero(fields: dict[str, float], ok: bool) -> None:
    if ok:
        Timeouts(**fields)
    else:
        with pytest.raises(ConfigError, match=next(iter(fields))):
            Timeouts(**fields)


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


@pytest.mark.parametrize("text", ["unix://sock:1", "grpc://h:1", "https://:1", "https://h", "h:0", "h:x"])
def test_parse_endpoint_refuses(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^etcd_endpoints: expected host:port \(or http:// or https://"):
        parse_endpoint(text)


@pytest.mark.parametrize(("text", "scheme"), [("h:1", ""), ("http://h:1", "http"), (" HTTPS://h:1", "https")])
def test_endpoint_scheme(text: str, scheme: str) -> None:
    assert endpoint_scheme(text) == scheme


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.9.8.7", True),
        ("::1", True),
        ("localhost", True),
        ("LocalHost", True),
        ("10.0.0.1", False),
        ("::", False),
        ("etcd.example", False),
        ("localhost.example", False),
        ("128.0.0.1", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


# -- https:// means TLS ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "tls"),
    [
        (dict(), False),
        (dict(endpoints=("http://h:1", "h:2")), False),  # both plaintext: not a mix
        (dict(ca_cert="CA"), True),
        (dict(endpoints=("h:1",), ca_cert="CA"), True),
        (dict(endpoints=("https://h:1",)), True),  # no CA file: the system's CA bundle (store.etcd)
        (dict(endpoints=("https://h:1", "HTTPS://g:2"), ca_cert="CA"), True),
        (dict(endpoints=("https://h:1",), cert_cert="C", cert_key="K"), True),  # mutual TLS with the system's CAs
    ],
)
def test_tls_is_a_ca_file_or_https(fields: dict[str, object], tls: bool) -> None:
    assert EtcdConfig(**fields).tls is tls  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(endpoints=("https://h:1", "h:2")), "etcd_endpoints: https:// and plaintext endpoints mixed in one list"),
        (dict(endpoints=("http://h:1", "https://h:2")), "etcd_endpoints: https:// and plaintext endpoints mixed"),
        (dict(endpoints=("http://h:1",), ca_cert="CA"), "etcd_ca_cert: set, but etcd_endpoints ask for plaintext"),
        (
            dict(endpoints=("h:1", "http://g:1"), ca_cert="CA"),
            "etcd_ca_cert: set, but etcd_endpoints ask for plaintext",
        ),
        (dict(insecure="yes"), "etcd_insecure: must be true or false, got 'yes'"),
    ],
)
def test_endpoint_schemes_that_contradict_are_refused(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        EtcdConfig(**fields)  # type: ignore[arg-type]
    assert str(info.value).startswith(message), str(info.value)


# -- a password in plaintext only on loopback, or when allowed ---------------------------------------

_AUTH = dict(user="u", password_file="PW")


@pytest.mark.parametrize(
    ("fields", "refused"),
    [
        (dict(endpoints=("127.0.0.1:2379",), **_AUTH), False),
        (dict(endpoints=("http://localhost:2379", "[::1]:2380", "127.0.0.2:1"), **_AUTH), False),
        (dict(endpoints=("10.0.0.1:2379",), **_AUTH), True),
        (dict(endpoints=("http://etcd.example:2379",), **_AUTH), True),
        (dict(endpoints=("127.0.0.1:2379", "10.0.0.2:2379"), **_AUTH), True),  # one remote endpoint is enough
        (dict(endpoints=("10.0.0.1:2379",), insecure=True, **_AUTH), False),  # --insecure
        (dict(endpoints=("https://10.0.0.1:2379",), **_AUTH), False),
        (dict(endpoints=("10.0.0.1:2379",), ca_cert="CA", **_AUTH), False),
        (dict(endpoints=("10.0.0.1:2379",)), False),  # no user: no password to protect
    ],
)
def test_a_password_in_plaintext_to_a_remote_etcd_is_refused_unless_insecure(
    fields: dict[str, object], refused: bool
) -> None:
    if not refused:
        EtcdConfig(**fields)  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigError) as info:
        EtcdConfig(**fields)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith("etcd_user: its password would cross the network in plaintext to "), message
    assert "https://" in message and "etcd_insecure (--insecure)" in message, message


# -- job and node ids are names ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("default", True),
        ("job-42", True),
        ("a", True),
        ("7", True),
        ("Run_3.v2", True),
        ("host.example.com", True),
        ("a..b", True),
        ("x" * 128, True),
        ("", False),
        (".", False),
        ("..", False),
        (".hidden", False),
        ("-flag", False),
        ("_x", False),
        ("a/b", False),
        ("../up", False),
        ("a\\b", False),
        ("a b", False),
        ("tab\t", False),
        ("nl\n", False),
        ("x" * 129, False),
        ("caf\u00e9", False),
        ("a:b", False),
        ("a\0", False),
    ],
)
def test_job_and_node_ids_are_names(name: str, ok: bool) -> None:
    for setting, build in (("job_id", lambda: WorldConfig(job_id=name)), ("node_id", lambda: WorkerEnv(node_id=name))):
        if ok:
            build()
            continue
        with pytest.raises(ConfigError) as info:
            build()
        assert str(info.value).startswith(f"{setting}: must be 1 to 128 of the characters A-Z a-z 0-9 . _ -"), (
            info.value
        )
        assert str(info.value).endswith(f"got {name!r}")


def test_config_error_is_fatal() -> None:
    from elasticd.errors import FatalError

    assert issubclass(ConfigError, FatalError)


# -- etcd TLS and auth -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(cert_cert="CERT"), "etcd_cert_cert: a client certificate needs its key"),
        (dict(cert_key="KEY"), "etcd_cert_cert: a client certificate needs its key"),
        (dict(cert_cert="CERT", cert_key="KEY"), "etcd_cert_cert: a client certificate needs TLS: set etcd_ca_cert"),
        (dict(user="u"), "etcd_user: a user needs a password"),
        (dict(password="p"), "etcd_user: a user needs a password"),
        (dict(user="u", password="p", password_file="PW"), "etcd_password: give etcd_password or etcd_password_file"),
    ],
)
def test_etcd_security_settings_are_validated(fields: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        EtcdConfig(**fields)  # file names only: whether the files exist is the loader's check
    assert str(info.value).startswith(message)


def test_value_objects_touch_no_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    absent = str(tmp_path / "absent")
    etcd = EtcdConfig(ca_cert=absent, cert_cert=absent, cert_key=absent, user="u", password_file=absent)
    assert WorkerEnv(node_id="n", etcd=etcd).etcd.tls
    (tmp_path / "file").write_text("")
    AgentConfig(program=("w",), audit_dir=tmp_path / "file")  # a file there: the loader's check
    AgentConfig(program=("w",), checkpoint=CheckpointConfig(checkpoint_dir=str(tmp_path / "file")))
    with pytest.raises(ConfigError, match="audit_dir: not a valid path"):
        AgentConfig(program=("w",), audit_dir=tmp_path / "a\0b")
    with pytest.raises(ConfigError, match="checkpoint_dir: not a valid path"):
        CheckpointConfig(checkpoint_dir=str(tmp_path / "a\0b"))


def test_checkpoint_switches() -> None:
    assert CheckpointConfig(checkpoint_dir="/c", checkpoint_every_s=2.5).saves
    assert not CheckpointConfig().enabled and not CheckpointConfig(checkpoint_dir="/c").saves
