"""One lease keepalive stream per etcd endpoint, for every renewal a process makes (``KeepAlive``).

etcd renews a lease only over its ``LeaseKeepAlive`` stream. Opening a stream for each renewal (as
etcd3's ``refresh_lease`` does) costs a gRPC call, a thread to feed it and etcd a stream set up
and torn down: about a millisecond of the renewer's CPU, at every ``keepalive_s``, for every lease.
Here one stream, opened at the first renewal, carries them all (as etcd's own Go client does);
a renewal is one message each way. A stream that answers nothing at all for a renewal's window
(an etcd member without a leader, a dead connection), or that breaks, is ended: the renewal fails as
its own call would have (the caller retries and fails over), and the next one opens a new stream. A
stream that goes on answering other renewals is behind, not dead (its process or etcd is busy: etcd
answers a stream in order): the renewal waits on for its answer, up to its whole bound, and the
stream stays open. Ending a live stream would fail every renewal waiting on it at once; on a loaded
host their retries open streams that fall behind in turn, and the process's leases end. Holds no
protocol logic.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc


class KeepAliveTimeout(Exception):
    """No answer to a renewal within its bound: the stream is ended when it answered nothing else
    meanwhile (``KeepAliveStream.renew``)."""


class KeepAliveBehind(KeepAliveTimeout):
    """No answer to a renewal within its whole bound while the stream answered others: it stays
    open (the endpoint answers; it is slow)."""


class KeepAliveStream:
    """One open ``LeaseKeepAlive`` stream: renewals go out as messages, and each answer goes to
    the oldest renewal of its lease still waiting (etcd answers a stream's requests in order)."""

    def __init__(self, open_stream: Callable[[Iterator[Any]], Any], request: Callable[[int], Any]) -> None:
        """``open_stream``: starts the call over a request iterator and returns its responses;
        ``request``: the request message that renews a lease."""
        self._request = request
        self._out: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting: dict[int, list[list[Any]]] = {}  # lease -> its renewals' slots, oldest first
        self._broken: BaseException | None = None
        self._answered_at = 0.0  # CLOCK_MONOTONIC of the newest answer (to any renewal)
        self._done = threading.Condition(self._lock)
        self._responses = open_stream(self._requests())
        threading.Thread(target=self._read, name="elasticd-keepalive-stream", daemon=True).start()

    def _requests(self) -> Iterator[Any]:
        while True:
            item = self._out.get()
            if item is None:
                return
            yield item

    def _read(self) -> None:
        broken: BaseException
        try:
            for response in self._responses:
                with self._lock:
                    self._answered_at = time.monotonic()
                    slots = self._waiting.get(int(response.ID))
                    if slots:  # the oldest, whether or not a renewal still waits on it
                        slots.pop(0).append(float(response.TTL))
                        self._done.notify_all()
            broken = KeepAliveTimeout("the keepalive stream ended")
        except grpc.RpcError as exc:
            broken = exc
        except Exception as exc:  # noqa: BLE001 (gRPC's own errors on a cancelled call: the stream is over)
            broken = KeepAliveTimeout(f"the keepalive stream failed: {type(exc).__name__}: {exc}")
        with self._lock:
            self._broken = broken
            self._done.notify_all()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def renew(self, lease: int, timeout_s: float, bound_s: float | None = None) -> float:
        """Renew ``lease``: its TTL now (0: etcd no longer has it).

        Waits while the stream answers: up to ``bound_s`` in all (at least ``timeout_s``), and ends
        the stream once it answered nothing at all for ``timeout_s`` (counted from this renewal's
        start or the stream's newest answer, whichever is later). A renewal that gives up on a live
        stream leaves its request's place in order: its answer, when it comes, goes to no later one.

        Raises:
            KeepAliveBehind: no answer within the bound while the stream answered others (it stays open).
            KeepAliveTimeout: the stream answered nothing for ``timeout_s`` (it is ended).
            grpc.RpcError: the stream broke (the caller maps its status code).
        """
        slot: list[Any] = []
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._waiting.setdefault(lease, []).append(slot)
        self._out.put(self._request(lease))
        began = time.monotonic()
        until = began + max(timeout_s, bound_s or 0.0)
        with self._lock:
            while True:
                quiet_until = max(began, self._answered_at) + timeout_s  # silent from then on
                wait_s = min(until, quiet_until) - time.monotonic()
                self._done.wait_for(lambda: bool(slot) or self._broken is not None, max(0.0, wait_s))
                now = time.monotonic()
                silent = now >= max(began, self._answered_at) + timeout_s
                if slot or self._broken is not None or silent or now >= until:
                    break
            if slot:
                return float(slot[0])
            broken = self._broken
            if broken is None and silent:
                slots = self._waiting.get(lease, [])
                if slot in slots:
                    slots.remove(slot)
        if broken is not None:
            raise broken
        if not silent:  # its slot stays: the answer to its request is on its way, in order
            raise KeepAliveBehind(
                f"no answer to a lease renewal within {now - began:.2g} s (the stream is behind: it answers others)"
            )
        self.close()
        raise KeepAliveTimeout(f"no answer on the keepalive stream for {timeout_s:g} s")

    def close(self) -> None:
        """End the stream (its reader thread ends with it)."""
        self._out.put(None)
        cancel = getattr(self._responses, "cancel", None)
        if cancel is not None:
            cancel()
        with self._lock:
            if self._broken is None:
                self._broken = KeepAliveTimeout("the keepalive stream was closed")
            self._done.notify_all()
