"""Where etcd is and how to reach it, as a value: ``EtcdConfig`` and the endpoint rules
(``parse_endpoint``, ``endpoint_scheme``, ``is_loopback``). A base module like ``config``, which
re-exports these names: it never reads the environment, a file or a command line.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from elasticd.errors import ConfigError


@dataclass(frozen=True)
class EtcdConfig:
    """Where etcd is and how keys are laid out, and how to reach it (TLS, auth).

    The certificate and password files are names here: ``settings.etcd_config`` checks that they
    exist, and the etcd client reads them.
    """

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = "/elasticd"
    ca_cert: str = field(
        default="",
        metadata={
            "doc": "CA bundle (PEM file) that signs the etcd servers' certificates; set: talk TLS to etcd "
            "(https:// endpoints talk TLS too, trusting the system's CA bundle when this is unset)."
        },
    )
    cert_cert: str = field(
        default="", metadata={"doc": "Client certificate (PEM file) for etcd mutual TLS; needs etcd_cert_key, and TLS."}
    )
    cert_key: str = field(default="", metadata={"doc": "Private key (PEM file) of etcd_cert_cert."})
    user: str = field(default="", metadata={"doc": "etcd user (role-based access); needs a password."})
    password: str = field(
        default="",
        repr=False,
        metadata={"doc": "Password of etcd_user (prefer etcd_password_file or ELASTICD_ETCD_PASSWORD; never logged)."},
    )
    password_file: str = field(
        default="", metadata={"doc": "File whose first line is etcd_user's password (instead of etcd_password)."}
    )
    insecure: bool = field(
        default=False,
        metadata={
            "doc": "Allow etcd_user's password to cross the network in plaintext, to an etcd that is not on "
            "loopback and is reached without TLS; off: such a configuration is refused."
        },
    )

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("etcd_endpoints: at least one host:port is required")
        for ep in self.endpoints:
            parse_endpoint(ep)
        if len({endpoint_scheme(ep) == "https" for ep in self.endpoints}) > 1:
            raise ConfigError(
                f"etcd_endpoints: https:// and plaintext endpoints mixed in one list "
                f"({', '.join(self.endpoints)}); use https:// for all of them or for none"
            )
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ConfigError(f"etcd_prefix: must start with '/' and not end with '/', got {self.prefix!r}")
        if bool(self.cert_cert) != bool(self.cert_key):
            raise ConfigError(
                "etcd_cert_cert: a client certificate needs its key, and the key its certificate "
                "(set both etcd_cert_cert and etcd_cert_key, or neither)"
            )
        if self.ca_cert and any(endpoint_scheme(ep) == "http" for ep in self.endpoints):
            raise ConfigError(
                "etcd_ca_cert: set, but etcd_endpoints ask for plaintext (http://); write them "
                "as https://host:port, or as host:port"
            )
        if self.cert_cert and not self.tls:
            raise ConfigError(
                "etcd_cert_cert: a client certificate needs TLS: set etcd_ca_cert, or write "
                "etcd_endpoints as https://host:port"
            )
        if self.password and self.password_file:
            raise ConfigError("etcd_password: give etcd_password or etcd_password_file, not both")
        has_password = bool(self.password or self.password_file)
        if bool(self.user) != has_password:
            raise ConfigError(
                "etcd_user: a user needs a password and a password its user (set etcd_user and "
                "etcd_password or etcd_password_file, or neither)"
            )
        if not isinstance(self.insecure, bool):
            raise ConfigError(f"etcd_insecure: must be true or false, got {self.insecure!r}")
        remote = [ep for ep in self.endpoints if not is_loopback(parse_endpoint(ep)[0])]
        if self.user and remote and not self.tls and not self.insecure:
            raise ConfigError(
                f"etcd_user: its password would cross the network in plaintext to {remote[0]}; "
                "talk TLS (write etcd_endpoints as https://host:port, or set etcd_ca_cert), or "
                "set etcd_insecure (--insecure) to allow it"
            )

    @property
    def tls(self) -> bool:
        """Talk TLS: a CA bundle is set, or the endpoints are ``https://``."""
        return bool(self.ca_cert) or endpoint_scheme(self.endpoints[0]) == "https"


def endpoint_scheme(endpoint: str) -> str:
    """``"https"``, ``"http"`` or ``""`` (no scheme) of an etcd endpoint."""
    scheme, sep, _ = endpoint.strip().partition("://")
    return scheme.lower() if sep else ""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split ``host:port``, after an ``http://`` or ``https://`` scheme (see ``endpoint_scheme``).

    Raises:
        ConfigError: the endpoint is not ``host:port`` with a port in 1..65535, or has another scheme.
    """
    text = endpoint.strip()
    scheme = endpoint_scheme(text)
    host, sep, port_text = (text.partition("://")[2] if scheme else text).rpartition(":")
    if (
        scheme not in ("", "http", "https")
        or not sep
        or not host
        or not port_text.isdigit()
        or not 0 < int(port_text) < 65536
    ):
        raise ConfigError(f"etcd_endpoints: expected host:port (or http:// or https:// before it), got {endpoint!r}")
    return host.strip("[]"), int(port_text)


def is_loopback(host: str) -> bool:
    """``localhost``, or an address in 127.0.0.0/8 or ``::1`` (a name is not resolved)."""
    try:
        return host.lower() == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
