"""``rendezvous.probe``: which missing members a round asks about (a table), and what a refused,
an accepted and an unanswerable connect say (real sockets on loopback)."""

from __future__ import annotations

import socket

import pytest

from elasticd.rendezvous.probe import PROBE_MAX, refused, to_probe
from elasticd.wire.records import MemberRecord

pytestmark = pytest.mark.timeout(30)


def _rec(mid: str, port: int = 1) -> MemberRecord:
    return MemberRecord(mid, "n", 0, 1, "127.0.0.1", port, "s")


MEMBERS = {m: _rec(m) for m in ("a", "b", "c")}


@pytest.mark.parametrize(("missing", "asked", "expected"), [
    (["a"], set(), ["a"]),
    (["a", "b"], {"a"}, ["b"]),                       # each once per round window
    (["a", "x"], set(), ["a"]),                       # no record, nothing to ask
    ([f"m{i}" for i in range(PROBE_MAX + 1)], set(), []),  # a large rendezvous still arriving
    ([], set(), []),
])
def test_to_probe(missing: list[str], asked: set[str], expected: list[str]) -> None:
    members = {**MEMBERS, **{m: _rec(m) for m in missing if m.startswith("m")}}
    assert [r.member_id for r in to_probe(missing, members, asked)] == expected


def test_a_closed_port_is_refused_a_listening_one_is_not_and_a_name_is_not_resolved() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        # a live process (or a stopped one: the kernel accepts); a host name is never resolved
        assert refused([("127.0.0.1", port), ("localhost", port)], 0.5) == [False, False]
    assert refused([("127.0.0.1", port), ("localhost", port)], 0.5) == [True, False]  # nothing listens any more


@pytest.mark.parametrize(("host", "port"), [("127.0.0.1", 0), ("127.0.0.1", 70000), ("", -1), ("::1x", 80),
                                            ("\x00", 80)])
def test_no_answer_decides_nothing(host: str, port: int) -> None:
    assert refused([(host, port)], 0.2) == [False]


def test_many_are_asked_under_one_deadline() -> None:
    socks = [socket.socket() for _ in range(4)]
    try:
        ports = []
        for s in socks:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
        for s in socks[:2]:
            s.listen(1)
        for s in socks[2:]:
            s.close()  # bound, never listened: refused
        assert refused([("127.0.0.1", p) for p in ports], 0.5) == [False, False, True, True]
    finally:
        for s in socks:
            s.close()
