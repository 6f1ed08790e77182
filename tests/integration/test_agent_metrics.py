"""The agent's Prometheus endpoint, scraped over HTTP from a running job under real agents."""

from __future__ import annotations

import os
import signal
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elasticd.testing.localcluster import free_port
from tests.integration.test_node_agent import (  # noqa: F401 (fixture)
    AgentJob,
    _worker_pid,
    agent_job,
)

SCRAPE_TIMEOUT_S = 2.0


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``http://127.0.0.1:port/metrics``: (name, sorted labels) -> value ({} if no answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=SCRAPE_TIMEOUT_S) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


@pytest.mark.timeout(150)
def test_metrics_endpoint_shows_the_job_moving_and_counts_a_restart(agent_job):
    job: AgentJob = agent_job(lease_ttl_s=2, keepalive_s=0.5)
    port_a, port_b = free_port(), free_port()
    prog = [sys.executable, "agents/mlp.py", "--step-sleep", "0.02", "--steps", "400"]
    a = job.start(
        "a",
        "--nnodes",
        "1:2",
        "--metrics-port",
        str(port_a),
        "--stats-interval-s",
        "0.5",
        program=[*prog, "--audit", str(job.audit_path("a"))],
    )
    b = job.start(
        "b", "--nnodes", "1:2", "--metrics-port", str(port_b), program=[*prog, "--audit", str(job.audit_path("b"))]
    )
    job.wait_for(lambda: value(scrape(port_a), "elasticd_world_size") == 2, 60, "world size 2 in the metrics")
    first = scrape(port_a)
    assert value(first, "elasticd_agent_info", job_id=job.job_id, node="a") == 1
    assert (value(first, "elasticd_generation") or 0) >= 1
    step0 = value(first, "elasticd_committed_step")
    assert step0 is not None
    job.wait_for(
        lambda: (value(scrape(port_a), "elasticd_committed_step") or -1) > step0 + 10,
        20,
        "the committed step to grow in the metrics",
    )
    job.wait_for(
        lambda: (value(scrape(port_a), "elasticd_worker_rss_bytes", local_rank="0") or 0) > 10 * 2**20,
        10,
        "the worker's memory sample",
    )
    # progress records reach etcd within keepalive_s (a node's together), rank 0's step time through
    # the job's digest (wire.digest) one read later
    job.wait_for(
        lambda: (
            (value(scrape(port_a), "elasticd_worker_step_time_seconds", local_rank="0") or 0) > 0
            and (value(scrape(port_a), "elasticd_step_time_seconds") or 0) > 0
        ),
        10,
        "the worker's and rank 0's step times",
    )
    now = scrape(port_a)
    assert value(now, "elasticd_worker_up", local_rank="0") == 1
    assert value(scrape(port_b), "elasticd_worker_restarts_total", local_rank="0") in (None, 0.0)
    # a's worker trained alone first, so b's arrival was a regroup: a recovery with cause "regroup"
    before = scrape(port_a)
    failures_before = total(before, "elasticd_recoveries_total") - (
        value(before, "elasticd_recoveries_total", cause="regroup") or 0
    )
    durations_before = value(before, "elasticd_recovery_duration_seconds_count") or 0

    os.kill(_worker_pid(b), signal.SIGKILL)
    job.wait_for(
        lambda: value(scrape(port_b), "elasticd_worker_restarts_total", local_rank="0") == 1,
        20,
        "the restart to be counted",
    )

    def failures() -> float:
        s = scrape(port_a)
        return total(s, "elasticd_recoveries_total") - (value(s, "elasticd_recoveries_total", cause="regroup") or 0)

    # the survivor's worker recovered from the broken generation: a recovery by its cause, with a duration
    job.wait_for(lambda: failures() > failures_before, 30, "a's recovery from the kill")
    after = scrape(port_a)
    assert (value(after, "elasticd_recovery_duration_seconds_count") or 0) > durations_before
    assert 0 < (value(after, "elasticd_recovery_duration_seconds_sum") or 0) < 30
    assert (value(after, "elasticd_generation") or 0) > (value(before, "elasticd_generation") or 0)
    assert value(scrape(port_a), "elasticd_worker_hangs_total", local_rank="0") in (None, 0.0)
    assert a.wait(90) == 0, job.logs_tail()
    assert b.wait(30) == 0, job.logs_tail()
    assert scrape(port_a) == {}  # the endpoint closes with the agent
