"""``elasticd.sdnotify``: the exact datagrams systemd would receive, and best effort without it.

Each test binds its own ``AF_UNIX`` datagram socket, in ``tmp_path`` or in the abstract namespace,
and plays systemd's side of ``NOTIFY_SOCKET``.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from elasticd.agent.sdnotify import Notifier, watchdog_interval

pytestmark = pytest.mark.timeout(30)

RECV_TIMEOUT_S = 5.0


def _bind(address: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.settimeout(RECV_TIMEOUT_S)  # a missing datagram fails the test instead of hanging it
    server.bind(address)
    return server


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A listening notify socket as a filesystem path: (NOTIFY_SOCKET value, server socket)."""
    path = str(tmp_path / "notify")
    assert len(path.encode()) < 108, f"AF_UNIX path too long for this test: {path}"
    server = _bind(path)
    try:
        yield path, server
    finally:
        server.close()


@pytest.fixture
def abstract_systemd() -> Iterator[tuple[str, socket.socket]]:
    """The same in the abstract namespace, as systemd's per-service sockets may be (``@name``)."""
    name = f"elasticd-test-{os.getpid()}-{uuid.uuid4().hex}"
    server = _bind("\0" + name)
    try:
        yield "@" + name, server
    finally:
        server.close()


MESSAGES: list[tuple[str, Callable[[Notifier], bool], bytes]] = [
    ("ready", lambda n: n.ready(), b"READY=1\n"),
    ("watchdog", lambda n: n.watchdog(), b"WATCHDOG=1\n"),
    (
        "status",
        lambda n: n.status("generation 3, world 4/2..8, step 1200"),
        b"STATUS=generation 3, world 4/2..8, step 1200\n",
    ),
    ("status_multiline", lambda n: n.status("draining\nstep 7"), b"STATUS=draining step 7\n"),
    ("stopping", lambda n: n.stopping(), b"STOPPING=1\n"),
    ("extend_timeout", lambda n: n.extend_timeout(timedelta(seconds=2.5)), b"EXTEND_TIMEOUT_USEC=2500000\n"),
    (
        "several_fields",
        lambda n: n.notify(READY=1, STATUS="joined generation 1"),
        b"READY=1\nSTATUS=joined generation 1\n",
    ),
    ("bool_value", lambda n: n.notify(WATCHDOG=True), b"WATCHDOG=1\n"),
]


@pytest.mark.parametrize(("send", "expected"), [(m[1], m[2]) for m in MESSAGES], ids=[m[0] for m in MESSAGES])
def test_sends_exact_datagram_to_path_socket(
    systemd: tuple[str, socket.socket], send: Callable[[Notifier], bool], expected: bytes
) -> None:
    path, server = systemd
    with Notifier(path) as notifier:
        assert notifier.enabled
        assert send(notifier) is True
    assert server.recv(4096) == expected


@pytest.mark.parametrize(("send", "expected"), [(m[1], m[2]) for m in MESSAGES], ids=[m[0] for m in MESSAGES])
def test_sends_exact_datagram_to_abstract_socket(
    abstract_systemd: tuple[str, socket.socket], send: Callable[[Notifier], bool], expected: bytes
) -> None:
    address, server = abstract_systemd
    with Notifier(address) as notifier:
        assert send(notifier) is True
    assert server.recv(4096) == expected


def test_one_datagram_per_call_in_order(systemd: tuple[str, socket.socket]) -> None:
    path, server = systemd
    with Notifier(path) as notifier:
        notifier.watchdog()
        notifier.status("waiting for 2 more workers")
        notifier.ready()
        notifier.stopping()
    got = [server.recv(4096) for _ in range(4)]
    assert got == [b"WATCHDOG=1\n", b"STATUS=waiting for 2 more workers\n", b"READY=1\n", b"STOPPING=1\n"]


@pytest.mark.parametrize("path", [None, ""], ids=["none", "empty"])
def test_disabled_notifier_is_a_no_op(path: str | None) -> None:
    with capture_logs() as logs:
        notifier = Notifier(path)
        assert not notifier.enabled
        results = [
            notifier.ready(),
            notifier.watchdog(),
            notifier.status("x"),
            notifier.stopping(),
            notifier.extend_timeout(timedelta(seconds=1)),
            notifier.notify(READY=1),
        ]
        notifier.close()
    assert results == [False] * 6
    assert logs == []


def test_missing_socket_does_not_raise_and_warns_once(tmp_path: Path) -> None:
    notifier = Notifier(str(tmp_path / "no-such-socket"))
    with capture_logs() as logs:
        assert notifier.ready() is False
        assert notifier.watchdog() is False
        assert notifier.status("still here") is False
    assert [e["event"] for e in logs] == ["sd_notify_failed"]
    assert logs[0]["log_level"] == "warning"
    assert logs[0]["socket"] == str(tmp_path / "no-such-socket")
    assert logs[0]["fields"] == ["READY"]
    assert "FileNotFoundError" in logs[0]["error"]


def test_socket_closed_by_systemd_does_not_raise(systemd: tuple[str, socket.socket]) -> None:
    path, server = systemd
    notifier = Notifier(path)
    assert notifier.watchdog() is True
    server.close()  # the path stays, nobody listens: ECONNREFUSED
    with capture_logs() as logs:
        assert notifier.watchdog() is False
        assert notifier.watchdog() is False
    assert [e["event"] for e in logs] == ["sd_notify_failed"]
    notifier.close()


def test_closed_notifier_does_not_raise(systemd: tuple[str, socket.socket]) -> None:
    path, _server = systemd
    notifier = Notifier(path)
    notifier.close()
    with capture_logs() as logs:
        assert notifier.ready() is False
    assert [e["event"] for e in logs] == ["sd_notify_failed"]


def test_missing_abstract_socket_does_not_raise() -> None:
    with capture_logs() as logs:
        assert Notifier(f"@elasticd-test-nobody-{uuid.uuid4().hex}").ready() is False
    assert [e["event"] for e in logs] == ["sd_notify_failed"]


@pytest.mark.parametrize(
    "fields",
    [{"ready": 1}, {"READY-NOW": 1}, {"STATUS": "two\nlines"}, {"STATUS": "carriage\rreturn"}],
    ids=["lower_case_key", "dash_in_key", "newline_in_value", "cr_in_value"],
)
def test_malformed_fields_are_a_programming_error(
    systemd: tuple[str, socket.socket], fields: dict[str, str | int]
) -> None:
    path, server = systemd
    server.settimeout(0)
    with Notifier(path) as notifier, pytest.raises(ValueError):
        notifier.notify(**fields)
    with pytest.raises(BlockingIOError):
        server.recv(4096)  # nothing half-formed was sent


def test_malformed_fields_raise_even_when_disabled() -> None:
    # A bug must show up in tests and on laptops too, not only under systemd.
    with pytest.raises(ValueError):
        Notifier(None).notify(status="lower case")


WATCHDOG_CASES: list[tuple[str | None, str | None, float | None]] = [
    ("30000000", None, 15.0),  # WatchdogSec=30s
    ("1000000", None, 0.5),
    (" 500000 ", None, 0.25),
    ("3", None, 1.5e-6),
    ("30000000", "<ours>", 15.0),  # WATCHDOG_PID names us
    ("30000000", "<another>", None),  # inherited from a parent: not ours
    ("30000000", "", 15.0),  # WATCHDOG_PID unset or empty: ours
    (None, None, None),  # no WatchdogSec
    ("", None, None),
    ("0", None, None),
    ("-5", None, None),
    ("thirty", None, None),
    ("1.5e6", None, None),  # the variable is an integer count of microseconds
]


@pytest.mark.parametrize(("usec", "pid", "expected"), WATCHDOG_CASES)
def test_watchdog_interval_is_half_of_watchdog_usec(usec: str | None, pid: str | None, expected: float | None) -> None:
    # Named, not numbered, in the table: a test's id must not change with the process that collects it.
    pid = {"<ours>": str(os.getpid()), "<another>": str(os.getpid() + 1)}.get(pid or "", pid)
    got = watchdog_interval(usec, pid)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


def test_watchdog_interval_logs_a_garbage_value() -> None:
    with capture_logs() as logs:
        assert watchdog_interval("thirty") is None
        assert watchdog_interval(None) is None
    assert [(e["event"], e["watchdog_usec"]) for e in logs] == [("sd_watchdog_usec_ignored", "thirty")]
