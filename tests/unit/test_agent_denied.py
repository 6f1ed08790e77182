"""etcd's permission denied in the node agent and its threads: never retried, never a
spin. The agent exits 2 with the one clear message at its start (both modes) and when etcd starts
refusing it later (its presence and job-reader threads end and hand the error to the loop); the
event writer drops its queue and stops. The store is the fake, refusing the job's keys as etcd
refuses a role that does not cover them."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import psutil
import pytest
import structlog

from elasticd.agent.elastic import Agent
from elasticd.agent.jobview import JobReader
from elasticd.agent.restart import GroupRestartAgent
from elasticd.config import AgentConfig, EtcdConfig, Timeouts, WorldConfig
from elasticd.errors import PermissionDenied
from elasticd.events import EventLog
from elasticd.wire.keys import Keys
from tests.fakes import GuardedStore

pytestmark = pytest.mark.timeout(60)

MESSAGE = (
    "permission denied for job j (etcd user other): the user's role does not cover /elasticd/j/ -- see "
    "`elasticctl auth setup-job`"
)
KEYS = Keys("/elasticd", "j")


class DenyingStore(GuardedStore):
    """The fake etcd, refusing every key operation while ``deny`` is set (leases are not checked by
    etcd's roles); ``refusals`` counts them."""

    def __init__(self, deny: bool = True) -> None:
        super().__init__()
        self.deny = deny
        self.refusals = 0

    def guard(self, call: str) -> None:
        if self.deny and not call.endswith("_lease"):
            self.refusals += 1
            raise PermissionDenied(MESSAGE)


def _config(program: Sequence[str], **settings: object) -> AgentConfig:
    fields: dict[str, object] = dict(
        program=tuple(program),
        node_id="n",
        world=WorldConfig(job_id="j"),
        poll_interval_s=0.02,
        kill_wait_s=2.0,
        etcd=EtcdConfig(user="other", password="pw"),
        timeouts=Timeouts(shutdown_grace_s=0.5, keepalive_s=0.1, lease_ttl_s=1.0),
    )
    fields.update(settings)
    return AgentConfig(**fields)  # type: ignore[arg-type]


def _events(logs: Sequence[Mapping[str, object]], name: str) -> list[Mapping[str, object]]:
    return [e for e in logs if e["event"] == name]


@pytest.mark.parametrize("mode", ["elastic", "restart"])
def test_an_agent_whose_role_does_not_cover_the_job_exits_2_at_once(mode: str) -> None:
    store = DenyingStore()
    config = _config([sys.executable, "-c", "raise SystemExit(9)"], mode=mode)
    agent = GroupRestartAgent(config, store) if mode == "restart" else Agent(config, store)
    started = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        outcome = agent.run(install_signals=False)
    assert (outcome.exit_code, outcome.reason) == (2, MESSAGE)
    assert time.monotonic() - started < 5  # not etcd_outage_s of waiting, as for an etcd that is away
    assert store.refusals == 1
    assert not _events(logs, "worker_started")
    assert not _events(logs, "agent_waiting_for_etcd")
    assert _events(logs, "agent_stopped")[-1]["exit_code"] == 2


def test_an_agent_that_etcd_starts_refusing_stops_its_workers_and_exits_2() -> None:
    store = DenyingStore(deny=False)
    agent = Agent(_config([sys.executable, "-c", "import time; time.sleep(60)"], hang_timeout_s=0), store)
    result: list[object] = []
    with structlog.testing.capture_logs() as logs:
        runner = threading.Thread(target=lambda: result.append(agent.run(install_signals=False)))
        runner.start()
        deadline = time.monotonic() + 20
        while not _events(logs, "worker_started") or store.get(KEYS.node("n")) is None:
            assert time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.02)
        store.deny = True  # the role was taken away
        denied_at = time.monotonic()
        runner.join(20)
    assert not runner.is_alive()
    (outcome,) = result
    assert (outcome.exit_code, outcome.reason) == (2, MESSAGE)  # type: ignore[attr-defined]
    assert time.monotonic() - denied_at < 5
    assert _events(logs, "node_record_denied") and _events(logs, "agent_permission_denied")
    (started,) = _events(logs, "worker_started")
    assert not psutil.pid_exists(int(started["pid"]))  # type: ignore[call-overload]  # stopped and reaped
    refusals = store.refusals
    time.sleep(0.5)
    assert store.refusals == refusals  # no thread goes on asking


def test_the_job_reader_ends_on_permission_denied_and_keeps_it() -> None:
    store = DenyingStore()
    with structlog.testing.capture_logs() as logs:
        reader = JobReader(store, KEYS, time.monotonic, 0.01)
        reader._thread.join(5)
    assert not reader._thread.is_alive()
    assert str(reader.denied) == MESSAGE and store.refusals == 1
    assert [e["error"] for e in _events(logs, "job_read_denied")] == [MESSAGE]
    assert reader.latest() is None


def test_the_event_log_drops_its_queue_and_stops_on_permission_denied() -> None:
    store = DenyingStore()
    log = EventLog(store, KEYS, "agent.n.1", keep=10)
    with structlog.testing.capture_logs() as logs:
        for i in range(3):
            log.record("worker_exited", i=i)
        assert log.flush(5)  # nothing left: dropped, not retried
        log.record("worker_exited", i=3)  # after it stopped: ignored, never raises
        log.close(1)
    assert store.refusals == 1
    assert log.written == 0 and log.dropped >= 1
    assert len(_events(logs, "event_write_denied")) == 1
    store.deny = False
    assert store.get_prefix(KEYS.events) == []


def test_the_restart_agent_exits_2_when_etcd_starts_refusing_its_reads() -> None:
    store = DenyingStore(deny=False)
    config = replace(
        _config([sys.executable, "-c", "import time; time.sleep(60)"], mode="restart"),
        world=WorldConfig(job_id="j", min_workers=1, max_workers=1),
    )
    agent = GroupRestartAgent(config, store)
    result: list[object] = []
    with structlog.testing.capture_logs() as logs:
        runner = threading.Thread(target=lambda: result.append(agent.run(install_signals=False)))
        runner.start()
        deadline = time.monotonic() + 20
        while not _events(logs, "worker_started"):
            assert time.monotonic() < deadline, "the agent did not start its worker"
            time.sleep(0.02)
        store.deny = True
        runner.join(20)
    assert not runner.is_alive()
    (outcome,) = result
    assert (outcome.exit_code, outcome.reason) == (2, MESSAGE)  # type: ignore[attr-defined]
    assert _events(logs, "agent_permission_denied")
