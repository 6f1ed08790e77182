"""One lease keepalive stream per etcd endpoint, for every renewal a process makes (``KeepAlive``).

etcd renews a lease only over its ``LeaseKeepAlive`` stream. Opening a stream for each renewal (as
etcd3's ``refresh_lease`` does) costs a gRPC call, a thread to feed it and etcd a stream set up
and torn down: about a millisecond of the renewer's CPU, at every ``keepalive_s``, for every lease.
Here one stream, opened at the first renewal, carries them all (as etcd's own Go client does);
a renewal is one message each way. A renewal not answered within its bound, or a stream that
breaks, ends the stream: the renewal fails as its own call would have (the caller retries and
fails over), and the next one opens a new stream. Holds no protocol logic.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc


class KeepAliveTimeout(Exception):
    """No answer to a renewal within its bound: the stream is ended."""


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
                    slots = self._waiting.get(int(response.ID))
                    if slots:
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

    def renew(self, lease: int, timeout_s: float) -> float:
        """Renew ``lease``: its TTL now (0: etcd no longer has it).

        Raises:
            KeepAliveTimeout: no answer within ``timeout_s`` (the stream is ended).
            grpc.RpcError: the stream broke (the caller maps its status code).
        """
        slot: list[Any] = []
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._waiting.setdefault(lease, []).append(slot)
        self._out.put(self._request(lease))
        with self._lock:
            self._done.wait_for(lambda: bool(slot) or self._broken is not None, timeout_s)
            if slot:
                return float(slot[0])
            slots = self._waiting.get(lease, [])
            if slot in slots:
                slots.remove(slot)
            broken = self._broken
        if broken is not None:
            raise broken
        self.close()
        raise KeepAliveTimeout(f"no answer to a lease renewal within {timeout_s:g} s")

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
