"""The node agent for real: agents as separate processes, a real etcd, real gloo workers.

Each agent runs in its own session, so teardown kills it and every worker it started with one
``killpg`` on its pid (the workers stay in the agent's process group).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import etcd3
import pytest

from elasticd.testing.audit import check_dir, read_lines
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import REPO_ROOT, free_port, log_events
from elasticd.wire.keys import Keys
from elasticd.wire.records import FinishedRecord, encode
from tests.jobs import job_factory, wait_until

AGENT = [sys.executable, "-c", "import sys; from elasticd.cli import agent_main; sys.exit(agent_main())"]
MLP = [sys.executable, "agents/mlp.py", "--step-sleep", "0.02", "--steps", "300"]
STOPPED_STEPS = 650  # ~20 s: the three stops and rejoins take ~300 steps from step 5 (x2 for a loaded machine)
_ids = itertools.count()


def _env(**settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["ELASTICD_RESUME_HOLD_S"] = "1"  # a whole-job restart here has nothing cut off from etcd
    env.update({"ELASTICD_" + k.upper(): str(v) for k, v in settings.items()})
    return env


class AgentProcess:
    """One ``elasticd`` process; its log (the agent's and its workers' lines) goes to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                AGENT + argv, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self, name: str) -> list[dict[str, object]]:
        """The agent's log lines of event ``name``."""
        return log_events(self.log_path, name)

    def kill_group(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the agent and the workers it started
        except ProcessLookupError:
            pass
        self.wait(10)


class AgentJob:
    """One job run by agents; each agent's workers append to ``<dir>/<node>.jsonl`` (the audit log)."""

    def __init__(self, etcd: EtcdServer, workdir: Path, **settings: object) -> None:
        self.etcd = etcd
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.job_id = f"agent{os.getpid()}x{next(_ids)}"
        self.settings = settings
        self.agents: dict[str, AgentProcess] = {}

    def audit_path(self, node: str) -> Path:
        return self.dir / f"{node}.jsonl"

    def start(self, node: str, *flags: str, program: list[str] | None = None, steps: int = 300) -> AgentProcess:
        prog = program if program is not None else [*MLP[:-1], str(steps), "--audit", str(self.audit_path(node))]
        argv = ["--etcd", self.etcd.endpoint, "--job-id", self.job_id, "--node-id", node, *flags, "--", *prog]
        agent = AgentProcess(argv, _env(**self.settings), self.dir / f"agent-{node}.log")
        self.agents[node] = agent
        return agent

    def commits(self, node: str) -> list[dict[str, object]]:
        path = self.audit_path(node)
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # the last line of a killed worker may be cut short
        return [r for r in rows if r.get("event") == "commit"]

    def commits_at_world(self, node: str, world: int) -> int:
        return sum(1 for r in self.commits(node) if r["world_size"] == world)

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        wait_until(cond, timeout, what, self.logs_tail)

    def logs_tail(self, n: int = 25) -> str:
        return "\n".join(
            f"--- agent {node}\n" + "\n".join(a.log_text().splitlines()[-n:]) for node, a in self.agents.items()
        )

    def stop(self) -> None:
        for a in self.agents.values():
            a.kill_group()


@pytest.fixture
def agent_job(etcd_server: EtcdServer, tmp_path: Path) -> Iterator[Callable[..., AgentJob]]:
    with job_factory(lambda d, settings: AgentJob(etcd_server, d, **settings), tmp_path) as make:
        yield make


def _worker_pid(agent: AgentProcess) -> int:
    started = agent.events("worker_started")
    assert started, agent.log_text()[-3000:]
    return int(started[-1]["pid"])  # type: ignore[call-overload]


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(120)
def test_sigkill_of_a_worker_revokes_its_lease_at_once_and_the_agent_restarts_it(agent_job):
    # A 10 s lease: survivors that waited for the dead worker's lease to expire would show it.
    job = agent_job(lease_ttl_s=10)
    # 600 steps: the restarted worker (a fresh Python importing torch) must be back before the end.
    # b runs its node relay (relay.node): its workers, the restarted one too, follow the job
    # through it, under member leases of the relay, and the victim's ends at once.
    a = job.start("a", "--nnodes", "1:2", steps=600)
    b = job.start("b", "--nnodes", "1:2", "--relay", "true", steps=600)
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 60, "both workers to train together")
    victim = _worker_pid(b)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    job.wait_for(lambda: any(r["t"] > killed_at for r in job.commits("a")), 10, "the survivor's next commit")
    first_after = min(float(r["t"]) for r in job.commits("a") if r["t"] > killed_at)  # type: ignore[arg-type]
    assert first_after - killed_at < 3.0, f"the survivor went on only {first_after - killed_at:.2f} s after the kill"
    assert a.wait(90) == 0, job.logs_tail()
    assert b.wait(30) == 0, job.logs_tail()
    ended = b.events("member_leases_ended")  # its connection to the relay closed
    assert ended and ended[0]["cause"] == "its worker's connection closed", job.logs_tail()
    exited = [e for e in b.events("worker_exited") if e["pid"] == victim]
    assert exited and exited[0]["kind"] == "signaled" and exited[0]["signal"] == signal.SIGKILL
    assert len(b.events("worker_started")) == 2  # the restart
    assert b.events("agent_stopped")[-1]["reason"] == "workers_finished"
    assert b.events("relay_started") and len(b.events("relay_connected")) == 2, b.log_text()[-2000:]
    assert "relay_lost" not in b.log_text() and not a.events("relay_connected")
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == 600
    # the restarted worker rejoined as a newcomer: it synced into a world of 2 after the kill
    rejoined = [r for r in read_lines([job.audit_path("b")]) if r["event"] == "sync" and r["t"] > killed_at]
    assert rejoined and rejoined[0]["world_size"] == 2, rejoined
    assert len(set(rep.final_checksums)) == 1


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(120)
def test_a_sigstopped_worker_loses_its_lease_to_its_agent_and_rejoins_after_sigcont(agent_job):
    # A 10 s lease: without the agent's revocation the other worker would wait for it to expire.
    # Three stops, each at a random point of a step: a stop that lands after the stopped worker's
    # sum arrived leaves it holding a step its peer may redo without it; continued, it applies it as
    # a branch that its rejoin discards (the audit: never a step in two generations).
    job = agent_job(lease_ttl_s=10, stopped_worker_s=0.5)
    a = job.start("a", "--nnodes", "1:2", steps=STOPPED_STEPS)
    b = job.start("b", "--nnodes", "1:2", steps=STOPPED_STEPS)
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 60, "both workers to train together")
    victim = _worker_pid(b)
    for _ in range(3):
        stopped_at = time.time()
        os.kill(victim, signal.SIGSTOP)
        try:
            job.wait_for(
                lambda: any(r["t"] > stopped_at and r["world_size"] == 1 for r in job.commits("a")),
                8,
                "the other worker to commit alone, before the stopped one's 10 s lease could expire",
            )
            time.sleep(1.0)  # stopped for a while longer: nothing of it may be applied meanwhile
        finally:
            os.kill(victim, signal.SIGCONT)
        continued_at = time.time()
        job.wait_for(
            lambda: any(r["t"] > continued_at and r["world_size"] == 2 for r in job.commits("b")),
            60,
            "the continued worker to rejoin (not restarted) and commit at world 2 again",
        )
    assert a.wait(90) == 0, job.logs_tail()
    assert b.wait(30) == 0, job.logs_tail()
    stops = b.events("worker_stopped")
    assert [e["pid"] for e in stops] == [victim] * 3, job.logs_tail()
    # its member lease of the node's relay released by the agent (the relay's default)
    assert [e["pid"] for e in b.events("worker_released")][:3] == [victim] * 3, job.logs_tail()
    assert [e["pid"] for e in b.events("worker_continued")] == [victim] * 3, job.logs_tail()
    assert len(b.events("worker_started")) == 1, "the stopped worker is not killed or restarted"
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == STOPPED_STEPS and len(set(rep.final_checksums)) == 1


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(120)
def test_sigterm_drains_the_node_and_the_job_goes_on_at_world_1(agent_job):
    job = agent_job()
    a = job.start("a", "--nnodes", "1:2")
    b = job.start("b", "--nnodes", "1:2")
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 60, "both workers to train together")
    sent = time.monotonic()
    b.proc.send_signal(signal.SIGTERM)
    assert b.wait(20) == 0, job.logs_tail()
    assert time.monotonic() - sent < 10
    assert b.events("agent_stopped")[-1]["reason"] == "drained"
    assert b.events("workers_signalled") and not b.events("workers_killed")
    assert '"drained"' in b.log_text()  # the worker's own line: it finished its step and left
    assert not b.events("worker_restart_scheduled")
    assert a.wait(90) == 0, job.logs_tail()
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == 300
    assert rep.step_world[300] == 1


@pytest.mark.timeout(60)
def test_a_worker_that_always_fails_exhausts_the_restart_budget(agent_job):
    job = agent_job()
    started = time.monotonic()
    agent = job.start(
        "c",
        "--max-restarts",
        "2",
        "--restart-backoff-initial-s",
        "0.05",
        program=[sys.executable, "-c", "import sys; sys.exit(1)"],
    )
    assert agent.wait(30) == 1, agent.log_text()[-3000:]
    assert time.monotonic() - started < 30
    text = agent.log_text()
    assert '"restarts_exhausted"' in text
    assert "restarts_exhausted: worker 0" in text.splitlines()[-1]  # the reason, on stderr
    assert len(agent.events("worker_started")) == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("toml", "argv", "message"),
    [
        ("program = ['true']\nbogus_field = 1\n", [], "elasticd: bogus_field: unknown setting in "),
        ("program = ['true']\nlease_ttl_s = 'ten'\n", [], "elasticd: lease_ttl_s: expected a number, got 'ten'"),
        ("max_restarts = 1\n", [], "elasticd: program: no training program given"),
        (None, ["--max-restarts", "x", "--", "true"], "elasticd: max_restarts: expected an integer, got 'x'"),
    ],
    ids=["unknown field", "ill-typed field", "no program", "ill-typed flag"],
)
def test_bad_config_exits_2_with_one_line_naming_the_field(
    tmp_path: Path, toml: str | None, argv: list[str], message: str
) -> None:
    if toml is not None:
        (tmp_path / "elasticd.toml").write_text(toml)
        argv = ["--config", str(tmp_path / "elasticd.toml"), *argv]
    proc = subprocess.run(AGENT + argv, env=_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), proc.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["elastic", "restart"])
def test_an_etcd_that_never_answers_is_a_clear_error_with_exit_2_before_any_worker_starts(mode: str) -> None:
    """The agent says what it waits for while it waits, and gives up after etcd_outage_s with exit 2
    (systemd does not restart it): an etcd that never answered is most often a wrong --etcd."""
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.run(
        AGENT + ["--mode", mode, "--etcd", endpoint, "--etcd-outage-s", "3", "--", "true"],
        env=_env(),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=40,
    )
    assert proc.returncode == 2, proc
    assert proc.stderr.startswith(
        f"elasticd: etcd_unreachable: no etcd at {endpoint} answered since the agent started, "
        "for etcd_outage_s (3 s); check --etcd"
    ), proc.stderr
    waiting = [json.loads(line) for line in proc.stdout.splitlines() if '"agent_waiting_for_etcd"' in line]
    assert waiting and waiting[0]["endpoints"] == [endpoint], proc.stdout
    assert '"worker_started"' not in proc.stdout


@pytest.mark.timeout(90)
def test_an_agent_started_during_an_etcd_outage_waits_for_etcd_and_runs(tmp_path: Path) -> None:
    """An agent started while etcd is down (a replacement node) does not exit into systemd's restart
    loop: it waits for etcd (up to etcd_outage_s) and then runs its workers."""
    server = EtcdServer()  # ports chosen, not started yet: an outage
    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as out:
        agent = subprocess.Popen(
            AGENT + ["--etcd", server.endpoint, "--", "true"],
            env=_env(),
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until(
            lambda: '"agent_waiting_for_etcd"' in log_path.read_text(),
            30,
            "the agent to wait for etcd",
            lambda: log_path.read_text()[-3000:],
        )
        assert agent.poll() is None
        server.start()
        # `true` is no elasticd worker: the job's end is written for it, so that its exit 0 is done
        etcd3.client("127.0.0.1", int(server.endpoint.rsplit(":", 1)[1])).put(
            Keys("/elasticd", "default").finished, encode(FinishedRecord(generation=1, step=1))
        )
        assert agent.wait(60) == 0, log_path.read_text()[-3000:]
        assert '"worker_started"' in log_path.read_text()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait(10)
        server.stop()


@pytest.mark.timeout(90)
def test_agent_sends_ready_watchdog_status_and_stopping_to_its_notify_socket(agent_job, tmp_path):
    """The test binds its own datagram socket as NOTIFY_SOCKET, as systemd would for Type=notify."""
    import socket as socketlib

    path = tmp_path / "notify.sock"
    sock = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.2)
    job = agent_job(lease_ttl_s=2, keepalive_s=0.5, min_workers=1)
    prog = [*MLP[:-1], "100000", "--audit", str(job.audit_path("n"))]
    argv = ["--etcd", job.etcd.endpoint, "--job-id", job.job_id, "--node-id", "n", "--", *prog]
    env = _env(**job.settings)
    env.update(NOTIFY_SOCKET=str(path), WATCHDOG_USEC="1000000")
    agent = AgentProcess(argv, env, job.dir / "agent-n.log")
    job.agents["n"] = agent
    messages: list[str] = []

    def receive_until(cond: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not cond():
            try:
                messages.extend(sock.recv(4096).decode().splitlines())
            except TimeoutError:
                pass

    try:
        receive_until(lambda: "READY=1" in messages and any(m.startswith("STATUS=generation") for m in messages), 60)
        assert "READY=1" in messages, (messages, agent.log_text()[-2000:])
        assert messages.index("WATCHDOG=1") < messages.index("READY=1")  # pinged while starting too
        status = [m for m in messages if m.startswith("STATUS=generation")]
        assert status and "world 1" in status[-1], messages
        pings = messages.count("WATCHDOG=1")
        receive_until(lambda: messages.count("WATCHDOG=1") >= pings + 2, 5)  # every 0.5 s
        assert messages.count("WATCHDOG=1") >= pings + 2
        os.kill(agent.pid, signal.SIGTERM)
        receive_until(lambda: "STOPPING=1" in messages, 10)
        assert "STOPPING=1" in messages
        assert agent.wait(30) == 0, agent.log_text()[-2000:]
    finally:
        sock.close()


@pytest.mark.timeout(120)
def test_a_second_agent_with_the_same_node_id_is_refused_and_the_first_trains_on(agent_job):
    """The second agent exits 2 naming the first (host, pid, since when) after waiting out
    one lease TTL (plus the margin) for a crashed agent's record; it starts no worker, and the first
    agent's worker goes on committing in the same generation."""
    from elasticd.agent.presence import CLAIM_MARGIN_S

    ttl = 2.0
    job = agent_job(lease_ttl_s=ttl, keepalive_s=0.5, min_workers=1)
    first = job.start("a", steps=100_000)
    job.wait_for(lambda: len(job.commits("a")) >= 3, 60, "the first agent's worker to commit")
    generation = job.commits("a")[-1]["generation"]
    dup_audit = job.dir / "a-duplicate.jsonl"
    argv = [
        "--etcd",
        job.etcd.endpoint,
        "--job-id",
        job.job_id,
        "--node-id",
        "a",
        "--",
        *MLP[:-1],
        "100000",
        "--audit",
        str(dup_audit),
    ]
    started = time.monotonic()
    second = AgentProcess(argv, _env(**job.settings), job.dir / "agent-a-duplicate.log")
    job.agents["a (duplicate)"] = second  # killed in teardown too
    assert second.wait(30) == 2, job.logs_tail()
    took = time.monotonic() - started
    assert ttl + CLAIM_MARGIN_S <= took < ttl + CLAIM_MARGIN_S + 15, took
    last = second.log_text().splitlines()[-1]  # the reason, on stderr
    assert last.startswith(f"elasticd: node_id_taken: node id 'a' of job '{job.job_id}'"), last
    assert f"the elasticd agent pid {first.pid} on host 127.0.0.1, since 20" in last, last
    assert "--node-id" in last
    assert not second.events("worker_started") and not dup_audit.exists()
    assert second.events("node_id_held") and second.events("node_id_taken")
    # the first agent and its worker never noticed: more commits, in the same generation
    seen = len(job.commits("a"))
    job.wait_for(lambda: len(job.commits("a")) >= seen + 10, 30, "the first agent's worker to commit on")
    assert first.proc.poll() is None
    assert {r["generation"] for r in job.commits("a")} == {generation}
    assert not first.events("worker_exited")


@pytest.mark.timeout(120)
def test_an_agent_restarted_after_a_crash_waits_out_its_old_record_and_takes_the_node_id_back(agent_job):
    """The old record of a SIGKILLed agent still holds the node id until its lease expires; the new
    agent (as systemd would restart it) waits that out instead of being refused."""
    from elasticd.agent.presence import CLAIM_MARGIN_S

    ttl = 2.0
    job = agent_job(lease_ttl_s=ttl, keepalive_s=0.5, min_workers=1)
    old = job.start("a", steps=100_000)
    job.wait_for(lambda: len(job.commits("a")) >= 3, 60, "the first agent's worker to commit")
    old.kill_group()  # the agent and its worker, with no chance to revoke their leases
    restarted_at = time.time()
    argv = [
        "--etcd",
        job.etcd.endpoint,
        "--job-id",
        job.job_id,
        "--node-id",
        "a",
        "--",
        *MLP[:-1],
        "100000",
        "--audit",
        str(job.audit_path("a")),
    ]
    new = AgentProcess(argv, _env(**job.settings), job.dir / "agent-a-restarted.log")  # a log of its own
    job.agents["a (restarted)"] = new
    job.wait_for(lambda: bool(new.events("node_registered")), ttl + CLAIM_MARGIN_S + 15, "the node id claim")
    assert new.events("node_id_held"), new.log_text()[-3000:]  # the old record was still there
    assert float(new.events("node_registered")[0]["waited_s"]) < ttl + CLAIM_MARGIN_S  # type: ignore[arg-type]
    job.wait_for(
        lambda: any(float(r["t"]) > restarted_at for r in job.commits("a")),
        60,  # type: ignore[arg-type]
        "the restarted agent's worker to commit",
    )
    assert new.proc.poll() is None
