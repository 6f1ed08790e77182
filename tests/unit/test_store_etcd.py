"""store/etcd.py without an etcd: ``https://`` endpoints make a TLS channel (the system's CA bundle
when no CA file is set), and no bundle at all is a clear ConfigError. The talk itself is tested
against a real etcd in tests/integration/test_etcd_security.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.errors import ConfigError
from elasticd.store.etcd import EtcdClient, system_ca_bundle

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("present", "candidates", "found"), [
    (["a", "b"], ["a", "b"], "a"),
    (["b"], ["a", "b"], "b"),
    (["b"], ["", "a", "b"], "b"),  # OpenSSL's file unset
    (["dir/"], ["dir", "b"], None),  # a directory is not a bundle
    ([], ["a", "b"], None),
])
def test_system_ca_bundle_is_the_first_file_found(tmp_path: Path, present: list[str], candidates: list[str],
                                                   found: str | None) -> None:
    for name in present:
        if name.endswith("/"):
            (tmp_path / name).mkdir()
        else:
            (tmp_path / name).write_text("-----BEGIN CERTIFICATE-----\n")
    paths = [str(tmp_path / c) if c else "" for c in candidates]
    if found is not None:
        assert system_ca_bundle(paths) == str(tmp_path / found)
        return
    with pytest.raises(ConfigError) as info:
        system_ca_bundle(paths)
    message = str(info.value)
    assert message.startswith("etcd_ca_cert: the etcd endpoints are https:// but no etcd_ca_cert is set"), message
    assert paths[-1] in message and message.endswith("set etcd_ca_cert to the CA file that signs "
                                                               "etcd's certificate")


def test_the_default_candidates_start_with_openssls_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "bundle.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))  # OpenSSL's own override of its default file
    assert system_ca_bundle() == str(bundle)


@pytest.mark.parametrize(("endpoints", "ca_cert", "secure"), [
    (("127.0.0.1:1",), "", False),
    (("http://127.0.0.1:1",), "", False),
    (("https://127.0.0.1:1",), "", True),  # was plaintext: the scheme was dropped
    (("127.0.0.1:1",), "CA", True),
    (("https://127.0.0.1:1", "https://127.0.0.1:2"), "CA", True),
])
def test_https_or_a_ca_file_makes_a_tls_channel(tmp_path: Path, endpoints: tuple[str, ...], ca_cert: str,
                                                 secure: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "bundle.pem"
    bundle.write_text("")  # gRPC reads the roots when a connection is made: none is, here
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    config = EtcdConfig(endpoints=endpoints, ca_cert=str(bundle) if ca_cert else "")
    client = EtcdClient(config, Timeouts(), RetryPolicy())  # no user: nothing is sent yet
    try:
        assert client._client.uses_secure_channel is secure
    finally:
        client.close()
