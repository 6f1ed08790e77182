"""The node relay (``relay.node``) against a real etcd, with the relay and lightweight members
(no torch) each in a process of their own, as an agent and its workers run them: the members form
generations and see a leave through the relay alone; an etcd held by SIGSTOP fails their view reads
without making them leave the relay; a relay held by SIGSTOP is left within ``relay_stale_s`` and the
members go on reading etcd themselves."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.store.etcd import EtcdClient
from elasticd.testing.localcluster import python_program
from elasticd.wire.keys import Keys
from tests.jobs import wait_until

pytestmark = pytest.mark.timeout(120)
T = Timeouts()


class Proc:
    def __init__(self, args: list[str], out: Path, env: dict[str, str] | None = None) -> None:
        self.out = out
        self.log = out.open("w")
        self.proc = subprocess.Popen(
            python_program(*args),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=os.environ | {"PYTHONPATH": "."} | (env or {}),
        )

    def text(self) -> str:
        return self.out.read_text()

    def generations(self) -> list[tuple[int, int]]:
        got = []
        for found in re.findall(r'\{"member": [^{}]*\}', self.text()):  # a log line of another thread may
            rec = json.loads(found)  # precede it on its line
            if "generation" in rec and "world" in rec:
                got.append((int(rec["generation"]), int(rec["world"])))
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.stop()


def _wait(cond, timeout: float, what: str, procs: list[Proc] | None = None) -> None:  # type: ignore[no-untyped-def]
    wait_until(cond, timeout, what, lambda: "\n".join(f"--- {p.out.name}\n{p.text()[-1500:]}" for p in procs or []))


def _start(etcd_server, procs: list[Proc], tmp_path: Path, job: str, n: int) -> tuple[Proc, list[Proc]]:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "relay.sock")
    relay = Proc(["tests/programs/relay_node.py", etcd_server.endpoint, job, "n0", path], tmp_path / "relay.out")
    procs.append(relay)
    _wait(lambda: '"relay"' in relay.text(), 30, "the relay to listen")
    members = [
        Proc(
            ["tests/programs/rdzv_member.py", etcd_server.endpoint, job, "n0", str(n - 1), str(n)],
            tmp_path / f"m{i}.out",
            {"ELASTICD_RELAY_SOCKET": path},
        )
        for i in range(n)
    ]
    procs.extend(members)
    return relay, members


def test_members_form_generations_and_see_a_leave_through_the_relay(
    etcd_server, procs: list[Proc], tmp_path: Path
) -> None:
    job = f"relay{time.monotonic_ns()}"
    relay, members = _start(etcd_server, procs, tmp_path, job, 3)
    _wait(lambda: all((1, 3) in m.generations() for m in members), 60, "generation 1 of 3", procs)
    # an etcd held by SIGSTOP: the relay's reads fail, the members' view reads fail with it (as their
    # own would), but the relay still beats, so no member leaves it
    etcd_server.signal(signal.SIGSTOP)
    try:
        time.sleep(T.relay_stale_s + 1.0)
    finally:
        etcd_server.signal(signal.SIGCONT)
    # a member leaves (SIGTERM: its lease is revoked): the others learn it from the relay
    victim = members[2]
    victim.proc.send_signal(signal.SIGTERM)
    victim.proc.wait(10)
    t0 = time.monotonic()
    _wait(lambda: all(any(w == 2 for _, w in m.generations()) for m in members[:2]), 30, "a generation of 2")
    assert time.monotonic() - t0 < T.lease_ttl_s  # not by the lease's end: a revoked lease, seen at once
    for m in members[:2]:
        assert "relay_lost" not in m.text() and "relay_unreachable" not in m.text(), m.text()[-2000:]
        assert "Traceback" not in m.text()
    assert "Traceback" not in relay.text()


def test_a_stopped_relay_is_left_within_relay_stale_s_and_the_members_read_etcd_themselves(
    etcd_server, procs: list[Proc], tmp_path: Path
) -> None:
    job = f"relaystop{time.monotonic_ns()}"
    relay, members = _start(etcd_server, procs, tmp_path, job, 3)
    _wait(lambda: all((1, 3) in m.generations() for m in members), 60, "generation 1 of 3", procs)
    os.kill(relay.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    _wait(lambda: all("relay_lost" in m.text() for m in members), T.relay_stale_s + 3, "the members to leave the relay")
    assert time.monotonic() - t0 <= T.relay_stale_s + 1.0
    # with the relay still stopped, a leave is seen straight from etcd
    members[0].proc.kill()  # SIGKILL, no agent to revoke: its lease ends after the TTL
    _wait(
        lambda: all(any(w == 2 for _, w in m.generations()) for m in members[1:]),
        T.lease_ttl_s + 15,
        "a generation of 2 without the relay",
    )
    store = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    try:
        assert store.get(Keys("/elasticd", job).generation) is not None
    finally:
        store.close()
    for m in members[1:]:
        assert "Traceback" not in m.text()


class _Counting:
    """The relay's etcd client, counting its batched writes (a real etcd behind it)."""

    def __init__(self, inner: EtcdClient) -> None:
        self._inner = inner
        self.batches: list[int] = []

    def put_many(self, items):  # type: ignore[no-untyped-def]
        self.batches.append(len(items))
        return self._inner.put_many(items)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self._inner, name)


def test_leased_puts_go_through_the_relay_in_batches_and_a_lost_lease_fails_only_its_own(
    etcd_server, tmp_path: Path
) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from elasticd.errors import LeaseLost
    from elasticd.relay.node import NodeRelay
    from elasticd.relay.store import RelayedStore

    keys = Keys("/elasticd", f"relayput{time.monotonic_ns()}")
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    counting = _Counting(client)
    relay = NodeRelay(counting, keys, "n0", str(tmp_path / "r.sock"), T)  # type: ignore[arg-type]
    relay.start()
    stores = [RelayedStore(client, keys, relay.path, T, RetryPolicy()) for _ in range(8)]
    try:
        leases = [client.grant_lease(T.lease_ttl_s) for _ in stores]
        client.revoke_lease(leases[3])  # member 3's lease is gone

        def put(i: int) -> int | str:
            try:
                return stores[i].put(keys.ready(f"n0.{i}.1"), f"ready {i}".encode(), lease=leases[i])
            except LeaseLost:
                return "lease lost"

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(put, range(8)))
        assert got[3] == "lease lost"
        for i in range(8):
            kv = client.get(keys.ready(f"n0.{i}.1"))
            if i == 3:
                assert kv is None
            else:
                assert kv is not None and kv.value == f"ready {i}".encode() and kv.lease == leases[i]
                assert kv.mod_revision == got[i]
        assert sum(counting.batches) >= 8 and max(counting.batches) > 1, counting.batches  # batched
        assert all(s.relayed for s in stores)
        # an unleased put, and a write to a watched key, go straight to etcd
        stores[0].put(keys.committed, b"{}")
        assert sum(counting.batches) < 8 + 8
    finally:
        for s in stores:
            s.close()
        relay.close()
        client.close()


def _relay_and_store(etcd_server, procs: list[Proc], tmp_path: Path, keys: Keys):  # type: ignore[no-untyped-def]
    """A relay process for ``keys``' job, and a worker's store in this process: (relay, etcd client, RelayedStore)."""
    from elasticd.relay.store import RelayedStore

    path = str(tmp_path / "relay.sock")
    relay = Proc(
        ["tests/programs/relay_node.py", etcd_server.endpoint, keys.job.rsplit("/", 1)[1], "n0", path],
        tmp_path / "relay.out",
    )
    procs.append(relay)
    _wait(lambda: '"relay"' in relay.text(), 30, "the relay to listen", procs)
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    return relay, client, RelayedStore(client, keys, path, T, RetryPolicy())


def test_a_put_queued_by_a_stopped_relay_never_lands_over_the_workers_own_newer_write(
    etcd_server, procs: list[Proc], tmp_path: Path
) -> None:
    """The relay is SIGSTOPped with a worker's put in its socket; the worker leaves it after
    relay_stale_s, writes that record and a newer one itself; when the relay continues, the queued
    put is dropped (the worker shut its end first), so the newer record stays."""
    keys = Keys("/elasticd", f"relaystale{time.monotonic_ns()}")
    relay, client, store = _relay_and_store(etcd_server, procs, tmp_path, keys)
    try:
        lease = client.grant_lease(30)
        key = keys.ready("n0.0.1")
        store.put(key, b"v0", lease=lease)  # through the relay
        assert store.relayed and client.get(key).value == b"v0"  # type: ignore[union-attr]
        os.kill(relay.proc.pid, signal.SIGSTOP)
        try:
            _wait(lambda: psutil.Process(relay.proc.pid).status() == psutil.STATUS_STOPPED, 5, "the relay stopped")
            t0 = time.monotonic()
            store.put(key, b"v1", lease=lease)  # queued in the stopped relay's socket; then directly
            assert not store.relayed and time.monotonic() - t0 <= T.relay_stale_s + 1.0
            store.put(key, b"v2", lease=lease)  # the worker's newer record
        finally:
            os.kill(relay.proc.pid, signal.SIGCONT)
        time.sleep(1.5)  # the relay runs again: its queued v1 must not land
        assert client.get(key).value == b"v2"  # type: ignore[union-attr]
    finally:
        store.close()
        client.close()


def test_after_its_own_write_a_member_whose_relay_is_stopped_reads_etcd_itself_within_a_heartbeat(
    etcd_server, procs: list[Proc], tmp_path: Path
) -> None:
    """A worker that publishes (its coordinator) or aborts writes a watched key directly, then reads
    its view, which must show that write. With its relay SIGSTOPped, it used to wait relay_stale_s
    for the relay to be declared lost (seen under chaos: a relayed coordinator learned its own
    generation 2 s late); now it reads etcd itself once after relay_heartbeat_s, and stays on the
    relay."""
    keys = Keys("/elasticd", f"relayown{time.monotonic_ns()}")
    relay, client, store = _relay_and_store(etcd_server, procs, tmp_path, keys)
    try:
        store.get_prefixes(keys.member_view)  # served by the relay
        assert store.relayed
        os.kill(relay.proc.pid, signal.SIGSTOP)
        try:
            _wait(lambda: psutil.Process(relay.proc.pid).status() == psutil.STATUS_STOPPED, 5, "the relay stopped")
            store.put(keys.abort, b"mine")  # not leased: straight to etcd, and a watched key
            t0 = time.monotonic()
            view = store.get_prefixes(keys.member_view)
            took = time.monotonic() - t0
        finally:
            os.kill(relay.proc.pid, signal.SIGCONT)
        assert any(kv.key == keys.abort and kv.value == b"mine" for kv in view), view
        assert took < T.relay_heartbeat_s + 0.5 < T.relay_stale_s, took
        assert store.relayed  # one read of its own; the relay was not given up
    finally:
        store.close()
        client.close()
