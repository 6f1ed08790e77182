"""Stand-ins for etcd3 0.12's watch stub that keep its watcher thread civil (pure Python, no I/O).

etcd3's watcher thread re-opens a broken watch stream in an endless loop: ``PacedWatchStub`` paces
it (an etcd outage used to cost a fifth of a core per worker), and ``ClosedWatchStub`` ends the
thread quietly once its client is closed. ``store.etcd`` installs them on every client it makes.
"""

from __future__ import annotations

import time
from typing import Any


class PacedWatchStub:
    """Wraps etcd3's watch stub so that its watcher opens a new stream at most once per
    ``interval_s``.

    etcd3 0.12's watcher thread re-opens its stream at once, in an endless loop, whenever it
    breaks; while etcd is down every attempt fails at once, and the loop spun a core (measured: a
    fifth of a core per worker, half the training rate through an etcd outage on 2 cores).
    """

    def __init__(self, inner: Any, interval_s: float) -> None:
        self._inner, self._interval_s, self._last = inner, interval_s, float("-inf")

    def Watch(self, *args: object, **kwargs: object) -> Any:
        wait = self._last + self._interval_s - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        self._last = time.monotonic()
        try:
            return self._inner.Watch(*args, **kwargs)
        except ValueError as exc:  # "Channel closed!": the client was closed while this one waited
            raise SystemExit from exc  # ends etcd3's watcher thread quietly, as ClosedWatchStub does


class ClosedWatchStub:
    """Stands in for etcd3's watch stub once the client is closed.

    etcd3 0.12's watcher thread re-opens its stream in an endless loop; on a closed channel that
    raises ValueError and prints a traceback from a long-lived process. SystemExit ends the thread
    quietly (``threading`` ignores it).
    """

    def Watch(self, *args: object, **kwargs: object) -> None:
        raise SystemExit
