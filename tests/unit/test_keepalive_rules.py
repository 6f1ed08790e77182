"""When a renewal on the shared keepalive stream (``store.keepalive``) ends the stream: only when the
stream answered nothing for a whole window. One that answers others meanwhile is behind (a busy host
or etcd), and is waited on up to the renewal's bound; ending it would fail every renewal waiting on
it. The stream here is a scripted one (answers in order, at a set pace); the real stream is tested
against etcd in tests/integration/test_keepalive_stream.py."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from elasticd.store.keepalive import KeepAliveBehind, KeepAliveStream, KeepAliveTimeout

pytestmark = pytest.mark.timeout(60)


class PacedStream:
    """Answers each request in order, one every ``pace_s`` (None: never), TTL 30."""

    def __init__(self, pace_s: float | None) -> None:
        self.pace_s = pace_s
        self.asked: queue.Queue[Any] = queue.Queue()
        self.cancelled = threading.Event()
        self.received = 0  # requests taken off the stream so far

    def open(self, requests: Iterator[Any]) -> PacedStream:
        def take() -> None:
            for r in requests:
                self.received += 1
                self.asked.put(r)

        threading.Thread(target=take, daemon=True).start()
        self._iter = self._answers()
        return self

    def __iter__(self) -> Iterator[Any]:
        return self._iter

    def _answers(self) -> Iterator[Any]:
        while not self.cancelled.is_set():
            try:
                r = self.asked.get(timeout=0.05)
            except queue.Empty:
                continue
            if self.pace_s is None:
                self.cancelled.wait()
                return
            time.sleep(self.pace_s)
            yield SimpleNamespace(ID=r.ID, TTL=30)

    def cancel(self) -> None:
        self.cancelled.set()


def _stream(paced: PacedStream) -> KeepAliveStream:
    return KeepAliveStream(paced.open, lambda lease: SimpleNamespace(ID=lease))


def _backlog(stream: KeepAliveStream, paced: PacedStream, n: int) -> list[threading.Thread]:
    """``n`` renewals of other leases sent before the one under test (each waits long enough)."""

    def renew(lease: int) -> None:
        try:
            stream.renew(lease, 10.0)
        except KeepAliveTimeout:  # the test closed the stream
            pass

    threads = [threading.Thread(target=renew, args=(100 + i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while paced.received < n and time.monotonic() < deadline:  # all sent before the one under test
        time.sleep(0.01)
    assert paced.received >= n
    return threads


@pytest.mark.parametrize(
    ("pace_s", "backlog", "timeout_s", "bound_s", "answered", "raised", "stream_open"),
    [
        # answers flow: the renewal's answer comes after 16 others (~0.85 s), past its 0.5 s window
        (0.05, 16, 0.5, 2.0, True, None, True),
        # the same backlog, a bound no longer than the window: it fails as before, the stream open
        (0.05, 16, 0.5, 0.5, False, KeepAliveBehind, True),
        # answers flow, but the renewal's own would come after its whole bound: fails, stream open
        (0.05, 40, 0.5, 1.0, False, KeepAliveBehind, True),
        # nothing answered at all for a window: silent, the stream is ended
        (None, 0, 0.5, 2.0, False, KeepAliveTimeout, False),
        # prompt answers: the renewal answered within its window
        (0.0, 0, 0.5, 2.0, True, None, True),
    ],
)
def test_a_stream_is_ended_only_when_it_answers_nothing_for_a_window(
    pace_s: float | None,
    backlog: int,
    timeout_s: float,
    bound_s: float,
    answered: bool,
    raised: type[Exception] | None,
    stream_open: bool,
) -> None:
    paced = PacedStream(pace_s)
    stream = _stream(paced)
    try:
        _backlog(stream, paced, backlog)
        began = time.monotonic()
        if raised is None:
            assert stream.renew(7, timeout_s, bound_s) == 30.0
        else:
            with pytest.raises(raised) as exc:
                stream.renew(7, timeout_s, bound_s)
            assert (type(exc.value) is KeepAliveBehind) == (raised is KeepAliveBehind)
        took = time.monotonic() - began
        assert took < max(timeout_s, bound_s) + 1.0, took  # bounded
        assert answered == (raised is None)
        assert stream.broken != stream_open
    finally:
        stream.close()


def test_a_late_answer_after_a_failed_renewal_goes_to_the_next_renewal_of_that_lease() -> None:
    paced = PacedStream(0.05)
    stream = _stream(paced)
    try:
        _backlog(stream, paced, 30)
        with pytest.raises(KeepAliveBehind):
            stream.renew(7, 0.5, 0.5)  # its answer is ~1.55 s away
        assert stream.renew(7, 0.5, 5.0) == 30.0  # the first answer of lease 7 that comes
        assert not stream.broken
    finally:
        stream.close()
