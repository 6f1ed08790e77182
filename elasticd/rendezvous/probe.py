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


def to_probe(missing: Sequence[str], members: Mapping[str, MemberRecord], asked: Collection[str]) -> list[MemberRecord]:
    """The missing members to ask about now: none while more than ``PROBE_MAX`` are missing (the
    members of a large generation are still arriving), and each member once. Pure."""
    if len(missing) > PROBE_MAX:
        return []
    return [members[m] for m in missing if m not in asked and m in members]


def _numeric(host: str, port: int) -> tuple[socket.AddressFamily, tuple[object, ...]] | None:
    if not 0 < port < 65536:
        return None
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):  # a name (never resolved here: a DNS outage must not hold the round), or garbage
        return None
    family, _, _, _, sockaddr = info[0]
    return family, sockaddr


def _of_error(err: int) -> Answer:
    if err == 0:
        return Answer.ACCEPTED
    if err == errno.ECONNREFUSED:
        return Answer.REFUSED
    return Answer.UNREACHABLE if err in _UNREACHABLE else Answer.UNASKED


def answers(targets: Sequence[tuple[str, int]], timeout_s: float) -> list[Answer]:
    """For each (host, port), what a TCP connect to it got within ``timeout_s`` (see ``Answer``):
    up to ``PROBE_BATCH`` are asked at once, non-blocking, each batch under one deadline."""
    out = [Answer.UNASKED] * len(targets)
    for start in range(0, len(targets), PROBE_BATCH):
        _ask(targets, range(start, min(start + PROBE_BATCH, len(targets))), timeout_s, out)
    return out


def _ask(targets: Sequence[tuple[str, int]], batch: range, timeout_s: float, out: list[Answer]) -> None:
    sel = selectors.DefaultSelector()
    waiting: dict[socket.socket, int] = {}
    try:
        for i in batch:
            addr = _numeric(*targets[i])
            if addr is None:
                continue
            try:
                s = socket.socket(addr[0], socket.SOCK_STREAM)
            except OSError:  # out of descriptors: decides nothing
                continue
            s.setblocking(False)
            err = s.connect_ex(addr[1])
            if err in _PENDING:
                waiting[s] = i
                sel.register(s, selectors.EVENT_WRITE)
                continue
            out[i] = _of_error(err)
            s.close()
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                sel.unregister(sock)
                out[waiting.pop(sock)] = _of_error(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
                sock.close()
        for i in waiting.values():  # no answer within the bound
            out[i] = Answer.UNREACHABLE
    finally:
        for s in waiting:
            s.close()
        sel.close()
