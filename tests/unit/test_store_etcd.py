"""store/etcd.py without an etcd: ``https://`` endpoints make a TLS channel (the system's CA bundle
when no CA file is set), and no bundle at all is a clear ConfigError; etcd's "permission denied" is
one ``PermissionDenied`` naming the job and the user, never retried. The talk itself is tested
against a real etcd in tests/integration/test_etcd_security.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.errors import ConfigError, EtcdUnavailable, PermissionDenied
from elasticd.store.etcd import EtcdClient, permission_denied, system_ca_bundle

import grpc  # isort: skip  (after store.etcd, which sets gRPC's verbosity before its first import)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("present", "candidates", "found"),
    [
        (["a", "b"], ["a", "b"], "a"),
        (["b"], ["a", "b"], "b"),
        (["b"], ["", "a", "b"], "b"),  # OpenSSL's file unset
        (["dir/"], ["dir", "b"], None),  # a directory is not a bundle
        ([], ["a", "b"], None),
    ],
)
def test_system_ca_bundle_is_the_first_file_found(
    tmp_path: Path, present: list[str], candidates: list[str], found: str | None
) -> None:
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
    assert paths[-1] in message and message.endswith("set etcd_ca_cert to the CA file that signs etcd's certificate")


def test_the_default_candidates_start_with_openssls_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = tmp_path / "bundle.pem"
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))  # OpenSSL's own override of its default file
    assert system_ca_bundle() == str(bundle)


@pytest.mark.parametrize(
    ("endpoints", "ca_cert", "secure"),
    [
        (("127.0.0.1:1",), "", False),
        (("http://127.0.0.1:1",), "", False),
        (("https://127.0.0.1:1",), "", True),  # was plaintext: the scheme was dropped
        (("127.0.0.1:1",), "CA", True),
        (("https://127.0.0.1:1", "https://127.0.0.1:2"), "CA", True),
    ],
)
def test_https_or_a_ca_file_makes_a_tls_channel(
    tmp_path: Path, endpoints: tuple[str, ...], ca_cert: str, secure: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    bundle = tmp_path / "bundle.pem"
    bundle.write_text("")  # gRPC reads the roots when a connection is made: none is, here
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    config = EtcdConfig(endpoints=endpoints, ca_cert=str(bundle) if ca_cert else "")
    client = EtcdClient(config, Timeouts(), RetryPolicy())  # no user: nothing is sent yet
    try:
        assert client._client.uses_secure_channel is secure
    finally:
        client.close()


# -- etcd's "permission denied": one clear error, never retried --------------------------

ROLE_HINT = "-- see `elasticctl auth setup-job`"


@pytest.mark.parametrize(
    ("prefix", "key", "user", "message"),
    [
        (
            "/elasticd",
            "/elasticd/jobA/generation",
            "jobB",
            f"permission denied for job jobA (etcd user jobB): the user's role does not cover /elasticd/jobA/ {ROLE_HINT}",
        ),
        (
            "/elasticd",
            "/elasticd/jobA/",
            "jobB",
            f"permission denied for job jobA (etcd user jobB): the user's role does not cover /elasticd/jobA/ {ROLE_HINT}",
        ),
        (
            "/x/y",
            "/x/y/j.1/members/m",
            "u",
            f"permission denied for job j.1 (etcd user u): the user's role does not cover /x/y/j.1/ {ROLE_HINT}",
        ),
        (
            "/elasticd",
            "/elasticd/jobA/generation",
            "",
            "permission denied for job jobA (no etcd user: set --etcd-user): the user's role does not cover "
            f"/elasticd/jobA/ {ROLE_HINT}",
        ),
        (
            "/elasticd",
            "/other/jobA/generation",
            "u",
            "permission denied for get of /other/jobA/generation (etcd user u): etcd refused it to the user's role "
            f"{ROLE_HINT}",
        ),
        (
            "/elasticd",
            "",
            "u",
            f"permission denied for get (etcd user u): etcd refused it to the user's role {ROLE_HINT}",
        ),
    ],
)
def test_permission_denied_names_the_job_the_user_and_the_range(prefix: str, key: str, user: str, message: str) -> None:
    config = EtcdConfig(prefix=prefix, user=user, password="pw" if user else "")
    err = permission_denied(config, "get", key)
    assert isinstance(err, PermissionDenied) and not isinstance(err, EtcdUnavailable)
    assert str(err) == message


class _RpcError(grpc.RpcError):  # type: ignore[misc]  # grpc has no type stubs here
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"<_InactiveRpcError: {self._code}: {self._details}>"


class _RefusingEtcd:
    """Stands in for etcd3's client: every call is answered with ``error``; ``calls`` counts them."""

    def __init__(self, error: BaseException, watch_id: int = 7) -> None:
        self.error, self.watch_id, self.calls = error, watch_id, 0

    def get(self, key: str) -> object:
        self.calls += 1
        raise self.error

    def add_watch_prefix_callback(self, prefix: str, callback: object) -> int:
        self.calls += 1
        return self.watch_id

    def close(self) -> None:
        pass


def _client_with(fake: _RefusingEtcd) -> EtcdClient:
    client = EtcdClient(
        EtcdConfig(), Timeouts(), RetryPolicy(etcd_attempts=4, etcd_backoff_initial_s=0.01, etcd_backoff_max_s=0.01)
    )
    client.close()  # the real client made no connection yet; the fake answers instead
    client._client = fake
    return client


@pytest.mark.parametrize(
    "error",
    [
        _RpcError(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied"),
        _RpcError(grpc.StatusCode.UNKNOWN, "etcdserver: permission denied"),  # a transient code: not retried either
    ],
)
def test_etcds_permission_denied_is_one_clear_error_and_not_retried(error: BaseException) -> None:
    fake = _RefusingEtcd(error)
    with pytest.raises(PermissionDenied) as info:
        _client_with(fake).get("/elasticd/jobA/generation")
    assert fake.calls == 1
    assert str(info.value).startswith("permission denied for job jobA (no etcd user: set --etcd-user): ")
    assert not isinstance(info.value, EtcdUnavailable)


def test_other_refusals_stay_etcd_unavailable() -> None:
    fake = _RefusingEtcd(_RpcError(grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: user name is empty"))
    with pytest.raises(EtcdUnavailable, match="user name is empty"):
        _client_with(fake).get("/elasticd/jobA/generation")
    assert fake.calls == 1


def test_a_watch_that_etcd_refuses_is_permission_denied() -> None:
    """etcd 3.4 answers a watch on keys the role does not cover with watch id -1 (created, canceled)."""
    with pytest.raises(PermissionDenied, match="^permission denied for job jobA "):
        _client_with(_RefusingEtcd(RuntimeError("unused"), watch_id=-1)).watch_prefix("/elasticd/jobA/", lambda: None)
