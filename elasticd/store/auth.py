"""Per-job etcd credentials: a role whose one permission is a job's keys, and a user that has it.

Owns the name and the key range of a job's role (``role_name``, ``job_key_range``, ``range_end``:
pure) and ``setup_job``, which creates that role, its read-write permission on exactly
``<prefix>/<job>/``, the job's user and its grant of the role, through etcd's Auth API, each only
where it is missing, so that running it again changes nothing (a given password is set again).
etcd3 0.12's client has no helper for users and roles: its generated ``AuthStub`` is called on
``EtcdClient.call_rpc``'s channel, with the admin's token. Holds no command-line text
(``ops.jobauth`` does).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts, check_name
from elasticd.errors import ConfigError, EtcdRefused, EtcdUnavailable, PermissionDenied
from elasticd.store.etcd import EtcdClient

# After store.etcd, which installs etcd3's protobuf modules (store.etcd_protos) and sets gRPC's
# verbosity, before either is first imported.
import grpc  # isort: skip
from etcd3 import etcdrpc  # isort: skip
from etcd3.etcdrpc import auth_pb2  # isort: skip

ROLE_PREFIX = "elasticd-"
ROOT = "root"  # etcd's administrator: its user and role are etcd's own, never a job's
READWRITE = auth_pb2.Permission.READWRITE
GENERATED_PASSWORD_BYTES = 24  # 32 characters of base64url


def role_name(job: str) -> str:
    """The role of job ``job``: ``elasticd-<job>``."""
    return ROLE_PREFIX + job


def range_end(key: bytes) -> bytes:
    """The end of the range [key, end) that holds every key starting with ``key``, as etcd computes
    it for a prefix: the last byte below 0xff is incremented and what follows it dropped (``b"\\0"``,
    every key from ``key`` on, when every byte is 0xff)."""
    for i in range(len(key) - 1, -1, -1):
        if key[i] < 0xFF:
            return key[:i] + bytes([key[i] + 1])
    return b"\0"


def job_key_range(prefix: str, job: str) -> tuple[str, str]:
    """[start, end) of job ``job``'s keys under ``prefix``: exactly the keys under ``<prefix>/<job>/``
    (not those of a job whose id starts with ``job``)."""
    start = f"{prefix}/{job}/"
    return start, range_end(start.encode()).decode()


def describe_permission(perm_type: int, key: bytes, end: bytes) -> str:
    """A permission as people read it: ``READWRITE [/elasticd/a/, /elasticd/a0)``. Pure."""

    def text(b: bytes) -> str:
        return b.decode(errors="backslashreplace")

    kind = auth_pb2.Permission.Type.Name(perm_type)
    if not end:
        return f"{kind} {text(key)}"
    if end == b"\0":
        return f"{kind} every key from {text(key)} on"
    return f"{kind} [{text(key)}, {text(end)})"


@dataclass(frozen=True)
class JobAccess:
    """What ``setup_job`` found and did."""

    job: str
    user: str
    role: str
    key: str  # the role's permission covers [key, range_end)
    range_end: str
    role_created: bool
    permission_granted: bool  # False: the role had it already
    user_created: bool
    password_set: bool  # the given password was set again on a user that existed
    role_granted: bool  # False: the user had the role already
    other_permissions: tuple[str, ...] = ()  # the role's grants beyond the job's keys (describe_permission)
    other_roles: tuple[str, ...] = ()  # the user's roles besides the job's
    generated_password: str = field(default="", repr=False)  # a new user's, when no password was given


class _Auth:
    """etcd's Auth API through one client. Some refusals are answers: "not found" to a get, and
    "already exists" to an add whose first reply was lost (the store retries) come back as None."""

    def __init__(self, client: EtcdClient, timeout_s: float) -> None:
        self._client, self._timeout_s = client, timeout_s

    def _rpc(self, what: str, method: str, request: Any, tolerated: str = "") -> Any:
        def call(channel: grpc.Channel, metadata: tuple[tuple[str, str], ...] | None) -> Any:
            try:
                return getattr(etcdrpc.AuthStub(channel), method)(request, self._timeout_s, metadata=metadata)
            except grpc.RpcError as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
                if tolerated and code == grpc.StatusCode.FAILED_PRECONDITION and tolerated in str(details):
                    return None
                raise

        return self._client.call_rpc(what, call)

    def role(self, name: str) -> Any:
        return self._rpc("role_get", "RoleGet", etcdrpc.AuthRoleGetRequest(role=name), "not found")

    def add_role(self, name: str) -> None:
        self._rpc("role_add", "RoleAdd", etcdrpc.AuthRoleAddRequest(name=name), "already exists")

    def grant(self, role: str, key: bytes, end: bytes) -> None:
        perm = auth_pb2.Permission(permType=READWRITE, key=key, range_end=end)
        self._rpc(
            "role_grant_permission", "RoleGrantPermission", etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=perm)
        )

    def user(self, name: str) -> Any:
        return self._rpc("user_get", "UserGet", etcdrpc.AuthUserGetRequest(name=name), "not found")

    def add_user(self, name: str, password: str) -> None:
        self._rpc("user_add", "UserAdd", etcdrpc.AuthUserAddRequest(name=name, password=password), "already exists")

    def set_password(self, name: str, password: str) -> None:
        self._rpc(
            "user_change_password",
            "UserChangePassword",
            etcdrpc.AuthUserChangePasswordRequest(name=name, password=password),
        )

    def grant_role(self, user: str, role: str) -> None:
        self._rpc("user_grant_role", "UserGrantRole", etcdrpc.AuthUserGrantRoleRequest(user=user, role=role))


def setup_job(
    config: EtcdConfig, timeouts: Timeouts, retry: RetryPolicy, job: str, user: str, password: str | None
) -> JobAccess:
    """Create, where missing, the role ``elasticd-<job>`` with read-write on exactly
    ``<config.prefix>/<job>/``, and the user ``user`` with that role, as ``config.user`` (etcd's
    root user, or another with the root role).

    Args:
        password: the user's password: set on a new user, and set again on one that exists. None: a
            new user gets a generated one (``JobAccess.generated_password``); one that exists keeps its own.

    Raises:
        ConfigError: ``job`` or ``user`` is not a name, ``user`` is root, or ``config`` names no user.
        EtcdRefused: authentication is not enabled in etcd (a role would restrict nothing).
        PermissionDenied: ``config.user`` may not manage users and roles (it lacks the root role).
        EtcdUnavailable: etcd did not answer, or refused the admin's credentials.
    """
    check_name("job", job)
    check_name("user", user)
    if user == ROOT:
        raise ConfigError("user: root is etcd's administrator; give the job a user of its own")
    if not config.user:
        raise ConfigError(
            "setting up a job's credentials needs etcd's root user: --etcd-user root and "
            "--etcd-password-file FILE (or ELASTICD_ETCD_PASSWORD)"
        )
    try:
        client = EtcdClient(config, timeouts, retry)
    except EtcdUnavailable as exc:
        if "authentication is not enabled" in str(exc):
            raise EtcdRefused(
                "etcd's authentication is not enabled, so a job's role would restrict nothing: "
                "add the user root with the role root and enable it (etcdctl user add root; "
                "etcdctl auth enable), then run this again"
            ) from exc
        raise
    try:
        return _setup(_Auth(client, timeouts.etcd_request_s), config.prefix, job, user, password)
    except PermissionDenied as exc:
        raise PermissionDenied(
            f"etcd user {config.user} may not manage users and roles: a job's credentials "
            "are set up as etcd's root user (--etcd-user root)"
        ) from exc
    finally:
        client.close()


def _setup(auth: _Auth, prefix: str, job: str, user: str, password: str | None) -> JobAccess:
    role = role_name(job)
    key, end = job_key_range(prefix, job)
    key_b, end_b = key.encode(), end.encode()
    found = auth.role(role)
    if found is None:
        auth.add_role(role)
    perms = list(found.perm) if found is not None else []
    granted = not any(p.permType == READWRITE and p.key == key_b and p.range_end == end_b for p in perms)
    if granted:
        auth.grant(role, key_b, end_b)
    others = tuple(
        describe_permission(p.permType, p.key, p.range_end) for p in perms if (p.key, p.range_end) != (key_b, end_b)
    )
    held = auth.user(user)
    generated = ""
    if held is None:
        if password is None:
            password = generated = secrets.token_urlsafe(GENERATED_PASSWORD_BYTES)
        auth.add_user(user, password)
    elif password is not None:
        auth.set_password(user, password)
    roles = list(held.roles) if held is not None else []
    if role not in roles:
        auth.grant_role(user, role)
    return JobAccess(
        job=job,
        user=user,
        role=role,
        key=key,
        range_end=end,
        role_created=found is None,
        permission_granted=granted,
        user_created=held is None,
        password_set=held is not None and password is not None,
        role_granted=role not in roles,
        other_permissions=others,
        other_roles=tuple(r for r in roles if r != role),
        generated_password=generated,
    )
