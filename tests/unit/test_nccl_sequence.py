"""nccl.py: the order of the NCCL calls, without a GPU (the torch calls are a recording fake).

Environment before the device and any group; device bound; non-blocking init; eager connect; a
ready probe bounded by the build deadline; a failed or given-up build aborted, never destroyed;
an abort on a bounded helper thread, and the hard exit when, and only when, it hangs. Also the
environment itself (``settings.nccl_environ``) and how the agent passes it on (``child_environ``).
The real calls run in ``tests/programs/nccl_smoke.py`` on a GPU machine.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import SimpleNamespace

import pytest
import structlog
import torch
from torch._C._distributed_c10d import HashStore

from elasticd.config import Timeouts
from elasticd.errors import CollectiveTimeout, PeerLost
from elasticd.retry import Abandon, Bound, Deadline, never
from elasticd.settings import child_environ, environ_defaults, nccl_environ
from elasticd.worker.group.nccl import NcclGroups, request_nonblocking_init
from elasticd.worker.group.process_group import GroupFactory, StoreServer

pytestmark = pytest.mark.timeout(30)

DEVICE = torch.device("cuda", 1)  # a device object needs no GPU
TIMEOUTS = Timeouts(group_abort_s=2.0, abort_poll_s=0.004)
STORE = HashStore()  # never used by the fake


class Handle:
    """A backend or a group: only its name and its abort matter here."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    def abort(self) -> None:
        """Never called: ``FakeNccl.abort`` records the abort instead."""


class FakeWork:
    def __init__(self, done: Callable[[], bool]) -> None:
        self._done = done

    def is_completed(self) -> bool:
        return self._done()

    def wait(self) -> bool:
        return True


class FakeNccl:
    """Records each call as (name, detail) in ``calls`` (shared with the fake environment)."""

    def __init__(
        self,
        calls: list[tuple[str, object]],
        *,
        ready: Callable[[], bool] = lambda: True,
        fail: str = "",
        abort_until: threading.Event | None = None,
    ) -> None:
        self.calls, self._ready, self._fail, self._abort_until = calls, ready, fail, abort_until
        self.abort_threads: list[str] = []
        self.builds = 0

    def _call(self, name: str, detail: object) -> None:
        self.calls.append((name, detail))
        if name == self._fail:
            raise RuntimeError(f"{name} failed")

    def set_device(self, device: object) -> None:
        self._call("set_device", device)

    def new_backend(
        self, store: object, rank: int, world_size: int, timeout: timedelta, nonblocking: bool
    ) -> tuple[Handle, bool]:
        self.builds += 1
        self._call(
            "new_backend",
            {"rank": rank, "world_size": world_size, "timeout_s": timeout.total_seconds(), "nonblocking": nonblocking},
        )
        return Handle(f"backend{self.builds}"), nonblocking

    def bind(self, backend: Handle, store: object, rank: int, world_size: int, device: object) -> Handle:
        self._call("bind", (backend, device))
        return Handle(f"pg{self.builds}")

    def eager_connect(self, backend: Handle, device: object) -> None:
        self._call("eager_connect", (backend, device))

    def probe(self, pg: Handle, device: object) -> FakeWork:
        self._call("probe", (pg, device))
        return FakeWork(self._ready)

    def abort(self, target: Handle) -> None:
        self.abort_threads.append(threading.current_thread().name)
        self._call("abort", target)
        if self._abort_until is not None:
            self._abort_until.wait(10)


def groups(
    fake: FakeNccl, on_abort_hung: Callable[[], None] | None = None, timeouts: Timeouts = TIMEOUTS
) -> NcclGroups:
    def environ(values: Mapping[str, str]) -> Mapping[str, str]:
        fake.calls.append(("environ", dict(values)))
        return values

    def must_not_exit() -> None:
        raise AssertionError("hard exit although the abort returned")

    return NcclGroups(
        fake,
        DEVICE,
        timeouts,
        environ=environ,  # type: ignore[arg-type]  # a fake of torch's types
        on_abort_hung=on_abort_hung or must_not_exit,
    )


def names(calls: list[tuple[str, object]]) -> list[str]:
    return [n for n, _ in calls]


def within(span_s: float, abandon: Abandon = never) -> Bound:
    """A build's bound, polled as ``TIMEOUTS`` says."""
    return Bound.after(span_s, poll_s=TIMEOUTS.abort_poll_s, abandon=abandon)


# -- the environment ------------------------------------------------------------------------------


def test_environment_is_set_before_the_device_and_any_group() -> None:
    fake = FakeNccl([])
    nccl = groups(fake)
    assert names(fake.calls) == ["environ", "set_device"]
    assert fake.calls[1] == ("set_device", DEVICE)
    env = fake.calls[0][1]
    assert isinstance(env, dict) and env == nccl.environ
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort the comm, keep the process
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"


@pytest.mark.parametrize(
    ("build_s", "abort_s", "nonblocking_s"),
    [
        (15.0, 30.0, "15"),  # the defaults: the init's own bound
        (60.0, 30.0, "15"),  # half the abort bound: an abort waits for the comm's lock at most that long
        (15.0, 8.0, "4"),
        (0.5, 1.0, "1"),  # whole seconds, at least 1
    ],
)
def test_nonblocking_timeout_fits_inside_the_build_and_abort_bounds(
    build_s: float, abort_s: float, nonblocking_s: str
) -> None:
    env = nccl_environ(Timeouts(group_build_s=build_s, group_abort_s=abort_s))
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == nonblocking_s


def test_environment_defaults_keep_the_operators_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.delenv("TORCH_NCCL_ENABLE_MONITORING", raising=False)
    in_effect = environ_defaults({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_ENABLE_MONITORING": "0"})
    assert in_effect == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "0"}
    assert os.environ["TORCH_NCCL_ENABLE_MONITORING"] == "0"


def test_the_agent_passes_the_defaults_under_its_own_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    env = child_environ({"ELASTICD_LOCAL_RANK": "0"}, nccl_environ(Timeouts()))
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # set for the agent: kept
    assert env["ELASTICD_LOCAL_RANK"] == "0"


@pytest.mark.parametrize(
    ("opts", "applied"),
    [
        (SimpleNamespace(config=SimpleNamespace(blocking=-2147483648)), True),  # NCCL_CONFIG_UNDEF_INT
        (SimpleNamespace(), False),  # a torch without ncclConfig in its options
        (SimpleNamespace(config=SimpleNamespace()), False),  # an NCCL without non-blocking comms
    ],
)
def test_nonblocking_init_is_requested_where_the_option_exists(opts: SimpleNamespace, applied: bool) -> None:
    assert request_nonblocking_init(opts) is applied
    if applied:
        assert opts.config.blocking == 0


# -- the build ------------------------------------------------------------------------------------


def test_a_build_binds_the_device_connects_eagerly_and_waits_until_ready() -> None:
    fake = FakeNccl([])
    nccl = groups(fake)
    pg = nccl.build(STORE, 1, 2, within(5), "generation 3")
    assert repr(pg) == "pg1"
    assert names(fake.calls) == ["environ", "set_device", "new_backend", "bind", "eager_connect", "probe"]
    created = dict(fake.calls)
    assert created["new_backend"] == {
        "rank": 1,
        "world_size": 2,
        "timeout_s": TIMEOUTS.collective_s,
        "nonblocking": True,
    }
    assert repr(created["bind"]) == f"(backend1, {DEVICE!r})"  # the backend, bound to the device
    assert repr(created["eager_connect"]) == f"(backend1, {DEVICE!r})"  # the comm now, not at first use


def test_a_build_past_its_deadline_is_aborted_and_times_out() -> None:
    now = [0.0]

    def not_yet() -> bool:
        now[0] += 1.0  # each poll of the probe costs a second on the manual clock
        return False

    fake = FakeNccl([], ready=not_yet)
    nccl = groups(fake)
    with pytest.raises(CollectiveTimeout, match="not built in time"):
        nccl.build(STORE, 0, 2, Bound(Deadline(3.0, clock=lambda: now[0]), TIMEOUTS.abort_poll_s), "generation 3")
    assert names(fake.calls)[-2:] == ["probe", "abort"]
    assert repr(fake.calls[-1][1]) == "pg1"  # the group, aborted; nothing is ever destroyed
    assert fake.abort_threads == ["elasticd-nccl-abort"]


def test_a_build_given_up_by_its_caller_is_aborted() -> None:
    fake = FakeNccl([])
    gave_up = threading.Event()
    nccl = groups(fake)
    fake.eager_connect = lambda backend, device: gave_up.set()  # type: ignore[method-assign]
    with pytest.raises(PeerLost):
        nccl.build(STORE, 0, 2, within(5, gave_up.is_set), "generation 3")
    assert names(fake.calls)[-1] == "abort" and "probe" not in names(fake.calls)


@pytest.mark.parametrize(
    ("failing", "aborted"),
    [
        ("bind", "backend1"),  # not yet in a group: the backend itself is aborted
        ("eager_connect", "pg1"),
        ("probe", "pg1"),
    ],
)
def test_a_failed_build_is_aborted_and_its_error_raised(failing: str, aborted: str) -> None:
    fake = FakeNccl([], fail=failing)
    with pytest.raises(RuntimeError, match=f"{failing} failed"):
        groups(fake).build(STORE, 0, 2, within(5), "generation 3")
    assert names(fake.calls)[-1] == "abort" and repr(fake.calls[-1][1]) == aborted


def test_a_new_build_waits_until_a_given_up_build_is_aborted() -> None:
    release = threading.Event()
    fake = FakeNccl([], abort_until=release)
    nccl = groups(fake)
    given_up = threading.Event()
    ended: list[BaseException] = []

    def old_build() -> None:
        try:
            nccl.build(STORE, 0, 2, within(5, given_up.is_set), "generation 3")
        except PeerLost as exc:
            ended.append(exc)

    fake.eager_connect = lambda backend, device: given_up.set()  # type: ignore[method-assign]
    t = threading.Thread(target=old_build)
    t.start()
    try:
        deadline = Deadline.after(5)
        while "abort" not in names(fake.calls):  # the old build is stuck in its abort
            assert not deadline.expired()
            release.wait(0.005)
        with pytest.raises(CollectiveTimeout, match="earlier build"):
            nccl.build(STORE, 0, 2, within(0.05), "generation 4")
        assert fake.builds == 1  # nothing was created while the old comm was being aborted
    finally:
        release.set()
        t.join(5)
    assert len(ended) == 1
    del fake.eager_connect
    assert repr(nccl.build(STORE, 0, 2, within(5), "generation 5")) == "pg2"


# -- the abort ------------------------------------------------------------------------------------


def test_an_abort_that_returns_does_not_exit() -> None:
    fake = FakeNccl([])
    with structlog.testing.capture_logs() as logs:
        assert groups(fake).abort(Handle("pg"), "generation 2")
    assert names(fake.calls)[-1] == "abort" and fake.abort_threads == ["elasticd-nccl-abort"]
    assert "process_group_aborted" in [e["event"] for e in logs]


def test_an_abort_that_raises_is_logged_and_does_not_exit() -> None:
    fake = FakeNccl([], fail="abort")
    with structlog.testing.capture_logs() as logs:
        assert groups(fake).abort(Handle("pg"), "generation 2")
    assert [e["error"] for e in logs if e["event"] == "process_group_abort_failed"] == ["abort failed"]


def test_an_abort_that_hangs_logs_then_exits_hard() -> None:
    release = threading.Event()
    fake = FakeNccl([], abort_until=release)
    logged_first: list[bool] = []
    with structlog.testing.capture_logs() as logs:
        nccl = groups(
            fake,
            on_abort_hung=lambda: logged_first.append(any(e["event"] == "process_group_abort_hung" for e in logs)),
            timeouts=Timeouts(group_abort_s=0.05, abort_poll_s=0.004),
        )
        try:
            assert nccl.abort(Handle("pg"), "generation 2") is False
        finally:
            release.set()
    assert logged_first == [True]  # called once, after the log line
    hung = [e for e in logs if e["event"] == "process_group_abort_hung"]
    assert hung[0]["exit_code"] == 75 and hung[0]["log_level"] == "critical"


# -- through the group factory ------------------------------------------------------------------


def test_the_factory_builds_and_retires_nccl_groups_through_the_sequence() -> None:
    fake = FakeNccl([])
    timeouts = Timeouts(group_build_s=5.0, group_abort_s=2.0, abort_poll_s=0.004)
    server = StoreServer("127.0.0.1", timeouts)
    nccl = NcclGroups(
        fake,
        torch.device("cuda", 0),
        timeouts,
        environ=lambda values: values,  # type: ignore[arg-type]
        on_abort_hung=lambda: None,
    )
    factory = GroupFactory(server, "127.0.0.1", "nccl", 0, timeouts, nccl=nccl)
    group = factory.build(7, 0, 1, "127.0.0.1", server.port, Bound.after(5, poll_s=timeouts.abort_poll_s))
    assert (repr(group.pg), group.backend, group.device) == ("pg1", "nccl", torch.device("cuda", 0))
    factory.retire(group)
    assert group.pg is None
    assert names(fake.calls) == ["set_device", "new_backend", "bind", "eager_connect", "probe", "abort"]
    assert repr(fake.calls[-1][1]) == "pg1" and fake.abort_threads == ["elasticd-nccl-abort"]
    factory.drain(Deadline.after(5))
