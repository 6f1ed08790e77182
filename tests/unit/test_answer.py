"""A member's answering thread against the prober's question (``rendezvous.answer``), over real
loopback sockets, with a real process hung holding the GIL."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time

import pytest

from elasticd.rendezvous.answer import Answerer, Response, responses

HUNG_BOUND_S = 0.5

# A member process: answers, then, on a line on its stdin, calls libc's sleep through ctypes.PyDLL,
# which keeps the GIL: every Python thread of it stops, its kernel still accepts connects.
_MEMBER = textwrap.dedent(
    """
    import ctypes, sys
    from elasticd.rendezvous.answer import Answerer
    a = Answerer("127.0.0.1")
    a.start()
    print(a.port, flush=True)
    sys.stdin.readline()
    ctypes.PyDLL(None).sleep(60)
    """
)


def test_a_member_answers_and_one_hung_with_the_gil_is_silent_within_the_bound() -> None:
    proc = subprocess.Popen([sys.executable, "-c", _MEMBER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        assert responses([("127.0.0.1", port)], HUNG_BOUND_S) == [Response.ANSWERED]
        proc.stdin.write("hang\n")
        proc.stdin.flush()
        time.sleep(0.3)  # the main thread reads the line and enters the sleep
        started = time.monotonic()
        got = responses([("127.0.0.1", port)], HUNG_BOUND_S)
        took = time.monotonic() - started
        assert got == [Response.SILENT]
        assert HUNG_BOUND_S <= took < HUNG_BOUND_S + 1.0  # the bound, not more
    finally:
        proc.kill()
        proc.wait(10)
    assert responses([("127.0.0.1", port)], HUNG_BOUND_S) == [Response.CLOSED]  # gone: refused


def test_each_target_gets_its_own_answer_and_the_call_ends_when_all_answered() -> None:
    live = Answerer("127.0.0.1")
    live.start()
    mute = socket.socket()  # the kernel accepts; nothing answers
    mute.bind(("127.0.0.1", 0))
    mute.listen(4)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # nothing listens
    try:
        targets = [
            ("127.0.0.1", live.port),
            ("127.0.0.1", mute.getsockname()[1]),
            ("127.0.0.1", closed.getsockname()[1]),
            ("127.0.0.1", 0),  # no answer port (an older member)
            ("node-7", 4000),  # a name is never resolved
        ]
        assert responses(targets, 0.3) == [
            Response.ANSWERED,
            Response.SILENT,
            Response.CLOSED,
            Response.UNASKED,
            Response.UNASKED,
        ]
        started = time.monotonic()
        assert responses([("127.0.0.1", live.port)] * 20, 5.0) == [Response.ANSWERED] * 20
        assert time.monotonic() - started < 2.0  # not the bound: every answer came
    finally:
        live.close(2.0)
        mute.close()
        closed.close()


@pytest.mark.timeout(20)
def test_close_ends_the_thread_and_the_port_refuses_after() -> None:
    a = Answerer("127.0.0.1")
    a.start()
    assert responses([("127.0.0.1", a.port)], 1.0) == [Response.ANSWERED]
    started = time.monotonic()
    a.close(5.0)
    assert time.monotonic() - started < 2.0
    assert a._thread is not None and not a._thread.is_alive()
    assert responses([("127.0.0.1", a.port)], 1.0) == [Response.CLOSED]


def test_an_address_not_of_this_machine_is_an_error() -> None:
    with pytest.raises(OSError):
        Answerer("192.0.2.1")  # TEST-NET-1: never a local address
