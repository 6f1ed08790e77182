"""config.py: the value objects validate themselves (naming the setting), touch no file, and give
their durations as timedelta. The loading of these values is tested in test_settings.py."""

from __future__ import annotations

from datetime import timedelta

import pytest

from elasticd.config import (
    AgentConfig,
    CheckpointConfig,
    EtcdConfig,
    Timeouts,
    WorkerEnv,
    parse_endpoint,
)
from elasticd.errors import ConfigError

pytestmark = pytest.mark.timeout(60)


def test_timeouts_as_timedelta() -> None:
    t = Timeouts(collective_s=11, keepalive_s=1.5)
    assert t.td("collective") == timedelta(seconds=11)
    assert t.td("keepalive") == timedelta(seconds=1.5)


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


def test_config_error_is_fatal() -> None:
    from elasticd.errors import FatalError

    assert issubclass(ConfigError, FatalError)


# -- etcd TLS and auth -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(cert_cert="CERT"), "etcd_cert_cert: a client certificate needs its key"),
        (dict(cert_key="KEY"), "etcd_cert_cert: a client certificate needs its key"),
        (dict(cert_cert="CERT", cert_key="KEY"), "etcd_cert_cert: a client certificate needs etcd_ca_cert"),
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
    AgentConfig(program=("w",), checkpoint_dir=tmp_path / "file")  # a file there: the loader's check
    with pytest.raises(ConfigError, match="checkpoint_dir: not a valid path"):
        AgentConfig(program=("w",), checkpoint_dir=tmp_path / "a\0b")


def test_checkpoint_switches() -> None:
    assert CheckpointConfig(checkpoint_dir="/c", checkpoint_every_s=2.5).saves
    assert not CheckpointConfig().enabled and not CheckpointConfig(checkpoint_dir="/c").saves
