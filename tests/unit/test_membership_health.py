"""The watch thread's health check against views read around a join (fake store, no threads
started): a read that crossed the join must not abandon the generation just joined; a member lost
is learned from the coordinator's verdict."""

from __future__ import annotations

from elasticd.config import Timeouts, WorldConfig
from elasticd.rendezvous.membership import Membership
from elasticd.retry import Deadline
from elasticd.wire.keys import Keys
from elasticd.wire.records import CoordinatorRecord, GenerationRecord, MemberRecord, encode
from tests.fakes import FakeKeyValueStore, ManualClock

KEYS = Keys("/elasticd", "j")


def _member(store: FakeKeyValueStore, name: str) -> Membership:
    rec = MemberRecord(member_id=name, node="n", local_rank=0, pid=1, host="127.0.0.1", store_port=1, signature="s")
    lease = store.grant_lease(10)
    store.put(KEYS.member(name), encode(rec), lease=lease)
    return Membership(store, KEYS, rec, WorldConfig(job_id="j", min_workers=1), Timeouts())


def _publish(store: FakeKeyValueStore, generation: int, members: tuple[str, ...]) -> GenerationRecord:
    rec = GenerationRecord(
        generation=generation,
        members=members,
        store_host="127.0.0.1",
        store_port=1,
        signature="s",
        committed_step=0,
        reason="join",
    )
    store.put(KEYS.generation, encode(rec))
    return rec


def test_a_snapshot_read_before_the_join_does_not_abandon_the_new_generation() -> None:
    store = FakeKeyValueStore(ManualClock())
    a = _member(store, "a")
    _member(store, "b")
    _publish(store, 5, ("a",))
    before = a.view()  # the watch thread's read, under way while the join happens
    g6 = _publish(store, 6, ("a", "b"))
    a._joined(g6, 0.0, a.view())
    a._watch.assess(before)  # ... and applied after it
    assert not a.must_abandon(), a.abandon_reason
    _publish(store, 7, ("b",))
    a._watch.assess(a.view())  # a newer generation: this one is superseded
    assert a.must_abandon() and a.abandon_reason == "generation superseded"


def test_a_current_snapshot_that_lost_a_member_abandons() -> None:
    store = FakeKeyValueStore(ManualClock())
    a = _member(store, "a")
    _member(store, "b")
    g = _publish(store, 3, ("a", "b"))
    a._joined(g, 0.0, a.view())
    store.delete(KEYS.member("b"))
    a._watch.assess(a.view())
    assert not a.must_abandon()  # nobody has judged it yet: a member never reads the others' records
    store.put(KEYS.coordinator, encode(CoordinatorRecord("a", "n")))
    a._new_coordinator(elected=True).round()  # the coordinator writes its verdict
    a._watch.assess(a.view())
    assert a.must_abandon() and "b" in a.abandon_reason


def test_a_lease_lost_again_while_re_registering_is_retried_in_the_join() -> None:
    """On an overloaded host the lease granted anew can expire before the ready record is written:
    the join tries again (bounded by its deadline) instead of letting ``LeaseLost`` escape."""
    from elasticd.errors import LeaseLost
    from elasticd.retry import Deadline

    class Flaky(FakeKeyValueStore):
        fails = 3

        def put(self, key: str, value: bytes, lease: int = 0) -> int:
            if "/ready/" in key and self.fails:
                self.fails -= 1
                raise LeaseLost("put: the lease no longer exists")
            return super().put(key, value, lease)

    store = Flaky(ManualClock())
    rec = MemberRecord(member_id="a", node="n", local_rank=0, pid=1, host="127.0.0.1", store_port=1, signature="s")
    m = Membership(
        store,
        KEYS,
        rec,
        WorldConfig(job_id="j", min_workers=1),
        Timeouts(keepalive_s=0.01, join_window_s=0.01, last_call_s=0.01),
    )
    m._register()
    joined = m.join(-1, Deadline.after(10))
    assert joined.generation == 1 and store.fails == 0


def test_a_generation_that_superseded_mine_and_takes_me_is_joined_without_a_ready_record() -> None:
    """A leave in one round (rendezvous.survivors): the survivors' generation is seen by the watch,
    which does not fence this member (the generation cannot train without it), and the join takes
    it from that view at once, writing nothing. The view is used once: a join that begins later
    reads the job as usual."""
    store = FakeKeyValueStore(ManualClock())
    a = _member(store, "a")
    _member(store, "b")
    _member(store, "c")
    g3 = _publish(store, 3, ("a", "b", "c"))
    a._joined(g3, 0.0, a.view())
    _publish(store, 4, ("a", "c"))  # b's lease was revoked: the survivors, in their old order
    a._watch.assess(a.view())
    assert a.must_abandon() and a.abandon_reason == "generation superseded" and not a.veto()  # no veto
    joined = a.join(0, Deadline.after(1.0))
    assert (joined.record.generation, joined.rank, joined.world_size) == (4, 0, 2)
    assert store.get(KEYS.ready("a")) is None
    assert a._watch.superseded_in is None  # entered: nothing left to act on
    _publish(store, 5, ("c",))  # without a: fenced, and the view is dropped when a join begins
    a._watch.assess(a.view())
    assert a._watch.fenced and a._watch.superseded_in is not None
    a._watch.leave()
    assert a._watch.superseded_in is None
