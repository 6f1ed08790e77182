"""Whether a member's process is gone, asked of its host (``refused``), and which missing members
of a broken generation to ask about (``to_probe``, pure).

Every worker listens on the store port it advertised in its member record for as long as it lives
(``worker.process_group.StoreServer``). A TCP connect to it that the host refuses means nothing
listens there: the process is gone. Its lease says nothing yet when no agent revoked it (the node
was lost with its agent, or the worker runs without one) and would hold the round for
``last_call_s``; the coordinator leaves such a member out at once (``Coordinator``). Any other
answer decides nothing: a connect that is accepted (a stopped process's port still accepts), times
out or finds the host unreachable (a link down) leaves the member to its last call and its lease.

Leaving a live member out by mistake would cost a rejoin, never a step (the commit rule keeps a
member that is left out behind, never ahead); a refusal cannot come from a live worker.
"""

from __future__ import annotations

import socket
from collections.abc import Collection, Mapping, Sequence

from elasticd.wire.records import MemberRecord

PROBE_MAX = 8  # missing members a round asks about at most: a node's workers; a large rendezvous just begun waits


def to_probe(missing: Sequence[str], members: Mapping[str, MemberRecord], asked: Collection[str]) -> list[MemberRecord]:
    """The missing members to ask about now: none while more than ``PROBE_MAX`` are missing (the
    members of a large generation are still arriving), and each member once per round. Pure."""
    if len(missing) > PROBE_MAX:
        return []
    return [members[m] for m in missing if m not in asked and m in members]


def refused(host: str, port: int, timeout_s: float) -> bool:
    """Whether ``host`` refuses a TCP connect to ``port`` within ``timeout_s`` (nothing listens)."""
    if not 0 < port < 65536:
        return False
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):  # timed out, unreachable, a name that does not resolve: no answer
        return False
