"""The rendezvous coordinator against a real etcd, with lightweight member processes (no torch):
elected once, failed over when it is SIGKILLed during a join round (the round completes within
the lease TTL + 1 s), and members that never read each other's records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.store.etcd import EtcdClient
from elasticd.testing.localcluster import python_program
from elasticd.wire.keys import Keys
from elasticd.wire.ops import decode_event
from elasticd.wire.records import AbortRecord, CoordinatorRecord, decode, decode_generation, encode

pytestmark = pytest.mark.timeout(120)
TTL_S = Timeouts().lease_ttl_s


class Member:
    def __init__(
        self, endpoint: str, job: str, node: str, out: Path, min_workers: int, max_workers: int, grace_s: float
    ) -> None:
        self.out = out
        self.log = out.open("w")
        # its log lines (stderr) apart from its generation lines (stdout): the coordinator's
        # thread logs while the main thread prints
        self.err = out.with_suffix(".log").open("w")
        self.proc = subprocess.Popen(
            python_program(
                "tests/programs/rdzv_member.py", endpoint, job, node, str(min_workers), str(max_workers), str(grace_s)
            ),
            stdout=self.log,
            stderr=self.err,
            env=os.environ | {"PYTHONPATH": "."},
        )

    def lines(self) -> list[dict[str, object]]:
        out = []
        for line in self.out.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and ("generation" in rec or "error" in rec) and "member" in rec:
                out.append(rec)
        return out

    def member_id(self) -> str | None:
        got = self.lines()
        return str(got[0]["member"]) if got else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()
        self.err.close()


@pytest.fixture
def members(tmp_path: Path) -> Iterator[list[Member]]:
    started: list[Member] = []
    yield started
    for m in started:
        m.stop()


@contextmanager
def _job(
    etcd_server,
    members: list[Member],
    tmp_path: Path,
    name: str,
    n: int,
    min_workers: int,  # type: ignore[no-untyped-def]
    max_workers: int,
    grace_s: float,
) -> Iterator[tuple[str, Keys, EtcdClient]]:
    """A fresh job of ``n`` member processes (nodes n0..), and a client of the test's own."""
    job = f"{name}{time.monotonic_ns()}"
    keys = Keys("/elasticd", job)
    store = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), Timeouts(), RetryPolicy())
    try:
        for i in range(n):
            members.append(
                Member(etcd_server.endpoint, job, f"n{i}", tmp_path / f"m{i}.out", min_workers, max_workers, grace_s)
            )
        yield job, keys, store
    finally:
        store.close()


def _wait(cond, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def _latest(m: Member) -> dict[str, object]:
    """The member's latest generation line ({} before its first)."""
    return max(
        (r for r in m.lines() if "generation" in r),
        key=lambda r: r["generation"],  # type: ignore[arg-type, return-value]
        default={},
    )


def _one_generation_of(members: list[Member]) -> bool:
    """Every member's latest generation is the same one, of all of them."""
    latest = [_latest(m) for m in members]
    return all(r.get("world") == len(members) for r in latest) and len({r["generation"] for r in latest}) == 1


@pytest.mark.parametrize("grace_s", [Timeouts().coordinator_grace_s, 60.0], ids=["deputies", "election only"])
def test_a_coordinator_killed_during_a_join_round_is_replaced_and_the_round_completes(
    etcd_server, members: list[Member], tmp_path: Path, grace_s: float
) -> None:
    """No agent revokes the victim's lease (as on a node that died with its agent): with deputies,
    rank 0 or 1 of the old generation publishes after ``coordinator_grace_s``; without them (a grace
    longer than the test), a new coordinator is elected when the victim's lease ends."""
    with _job(etcd_server, members, tmp_path, "coord", 3, 3, 4, grace_s) as (job, keys, store):
        _wait(lambda: all(any(r.get("generation") == 1 for r in m.lines()) for m in members), 60, "generation 1")
        kv = store.get(keys.coordinator)
        assert kv is not None
        coordinator = decode(CoordinatorRecord, kv.value).member_id
        victim = next(m for m in members if m.member_id() == coordinator)
        survivors = [m for m in members if m is not victim]

        # a newcomer starts a join round; the coordinator is SIGKILLed as soon as it waits in it
        members.append(Member(etcd_server.endpoint, job, "n3", tmp_path / "m3.out", 3, 4, grace_s))
        _wait(lambda: bool(store.get_prefix(keys.ready(""))), 60, "the newcomer's ready record")
        killed_at = time.time()
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)

        alive = [*survivors, members[-1]]
        bound = TTL_S + 1.0

        def joined_without_victim() -> bool:
            return all(
                any(
                    r.get("generation", 0) > 1 and r.get("world") == 3 and r.get("t", 0) > killed_at  # type: ignore[operator]
                    for r in m.lines()
                )
                for m in alive
            )

        _wait(joined_without_victim, bound + 30, "a generation of the three live members")
        done = max(
            min(
                float(r["t"])
                for r in m.lines()  # type: ignore[arg-type]
                if r.get("generation", 0) > 1 and r.get("world") == 3 and float(r["t"]) > killed_at
            )  # type: ignore[arg-type, operator]
            for m in alive
        )
        took = done - killed_at
        assert took <= bound, f"the round took {took:.2f} s > TTL + 1 s = {bound} s"
        if grace_s > bound:  # no deputy: the victim's lease had to end first
            assert took >= TTL_S - 2 * Timeouts().keepalive_s, took
        # the same generation for all, with dense ranks, and a live coordinator in charge
        last = [max((r for r in m.lines() if "generation" in r), key=lambda r: r["generation"]) for m in alive]  # type: ignore[arg-type, return-value]
        assert len({r["generation"] for r in last}) == 1 and sorted(r["rank"] for r in last) == [0, 1, 2]  # type: ignore[type-var]
        _wait(
            lambda: (
                (kv := store.get(keys.coordinator)) is not None
                and decode(CoordinatorRecord, kv.value).member_id != coordinator
            ),
            bound + 5,
            "a new coordinator",
        )
        assert not any("error" in r for m in alive for r in m.lines())


def test_a_member_killed_unrevoked_is_not_taken_back_into_the_next_generation(
    etcd_server, members: list[Member], tmp_path: Path
) -> None:
    """A node lost with its agent: its worker's lease lives on for up to the TTL. The generation
    that the others form without it (after the abort their failed collective writes) consumed its
    old ready record: it must not come back as a candidate (it once did: the next generation was
    published at once with the dead member, and the job stood still until its lease ended)."""
    with _job(etcd_server, members, tmp_path, "unrevoked", 3, 2, 4, 0.0) as (job, keys, store):
        # min_workers is 2: a member that starts late (a loaded machine) joins the second generation
        _wait(lambda: _one_generation_of(members), 60, "one generation of all three")
        generation = int(_latest(members[0])["generation"])  # type: ignore[call-overload]
        kv = store.get(keys.coordinator)
        assert kv is not None
        coordinator = decode(CoordinatorRecord, kv.value).member_id
        victim = next(m for m in members if m.member_id() != coordinator)
        victim_id = victim.member_id()
        victim.proc.send_signal(signal.SIGKILL)  # unrevoked: its lease lives on for up to the TTL
        victim.proc.wait(10)
        # what a survivor's failed all_reduce writes
        store.put(keys.abort, encode(AbortRecord(generation=generation, member_id=coordinator, reason="peer lost")))
        alive = [m for m in members if m is not victim]
        _wait(
            lambda: all(
                any(r.get("generation", 0) > generation and r.get("world") == 2 for r in m.lines())  # type: ignore[operator]
                for m in alive
            ),
            TTL_S + 5,
            "a generation of the two live members",
        )
        _wait(lambda: not store.get_prefix(keys.member(victim_id or "")), TTL_S + 5, "the victim's lease to end")
        time.sleep(1.0)  # a generation published with the dead member would show by now
        # (on a loaded machine a survivor may come after the last call: a third generation takes
        # it back, which is fine; a generation with the dead member is the defect)
        published = [decode_event(kv.value).detail for kv in store.get_prefix(keys.events)]
        after = [d for d in published if d.get("generation", 0) > generation]  # type: ignore[operator]
        assert after and not [d for d in after if victim_id in d["members"]], after  # type: ignore[operator]
        record = decode_generation(store.get(keys.generation).value)  # type: ignore[union-attr]
        assert record.world_size == 2 and victim_id not in record.members
        assert not any("error" in r for m in alive for r in m.lines())


def test_a_coordinator_lost_together_with_rank_0_and_1_is_replaced_by_a_later_deputy_tier(
    etcd_server, members: list[Member], tmp_path: Path
) -> None:
    """The coordinator and both deputies of tier 0 die unrevoked at once (one node lost holding
    them, or a node lost while another's link is down): with nobody to write a verdict, the next
    tier (rank 2, ``deputy_step_s`` later) publishes the survivors' generation, well before the
    coordinator's lease ends. Before the tiers, the survivors waited for that lease (the chaos run's
    5.75 s stall)."""
    with _job(etcd_server, members, tmp_path, "tiers", 5, 2, 5, 0.0) as (job, keys, store):
        latest = _latest
        _wait(lambda: _one_generation_of(members), 60, "one generation of all five")
        generation = int(latest(members[0])["generation"])  # type: ignore[call-overload]
        kv = store.get(keys.coordinator)
        assert kv is not None
        coordinator = decode(CoordinatorRecord, kv.value).member_id
        victims = [m for m in members if latest(m)["rank"] in (0, 1) or m.member_id() == coordinator]
        alive = [m for m in members if m not in victims]
        for v in victims:  # unrevoked: their leases live on for up to the TTL
            v.proc.send_signal(signal.SIGKILL)
        for v in victims:
            v.proc.wait(10)
        killed_at = time.time()
        # what a survivor's failed all_reduce writes
        store.put(
            keys.abort,
            encode(AbortRecord(generation=generation, member_id=alive[0].member_id() or "", reason="peer lost")),
        )

        def first_after(m: Member) -> float | None:
            ts = [
                float(r["t"])
                for r in m.lines()  # type: ignore[arg-type]
                if r.get("generation", 0) > generation and r.get("world") == len(alive)
            ]  # type: ignore[operator]
            return min(ts) if ts else None

        _wait(lambda: all(first_after(m) is not None for m in alive), TTL_S + 10, "a generation of the survivors")
        took = max(first_after(m) or 0.0 for m in alive) - killed_at
        keepalive = Timeouts().keepalive_s
        # without a later tier, the coordinator's lease had to end: took >= TTL - 2 keepalives
        assert took < TTL_S - 2 * keepalive, f"the survivors' generation took {took:.2f} s (TTL {TTL_S:g} s)"
        last = [latest(m) for m in alive]
        assert len({r["generation"] for r in last}) == 1 and sorted(r["rank"] for r in last) == list(range(len(alive)))  # type: ignore[type-var]
        assert not any("error" in r for m in alive for r in m.lines())
        _wait(
            lambda: (
                (kv := store.get(keys.coordinator)) is not None
                and decode(CoordinatorRecord, kv.value).member_id in {m.member_id() for m in alive}
            ),
            TTL_S + 5,
            "a live coordinator",
        )


def test_a_member_whose_lease_is_revoked_is_left_in_one_round_and_no_survivor_writes_a_ready_record(
    etcd_server, members: list[Member], tmp_path: Path
) -> None:
    """A leave in one round (``rendezvous.survivors``): a member SIGKILLed and its lease
    revoked, as its agent does. The survivors' generation is published at once, in their old rank
    order, and each of them joins it without writing a ``ready`` record."""
    with _job(etcd_server, members, tmp_path, "leave", 4, 2, 4, Timeouts().coordinator_grace_s) as (job, keys, store):
        # min_workers is 2: a member that starts late (a loaded machine) joins a later generation
        _wait(lambda: _one_generation_of(members), 60, "one generation of all four")
        g1 = decode_generation(store.get(keys.generation).value)  # type: ignore[union-attr]
        assert g1.generation == _latest(members[0])["generation"]
        assert g1.holders == 4
        kv = store.get(keys.coordinator)
        assert kv is not None
        coordinator = decode(CoordinatorRecord, kv.value).member_id
        # not the coordinator (its failover is another test), not rank 0
        victim = next(m for m in members if m.member_id() not in (coordinator, g1.members[0]))
        victim_id = victim.member_id()
        assert victim_id is not None
        record = store.get(keys.member(victim_id))
        assert record is not None
        before = {kv.key: kv.mod_revision for kv in store.get_prefix(keys.ready("")) if kv.key != keys.ready(victim_id)}
        verdict = store.get(keys.verdict)  # one of an earlier round, where a late member made two
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        left_at = time.time()
        store.revoke_lease(record.lease)
        survivors = [m for m in members if m is not victim]

        after = g1.generation + 1

        def learned() -> bool:
            return all(any(r.get("generation") == after and r.get("world") == 3 for r in m.lines()) for m in survivors)

        _wait(learned, 30, "the next generation, of the three survivors")
        took = max(float(r["t"]) for m in survivors for r in m.lines() if r.get("generation") == after)  # type: ignore[arg-type]
        g2 = decode_generation(store.get(keys.generation).value)  # type: ignore[union-attr]
        assert g2.generation == after and g2.members == tuple(m for m in g1.members if m != victim_id)
        assert g2.reason == "member_lost" and g2.holders == 3
        assert {kv.key: kv.mod_revision for kv in store.get_prefix(keys.ready(""))} == before  # nobody wrote one
        assert store.get(keys.verdict) == verdict  # nor was a verdict needed
        assert took - left_at < TTL_S, took - left_at  # far below the lease (it was revoked)
        assert not any("error" in r for m in survivors for r in m.lines())
