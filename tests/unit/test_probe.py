"""``rendezvous.probe``: which missing members a round asks about (a table), and what a refused,
an accepted, an unanswered and an unaskable connect say (real sockets on loopback)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from elasticd.rendezvous.probe import PROBE_BATCH, PROBE_MAX, Answer, answers, to_probe
from elasticd.testing.localcluster import REPO_ROOT
from elasticd.wire.records import MemberRecord

pytestmark = pytest.mark.timeout(30)

A, R, U, N = Answer.ACCEPTED, Answer.REFUSED, Answer.UNREACHABLE, Answer.UNASKED


def _rec(mid: str, port: int = 1) -> MemberRecord:
    return MemberRecord(mid, "n", 0, 1, "127.0.0.1", port, "s")


MEMBERS = {m: _rec(m) for m in ("a", "b", "c")}


@pytest.mark.parametrize(
    ("missing", "asked", "expected"),
    [
        (["a"], set(), ["a"]),
        (["a", "b"], {"a"}, ["b"]),  # each once per round window
        (["a", "x"], set(), ["a"]),  # no record, nothing to ask
        ([f"m{i}" for i in range(PROBE_MAX + 1)], set(), []),  # a large rendezvous still arriving
        ([], set(), []),
    ],
)
def test_to_probe(missing: list[str], asked: set[str], expected: list[str]) -> None:
    members = {**MEMBERS, **{m: _rec(m) for m in missing if m.startswith("m")}}
    assert [r.member_id for r in to_probe(missing, members, asked)] == expected


@contextmanager
def _silent_port() -> Iterator[int]:
    """A port whose host never answers a connect: its accept queue is full (backlog 0 holds one
    connection, never accepted), so the kernel drops every further SYN, as a host that is gone
    or cut off answers nothing."""
    with socket.socket() as srv, socket.socket() as filler:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        filler.connect(("127.0.0.1", port))
        yield port


def test_a_closed_port_is_refused_a_listening_one_accepts_and_a_name_is_not_resolved() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        # a live process (or a stopped one: the kernel accepts); a host name is never resolved
        assert answers([("127.0.0.1", port), ("localhost", port)], 0.5) == [A, N]
    assert answers([("127.0.0.1", port), ("localhost", port)], 0.5) == [R, N]  # nothing listens any more


def test_a_host_that_does_not_answer_is_unreachable_once_the_bound_ran_out() -> None:
    with _silent_port() as port:
        t0 = time.monotonic()
        assert answers([("127.0.0.1", port)], 0.2) == [U]
        assert 0.19 <= time.monotonic() - t0 < 2.0


@pytest.mark.parametrize(
    ("host", "port"), [("127.0.0.1", 0), ("127.0.0.1", 70000), ("", -1), ("::1x", 80), ("\x00", 80)]
)
def test_no_address_decides_nothing(host: str, port: int) -> None:
    assert answers([(host, port)], 0.2) == [N]


def test_many_are_asked_under_one_deadline() -> None:
    socks = [socket.socket() for _ in range(4)]
    try:
        ports = []
        for s in socks:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        for s in socks[:2]:
            s.listen(8)
        for s in socks[2:]:
            s.close()  # bound, never listened: refused
        with _silent_port() as silent:
            t0 = time.monotonic()
            got = answers([("127.0.0.1", p) for p in ports] + [("127.0.0.1", silent)] * 3, 0.3)
            took = time.monotonic() - t0
        assert got == [A, A, R, R, U, U, U]
        assert took < 1.0  # one bound for all, not one each
    finally:
        for s in socks:
            s.close()


def test_more_than_a_batch_are_all_asked() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(PROBE_BATCH * 2)
        port = s.getsockname()[1]
        got = answers([("127.0.0.1", port)] * (PROBE_BATCH + 3), 1.0)
        assert got == [A] * (PROBE_BATCH + 3)


def test_a_workers_store_is_asked_without_a_warning_in_its_log() -> None:
    """Every worker's TCPStore (c10d's libuv server) is what the probes reach: a connect closed with
    a reset before the server accepted it made it warn once per probe ("The remote address of the
    client socket cannot be retrieved"); a normal close leaves its log quiet."""
    program = (
        "import sys, time\n"
        "from datetime import timedelta\n"
        "from torch.distributed import TCPStore\n"
        "from elasticd.rendezvous.probe import answers\n"
        "st = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))\n"
        "got = [answers([('127.0.0.1', st.port)] * 4, 1.0) for _ in range(5)]\n"
        "time.sleep(0.3)\n"
        "print(sum(a == 'accepted' for g in got for a in g))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program],
        capture_output=True,
        text=True,
        timeout=25,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["20"], done.stdout
    assert "TCPStore" not in done.stderr and "[W" not in done.stderr, done.stderr[-2000:]


def test_a_second_connect_halfway_through_is_answered_where_the_first_was_lost() -> None:
    """The first SYN is dropped (the accept queue is full), then the server makes room: the second
    connect, sent halfway through the bound, is accepted. Linux would resend the first SYN only
    after a second, past the bound: without the second connect the host would count as unreachable."""
    with socket.socket() as srv, socket.socket() as filler:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        filler.connect(("127.0.0.1", port))
        room = threading.Timer(0.15, lambda: srv.accept()[0].close())
        room.start()
        try:
            t0 = time.monotonic()
            assert answers([("127.0.0.1", port)], 0.6) == [A]
            assert time.monotonic() - t0 < 0.55
        finally:
            room.cancel()
