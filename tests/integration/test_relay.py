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
import threading
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
    """The relay's etcd client, counting its batched writes and its view reads (a real etcd behind it)."""

    def __init__(self, inner: EtcdClient) -> None:
        self._inner = inner
        self.batches: list[int] = []
        self.reads = 0

    def put_many(self, items):  # type: ignore[no-untyped-def]
        self.batches.append(len(items))
        return self._inner.put_many(items)

    def get_prefixes(self, prefixes):  # type: ignore[no-untyped-def]
        self.reads += 1
        return self._inner.get_prefixes(prefixes)

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
        leases = [s.grant_lease(T.lease_ttl_s) for s in stores]  # member leases of the relay
        stores[3].revoke_lease(leases[3])  # member 3's lease is gone

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
            else:  # under the node's one etcd lease
                assert kv is not None and kv.value == f"ready {i}".encode() and kv.lease == relay.node_lease
                assert kv.mod_revision == got[i]
        assert sum(counting.batches) >= 7 and max(counting.batches) > 1, counting.batches  # batched
        assert all(s.relayed for s in stores)
        # an unleased put, and a write to a watched key, go straight to etcd
        stores[0].put(keys.committed, b"{}")
        assert sum(counting.batches) < 7 + 8
        # a member lease revoked: its keys go at once, the others' stay
        stores[0].revoke_lease(leases[0])
        assert client.get(keys.ready("n0.0.1")) is None and client.get(keys.ready("n0.1.1")) is not None
        # the relay's end revokes the node's lease: every key still under it goes
    finally:
        for s in stores:
            s.close()
        relay.close()
    try:
        assert client.get(keys.ready("n0.1.1")) is None
    finally:
        client.close()


def test_a_relay_reads_etcd_on_a_change_not_on_its_heartbeats_and_its_view_stays_served(
    etcd_server, tmp_path: Path
) -> None:
    """With nothing changing the relay reads etcd only every view_poll_s; its heartbeats say the
    last read is still current, so a worker's view read is answered from it, with no etcd read. A
    change to a watched key is read at once and served; after the worker's own write its view holds
    that write."""
    from elasticd.relay.node import NodeRelay
    from elasticd.relay.store import RelayedStore

    t = Timeouts(view_poll_s=30.0)  # the safety net out of the way: every read here is a change's
    keys = Keys("/elasticd", f"relaybeat{time.monotonic_ns()}")
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), t, RetryPolicy())
    counting = _Counting(client)
    relay = NodeRelay(counting, keys, "n0", str(tmp_path / "r.sock"), t)  # type: ignore[arg-type]
    relay.start()
    own = _Counting(client)  # the worker's own etcd reads
    store = RelayedStore(own, keys, relay.path, t, RetryPolicy())  # type: ignore[arg-type]
    try:
        wait_until(lambda: counting.reads >= 1, 5.0, "the relay's first read", lambda: "")
        time.sleep(2 * t.relay_heartbeat_s)
        before = counting.reads
        time.sleep(4 * t.relay_heartbeat_s)  # older than 2 x relay_heartbeat_s, kept current by heartbeats
        view = store.get_prefixes(keys.member_view)
        assert counting.reads == before, "the relay read etcd with nothing changed"
        assert own.reads == 0, "the worker read etcd itself"
        assert not any(kv.key == keys.verdict for kv in view)
        client.put(keys.verdict, b"another member's write")  # a watched key: read at once
        wait_until(lambda: counting.reads == before + 1, 2.0, "the relay to read the change", lambda: "")
        wait_until(
            lambda: any(kv.key == keys.verdict for kv in store.get_prefixes(keys.member_view)),
            2.0,
            "the change served",
            lambda: "",
        )
        store.put(keys.abort, b"my own write")
        assert any(kv.key == keys.abort and kv.value == b"my own write" for kv in store.get_prefixes(keys.member_view))
        assert store.relayed
    finally:
        store.close()
        relay.close()
        client.close()


class _CountingCompares(_Counting):
    """... and its compare-and-puts."""

    def __init__(self, inner: EtcdClient) -> None:
        super().__init__(inner)
        self.compares = 0

    def compare_and_put(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.compares += 1
        return self._inner.compare_and_put(*args, **kwargs)


def test_a_nodes_workers_campaign_for_the_seat_at_once_one_wins_and_the_losers_read_on_from_the_relay(
    etcd_server, tmp_path: Path
) -> None:
    """Eight workers of a node campaign for the coordinator's seat on one view, as at a job's start:
    exactly one wins and the seat holds its record; the relay sends the campaigns queued together
    to etcd as one (the rest fail as they would right after it); a loser wrote nothing, so its next
    view read is served by the relay, not read from etcd by the worker itself."""
    from elasticd.relay.node import NodeRelay
    from elasticd.relay.store import RelayedStore

    keys = Keys("/elasticd", f"relayseat{time.monotonic_ns()}")
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    relay_side = _CountingCompares(client)
    relay = NodeRelay(relay_side, keys, "n0", str(tmp_path / "r.sock"), T)  # type: ignore[arg-type]
    relay.start()
    owns = [_Counting(client) for _ in range(8)]
    stores = [RelayedStore(own, keys, relay.path, T, RetryPolicy()) for own in owns]  # type: ignore[arg-type]
    try:
        leases = [s.grant_lease(T.lease_ttl_s) for s in stores]
        for s in stores:
            s.get_prefixes(keys.member_view)
        go, won = threading.Barrier(len(stores)), [False] * len(stores)

        def campaign(i: int) -> None:
            go.wait(10)
            won[i] = stores[i].compare_and_put(keys.coordinator, 0, f"worker{i}".encode(), lease=leases[i])

        threads = [threading.Thread(target=campaign, args=(i,)) for i in range(len(stores))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert sum(won) == 1, won
        held = client.get(keys.coordinator)
        assert held is not None and held.value == f"worker{won.index(True)}".encode()
        assert 1 <= relay_side.compares <= len(stores)
        for i, s in enumerate(stores):
            if not won[i]:  # the seat's watch event reaches the relay within milliseconds
                wait_until(
                    lambda s=s: any(kv.key == keys.coordinator for kv in s.get_prefixes(keys.member_view)),
                    2.0,
                    f"worker {i}'s view to show the seat",
                    lambda: "",
                )
                assert owns[i].reads == 0, f"a losing worker {i} read etcd itself"
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
        lease = store.grant_lease(T.lease_ttl_s)  # a member lease of the relay
        key = keys.ready("n0.0.1")
        store.put(key, b"v0", lease=lease)  # through the relay
        assert store.relayed and client.get(key).value == b"v0"  # type: ignore[union-attr]
        os.kill(relay.proc.pid, signal.SIGSTOP)
        try:
            _wait(lambda: psutil.Process(relay.proc.pid).status() == psutil.STATUS_STOPPED, 5, "the relay stopped")
            node_lease = client.get(key).lease  # type: ignore[union-attr]
            t0 = time.monotonic()
            # queued in the stopped relay's socket; the relay is left, the member's records move
            # to an etcd lease of its own, and the put is made directly under it
            store.put(key, b"v1", lease=lease)
            assert not store.relayed and time.monotonic() - t0 <= T.relay_stale_s + 1.0
            moved = client.get(key)
            assert moved is not None and moved.value == b"v1" and moved.lease not in (0, node_lease)
            assert store.refresh_lease(lease) > 0  # the member lease lives on, as the etcd lease it moved to
            store.put(key, b"v2", lease=lease)  # the worker's newer record
        finally:
            os.kill(relay.proc.pid, signal.SIGCONT)
        # the relay runs again: its queued v1 must not land, and its end of the member lease (the
        # worker's connection closed) must not delete the worker's record, now under its own lease
        time.sleep(1.5)
        kv = client.get(key)
        assert kv is not None and kv.value == b"v2" and kv.lease == moved.lease
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


def _leases_of(client: EtcdClient, keys: Keys) -> dict[str, int]:
    """key -> lease of every member, ready and progress record and the coordinator's seat."""
    rows = client.get_prefixes((keys.member(""), keys.ready(""), keys.progress(""), keys.coordinator))
    return {kv.key: kv.lease for kv in rows}


def test_one_etcd_lease_holds_a_node_a_killed_member_goes_at_once_a_stopped_one_after_the_ttl(
    etcd_server, procs: list[Proc], tmp_path: Path
) -> None:
    """Three members behind one relay hold one etcd lease between them, the relay's. The coordinator
    SIGKILLed: its member record and its seat are deleted as soon as its connection closes. A member
    SIGSTOPped: its records stay for lease_ttl_s, then go (its member lease ended, not renewed);
    SIGCONTed, it registers again under a new member lease of the relay."""
    from elasticd.wire.records import CoordinatorRecord, decode

    job = f"nodelease{time.monotonic_ns()}"
    keys = Keys("/elasticd", job)
    relay, members = _start(etcd_server, procs, tmp_path, job, 3)
    _wait(lambda: all((1, 3) in m.generations() for m in members), 60, "generation 1 of 3", procs)
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    try:
        held = _leases_of(client, keys)
        assert len({keys.member(f"n0.0.{m.proc.pid}") for m in members} & held.keys()) == 3
        assert keys.coordinator in held
        (node_lease,) = set(held.values())  # one lease for the node
        assert node_lease != 0

        seat = decode(CoordinatorRecord, client.get(keys.coordinator).value)  # type: ignore[union-attr]
        victim = next(m for m in members if seat.member_id == f"n0.0.{m.proc.pid}")
        victim.proc.kill()
        t0 = time.monotonic()

        def seat_gone() -> bool:  # deleted (another member may hold it again by now)
            kv = client.get(keys.coordinator)
            return kv is None or decode(CoordinatorRecord, kv.value).member_id != seat.member_id

        _wait(
            lambda: client.get(keys.member(seat.member_id)) is None and seat_gone(),
            T.lease_ttl_s + 2,
            "the killed coordinator's records to go",
        )
        assert time.monotonic() - t0 < T.lease_ttl_s / 2  # by its closed connection, not a lease's end
        rest = [m for m in members if m is not victim]
        _wait(lambda: all(any(w == 2 for _, w in m.generations()) for m in rest), 30, "a generation of 2", procs)

        stopped = rest[1]
        sid = keys.member(f"n0.0.{stopped.proc.pid}")
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            time.sleep(T.lease_ttl_s - 1.0)
            assert client.get(sid) is not None  # within the TTL: still a member
            _wait(lambda: client.get(sid) is None, 3.0, "the stopped member's record to go")
            took = time.monotonic() - t0
            assert T.lease_ttl_s - 1.0 <= took <= T.lease_ttl_s + 1.0, took
            assert client.get(keys.member(f"n0.0.{rest[0].proc.pid}")) is not None  # the others' stay
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        _wait(lambda: _leases_of(client, keys).get(sid) == node_lease, 15, "the stopped member registered again")
        assert stopped.text().count("member_registered") == 2  # under a new member lease
        for m in rest:
            assert "relay_lost" not in m.text() and "Traceback" not in m.text(), m.text()[-2000:]
        assert "Traceback" not in relay.text()
    finally:
        client.close()


def test_a_killed_relay_takes_its_node_lease_away_and_its_members_move_to_leases_of_their_own(
    etcd_server, procs: list[Proc], tmp_path: Path
) -> None:
    """The relay (its agent) SIGKILLed: its members leave it at once (the socket closed) and move
    their records to etcd leases of their own before the node's lease ends (after lease_ttl_s), so
    no record vanishes and the generation goes on: no regroup."""
    job = f"relaykill{time.monotonic_ns()}"
    keys = Keys("/elasticd", job)
    relay, members = _start(etcd_server, procs, tmp_path, job, 3)
    _wait(lambda: all(m.generations() and m.generations()[-1][1] == 3 for m in members), 60, "a generation of 3", procs)
    before = [m.generations() for m in members]
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    try:
        (node_lease,) = set(_leases_of(client, keys).values())
        relay.proc.kill()
        t0 = time.monotonic()
        _wait(lambda: all("relay_lost" in m.text() for m in members), T.relay_stale_s + 3, "the members to leave")
        assert time.monotonic() - t0 <= 1.0  # the socket closed: not by relay_stale_s
        mids = [keys.member(f"n0.0.{m.proc.pid}") for m in members]

        def own_leases() -> bool:
            held = _leases_of(client, keys)
            mine = [held.get(k, 0) for k in mids]
            return 0 not in mine and node_lease not in mine and len(set(mine)) == 3

        _wait(own_leases, T.lease_ttl_s + 15, "each member under a lease of its own", procs)
        _wait(
            lambda: node_lease not in _leases_of(client, keys).values(),
            max(0.0, t0 + T.lease_ttl_s + 2.0 - time.monotonic()),
            "the node lease's records to end with it",
        )
        time.sleep(1.0)
        for m in members:
            assert m.generations() == before[members.index(m)], m.text()[-2000:]  # no regroup
            assert "member_lease_moved" in m.text() and "member_registered" not in m.text().split("relay_lost")[1]
            assert "Traceback" not in m.text(), m.text()[-2000:]
    finally:
        client.close()


def test_the_agent_releases_a_members_lease_and_only_its_records_go(etcd_server, tmp_path: Path) -> None:
    """The agent saw a worker stopped past stopped_worker_s (or dead): ``release_members`` ends its
    member lease and deletes its records, in order after its queued puts; its renewal then answers 0
    and its puts fail as a lost lease's would. Another member's records, and a seat the released
    member no longer holds, stay."""
    from elasticd.errors import LeaseLost
    from elasticd.relay.node import NodeRelay
    from elasticd.relay.store import RelayedStore

    keys = Keys("/elasticd", f"relayrelease{time.monotonic_ns()}")
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    relay = NodeRelay(client, keys, "n0", str(tmp_path / "r.sock"), T)
    relay.start()
    a, b = (RelayedStore(client, keys, relay.path, T, RetryPolicy()) for _ in range(2))
    try:
        la, lb = a.grant_lease(T.lease_ttl_s), b.grant_lease(T.lease_ttl_s)
        a.put(keys.member("n0.0.1"), b"a", lease=la)
        a.put(keys.progress("n0.0.1"), b"a's progress", lease=la)
        assert a.compare_and_put(keys.coordinator, 0, b"seat of a", lease=la)
        assert not b.compare_and_put(keys.coordinator, 0, b"seat of b", lease=lb)  # a holds it
        b.put(keys.member("n0.1.1"), b"b", lease=lb)
        seat = client.get(keys.coordinator)
        assert seat is not None and seat.lease == relay.node_lease
        # b takes the seat over: a's end must not delete it
        assert b.compare_and_put(keys.coordinator, seat.mod_revision, b"seat of b", lease=lb)
        assert relay.release_members(["n0.0.1"], T.etcd_request_s)
        assert client.get(keys.member("n0.0.1")) is None and client.get(keys.progress("n0.0.1")) is None
        assert client.get(keys.member("n0.1.1")) is not None
        assert client.get(keys.coordinator).value == b"seat of b"  # type: ignore[union-attr]
        assert a.refresh_lease(la) == 0.0 and b.refresh_lease(lb) > 0
        with pytest.raises(LeaseLost):
            a.put(keys.ready("n0.0.1"), b"late", lease=la)
        assert client.get(keys.ready("n0.0.1")) is None
        # b's connection closes (its process ended): its records and its seat go at once
        b.close()
        wait_until(lambda: client.get(keys.coordinator) is None, 2.0, "b's seat to go", lambda: "")
        assert client.get(keys.member("n0.1.1")) is None
    finally:
        a.close()
        b.close()
        relay.close()
        client.close()


def test_a_relay_on_its_agents_lease_follows_that_lease_and_never_revokes_it(etcd_server, tmp_path: Path) -> None:
    """Under an agent the relay holds its workers' records under the agent's own node lease (its node
    record's): one etcd lease for the node. When the agent's lease ends and it holds a new one, the
    relay's member leases end with the old one (their renewals answer 0, so the workers register
    again under the new one); the relay's close leaves the agent's lease alone."""
    from elasticd.relay.node import NodeRelay
    from elasticd.relay.store import RelayedStore

    keys = Keys("/elasticd", f"relayborrow{time.monotonic_ns()}")
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    agent_lease = [client.grant_lease(T.lease_ttl_s), True]
    client.put(keys.node("n0"), b"the node record", lease=agent_lease[0])  # type: ignore[arg-type]

    def renew_agent_lease() -> None:  # as the agent's presence thread does
        while not stop.wait(T.keepalive_s):
            client.refresh_lease(agent_lease[0])  # type: ignore[arg-type]

    stop = threading.Event()
    renewer = threading.Thread(target=renew_agent_lease, daemon=True)
    renewer.start()
    relay = NodeRelay(client, keys, "n0", str(tmp_path / "r.sock"), T, node_lease=lambda: tuple(agent_lease))  # type: ignore[arg-type,return-value]
    relay.start()
    store = RelayedStore(client, keys, relay.path, T, RetryPolicy())
    try:
        lease = store.grant_lease(T.lease_ttl_s)
        store.put(keys.member("n0.0.1"), b"m", lease=lease)
        kv = client.get(keys.member("n0.0.1"))
        assert kv is not None and kv.lease == agent_lease[0] == relay.node_lease
        # the agent's lease ends; it holds a new one
        stop.set()
        renewer.join(5)
        client.revoke_lease(agent_lease[0])  # type: ignore[arg-type]
        agent_lease[0] = client.grant_lease(T.lease_ttl_s)
        wait_until(lambda: store.refresh_lease(lease) == 0.0, T.keepalive_s * 3, "the member lease to end", lambda: "")
        again = store.grant_lease(T.lease_ttl_s)
        store.put(keys.member("n0.0.1"), b"m", lease=again)
        assert client.get(keys.member("n0.0.1")).lease == agent_lease[0]  # type: ignore[union-attr]
    finally:
        store.close()
        relay.close()
    try:
        assert client.refresh_lease(agent_lease[0]) > 0  # type: ignore[arg-type]  # not the relay's to revoke
    finally:
        client.close()
