"""Whether a member's Python still runs, asked only while a collective waits for it: a byte its own
thread sends back (``Answerer``) to a reach check's prober (``responses``).

A connect to a member's store port (``rendezvous.probe``) is accepted by its host's kernel even
while the process is hung; a worker hung with every thread (a C call that holds the GIL) keeps its
place for as long as something else renews its lease — its agent's relay does, since the process
runs and its socket is open. Its peers would wait for it up to ``collective_s``. So each worker
listens on a port of its own (``MemberRecord.answer_port``) and a Python thread of it answers each
connect with one byte: a process whose Python cannot run sends nothing. A prober that finds a
member's host answering but its Python silent for ``unresponsive_s`` counts the member gone, as an
ended lease of its own would have after the TTL (``rendezvous.reach.verdict``).

Nothing is sent while the job trains: the question is asked only by a reach check, that is, while a
collective has waited ``reach_check_s``. A false alarm (a process whose Python was busy in one C
call for ``unresponsive_s``) costs a regroup, never a step.

Never imports etcd3 or torch.
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections.abc import Sequence
from enum import StrEnum

import structlog

from elasticd.rendezvous.probe import numeric_address

log = structlog.get_logger(__name__)

ANSWER = b"!"  # what a member's answering thread sends on each connect
ANSWER_IDLE_S = 5.0  # the answering thread looks at its stop flag at least this often
ANSWER_SEND_S = 1.0  # bound on sending the byte to one prober (a prober gone meanwhile)
RESPONSES_BATCH = 256  # connects in flight at once (file descriptors)
_IN_PROGRESS = (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN, errno.EALREADY)


class Response(StrEnum):
    ANSWERED = "answered"  # its Python sent the byte
    SILENT = "silent"  # accepted (or pending) but no byte within the bound: its Python does not run
    CLOSED = "closed"  # refused, or closed without the byte: the process is gone or ending
    UNASKED = "unasked"  # no port, not a numeric address, or a local error: decides nothing


class Answerer:
    """The listening socket and the thread of one member that answers ``responses``.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """

    def __init__(self, host: str) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.bind((host, 0))
            self._listener.listen(64)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self.port = int(self._listener.getsockname()[1])
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="elasticd-answer", daemon=True)
        self._thread.start()

    def close(self, bound_s: float) -> None:
        """Stop answering: the thread ends within ``bound_s`` (it wakes when the listener closes)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(bound_s)
        self._listener.close()

    def _run(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not sel.select(ANSWER_IDLE_S):
                    continue
                try:
                    conn, _ = self._listener.accept()
                except BlockingIOError:
                    continue
                except OSError:  # closed under us: the member closes
                    return
                with conn:
                    conn.settimeout(ANSWER_SEND_S)
                    with contextlib.suppress(OSError):
                        conn.sendall(ANSWER)


def responses(targets: Sequence[tuple[str, int]], timeout_s: float) -> list[Response]:
    """For each (host, port) of a member's answering thread, what came back within ``timeout_s``
    (see ``Response``); port 0 is ``UNASKED``. Up to ``RESPONSES_BATCH`` are asked at once, each batch
    under one deadline; the call returns as soon as every target of a batch has answered or closed."""
    out = [Response.UNASKED] * len(targets)
    for start in range(0, len(targets), RESPONSES_BATCH):
        _ask(targets, range(start, min(start + RESPONSES_BATCH, len(targets))), out, timeout_s)
    return out


def _ask(targets: Sequence[tuple[str, int]], batch: range, out: list[Response], timeout_s: float) -> None:
    sel = selectors.DefaultSelector()
    pending: dict[socket.socket, int] = {}
    try:
        for i in batch:
            host, port = targets[i]
            addr = numeric_address(host, port)
            if addr is None:
                continue
            try:
                s = socket.socket(addr[0], socket.SOCK_STREAM)
            except OSError:  # out of descriptors: decides nothing
                continue
            s.setblocking(False)
            err = s.connect_ex(addr[1])
            if err not in (0, *_IN_PROGRESS):
                out[i] = Response.CLOSED if err == errno.ECONNREFUSED else Response.UNASKED
                s.close()
                continue
            out[i] = Response.SILENT  # until its byte comes
            pending[s] = i
            sel.register(s, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                s = key.fileobj
                assert isinstance(s, socket.socket)
                i = pending.pop(s)
                sel.unregister(s)
                try:
                    got = s.recv(1)
                except OSError as exc:
                    got = b"" if exc.errno == errno.ECONNREFUSED else None
                out[i] = Response.ANSWERED if got == ANSWER else Response.CLOSED if got == b"" else Response.UNASKED
                s.close()
    finally:
        for s in pending:
            s.close()
        sel.close()
