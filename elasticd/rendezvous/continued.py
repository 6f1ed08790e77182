"""Whether this process was stopped and continued (SIGSTOP, then SIGCONT) during a step.

Owns a process-wide count of SIGCONT deliveries (``count``) and the handler that keeps it
(``install``, main thread only, idempotent, chaining any handler installed before it).

Why the commit rule needs it. A member's lease normally ends only by time (TTL), so a member
that knows when it last renewed knows whether its peers may have given up on it. But a worker's
agent revokes the lease of a worker it sees stopped for ``stopped_worker_s`` (so that the others
regroup without waiting for the TTL). Its peers give up on it and redo the step in a new
generation, but their abandoned all_reduce still runs in the background and completes the sum the
stopped member receives when it continues: it would commit a step that its peers did not. So a
member's lease counts as fresh only if its last granted renewal was asked after the last SIGCONT
(``Membership.lease_fresh``): a continued member votes "stale" (every member retries the step until
its renewal lands, or its lease is found gone: a veto), and one that continued after it voted does
not apply the step (``commit.Fence.continued``): it is behind, never ahead, and rejoins as a
newcomer. A SIGCONT to a running process costs one step retry.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_count = 0
_installed = False
_lock = threading.Lock()


def count() -> int:
    """SIGCONTs received since ``install`` (0 if not installed)."""
    return _count


def installed() -> bool:
    return _installed


def install() -> bool:
    """Count SIGCONT from now on. Only the main thread can install a signal handler: from another
    thread this does nothing and returns False (then a stop is not detected, see the module doc)."""
    global _installed
    with _lock:
        if _installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        previous = signal.getsignal(signal.SIGCONT)

        def on_continue(signum: int, frame: FrameType | None) -> None:
            global _count
            _count += 1
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGCONT, on_continue)
        _installed = True
        return True
