"""The node relay (``rendezvous.relay``) against a real etcd, with the relay and lightweight members
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
        self.proc = subprocess.Popen(python_program(*args), stdout=self.log, stderr=subprocess.STDOUT,
                                     env=os.environ | {"PYTHONPATH": "."} | (env or {}))

    def text(self) -> str:
        return self.out.read_text()

    def generations(self) -> list[tuple[int, int]]:
        got = []
        for found in re.findall(r'\{"member": [^{}]*\}', self.text()):  # a log line of another thread may
            rec = json.loads(found)                                      # precede it on its line
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
    members = [Proc(["tests/programs/rdzv_member.py", etcd_server.endpoint, job, "n0", str(n - 1), str(n)],
                    tmp_path / f"m{i}.out", {"ELASTICD_RELAY_SOCKET": path}) for i in range(n)]
    procs.extend(members)
    return relay, members


def test_members_form_generations_and_see_a_leave_through_the_relay(etcd_server, procs: list[Proc],
                                                                     tmp_path: Path) -> None:
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
        etcd_server, procs: list[Proc], tmp_path: Path) -> None:
    job = f"relaystop{time.monotonic_ns()}"
    relay, members = _start(etcd_server, procs, tmp_path, job, 3)
    _wait(lambda: all((1, 3) in m.generations() for m in members), 60, "generation 1 of 3", procs)
    os.kill(relay.proc.pid, signal.SIGSTOP)
    t0 = time.monotonic()
    _wait(lambda: all("relay_lost" in m.text() for m in members), T.relay_stale_s + 3, "the members to leave the relay")
    assert time.monotonic() - t0 <= T.relay_stale_s + 1.0
    # with the relay still stopped, a leave is seen straight from etcd
    members[0].proc.kill()  # SIGKILL, no agent to revoke: its lease ends after the TTL
    _wait(lambda: all(any(w == 2 for _, w in m.generations()) for m in members[1:]), T.lease_ttl_s + 15,
          "a generation of 2 without the relay")
    store = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), T, RetryPolicy())
    try:
        assert store.get(Keys("/elasticd", job).generation) is not None
    finally:
        store.close()
    for m in members[1:]:
        assert "Traceback" not in m.text()
