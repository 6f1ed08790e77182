"""The sealing of a generation's store keys (``worker.store_seal``): pure cases for ``Seal``, the
store over a real in-memory c10d store, and a gloo group built over it by the group factory."""

from __future__ import annotations

import threading
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore, PrefixStore, TCPStore

from elasticd.config import Timeouts
from elasticd.retry import Bound, Deadline
from elasticd.worker.group.process_group import Group, GroupFactory, StoreServer, listen_on
from elasticd.worker.group.store_seal import MAGIC, SealedStore, Seal, generation_store

pytestmark = pytest.mark.timeout(60)

TOKEN = "0123456789abcdef0123456789abcdef"
OTHER = "fedcba9876543210fedcba9876543210"


# -- Seal (pure) ---------------------------------------------------------------------------------


def test_an_empty_token_has_no_seal() -> None:
    with pytest.raises(ValueError):
        Seal.from_token("")


@pytest.mark.parametrize("key", ["gen/3//arrived", "gen/3//0/1", "gen/3/xfer/0//0/0", ""])
def test_names_reveal_neither_the_key_nor_the_token(key: str) -> None:
    seal = Seal.from_token(TOKEN)
    name = seal.name(key)
    assert name == Seal.from_token(TOKEN).name(key)  # every member derives the same name
    assert len(name) == 32 and int(name, 16) >= 0
    assert name != Seal.from_token(OTHER).name(key)
    assert TOKEN not in name and (not key or key not in name)


def test_names_of_different_keys_differ() -> None:
    seal = Seal.from_token(TOKEN)
    keys = [f"gen/{g}//{k}" for g in range(1, 20) for k in ("arrived", "0/0", "0/1")]
    assert len({seal.name(k) for k in keys}) == len(keys)


@pytest.mark.parametrize("value", [b"", b"x", b"127.0.0.1:29500" * 3, bytes(range(256)) * 20])
def test_a_sealed_value_opens_only_under_its_token_and_key(value: bytes) -> None:
    seal, name = Seal.from_token(TOKEN), Seal.from_token(TOKEN).name("gen/1//0/0")
    sealed = seal.seal(name, value)
    assert sealed.startswith(MAGIC) and seal.open(name, sealed) == value
    assert seal.seal(name, value) != sealed  # a fresh nonce each time
    if len(value) >= 8:
        assert value[:8] not in sealed
    for opener, at in ((Seal.from_token(OTHER), name), (seal, seal.name("gen/1//0/1"))):
        with pytest.raises(ValueError):
            opener.open(at, sealed)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda s: s[:-1] + bytes([s[-1] ^ 1]),  # the tag
        lambda s: s[:20] + bytes([s[20] ^ 1]) + s[21:],  # the body
        lambda s: s[:-1],  # truncated
        lambda s: b"E0" + s[2:],  # another format
        lambda s: b"",
        lambda s: b"127.0.0.1",  # a value written without the token
    ],
)
def test_a_changed_value_fails_to_open(tamper) -> None:  # type: ignore[no-untyped-def]
    seal = Seal.from_token(TOKEN)
    name = seal.name("k")
    with pytest.raises(ValueError):
        seal.open(name, tamper(seal.seal(name, b"a value of some length")))


def test_counter_offsets_are_per_name_and_leave_room_to_count() -> None:
    seal = Seal.from_token(TOKEN)
    offsets = {seal.counter_offset(seal.name(f"gen/{g}//arrived")) for g in range(50)}
    assert len(offsets) == 50 and max(offsets) < 2**56
    assert seal.counter_offset("x") != Seal.from_token(OTHER).counter_offset("x")


# -- the store over a real c10d store ------------------------------------------------------------


def test_the_sealed_store_keeps_its_keys_and_values_unreadable_in_the_base() -> None:
    base = HashStore()
    sealed = SealedStore(base, Seal.from_token(TOKEN), "gen/3/")
    store = PrefixStore("0", sealed)  # through C++, as gloo calls it
    store.set("1", "rank 1 listens at 127.0.0.1:4242")
    assert store.get("1") == b"rank 1 listens at 127.0.0.1:4242"
    assert sealed.add("arrived", 1) == 1 and sealed.add("arrived", 1) == 2 and sealed.add("arrived", 0) == 2
    assert SealedStore(base, Seal.from_token(TOKEN), "gen/3/").add("arrived", 1) == 3  # another member's view
    assert store.check(["1"]) and not store.check(["2"])
    store.wait(["1"], timedelta(seconds=1))
    listed = base.list_keys()
    assert len(listed) == 2
    assert not any(TOKEN in k or "gen/" in k or "arrived" in k for k in listed)
    raw = {k: base.get(k) for k in listed}
    assert not any(b"127.0.0.1" in v or v == b"3" for v in raw.values())
    assert store.num_keys() == 2 and store.delete_key("1") and not store.check(["1"])


def test_a_value_written_without_the_token_is_refused() -> None:
    base = HashStore()
    sealed = SealedStore(base, Seal.from_token(TOKEN), "gen/3/")
    sealed.set("0/0", b"genuine")
    (name,) = base.list_keys()
    for forged in (b"127.0.0.1:1", Seal.from_token(OTHER).seal(name, b"x")):
        base.set(name, forged)  # type: ignore[arg-type]  # pybind takes bytes as they are
        with pytest.raises(dist.DistStoreError, match="authentication|not a sealed value"):
            sealed.get("0/0")
        with pytest.raises(dist.DistError):  # as gloo meets it: through C++ (a CollectiveError in the build)
            PrefixStore("0", sealed).get("0")


def test_without_a_token_the_keys_are_those_of_a_plain_prefix() -> None:
    base = HashStore()
    store = generation_store(base, "gen/3/", "")
    assert isinstance(store, PrefixStore)
    store.add("arrived", 1)
    assert base.list_keys() == ["gen/3//arrived"] and base.get("gen/3//arrived") == b"1"
    assert isinstance(generation_store(base, "gen/3/", TOKEN), SealedStore)


# -- the listener and a group over the sealed store ----------------------------------------------


def test_the_listener_is_bound_to_the_address_it_was_given() -> None:
    sock = listen_on("127.0.0.1")
    try:
        host, port = sock.getsockname()[:2]
        assert host == "127.0.0.1" and port > 0
    finally:
        sock.close()


def test_the_store_server_listens_on_its_host_only() -> None:
    """Given a port, c10d alone listens on every interface: the server is handed its socket."""
    server = StoreServer("127.0.0.1", Timeouts())
    ours = [
        c
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port
    ]
    assert [c.laddr.ip for c in ours] == ["127.0.0.1"]
    server.store.set("k", "v")
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    assert client.get("k") == b"v"


def test_an_address_not_of_this_host_is_a_config_error() -> None:
    from elasticd.errors import ConfigError

    with pytest.raises(ConfigError, match="advertise_addr"):
        listen_on("192.0.2.1")  # TEST-NET-1: never an address of this host


def test_a_gloo_group_over_the_sealed_store_works_and_leaves_nothing_readable() -> None:
    timeouts = Timeouts(group_build_s=20)
    servers = [StoreServer("127.0.0.1", timeouts) for _ in range(2)]
    factories = [GroupFactory(s, "127.0.0.1", "gloo", r, timeouts) for r, s in enumerate(servers)]
    groups: dict[int, Group] = {}

    def build(rank: int) -> None:
        bound = Bound.after(20, poll_s=timeouts.abort_poll_s)
        groups[rank] = factories[rank].build(5, rank, 2, "127.0.0.1", servers[0].port, bound, token=TOKEN)

    subgroups: dict[int, Group] = {}

    def subgroup(rank: int) -> None:  # a transfer's, under the generation's token too
        bound = Bound.after(20, poll_s=timeouts.abort_poll_s)
        subgroups[rank] = factories[rank].build_subgroup(groups[rank], [0, 1], "xfer", bound)

    for target in (build, subgroup):
        threads = [threading.Thread(target=target, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    assert sorted(groups) == sorted(subgroups) == [0, 1]
    assert isinstance(groups[0].store, SealedStore) and isinstance(subgroups[1].store, SealedStore)
    for made in (groups, subgroups):
        x = torch.ones(3)
        works = [made[r].pg.allreduce([x if r == 0 else torch.ones(3)]) for r in range(2)]
        for w in works:
            w.wait()
        assert x.tolist() == [2.0, 2.0, 2.0]
    stray = TCPStore("127.0.0.1", servers[0].port, is_master=False, timeout=timedelta(seconds=2))
    listed = stray.list_keys()
    assert listed and not any(TOKEN in k or "gen/" in k for k in listed)
    assert not stray.check(["gen/5//arrived"]) and not stray.check([f"{TOKEN}/gen/5//arrived"])
    seal = Seal.from_token(TOKEN)
    counters = {seal.name("gen/5//arrived"), seal.name("gen/5/xfer//arrived")}
    for key in listed:  # gloo's addresses sealed, the arrival counts offset by a secret
        raw = stray.get(key)
        if key in counters:
            assert raw != b"2" and int(raw) - seal.counter_offset(key) == 2
        else:
            assert raw.startswith(MAGIC) and seal.open(key, raw)
    assert counters <= set(listed) and len(listed) == 2 + 2 * 2  # each rank's address, twice
    for r in range(2):
        factories[r].retire(subgroups[r])
        factories[r].retire(groups[r])
        assert groups[r].store is None
    for f in factories:
        f.drain(Deadline.after(10))
