"""A tiny sd_notify client: tells systemd that the agent is ready, alive, busy with what, or stopping.

Owns the sd_notify wire protocol: ``KEY=VALUE\\n`` lines in one datagram over an ``AF_UNIX`` /
``SOCK_DGRAM`` socket, including abstract-namespace addresses (``@name``), and the arithmetic of
``WATCHDOG_USEC``. It does not read ``os.environ`` (``settings.py`` does; the entry point passes the
values of ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` in), does not decide when to
send what (the agent does), and imports nothing from elasticd, so it stays torch-free.

Notification is best effort, as in ``sd_notify(3)``: with no socket configured every call is a
no-op, and a socket that is missing, refuses, or stays full is logged once and never raises, since
losing a notification must not take a training job down. Messages: ``READY=1`` (startup done),
``WATCHDOG=1`` (still alive), ``STATUS=<text>`` (one line for ``systemctl status``),
``STOPPING=1`` (drain begun), ``EXTEND_TIMEOUT_USEC=<n>`` (still starting or stopping, give me
longer).
"""

from __future__ import annotations

import os
import re
import socket
from datetime import timedelta
from types import TracebackType

import structlog

log = structlog.get_logger(__name__)

# sd_notify keys are upper-case names (sd_notify(3)); anything else systemd ignores or misreads.
_KEY = re.compile(r"[A-Z_][A-Z0-9_]*")


class Notifier:
    """Sends sd_notify messages to one socket, or does nothing when there is none.

    The socket is created with close-on-exec (Python's default), so spawned workers never inherit
    it; with ``NotifyAccess=main`` systemd would ignore them anyway.
    """

    def __init__(self, socket_path: str | None, send_timeout: timedelta = timedelta(seconds=1)) -> None:
        """Create a notifier.

        Args:
            socket_path: the value of ``NOTIFY_SOCKET``: a filesystem path, or ``@name`` for the
                abstract namespace. ``None`` or ``""`` disables notification (not under systemd).
            send_timeout: bound on one send; systemd drains its socket at once, so a send that
                waits longer means systemd is stuck and the message is dropped.
        """
        self._path = socket_path or None
        self._address: str | None = None
        self._sock: socket.socket | None = None
        self._warned = False
        if self._path is None:
            return
        self._address = "\0" + self._path[1:] if self._path.startswith("@") else self._path
        try:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sock.settimeout(send_timeout.total_seconds())
        except OSError as exc:
            self._warn_once(exc, fields=())

    @property
    def enabled(self) -> bool:
        """Whether a socket was configured (not whether systemd is listening on it)."""
        return self._path is not None

    def ready(self) -> bool:
        """Send ``READY=1``: startup is complete (the agent's node has joined the job).

        Returns:
            True if the datagram was sent; False when disabled or the send failed (logged once).
        """
        return self.notify(READY=1)

    def watchdog(self) -> bool:
        """Send ``WATCHDOG=1``: the agent loop is alive; resets systemd's ``WatchdogSec`` timer."""
        return self.notify(WATCHDOG=1)

    def status(self, text: str) -> bool:
        """Send ``STATUS=<text>``, shown by ``systemctl status``; line breaks become spaces."""
        return self.notify(STATUS=" ".join(text.splitlines()))

    def stopping(self) -> bool:
        """Send ``STOPPING=1``: a drain has begun; systemd shows the unit as deactivating."""
        return self.notify(STOPPING=1)

    def extend_timeout(self, span: timedelta) -> bool:
        """Send ``EXTEND_TIMEOUT_USEC``: still starting or stopping; allow ``span`` more from now.

        Only has an effect while systemd is timing a start or a stop (``TimeoutStartSec``,
        ``TimeoutStopSec``); repeat it before ``span`` runs out.
        """
        return self.notify(EXTEND_TIMEOUT_USEC=int(span.total_seconds() * 1_000_000))

    def notify(self, **fields: str | int) -> bool:
        """Send the fields as one datagram, ``KEY=VALUE`` per line, in the order given.

        Args:
            fields: sd_notify variables, e.g. ``notify(READY=1, STATUS="joined generation 3")``.

        Returns:
            True if the datagram was sent; False when disabled or the send failed (logged once).

        Raises:
            ValueError: a key is not an upper-case sd_notify name, or a value holds a line break;
                these are programming errors, not conditions of the socket.
        """
        lines: list[str] = []
        for key, value in fields.items():
            if not _KEY.fullmatch(key):
                raise ValueError(f"sd_notify key must be upper-case letters, digits and '_', got {key!r}")
            text = str(int(value)) if isinstance(value, bool) else str(value)
            if "\n" in text or "\r" in text:
                raise ValueError(f"sd_notify value of {key} must be one line, got {text!r}")
            lines.append(f"{key}={text}\n")
        if self._sock is None or self._address is None or not lines:
            return False
        try:
            self._sock.sendto("".join(lines).encode("utf-8"), self._address)
        except OSError as exc:
            self._warn_once(exc, fields=tuple(fields))
            return False
        return True

    def close(self) -> None:
        """Close the socket; later calls return False (and log once)."""
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> Notifier:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _warn_once(self, exc: OSError, fields: tuple[str, ...]) -> None:
        # One line, not one per watchdog tick: a missing socket stays missing.
        if self._warned:
            return
        self._warned = True
        log.warning(
            "sd_notify_failed",
            socket=self._path,
            fields=list(fields),
            error=f"{type(exc).__name__}: {exc}",
            note="further sd_notify failures are not logged",
        )


def watchdog_interval(usec: str | None, pid: str | None = None) -> float | None:
    """How often to send ``WATCHDOG=1``: half of ``WatchdogSec``, as ``sd_watchdog_enabled(3)`` advises.

    Args:
        usec: the value of ``WATCHDOG_USEC`` (microseconds), or None when it is unset.
        pid: the value of ``WATCHDOG_PID``, if set: the watchdog is this process's only when it
            names our PID (a child that inherited the variables must not ping).

    Returns:
        Seconds between pings, or None when there is no watchdog for this process (unset, empty,
        not a positive integer (logged), or meant for another PID).
    """
    if not usec:
        return None
    if pid and pid.strip() != str(os.getpid()):
        return None
    try:
        micros = int(usec.strip())
    except ValueError:
        micros = 0
    if micros <= 0:
        log.warning("sd_watchdog_usec_ignored", watchdog_usec=usec, reason="not a positive integer")
        return None
    return micros / 1_000_000 / 2
