"""The node relay's write loop on an in-memory store (its threads not started): compare-and-puts
of one key and expected revision queued together go to the store as one, and the first of them
alone can win; anything else queued behind them is written after, in order."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from elasticd.config import Timeouts
from elasticd.relay.messages import HEADER, LeaseOp, LeaseRequest, MessageReader, PutRequest, Reply
from elasticd.relay.node import NodeRelay, _Client
from elasticd.wire.keys import Keys
from tests.fakes import FakeKeyValueStore

KEYS = Keys("/elasticd", "j")


class _Store(FakeKeyValueStore):
    def __init__(self) -> None:
        super().__init__()
        self.compares: list[str] = []
        self.puts: list[list[str]] = []

    def compare_and_put(self, key, expected_mod_revision, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.compares.append(key)
        return super().compare_and_put(key, expected_mod_revision, value, *args, **kwargs)

    def put_many(self, items):  # type: ignore[no-untyped-def]
        self.puts.append([k for k, _, _ in items])
        return super().put_many(items)


@pytest.fixture
def workers() -> Iterator[list[tuple[_Client, socket.socket]]]:
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        yield [(_Client(mine), theirs) for mine, theirs in pairs]
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def _replies(sock: socket.socket) -> list[Reply]:
    out, reader = [], MessageReader()
    select.select([sock], [], [], 2.0)  # the reply is sent just after the store's answer
    sock.setblocking(False)
    data = b""
    try:
        while True:
            data += sock.recv(65536)
    except BlockingIOError:
        pass
    while data:
        (n,) = HEADER.unpack_from(data)
        message = reader.decode(data[HEADER.size : HEADER.size + n])
        assert isinstance(message, Reply)
        out.append(message)
        data = data[HEADER.size + n :]
    return out


def _relay(store: _Store, workers: list[tuple[_Client, socket.socket]]) -> tuple[NodeRelay, list[int]]:
    relay = NodeRelay(store, KEYS, "n0", "/nonexistent", Timeouts())
    relay.node_lease, relay._node_ok = store.grant_lease(3.0), True
    leases = []
    for client, _ in workers:
        leases.append(relay._answer_lease(client, LeaseRequest(1, LeaseOp.GRANT)).revision)
    return relay, leases


def test_campaigns_queued_together_are_one_compare_and_the_first_alone_wins(
    workers: list[tuple[_Client, socket.socket]],
) -> None:
    store = _Store()
    relay, leases = _relay(store, workers)
    seat = KEYS.coordinator
    for i, (client, _) in enumerate(workers[:3]):
        relay._puts.put((client, PutRequest(10 + i, seat, f"w{i}".encode(), leases[i], expected=0)))
    later = workers[3][0], PutRequest(20, KEYS.member("w3"), b"rec", leases[3])
    relay._puts.put(later)

    relay._write_from(relay._puts.get_nowait())
    assert store.compares == [seat]  # one compare for three campaigns
    assert [r.revision for _, theirs in workers[:3] for r in _replies(theirs)] == [1, 0, 0]
    kv = store.get(seat)
    assert kv is not None and kv.value == b"w0" and kv.lease == relay.node_lease
    assert relay._carry is not None and relay._carry[1] is later[1]  # the put behind them waits its turn

    relay._write_from(relay._carry)
    assert store.puts == [[KEYS.member("w3")]]
    assert [r.revision > 0 for r in _replies(workers[3][1])] == [True]


def test_a_campaign_with_another_expected_revision_is_not_joined_to_them(
    workers: list[tuple[_Client, socket.socket]],
) -> None:
    store = _Store()
    relay, leases = _relay(store, workers)
    seat = KEYS.coordinator
    relay._puts.put((workers[0][0], PutRequest(1, seat, b"w0", leases[0], expected=0)))
    relay._puts.put((workers[1][0], PutRequest(2, seat, b"w1", leases[1], expected=5)))
    relay._write_from(relay._puts.get_nowait())
    assert store.compares == [seat]
    assert relay._carry is not None and relay._carry[1].expected == 5
    relay._write_from(relay._carry)
    assert store.compares == [seat, seat]  # its own compare (and it fails: the revision is not 5)
    assert [r.revision for r in _replies(workers[1][1])] == [0]


def test_a_nodes_progress_records_go_in_one_transaction_a_keepalive_after_the_first_and_the_rest_at_once(
    workers: list[tuple[_Client, socket.socket]],
) -> None:
    store = _Store()
    relay, leases = _relay(store, workers)
    t = Timeouts()
    loop = threading.Thread(target=relay._write_loop, daemon=True)
    loop.start()
    try:
        began = time.monotonic()
        for i, (client, _) in enumerate(workers[:3]):
            relay._puts.put((client, PutRequest(i + 1, KEYS.progress(f"w{i}"), b"p", leases[i])))
            time.sleep(0.05)  # each worker at a time of its own
        relay._puts.put((workers[3][0], PutRequest(9, KEYS.member("w3"), b"rec", leases[3])))
        deadline = time.monotonic() + 5
        while len(store.puts) < 2:
            assert time.monotonic() < deadline, store.puts
            time.sleep(0.01)
        took = time.monotonic() - began
        assert store.puts == [[KEYS.member("w3")], [KEYS.progress(f"w{i}") for i in range(3)]]
        assert t.keepalive_s <= took < t.keepalive_s + 1.0
        for i in range(3):
            assert [r.revision > 0 and not r.error for r in _replies(workers[i][1])] == [True]
    finally:
        relay._stop.set()
        loop.join(5)
