"""The operators' view through etcd, for real: node records, ``elasticctl drain`` and ``events``.

Real etcd, real agents (separate processes, as in ``test_node_agent.py``), real gloo workers of
``agents/mlp.py``, and ``elasticctl`` run as a user runs it (a fresh interpreter per command).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.store.etcd import EtcdClient
from elasticd.testing.audit import check_dir
from elasticd.testing.localcluster import REPO_ROOT
from elasticd.wire.keys import Keys
from tests.integration.test_node_agent import (  # noqa: F401
    MLP,
    AgentJob,
    _worker_pid,
    agent_job,
)

CLI_TIMEOUT_S = 60


def elasticctl(job: AgentJob, *args: str, job_id: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return subprocess.run(
        [sys.executable, "-m", "elasticd.cli", "--etcd", job.etcd.endpoint, *args, "--job", job_id or job.job_id],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )


@contextmanager
def etcd_client(job: AgentJob) -> Iterator[EtcdClient]:
    client = EtcdClient(EtcdConfig(endpoints=(job.etcd.endpoint,)), Timeouts(), RetryPolicy())
    try:
        yield client
    finally:
        client.close()


def status_json(job: AgentJob) -> dict[str, Any]:
    proc = elasticctl(job, "status", "--json")
    assert proc.returncode in (0, 1, 2) and proc.stdout, proc
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def events_json(job: AgentJob) -> dict[str, Any]:
    proc = elasticctl(job, "events", "--json")
    assert proc.returncode == 0, proc
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


# The jobs below run until the test drains them (SIGTERM to every agent): a fixed step target would
# either end the job before the checks on a busy machine or make the test slow on an idle one.
ENDLESS = 10**6


def _program(job: AgentJob, node: str, steps: int = ENDLESS) -> list[str]:
    return [*MLP[:-1], str(steps), "--audit", str(job.audit_path(node))]


def drain_all(job: AgentJob, *agents: Any) -> None:
    """SIGTERM every agent (what systemctl stop does); each must drain and exit 0."""
    for agent in agents:
        agent.proc.send_signal(signal.SIGTERM)
    for agent in agents:
        assert agent.wait(30) == 0, job.logs_tail()


@pytest.mark.timeout(150)
def test_elasticctl_drain_takes_a_node_out_and_the_job_goes_on_smaller(agent_job: Any) -> None:
    job = agent_job(stats_interval_s=0.5)
    a = job.start("a", "--nnodes", "1:2", program=_program(job, "a"))
    b = job.start("b", "--nnodes", "1:2", program=_program(job, "b"))
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 60, "both workers to train together")
    b_worker = _worker_pid(b)
    proc = elasticctl(job, "drain", "b", "--wait", "--timeout", "40")
    assert proc.returncode == 0, (proc, job.logs_tail())
    assert "drain of node 'b' requested (1 live member(s) there)" in proc.stdout
    assert "node 'b' drained: generation" in proc.stdout
    assert b.wait(20) == 0, job.logs_tail()
    last_at_2 = max(int(r["step"]) for r in job.commits("a") if r["world_size"] == 2)
    assert b.events("agent_stopped")[-1]["reason"] == "drained"
    assert b.events("drain_requested") and b.events("drain_request_deleted")
    assert b.events("workers_signalled") and not b.events("workers_killed")
    assert not b.events("worker_restart_scheduled")

    # While a trains on alone: the smaller world, and a's node record with restarts, RSS and CPU.
    def smaller_with_resources() -> bool:
        st = status_json(job)
        g = st["generation"]
        return (
            g is not None
            and g["world_size"] == 1
            and [n["node"] for n in st["nodes"]] == ["a"]
            and st["members"][0]["rss_bytes"] is not None
            and st["members"][0]["state"] == "training"
        )

    job.wait_for(smaller_with_resources, 30, "status to show the world of 1 with a's node record")
    st = status_json(job)
    assert st["members"][0]["node"] == "a" and st["members"][0]["restarts"] == 0
    assert st["members"][0]["rss_bytes"] > 10 * 2**20 and st["members"][0]["cpu_percent"] is not None
    (node_a,) = st["nodes"]
    assert (node_a["state"], node_a["workers"], node_a["workers_running"], node_a["restarts"]) == ("running", 1, 1, 0)
    assert node_a["agent_pid"] == a.pid and st["drains"] == [] and st["malformed"] == []
    assert b_worker not in [m["pid"] for m in st["members"]]
    table = elasticctl(job, "status")
    assert "AGENT_STATE" in table.stdout and "RSS" in table.stdout, table

    with etcd_client(job) as client:
        assert client.get(Keys("/elasticd", job.job_id).drain("b")) is None  # deleted by b's agent

    job.wait_for(lambda: len(job.commits("a")) >= last_at_2 + 20, 30, "a to train on alone")
    drain_all(job, a)
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations  # no committed step lost or repeated, equal checksums
    assert rep.last_step >= last_at_2 + 20
    assert all(rep.step_world[s] == 1 for s in range(last_at_2 + 1, rep.last_step + 1))
    kinds = [
        (e["kind"], e["source"].split(".")[1] if e["source"].startswith("agent.") else "member")
        for e in events_json(job)["events"]
    ]
    assert kinds.index(("node_draining", "b")) < kinds.index(("node_drained", "b"))
    draining = next(e for e in events_json(job)["events"] if e["kind"] == "node_draining")
    assert draining["detail"]["cause"].startswith("elasticctl drain by ")


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
@pytest.mark.timeout(150)
def test_a_killed_worker_shows_up_in_the_events_in_time_order(agent_job: Any) -> None:
    job = agent_job(stats_interval_s=0.5)
    a = job.start("a", "--nnodes", "1:2", program=_program(job, "a"))
    b = job.start("b", "--nnodes", "1:2", program=_program(job, "b"))
    job.wait_for(lambda: job.commits_at_world("a", 2) >= 5, 60, "both workers to train together")
    victim = _worker_pid(b)
    killed_at = time.time()
    os.kill(victim, signal.SIGKILL)
    job.wait_for(lambda: len(b.events("worker_started")) == 2, 30, "the agent to restart the worker")
    job.wait_for(
        lambda: any(r["world_size"] == 2 and r["t"] > killed_at for r in job.commits("b")),
        60,
        "the restarted worker to train again",
    )

    # status, while the job runs: the last recoveries, and b's restart on its member and node rows
    def restart_shown() -> bool:
        st = status_json(job)
        rows = [m for m in st["members"] if m["node"] == "b" and m["state"] == "training"]
        return bool(rows and rows[0]["restarts"] == 1 and st["recoveries"])

    job.wait_for(restart_shown, 20, "status to show b's restart")
    st = status_json(job)
    assert st["recoveries"][-1]["duration_s"] is not None and st["recoveries"][-1]["cause"]
    assert next(n for n in st["nodes"] if n["node"] == "b")["restarts"] == 1
    assert next(n for n in st["nodes"] if n["node"] == "a")["restarts"] == 0

    def history_complete() -> bool:
        kinds = {e["kind"] for e in events_json(job)["events"] if e["time"] >= killed_at}
        return {"worker_exited", "worker_restarted", "generation_published", "recovered"} <= kinds

    job.wait_for(history_complete, 30, "the events of the kill")
    events = events_json(job)["events"]
    times = [e["time"] for e in events]
    assert times == sorted(times), "newest last"
    after = [e for e in events if e["time"] >= killed_at]
    exited = next(e for e in after if e["kind"] == "worker_exited")
    assert exited["source"].startswith("agent.b.") and exited["detail"]["pid"] == victim
    assert exited["detail"]["how"] == "was killed by SIGKILL"
    restarted = next(e for e in after if e["kind"] == "worker_restarted")
    assert restarted["source"] == exited["source"] and restarted["detail"]["pid"] == _worker_pid(b)
    # The survivor notices the broken connection about as fast as the agent reaps the worker, so
    # the smaller generation and the agent's worker_exited come in either order; the rest is causal.
    shrink = next(e for e in after if e["kind"] == "generation_published" and e["detail"]["world_size"] == 1)
    assert shrink["detail"]["reason"] in ("aborted", "member_lost")
    assert shrink["detail"]["members"] == [m for m in shrink["detail"]["members"] if m.startswith("a.")]
    recovered = next(e for e in after if e["kind"] == "recovered")
    assert recovered["detail"]["generation"] == shrink["detail"]["generation"]
    assert 0 < recovered["detail"]["duration_s"] < 10 and recovered["detail"]["cause"]
    rejoin = next(e for e in after if e["kind"] == "generation_published" and e["detail"]["world_size"] == 2)
    assert rejoin["detail"]["reason"] == "join"
    assert exited["time"] < restarted["time"] < rejoin["time"]
    assert shrink["time"] <= recovered["time"] < rejoin["time"]

    text = elasticctl(job, "events").stdout
    assert "worker_exited" in text and 'how="was killed by SIGKILL"' in text

    # the same history as one picture: a PNG of the figure's size, one violet line per generation
    pytest.importorskip("matplotlib")
    from elasticd.ops.timeline_plot import DPI, GENERATION_RGB, SIZE_IN
    from tests.unit.test_timeline import count_lines

    png = job.dir / "timeline.png"
    drawn = elasticctl(job, "timeline", "--out", str(png))
    assert drawn.returncode == 0 and drawn.stdout.strip() == str(png), drawn
    import matplotlib.pyplot as plt

    img = plt.imread(png)
    assert img.shape[:2] == (SIZE_IN[1] * DPI, SIZE_IN[0] * DPI)
    every = events_json(job)["events"]
    times = sorted(e["time"] for e in every if e["kind"] == "generation_published")
    s_per_px = (every[-1]["time"] - every[0]["time"]) * 1.02 / (SIZE_IN[0] * DPI * 0.93)  # the axis' scale

    def apart(px: float) -> int:  # generations drawn at least px pixels apart
        return 1 + sum(1 for t0, t1 in zip(times, times[1:]) if t1 - t0 > px * s_per_px)

    # start, the shrink, the rejoin (generations less than a pixel or so apart share a line)
    assert apart(3) <= count_lines(img, GENERATION_RGB) <= apart(0.5) and apart(3) >= 3
    bad = elasticctl(job, "timeline", "--out", str(job.dir / "t.jpg"))
    assert bad.returncode == 2 and ".png, .svg or .html" in bad.stderr and not (job.dir / "t.jpg").exists()

    drain_all(job, a, b)
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations


@pytest.mark.timeout(120)
def test_unknown_node_and_garbage_records_give_clear_answers_and_disturb_nothing(agent_job: Any) -> None:
    job = agent_job(stats_interval_s=0.5)
    a = job.start("a", program=_program(job, "a"))
    job.wait_for(lambda: len(job.commits("a")) >= 5, 60, "the job to train")
    proc = elasticctl(job, "drain", "nosuchnode")
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        f"elasticctl: unknown node 'nosuchnode' in job '{job.job_id}': no agent record at "
        f"/elasticd/{job.job_id}/nodes/nosuchnode (known nodes: a)"
    ]
    keys = Keys("/elasticd", job.job_id)
    with etcd_client(job) as client:
        assert client.get(keys.drain("nosuchnode")) is None
        client.put(keys.node("x"), b"\x00garbage{")
        client.put(keys.event("zzz-by-hand"), b'{"kind": 5}')
    st = status_json(job)
    assert sorted(m.split(":")[0] for m in st["malformed"]) == [keys.event("zzz-by-hand"), keys.node("x")]
    assert [n["node"] for n in st["nodes"]] == ["a"] and st["generation"] is not None
    ev = events_json(job)
    assert [m.split(":")[0] for m in ev["malformed"]] == [keys.event("zzz-by-hand")]
    assert any(e["kind"] == "generation_published" for e in ev["events"])
    table = elasticctl(job, "events")
    assert table.returncode == 0 and "malformed events (1, ignored)" in table.stdout
    gone = elasticctl(job, "events", job_id="nosuchjob")
    assert gone.returncode == 2 and "no such job" in gone.stderr
    trained = len(job.commits("a"))
    job.wait_for(lambda: len(job.commits("a")) >= trained + 10, 30, "the job to go on")  # not disturbed
    drain_all(job, a)
    rep = check_dir(job.dir, 2048)
    assert rep.ok, rep.violations
