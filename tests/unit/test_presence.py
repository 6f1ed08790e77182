"""The claim of a node id (``presence.decide_claim`` and ``NodePresence.claim``).

The decision is a table on hand-built records and a fixed waiting time; the executor runs against
the fake store (``tests/fakes.py``), whose leases run on a manual clock that the test's ``wait``
moves, so a whole lease TTL of waiting takes no real time.
"""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from elasticd.agent.presence import (
    CLAIM_MARGIN_S,
    ClaimKind,
    NodePresence,
    decide_claim,
    describe_holder,
    wait_began,
)
from elasticd.config import Timeouts
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.ops import NodeRecord, decode_node, encode_node
from tests.fakes import FakeKeyValueStore, ManualClock

pytestmark = pytest.mark.timeout(60)

KEYS = Keys("/elasticd", "job")
SINCE = 1_700_000_000.0  # 2023-11-14T22:13:20Z
TTL = 3.0


def record(pid: int = 4242, host: str = "10.0.0.9", since: float | None = SINCE) -> NodeRecord:
    return NodeRecord(node="a", host=host, agent_pid=pid, state="running", time=SINCE + 60, workers=(), since=since)


def held(lease: int, value: bytes | None = None) -> KeyValue:
    return KeyValue(KEYS.node("a"), encode_node(record()) if value is None else value, 7, 5, lease)


@pytest.mark.parametrize(
    ("row", "mine", "waited_s", "kind"),
    [
        (None, 0, 0.0, ClaimKind.CLAIM),  # free: claim it
        (None, 0x10, 99.0, ClaimKind.CLAIM),  # free however long we waited
        (held(0x10), 0x10, 0.0, ClaimKind.CLAIMED),  # under my lease: my claim's reply was lost
        (held(0x20), 0x10, 0.0, ClaimKind.WAIT),  # another lease: maybe a crashed agent of this node
        (held(0x20), 0, TTL + CLAIM_MARGIN_S - 0.01, ClaimKind.WAIT),  # not yet a whole TTL + margin
        (held(0x20), 0x10, TTL + CLAIM_MARGIN_S, ClaimKind.REFUSE),  # renewed that long: alive
        (held(0), 0, 0.0, ClaimKind.REFUSE),  # under no lease: never expires, waiting is no use
        (held(0x20, b"not json"), 0, 0.0, ClaimKind.WAIT),  # garbage under a lease still holds the id
        (held(0x20, b"not json"), 0, 60.0, ClaimKind.REFUSE),
    ],
    ids=[
        "free",
        "free after waiting",
        "mine",
        "held: wait",
        "held: still wait",
        "held past the bound",
        "unleased",
        "garbage: wait",
        "garbage: refuse",
    ],
)
def test_decide_claim(row: KeyValue | None, mine: int, waited_s: float, kind: ClaimKind) -> None:
    assert decide_claim(row, mine, waited_s, TTL).kind is kind


def test_a_refusal_names_the_other_agents_host_pid_and_since_when() -> None:
    reason = decide_claim(held(0x20), 0, 10.0, TTL).reason
    assert "pid 4242 on host 10.0.0.9, since 2023-11-14T22:13:20Z" in reason
    assert "still renewed after 10.0 s" in reason
    assert "since before" in describe_holder(KeyValue(KEYS.node("a"), encode_node(record(since=None)), 1, 1, 2))


class Waits:
    """The claim's ``wait``: moves the manual clock (and the store's leases with it), keeping
    ``renewed`` leases alive as a live agent would."""

    def __init__(self, store: FakeKeyValueStore, *renewed: int) -> None:
        self.store, self.renewed, self.total = store, list(renewed), 0.0

    def __call__(self, seconds: float) -> None:
        assert 0 < seconds <= 1.0, seconds  # bounded: at most keepalive_s
        self.store.clock.advance(seconds)
        self.total += seconds
        for lease in self.renewed:
            self.store.refresh_lease(lease)


def _presence(store: FakeKeyValueStore) -> NodePresence:
    return NodePresence(
        store,
        KEYS,
        "a",
        Timeouts(lease_ttl_s=TTL, keepalive_s=1.0),
        stats_interval_s=60,
        events_keep=10,
        on_drain=lambda _: None,
        clock=store.clock,
    )


def _other_agent(store: FakeKeyValueStore) -> int:
    lease = store.grant_lease(TTL)
    assert store.compare_and_put(KEYS.node("a"), 0, encode_node(record(pid=1111)), lease=lease)
    return lease


def test_a_free_node_id_is_claimed_under_a_lease_at_once() -> None:
    store = FakeKeyValueStore(ManualClock())
    wait = Waits(store)
    decision = _presence(store).claim(record(pid=2222), wait, lambda: False, "job")
    assert decision.kind is ClaimKind.CLAIMED and wait.total == 0
    kv = store.get(KEYS.node("a"))
    assert kv is not None and kv.lease and decode_node(kv.value).agent_pid == 2222


def test_a_node_id_held_by_a_live_agent_is_refused_after_a_lease_ttl_and_left_alone() -> None:
    store = FakeKeyValueStore(ManualClock())
    other = _other_agent(store)
    before = store.get(KEYS.node("a"))
    wait = Waits(store, other)
    decision = _presence(store).claim(record(pid=2222), wait, lambda: False, "job")
    assert decision.kind is ClaimKind.REFUSE
    assert TTL + CLAIM_MARGIN_S <= wait.total <= TTL + CLAIM_MARGIN_S + 0.001
    assert decision.reason.startswith(
        "node_id_taken: node id 'a' of job 'job' (/elasticd/job/nodes/a): it is "
        "held by the elasticd agent pid 1111 on host 10.0.0.9"
    )
    assert store.get(KEYS.node("a")) == before  # untouched, still under the other agent's lease


def test_the_record_of_a_crashed_agent_is_waited_out_and_then_claimed() -> None:
    store = FakeKeyValueStore(ManualClock())
    _other_agent(store)  # nobody renews it: it expires after TTL
    wait = Waits(store)
    decision = _presence(store).claim(record(pid=2222), wait, lambda: False, "job")
    assert decision.kind is ClaimKind.CLAIMED
    assert TTL <= wait.total < TTL + CLAIM_MARGIN_S
    kv = store.get(KEYS.node("a"))
    assert kv is not None and decode_node(kv.value).agent_pid == 2222


def test_a_stop_request_ends_the_wait_without_claiming() -> None:
    store = FakeKeyValueStore(ManualClock())
    other = _other_agent(store)
    decision = _presence(store).claim(record(pid=2222), Waits(store, other), lambda: True, "job")
    assert decision.kind is ClaimKind.WAIT
    kv = store.get(KEYS.node("a"))
    assert kv is not None and kv.lease == other


def test_after_losing_its_lease_an_agent_does_not_overwrite_a_node_id_claimed_meanwhile() -> None:
    store = FakeKeyValueStore(ManualClock())
    p = _presence(store)
    assert p.claim(record(pid=2222), Waits(store), lambda: False).kind is ClaimKind.CLAIMED
    store.clock.advance(TTL + 1)  # as if etcd were away longer than the TTL: the lease is gone
    assert store.get(KEYS.node("a")) is None
    other = _other_agent(store)
    with capture_logs() as logs:
        p.start()  # its first round finds the lease gone, grants another, and tries to create the record
        try:
            p.update(record(pid=2222, host="10.0.0.1"))  # a change the thread would write
            deadline = time.monotonic() + 10
            while not any(e["event"] == "node_record_taken" for e in logs) and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            p.close(5)
    taken = [e for e in logs if e["event"] == "node_record_taken"]
    assert len(taken) == 1 and "pid 1111" in str(taken[0]["holder"]), logs
    kv = store.get(KEYS.node("a"))
    assert kv is not None and kv.lease == other and decode_node(kv.value).agent_pid == 1111


@pytest.mark.parametrize(
    ("began", "seen", "term", "now", "want"),
    [
        (10.0, 0, 5, 11.0, (10.0, 5)),  # the first term seen: the wait goes on from when it began
        (10.0, 5, 5, 12.0, (10.0, 5)),  # the same leader
        (10.0, 5, 4, 12.0, (10.0, 5)),  # an answer from a member that lags: nothing new
        (10.0, 5, 6, 12.5, (12.5, 6)),  # a new leader refreshed the holder's lease: wait anew
        (10.0, 0, 0, 12.0, (10.0, 0)),  # a store that tells no term
    ],
)
def test_a_new_etcd_leader_restarts_the_wait(
    began: float, seen: int, term: int, now: float, want: tuple[float, int]
) -> None:
    assert wait_began(began, seen, term, now) == want


class LeaderChanges(Waits):
    """``Waits`` that also has etcd elect a new leader (which refreshes every lease) at the given
    moments of the wait."""

    def __init__(self, store: FakeKeyValueStore, at: list[float]) -> None:
        super().__init__(store)
        self.at = sorted(at)

    def __call__(self, seconds: float) -> None:
        super().__call__(seconds)
        while self.at and self.total >= self.at[0]:
            self.at.pop(0)
            self.store.new_leader()


def test_a_crashed_agents_record_kept_alive_by_etcd_elections_is_still_waited_out_and_claimed() -> None:
    # Each new leader refreshes the dead agent's lease to a full TTL: at 2 s and 4 s of the wait it
    # lives until 7 s, past the bound TTL + margin (5 s) counted from the start. The chaos run found
    # a replacement agent refused its own node id this way (exit 2, which systemd does not restart).
    store = FakeKeyValueStore(ManualClock())
    _other_agent(store)  # nobody renews it
    wait = LeaderChanges(store, [2.0, 4.0])
    with capture_logs() as logs:
        decision = _presence(store).claim(record(pid=2222), wait, lambda: False, "job")
    assert decision.kind is ClaimKind.CLAIMED, decision.reason
    assert 4.0 + TTL <= wait.total < 4.0 + TTL + CLAIM_MARGIN_S
    assert sum(1 for e in logs if e["event"] == "node_id_wait_restarted") == 2
    kv = store.get(KEYS.node("a"))
    assert kv is not None and decode_node(kv.value).agent_pid == 2222


def test_a_live_agent_is_still_refused_across_an_etcd_election() -> None:
    store = FakeKeyValueStore(ManualClock())
    other = _other_agent(store)
    wait = LeaderChanges(store, [1.0])
    wait.renewed = [other]  # its agent renews it
    decision = _presence(store).claim(record(pid=2222), wait, lambda: False, "job")
    assert decision.kind is ClaimKind.REFUSE
    assert 1.0 + TTL + CLAIM_MARGIN_S <= wait.total <= 1.0 + TTL + CLAIM_MARGIN_S + 1.0
