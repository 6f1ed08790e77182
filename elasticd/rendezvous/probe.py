"""Whether members' processes are gone, asked of their hosts (``refused``), and which missing
members of a broken generation to ask about (``to_probe``, pure).

Every worker listens on the store port it advertised in its member record for as long as it lives
(``worker.process_group.StoreServer``). A TCP connect to it that the host refuses means nothing
listens there: the process is gone. Its lease says nothing yet when no agent revoked it (the node
was lost with its agent while its host still answers, or the worker runs without an agent) and
would hold the round for ``last_call_s``; the coordinator leaves such a member out at once
(``Coordinator``). Any other answer decides nothing: a connect that is accepted (a stopped
process's port still accepts), times out (a host that is down, a link down), or an address that is
not a numeric IP (no name is resolved here) leaves the member to its last call and its lease.

A live member left out by mistake (a firewall that rejects with a reset) costs a rejoin, never a
step: the commit rule keeps a member that is left out behind, never ahead; and the coordinator
never leaves out, on a probe alone, the last members of a generation that hold its state.
"""

from __future__ import annotations

import errno
import selectors
import socket
import time
from collections.abc import Collection, Mapping, Sequence

from elasticd.wire.records import MemberRecord

PROBE_MAX = 8  # missing members a round asks about at most: a node's workers; a large rendezvous just begun waits
_PENDING = {errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN, errno.EALREADY}


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


def refused(targets: Sequence[tuple[str, int]], timeout_s: float) -> list[bool]:
    """For each (host, port), whether the host refused a TCP connect to it within ``timeout_s``:
    all are asked at once, non-blocking, under one deadline."""
    out = [False] * len(targets)
    sel = selectors.DefaultSelector()
    waiting: dict[socket.socket, int] = {}
    try:
        for i, (host, port) in enumerate(targets):
            addr = _numeric(host, port)
            if addr is None:
                continue
            s = socket.socket(addr[0], socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex(addr[1])
            if err in _PENDING:
                waiting[s] = i
                sel.register(s, selectors.EVENT_WRITE)
                continue
            out[i] = err == errno.ECONNREFUSED
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
                out[waiting.pop(sock)] = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == errno.ECONNREFUSED
                sock.close()
    finally:
        for s in waiting:
            s.close()
        sel.close()
    return out
