"""Whether members' processes are gone or their hosts out of reach, asked of their hosts with a TCP
connect to the store port each advertised (``answers``), and which missing members of a
broken generation to ask about (``to_probe``, pure).

Every worker listens on the store port it advertised in its member record for as long as it lives
(``worker.process_group.StoreServer``), and its host's kernel answers a connect to it even while the
process is stopped or busy. So:

* ``REFUSED``: nothing listens there; the process is gone. Its lease says nothing yet when no agent
  revoked it (the node was lost with its agent while its host still answers, or the worker runs
  without an agent) and would hold the round for ``last_call_s``;
* ``UNREACHABLE``: no answer within the bound, or the network said the host cannot be reached: the
  host is down or cut off (a link down, a lost node). Its lease would hold the generation until it
  expires (the lease TTL: 30 s in a large job), while nothing can reach it anyway;
* ``ACCEPTED``: the process lives (perhaps stopped: its port still accepts); its lease decides;
* ``UNASKED``: an address that is not a numeric IP (no name is resolved here: a DNS outage must
  not hold a round), a port out of range, or a local error: decides nothing.

The coordinator leaves a missing member of a broken generation out at once when its answer is
``REFUSED`` or ``UNREACHABLE`` (``Coordinator``), and a member stuck in a collective asks its
generation's hosts (``rendezvous.reach``). A live member left out by mistake (a firewall that
rejects with a reset, a lost SYN) costs a rejoin, never a step: the commit rule keeps a member that
is left out behind, never ahead; and the coordinator never leaves out, on a probe alone, the last
members of a generation that hold its state.

An accepted connect is closed normally (a reset would make the peer's TCPStore warn that it
cannot read the address of a client gone before its accept): it waits out ``TIME_WAIT`` on the
prober's side, per destination, so a prober's local ports do not run out at the rates asked here
(the reach check backs off within a wait: ``rendezvous.reach``).
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Collection, Mapping, Sequence
from enum import StrEnum

from elasticd.retry import Clock
from elasticd.wire.records import MemberRecord

PROBE_MAX = 8  # missing members a round asks about at most: a node's workers; a large rendezvous just begun waits
PROBE_BATCH = 256  # connects in flight at once (file descriptors), each batch under its own bound
_PENDING = {errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN, errno.EALREADY}
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ETIMEDOUT, errno.EHOSTDOWN}


class Answer(StrEnum):
    ACCEPTED = "accepted"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"
    UNASKED = "unasked"


GONE = frozenset({Answer.REFUSED, Answer.UNREACHABLE})  # answers that say a member is gone (or cut off)


def to_probe(missing: Sequence[str], members: Mapping[str, MemberRecord], asked: Collection[str]) -> list[MemberRecord]:
    """The missing members to ask about now: none while more than ``PROBE_MAX`` are missing (the
    members of a large generation are still arriving), and each member once. Pure."""
    if len(missing) > PROBE_MAX:
        return []
    return [members[m] for m in missing if m not in asked and m in members]


def numeric_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple[object, ...]] | None:
    """(family, socket address) of a numeric ``host`` and a ``port`` in 1..65535; None otherwise (a
    name is never resolved here: a DNS outage must not hold a round)."""
    if not 0 < port < 65536:
        return None
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):  # a name, or garbage
        return None
    family, _, _, _, sockaddr = info[0]
    return family, sockaddr


def _of_error(err: int) -> Answer:
    if err == 0:
        return Answer.ACCEPTED
    if err == errno.ECONNREFUSED:
        return Answer.REFUSED
    return Answer.UNREACHABLE if err in _UNREACHABLE else Answer.UNASKED


def answers(targets: Sequence[tuple[str, int]], timeout_s: float, clock: Clock = time.monotonic) -> list[Answer]:
    """For each (host, port), what a TCP connect to it got within ``timeout_s`` (see ``Answer``):
    up to ``PROBE_BATCH`` are asked at once, non-blocking, each batch under one deadline (so the
    whole takes at most ceil(len / PROBE_BATCH) x ``timeout_s``). A target still silent halfway
    through gets a second connect (a second SYN: Linux resends a lost one only after a second), and
    the first answer of either counts: one lost packet does not make a live host unreachable."""
    out = [Answer.UNASKED] * len(targets)
    for start in range(0, len(targets), PROBE_BATCH):
        _Batch(targets, out, clock).ask(range(start, min(start + PROBE_BATCH, len(targets))), timeout_s)
    return out


class _Batch:
    """One batch of connects in flight, up to two per target."""

    def __init__(self, targets: Sequence[tuple[str, int]], out: list[Answer], clock: Clock) -> None:
        self._targets, self._out, self._clock = targets, out, clock
        self._sel = selectors.DefaultSelector()
        self._waiting: dict[socket.socket, int] = {}
        self._addrs: dict[int, tuple[socket.AddressFamily, tuple[object, ...]]] = {}
        self._decided: set[int] = set()

    def _settle(self, i: int, answer: Answer) -> None:
        if i not in self._decided:
            self._decided.add(i)
            self._out[i] = answer

    def _connect(self, i: int) -> None:
        family, sockaddr = self._addrs[i]
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # out of descriptors: decides nothing
            return
        s.setblocking(False)
        err = s.connect_ex(sockaddr)
        if err in _PENDING:
            self._waiting[s] = i
            self._sel.register(s, selectors.EVENT_WRITE)
            return
        self._settle(i, _of_error(err))
        s.close()

    def _open(self) -> set[int]:
        return {i for i in self._waiting.values() if i not in self._decided}

    def ask(self, batch: range, timeout_s: float) -> None:
        try:
            for i in batch:
                addr = numeric_address(*self._targets[i])
                if addr is not None:
                    self._addrs[i] = addr
                    self._connect(i)
            start = self._clock()
            resend_at, deadline, resent = start + timeout_s / 2, start + timeout_s, False
            while self._open():
                now = self._clock()
                if not resent and now >= resend_at:
                    resent = True
                    for i in self._open():
                        self._connect(i)
                    continue
                left = (deadline if resent else resend_at) - now
                if left <= 0:
                    break
                for key, _ in self._sel.select(left):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    self._sel.unregister(sock)
                    self._settle(
                        self._waiting.pop(sock), _of_error(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                    )
                    sock.close()
            for i in self._open():  # no answer within the bound
                self._settle(i, Answer.UNREACHABLE)
        finally:
            for s in self._waiting:
                s.close()
            self._sel.close()
