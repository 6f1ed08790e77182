"""A generation's keys in the c10d store, sealed under the generation's secret token.

Owns ``Seal`` (pure: key names, sealed values and counter offsets derived from a token) and
``SealedStore``, the c10d ``Store`` that the members of one generation, and its subgroups, build
their groups over when the generation record carries a token (``generation_store`` picks it).
c10d's ``TCPStore`` has no authentication: any client that reaches its port may list every key
(``list_keys``, torch 2.13, both backends), then read and overwrite it, so a key prefix alone would
hand the token to whoever lists the keys. Under a token, each key is stored under an HMAC of its
name, each value is encrypted and authenticated (AES-256-GCM from ``cryptography``, the key name as
associated data), and each counter is offset by a secret, so a process that reaches the port but cannot read
the job's etcd keys learns nothing from what it lists or reads, and whatever it writes over a
member's key fails to open: that build fails (``CollectiveError``), it never accepts the value.
Never opens a connection of its own, never retries, never decides membership.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from torch._C._distributed_c10d import PrefixStore, Store

MAGIC = b"E2"  # format of a sealed value: AES-256-GCM
NONCE_BYTES = 12  # GCM's nonce (random: one key per generation, a handful of writes)
NAME_HEX = 32  # a 128-bit key name
COUNTER_OFFSET_BYTES = 7  # < 2**56: the server adds in int64, with room for any count


@dataclass(frozen=True)
class Seal:
    """The keys derived from one generation's token. Pure."""

    name_key: bytes
    enc_key: bytes
    mac_key: bytes

    @classmethod
    def from_token(cls, token: str) -> Seal:
        """Raises:
        ValueError: ``token`` is empty."""
        if not token:
            raise ValueError("a seal needs a non-empty token")
        secret = token.encode()
        return cls(*(hmac.digest(secret, b"elasticd-store/" + label, "sha256") for label in (b"name", b"enc", b"mac")))

    def name(self, key: str) -> str:
        """The name ``key`` is stored under: neither it nor the token can be read back from it."""
        return hmac.digest(self.name_key, key.encode(), "sha256").hex()[:NAME_HEX]

    def seal(self, name: str, value: bytes) -> bytes:
        """``value`` encrypted and authenticated under a fresh nonce, bound to ``name``."""
        nonce = os.urandom(NONCE_BYTES)
        return MAGIC + nonce + AESGCM(self.enc_key).encrypt(nonce, value, name.encode())

    def open(self, name: str, sealed: bytes) -> bytes:
        """The value that ``seal(name, ...)`` sealed.

        Raises:
            ValueError: ``sealed`` was not sealed under this token for ``name`` (written by
                another process, changed, or moved from another key).
        """
        head = len(MAGIC) + NONCE_BYTES
        if len(sealed) < head + 16 or not sealed.startswith(MAGIC):  # 16: GCM's tag
            raise ValueError(f"store key {name}: not a sealed value ({len(sealed)} bytes)")
        try:
            return AESGCM(self.enc_key).decrypt(sealed[len(MAGIC) : head], sealed[head:], name.encode())
        except InvalidTag:
            raise ValueError(f"store key {name}: the value fails authentication (written without the token)") from None

    def counter_offset(self, name: str) -> int:
        """What a counter stored under ``name`` starts from, so its raw value tells nothing."""
        digest = hmac.digest(self.mac_key, b"counter/" + name.encode(), "sha256")
        return int.from_bytes(digest[:COUNTER_OFFSET_BYTES], "big")


class SealedStore(Store):
    """``base`` under ``prefix``, every key named, valued and counted through ``seal``.

    Serves what gloo, NCCL and the arrival barrier ask of a store (``set``, ``get``, ``add``,
    ``check``, ``wait``, key deletion and count); other calls fail. Counters are read only through
    ``add``. C++ holds this store without keeping its Python half alive, so whoever builds a group
    over it keeps a reference for as long as the group (``process_group.Group.store``).
    """

    def __init__(self, base: Store, seal: Seal, prefix: str) -> None:
        super().__init__()
        self.set_timeout(base.timeout)  # type: ignore[attr-defined]  # what C++ callers read as this store's
        self._base, self._seal, self._prefix = base, seal, prefix
        self._counters: set[str] = set()  # counters this store has set its offset on

    def _name(self, key: str) -> str:
        return self._seal.name(f"{self._prefix}/{key}")  # PrefixStore's join: the same keys as without a token

    def set(self, key: str, value: str | bytes) -> None:
        name = self._name(key)
        self._base.set(name, _raw(self._seal.seal(name, _bytes(value))))

    def get(self, key: str) -> bytes:
        """Raises:
        DistStoreError: the value was not sealed for this key under this generation's token."""
        name = self._name(key)
        try:
            return self._seal.open(name, self._base.get(name))
        except ValueError as exc:
            raise dist.DistStoreError(str(exc)) from exc

    def add(self, key: str, value: int) -> int:
        name = self._name(key)
        offset = self._seal.counter_offset(name)
        if name not in self._counters:
            self._base.compare_set(name, "", str(offset))  # only the first caller's lands
            self._counters.add(name)
        return self._base.add(name, value) - offset

    def check(self, keys: list[str]) -> bool:
        return self._base.check([self._name(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self._name(k) for k in keys]
        if timeout is None:
            self._base.wait(names)
        else:
            self._base.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self._base.delete_key(self._name(key))

    deleteKey = delete_key  # the names c10d's C++ calls these by

    def num_keys(self) -> int:
        return self._base.num_keys()

    getNumKeys = num_keys

    def has_extended_api(self) -> bool:
        return False  # no multi_get/multi_set: c10d then asks key by key

    def clone(self) -> SealedStore:
        return SealedStore(self._base.clone(), self._seal, self._prefix)  # type: ignore[attr-defined]


def generation_store(base: Store, prefix: str, token: str) -> Store:
    """The store a group is built over: ``base`` under ``prefix``, sealed when ``token`` is set
    (the generation record's; empty in records made by hand)."""
    return SealedStore(base, Seal.from_token(token), prefix) if token else PrefixStore(prefix, base)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def _raw(value: bytes) -> str:
    """pybind passes bytes to a ``std::string`` parameter as they are; torch's stubs say ``str``."""
    return value  # type: ignore[return-value]
