"""The agent's metrics: observations become values; recoveries are counted once per new recovery."""

from __future__ import annotations

import pytest

from elasticd.agent.jobview import (
    JobView,
    WorkerObservation,
    WorkerPhase,
)
from elasticd.agent.metrics import AgentMetrics
from elasticd.agent.supervisor import WorkerStats
from elasticd.wire.progress import ProgressRecord

pytestmark = pytest.mark.timeout(30)


def _get(m: AgentMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def _view(
    step: int, recoveries: int, last_s: float | None, cause: str | None
) -> tuple[JobView, dict[int, WorkerObservation]]:
    mine = ProgressRecord(
        step, 3, rank=1, step_time_s=0.02, recoveries=recoveries, last_recovery_s=last_s, last_recovery_cause=cause
    )
    rank0 = ProgressRecord(step, 3, rank=0, step_time_s=0.05)
    view = JobView(
        read_at=1.0,
        generation=3,
        world_size=2,
        in_generation=frozenset({"a.0.1", "b.0.2"}),
        job_step=step,
        progress={"b.0.2": mine, "a.0.1": rank0},
    )
    return view, {0: WorkerObservation(WorkerPhase.TRAINING, "b.0.2", step, 3, mine)}


def test_job_gauges_and_recoveries_counted_once() -> None:
    m = AgentMetrics("j", "b")
    assert _get(m, "elasticd_agent_info", job_id="j", node="b") == 1
    m.set_view(*_view(10, 0, None, None))
    assert (_get(m, "elasticd_generation"), _get(m, "elasticd_world_size"), _get(m, "elasticd_committed_step")) == (
        3,
        2,
        10,
    )
    assert _get(m, "elasticd_step_time_seconds") == 0.05  # rank 0's
    assert _get(m, "elasticd_worker_step_time_seconds", local_rank="0") == 0.02
    assert _get(m, "elasticd_recovery_duration_seconds_count") == 0
    m.set_view(*_view(11, 1, 0.4, "CollectiveError"))
    m.set_view(*_view(12, 1, 0.4, "CollectiveError"))  # the same recovery seen again: not counted again
    assert _get(m, "elasticd_recoveries_total", cause="CollectiveError") == 1
    assert _get(m, "elasticd_recovery_duration_seconds_count") == 1
    assert _get(m, "elasticd_recovery_duration_seconds_sum") == pytest.approx(0.4)
    m.set_view(*_view(13, 3, 0.2, "regroup"))  # two more since the last read (only the last duration is known)
    assert _get(m, "elasticd_recoveries_total", cause="regroup") == 2


def test_workers_up_and_samples_and_restart_counters() -> None:
    m = AgentMetrics("j", "b")
    m.set_workers(2, {0: 100}, {0: WorkerStats(0, 100, 5_000_000, 12.5, 1.0)})
    assert _get(m, "elasticd_worker_up", local_rank="0") == 1 and _get(m, "elasticd_worker_up", local_rank="1") == 0
    assert _get(m, "elasticd_worker_rss_bytes", local_rank="0") == 5_000_000
    assert _get(m, "elasticd_worker_cpu_percent", local_rank="0") == 12.5
    m.set_workers(2, {}, {})  # it ended: no stale sample is left behind
    assert _get(m, "elasticd_worker_up", local_rank="0") == 0
    assert _get(m, "elasticd_worker_rss_bytes", local_rank="0") is None
    m.worker_restarted(0)
    m.worker_hung(0)
    assert _get(m, "elasticd_worker_restarts_total", local_rank="0") == 1
    assert _get(m, "elasticd_worker_hangs_total", local_rank="0") == 1
