"""The node agent's Prometheus metrics: the registry, its metrics, and the HTTP endpoint.

Owns the metric names and how the agent's observations become metric values. The agent feeds it
from what it already has: each read of the job's keys (``progress.JobView``, every
``keepalive_s``), its workers' resource samples, and its restart and hang decisions. It reads
nothing by itself and never touches etcd. Uses ``prometheus_client`` (the standard exposition
format and registry); each ``AgentMetrics`` has its own registry, so several agents in one process
(tests) do not collide. Imports no torch.

Metrics (all prefixed ``elasticd_``):

* ``agent_info{job_id,node}`` 1;
* ``generation``, ``world_size``, ``committed_step``: the job, as of the last read;
* ``step_time_seconds``: the last step time reported by the generation's rank 0;
* ``worker_step_time_seconds{local_rank}``: the last step time of this node's worker;
* ``worker_compute_seconds{local_rank}``: its own compute time per step, smoothed (batch start to
  its contribution to the sum);
* ``worker_straggler_score{local_rank}``: that time over the median of the other members'
  (``wire.stragglers``; about 1 when healthy);
* ``worker_stragglers_total{local_rank}``: its slow episodes that lasted ``straggler_s``;
* ``recoveries_total{cause}``: recoveries of this node's workers (a generation broke and they
  trained again in a new one), by what broke it;
* ``recovery_duration_seconds``: histogram of those recoveries' durations (failure to training);
* ``worker_restarts_total{local_rank}``: restarts of this node's workers the agent scheduled;
* ``worker_hangs_total{local_rank}``: workers killed as hung;
* ``worker_up{local_rank}``: 1 while the worker's process runs;
* ``worker_rss_bytes{local_rank}``, ``worker_cpu_percent{local_rank}``: its last resource sample.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from elasticd.agent.jobview import JobView, WorkerObservation
from elasticd.agent.supervisor import WorkerStats

log = structlog.get_logger(__name__)

# Recovery durations run from ~0.1 s (a crash under the agent) to the join bound (minutes).
RECOVERY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


class AgentMetrics:
    """The agent's metrics in their own registry. Not thread-safe for writers: the agent's loop writes."""

    def __init__(self, job_id: str, node: str) -> None:
        r = self.registry = CollectorRegistry()
        info = Gauge("elasticd_agent_info", "The job and node this agent serves.", ["job_id", "node"], registry=r)
        info.labels(job_id=job_id, node=node).set(1)
        self.generation = Gauge("elasticd_generation", "The job's current generation (0: none).", registry=r)
        self.world_size = Gauge("elasticd_world_size", "Members of the job's current generation.", registry=r)
        self.committed_step = Gauge("elasticd_committed_step", "The job's newest committed step.", registry=r)
        self.step_time = Gauge(
            "elasticd_step_time_seconds", "The last step time reported by the generation's rank 0.", registry=r
        )
        self.worker_step_time = Gauge(
            "elasticd_worker_step_time_seconds", "The last step time of this node's worker.", ["local_rank"], registry=r
        )
        self.worker_compute = Gauge(
            "elasticd_worker_compute_seconds",
            "This node's worker's own compute time per step, smoothed.",
            ["local_rank"],
            registry=r,
        )
        self.straggler_score = Gauge(
            "elasticd_worker_straggler_score",
            "This node's worker's compute time over the median of the others' (about 1 when healthy).",
            ["local_rank"],
            registry=r,
        )
        self.stragglers = Counter(
            "elasticd_worker_stragglers",
            "Slow episodes of this node's worker that lasted straggler_s.",
            ["local_rank"],
            registry=r,
        )
        self.recoveries = Counter(
            "elasticd_recoveries", "Recoveries of this node's workers, by cause.", ["cause"], registry=r
        )
        self.recovery_duration = Histogram(
            "elasticd_recovery_duration_seconds",
            "How long this node's workers took to recover (failure to training).",
            buckets=RECOVERY_BUCKETS_S,
            registry=r,
        )
        self.restarts = Counter(
            "elasticd_worker_restarts", "Worker restarts scheduled by this agent.", ["local_rank"], registry=r
        )
        self.hangs = Counter("elasticd_worker_hangs", "Workers this agent killed as hung.", ["local_rank"], registry=r)
        self.up = Gauge("elasticd_worker_up", "1 while the worker's process runs.", ["local_rank"], registry=r)
        self.rss = Gauge(
            "elasticd_worker_rss_bytes", "The worker's resident memory (last sample).", ["local_rank"], registry=r
        )
        self.cpu = Gauge(
            "elasticd_worker_cpu_percent",
            "The worker's CPU use (last sample; 100 is one core).",
            ["local_rank"],
            registry=r,
        )
        self._recoveries_seen: dict[str, int] = {}  # member id -> its recoveries count last seen

    def set_view(
        self, view: JobView, local: Mapping[int, WorkerObservation], scores: Mapping[str, float] | None = None
    ) -> None:
        """Take a read of the job's keys, what this node's running workers look like in it, and the
        generation's straggler scores (``wire.stragglers``)."""
        self.generation.set(view.generation)
        self.world_size.set(view.world_size)
        self.committed_step.set(view.job_step)
        if view.rank0_step_time_s is not None:
            self.step_time.set(view.rank0_step_time_s)
        for lr, obs in local.items():
            p = obs.progress
            if p is None:
                continue
            if p.step_time_s is not None:
                self.worker_step_time.labels(local_rank=str(lr)).set(p.step_time_s)
            if p.compute_s is not None:
                self.worker_compute.labels(local_rank=str(lr)).set(p.compute_s)
            score = (scores or {}).get(obs.member_id)
            if score is not None:
                self.straggler_score.labels(local_rank=str(lr)).set(score)
            before = self._recoveries_seen.get(obs.member_id, 0)
            if p.recoveries > before:
                self.recoveries.labels(cause=p.last_recovery_cause or "unknown").inc(p.recoveries - before)
                if p.last_recovery_s is not None:
                    self.recovery_duration.observe(p.last_recovery_s)
            self._recoveries_seen[obs.member_id] = max(before, p.recoveries)
        live = {o.member_id for o in local.values() if o.member_id}
        for mid in [m for m in self._recoveries_seen if m not in live and m not in view.members]:
            del self._recoveries_seen[mid]  # bounded: forget members that are gone

    def straggler_detected(self, local_rank: int) -> None:
        self.stragglers.labels(local_rank=str(local_rank)).inc()

    def set_workers(self, nproc: int, running: Mapping[int, int], stats: Mapping[int, WorkerStats]) -> None:
        """Which local ranks run, and their last resource samples."""
        for lr in range(nproc):
            label = str(lr)
            self.up.labels(local_rank=label).set(1 if lr in running else 0)
            s = stats.get(lr)
            if s is not None and lr in running:
                self.rss.labels(local_rank=label).set(s.rss_bytes)
                self.cpu.labels(local_rank=label).set(s.cpu_percent)
            else:
                for g in (self.rss, self.cpu):
                    try:
                        g.remove(label)
                    except KeyError:
                        pass

    def worker_restarted(self, local_rank: int) -> None:
        self.restarts.labels(local_rank=str(local_rank)).inc()

    def worker_hung(self, local_rank: int) -> None:
        self.hangs.labels(local_rank=str(local_rank)).inc()


@dataclass
class MetricsServer:
    """The HTTP endpoint serving one registry at ``/metrics`` (any path answers)."""

    server: WSGIServer
    thread: Thread
    addr: str
    port: int

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5.0)


def serve(metrics: AgentMetrics, addr: str, port: int) -> MetricsServer:
    """Serve ``metrics`` over HTTP on ``addr:port`` from a daemon thread.

    Raises:
        OSError: the address cannot be bound (in use, not local, no permission).
    """
    server, thread = start_http_server(port, addr=addr, registry=metrics.registry)
    bound = int(server.server_address[1])
    log.info("metrics_serving", addr=addr, port=bound)
    return MetricsServer(server, thread, addr, bound)
