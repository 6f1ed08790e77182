"""What an etcd client needs besides etcd itself: the user's password (``read_password``), the
system's CA bundle for ``https://`` endpoints without a CA file (``system_ca_bundle``), and the
error for etcd's "permission denied" that names the job and the user (``permission_denied``).

Reads files, never talks to etcd, holds no protocol logic.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Sequence
from pathlib import Path

from elasticd.config import EtcdConfig
from elasticd.errors import ConfigError, PermissionDenied


def permission_denied(config: EtcdConfig, what: str, key: str) -> PermissionDenied:
    """The error for etcd's "permission denied" on ``key`` (the first key of the request; "" for a
    lease): it names the job (the key's segment after the prefix), the etcd user, and the range that
    the user's role must cover. Pure."""
    user = f"etcd user {config.user}" if config.user else "no etcd user: set --etcd-user"
    root = config.prefix + "/"
    job = key[len(root) :].partition("/")[0] if key.startswith(root) else ""
    if job:
        return PermissionDenied(
            f"permission denied for job {job} ({user}): the user's role does not cover "
            f"{root}{job}/ -- see `elasticctl auth setup-job`"
        )
    return PermissionDenied(
        f"permission denied for {what}{f' of {key}' if key else ''} ({user}): etcd refused "
        "it to the user's role -- see `elasticctl auth setup-job`"
    )


# Where distributions keep the system's CA bundle, for a Python whose OpenSSL does not say (one
# built elsewhere): Debian and Ubuntu, Fedora and RHEL, openSUSE, Alpine and macOS.
SYSTEM_CA_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
)


def system_ca_bundle(candidates: Sequence[str] | None = None) -> str:
    """The system's CA bundle: the first file of ``candidates``, by default OpenSSL's default file
    (``$SSL_CERT_FILE`` when set), then ``SYSTEM_CA_BUNDLES``.

    Raises:
        ConfigError: none of them is a file; the message names ``etcd_ca_cert``.
    """
    if candidates is None:
        paths = ssl.get_default_verify_paths()
        candidates = (paths.cafile or "", paths.openssl_cafile, *SYSTEM_CA_BUNDLES)
    for path in candidates:
        if path and os.path.isfile(path):
            return path
    raise ConfigError(
        f"etcd_ca_cert: the etcd endpoints are https:// but no etcd_ca_cert is set, and no "
        f"system CA bundle was found (looked at {', '.join(p for p in candidates if p)}); set "
        "etcd_ca_cert to the CA file that signs etcd's certificate"
    )


def read_password(config: EtcdConfig) -> str:
    """The password: ``password``, else the first line of ``password_file`` ("" without a user).

    Raises:
        ConfigError: the password file cannot be read or is empty.
    """
    if not config.password_file:
        return config.password
    try:
        text = Path(config.password_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"etcd_password_file: cannot read {config.password_file!r}: {exc}") from exc
    lines = text.splitlines()
    if not lines or not lines[0]:
        raise ConfigError(f"etcd_password_file: {config.password_file!r} is empty")
    return lines[0]
