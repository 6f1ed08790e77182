"""When a renewal on the shared keepalive stream (``store.keepalive``) ends the stream: only once
the stream answered nothing at all for the renewal's window. One that answers others meanwhile is
behind (a busy host or etcd), and is waited on up to the renewal's bound; ending it would fail
every renewal waiting on it. The stream here is a scripted one (answers in order, at a set pace,
once the renewal under test is sent); the real stream is tested against etcd in
tests/integration/test_keepalive_stream.py."""

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
    """Answers requests in order, one every ``pace_s`` (None: never), once ``start_after`` requests
    came, and no more than ``answers`` of them (None: all); each answer's TTL is its request's
    number (1, 2, ...)."""

    def __init__(self, pace_s: float | None, start_after: int = 1, answers: int | None = None) -> None:
        self.pace_s, self.start_after, self.answers = pace_s, start_after, answers
        self.asked: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.cancelled = threading.Event()
        self.received = 0  # requests taken off the stream so far

    def open(self, requests: Iterator[Any]) -> PacedStream:
        def take() -> None:
            for r in requests:
                self.received += 1
                self.asked.put((self.received, r))

        threading.Thread(target=take, daemon=True).start()
        self._iter = self._answer()
        return self

    def __iter__(self) -> Iterator[Any]:
        return self._iter

    def _answer(self) -> Iterator[Any]:
        deadline = time.monotonic() + 20
        while self.received < self.start_after and not self.cancelled.wait(0.01):
            assert time.monotonic() < deadline
        sent = 0
        while not self.cancelled.is_set():
            try:
                n, r = self.asked.get(timeout=0.05)
            except queue.Empty:
                continue
            if self.pace_s is None or (self.answers is not None and sent >= self.answers):
                self.cancelled.wait()
                return
            time.sleep(self.pace_s)
            sent += 1
            yield SimpleNamespace(ID=r.ID, TTL=n)

    def cancel(self) -> None:
        self.cancelled.set()


def _stream(paced: PacedStream) -> KeepAliveStream:
    return KeepAliveStream(paced.open, lambda lease: SimpleNamespace(ID=lease))


def _backlog(stream: KeepAliveStream, paced: PacedStream, n: int) -> None:
    """``n`` renewals of other leases, sent before the one under test (each waits long enough)."""

    def renew(lease: int) -> None:
        try:
            stream.renew(lease, 30.0)
        except KeepAliveTimeout:  # the test closed the stream
            pass

    for i in range(n):
        threading.Thread(target=renew, args=(100 + i,), daemon=True).start()
    deadline = time.monotonic() + 10
    while paced.received < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert paced.received >= n


@pytest.mark.parametrize(
    ("pace_s", "backlog", "answers", "timeout_s", "bound_s", "raised", "stream_open"),
    [
        # answers flow: the renewal's own comes after 30 others (~1.5 s), past its 1 s window
        (0.05, 30, None, 1.0, 4.0, None, True),
        # the same backlog, a bound of one window: the renewal fails, the stream stays open
        (0.05, 30, None, 1.0, 1.0, KeepAliveBehind, True),
        # answers flow, but the renewal's own would come after its whole bound (~3 s against 2 s)
        (0.05, 60, None, 1.0, 2.0, KeepAliveBehind, True),
        # nothing answered at all for a window: silent, the stream is ended
        (None, 0, None, 0.5, 4.0, KeepAliveTimeout, False),
        # answers flow for ~0.5 s, then none: silent a window after the last, the stream is ended
        (0.05, 30, 10, 1.0, 4.0, KeepAliveTimeout, False),
        # prompt answers: the renewal answered within its window
        (0.0, 0, None, 1.0, 4.0, None, True),
    ],
)
def test_a_stream_is_ended_only_once_it_answers_nothing_for_a_window(
    pace_s: float | None,
    backlog: int,
    answers: int | None,
    timeout_s: float,
    bound_s: float,
    raised: type[Exception] | None,
    stream_open: bool,
) -> None:
    paced = PacedStream(pace_s, start_after=backlog + 1, answers=answers)
    stream = _stream(paced)
    try:
        _backlog(stream, paced, backlog)
        began = time.monotonic()
        if raised is None:
            assert stream.renew(7, timeout_s, bound_s) == backlog + 1  # the answer to its own request
        else:
            with pytest.raises(raised) as exc:
                stream.renew(7, timeout_s, bound_s)
            assert type(exc.value) is raised
        assert time.monotonic() - began < max(timeout_s, bound_s) + 1.0  # bounded
        assert stream.broken != stream_open
    finally:
        stream.close()


def test_the_answer_to_a_renewal_given_up_on_goes_to_no_later_renewal() -> None:
    paced = PacedStream(0.05, start_after=31)
    stream = _stream(paced)
    try:
        _backlog(stream, paced, 30)
        with pytest.raises(KeepAliveBehind):
            stream.renew(7, 1.0, 1.0)  # request 31: its answer is ~1.55 s away
        assert stream.renew(7, 2.0, 5.0) == 32  # its own request's answer, not request 31's
        assert not stream.broken
    finally:
        stream.close()
