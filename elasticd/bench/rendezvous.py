"""``python -m elasticd.bench rendezvous --members N [--per-process K]``: the rendezvous at scale.

Owns running the ``rendezvous`` benchmark. N lightweight members (the project's
own ``Membership``, each over its own ``EtcdClient``; no torch, no process group), K per process as
threads, ceil(N/K) processes, against one local etcd that the bench starts. It measures the
registration (all N at once), one join round (all N call ``join()`` at once, once all registered,
as trainers do when their processes are ready) and one leave (a member closes its membership,
which revokes its lease; the survivors see ``must_abandon()`` and join again, as ``worker.rejoin``
does), with an idle window before the leave. For each round: the times (from the first
``join()`` call, or the leave, to the generation published and to the first and the last member's
``join()`` return), what etcd did (requests, puts, txns, watch
events and bytes sent, from its /metrics), what the members asked (a counting proxy over each
store client), and the CPU seconds of etcd and of the member processes.

A calibration in the same run measures etcd's costs per operation (a small request, a watch event
delivered, a byte read); ``predict`` (pure) turns them into a round's time at any N under the
current protocol, and ``walls`` names the N at which a stock etcd refuses it (both pure, in
``bench.rendezvous_model``; the member processes are ``bench.rendezvous_members``). Every process
it starts is tracked by PID and killed in ``finally``; every wait is bounded.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from elasticd.bench.common import BenchError, LeaseSettings, fmt, host_stolen_s, progress, run_subcommand
from elasticd.bench.rendezvous_members import (
    PREFIX,
    REPLY_TIMEOUT_S,
    MemberProcesses,
    Plan,
    RelayPlan,
    bench_record,
)
from elasticd.bench.rendezvous_model import (
    KV_OVERHEAD_B,
    MODEL_N,
    STOCK_MAX_TXN_OPS,
    Costs,
    Sizes,
    difference,
    model_rows,
    parse_metrics,
    round_times,
    wall_thresholds,
    load_walls,
)
from elasticd.agent.jobview import job_read_interval_s
from elasticd.config import AgentConfig, EtcdConfig, RetryPolicy, Timeouts
from elasticd.errors import EtcdUnavailable
from elasticd.store.etcd import EtcdClient
from elasticd.store.kv import KeyValue
from elasticd.testing.etcd import EtcdServer, etcd_binary
from elasticd.wire.keys import Keys
from elasticd.wire.ops import EventKind, decode_event
from elasticd.wire.records import ReadyRecord, encode
from elasticd.wire.snapshot import DecodedRecords, parse_snapshot

ROUND_TIMEOUT_S = 120.0  # bound on one round, from its start to the last member's join() return
# After a round, its counts are read once the members have digested its watch events (their count
# of notifications is still for SETTLE_S), for at most SETTLE_MAX_S: on 2 cores the members take
# seconds to, and the idle window must not start before.
SETTLE_S, SETTLE_MAX_S = 0.5, 30.0
IDLE_S = 3.0  # the idle window between the rounds: the steady-state cost of N members
EVENTS_TIMEOUT_S = 30.0  # bound on the calibration's watch events reaching the watchers
POLL_S = 0.05  # how often the calibration looks at its watch events
NODES_PER_PROCESS = 8  # with --nodes: the nodes' members one process runs, as threads (K = this x --per-node)
NODES_PER_RELAY_PROCESS = 32  # the relays one relay process runs (as agents, apart from their workers)
LONGEST_PID = 4_194_303  # Linux's pid_max (2^22 - 1): the walls are computed for the longest member ids
# Calibration sizes: enough work that etcd's CPU (10 ms ticks in /proc) is measured to a few %.
CAL_REQUESTS, CAL_WRITES, CAL_RECORDS, CAL_READS, CAL_WATCHERS, CAL_PUTS = 400, 100, 300, 40, 100, 100


@dataclass(frozen=True)
class RendezvousSettings(LeaseSettings):
    """What ``rendezvous`` runs; printed next to the figures. Every timeout is elasticd's default, as a
    new user gets them (lease TTL 3 s, keepalive 0.75 s, join window 0.25 s, last call 0.3 s)."""

    lease_ttl_s: float = Timeouts().lease_ttl_s
    keepalive_s: float = Timeouts().keepalive_s
    members: int = 20
    per_process: int = 25
    per_node: int = 1  # members per node; more than 1: each node's members share its relay
    etcd_max_txn_ops: int = 0  # 0: etcd's default (a stock etcd)


class _TunedEtcd(EtcdServer):
    """A local etcd with ``--max-txn-ops`` raised, to measure past the publish wall (not a stock etcd)."""

    def __init__(self, max_txn_ops: int) -> None:
        super().__init__()
        self.max_txn_ops = max_txn_ops

    def launch(self) -> None:
        url = f"http://{self.host}:{self.client_port}"
        cmd = [
            etcd_binary(),
            "--name",
            self.name,
            "--data-dir",
            self.data_dir,
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            self.initial_cluster,
            "--log-level",
            "error",
            "--max-txn-ops",
            str(self.max_txn_ops),
        ]
        with self.log_path.open("ab") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)


class Probe:
    """etcd's CPU seconds (``/proc`` through psutil) and its /metrics counters."""

    def __init__(self, etcd: EtcdServer) -> None:
        assert etcd.proc is not None
        self._url = f"http://{etcd.endpoint}/metrics"
        self._proc = psutil.Process(etcd.proc.pid)

    def etcd_cpu_s(self) -> float:
        t = self._proc.cpu_times()
        return float(t.user + t.system)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self._url, timeout=REPLY_TIMEOUT_S) as r:
            return parse_metrics(r.read().decode())


def calibrate(store: EtcdClient, probe: Probe, keys: Keys) -> Costs:
    """Measure the per-operation costs on the bench's etcd, in a job of its own, before the members
    start: ``CAL_REQUESTS`` small gets; ``CAL_WRITES`` small puts; ``CAL_READS`` reads of ``CAL_RECORDS`` member and ready
    records, parsed as a member does; ``CAL_PUTS`` puts under ``CAL_WATCHERS`` watches.

    Raises:
        EtcdUnavailable: etcd did not answer.
    """

    def measured(work: Callable[[], object]) -> tuple[float, float, float]:
        w0, e0, m0 = time.monotonic(), probe.etcd_cpu_s(), time.process_time()
        work()
        return time.monotonic() - w0, probe.etcd_cpu_s() - e0, time.process_time() - m0

    key = f"{keys.job}/calibrate"
    store.put(key, b"x")
    wall, etcd, own = measured(lambda: [store.get(key) for _ in range(CAL_REQUESTS)])
    rtt, e_req, m_req = wall / CAL_REQUESTS, etcd / CAL_REQUESTS, own / CAL_REQUESTS

    def writes() -> None:
        for _ in range(CAL_WRITES):
            store.put(key, b"x")

    write_rtt = measured(writes)[0] / CAL_WRITES
    for i in range(CAL_RECORDS):
        rec = bench_record(i, os.getpid())
        store.put(keys.member(rec.member_id), encode(rec))
        store.put(keys.ready(rec.member_id), encode(ReadyRecord(rec.member_id, 0, 1, 0, rec.signature)))
    kvs = store.get_prefixes(keys.rendezvous)
    nbytes = CAL_READS * sum(len(kv.key) + len(kv.value) + KV_OVERHEAD_B for kv in kvs)
    _, etcd, own = measured(
        lambda: [parse_snapshot(keys, store.get_prefixes(keys.rendezvous)) for _ in range(CAL_READS)]
    )
    e_byte, m_byte = max(0.0, etcd - CAL_READS * e_req) / nbytes, max(0.0, own - CAL_READS * m_req) / nbytes
    hits = Counter[str]()
    lock = threading.Lock()

    def hit() -> None:
        with lock:
            hits["n"] += 1

    prefix = f"{keys.job}/calibrate-watch/"
    cancels = [store.watch_prefix(prefix, hit) for _ in range(CAL_WATCHERS)]
    before = probe.metrics()["watch_events"]

    def puts() -> None:
        for i in range(CAL_PUTS):
            store.put(f"{prefix}{i}", b"x")
        deadline, last, last_at = time.monotonic() + EVENTS_TIMEOUT_S, -1, time.monotonic()
        while hits["n"] < CAL_WATCHERS * CAL_PUTS and time.monotonic() < deadline:
            if hits["n"] != last:
                last, last_at = hits["n"], time.monotonic()
            elif time.monotonic() - last_at > 1.0:  # etcd batched some events into one notification
                break
            time.sleep(POLL_S)

    _, etcd, own = measured(puts)
    events = max(1.0, probe.metrics()["watch_events"] - before)
    for cancel in cancels:
        cancel()
    return Costs(
        request_rtt_s=rtt,
        write_rtt_s=write_rtt,
        etcd_per_request_s=e_req,
        etcd_per_event_s=max(0.0, etcd - CAL_PUTS * e_req) / events,
        etcd_per_byte_s=e_byte,
        member_per_request_s=m_req,
        member_per_event_s=max(0.0, own - CAL_PUTS * m_req) / events,
        member_per_byte_s=m_byte,
    )


PARSE_REPS = 3  # repetitions of each parse timed by ``parse_costs`` (the median is kept)


def parse_costs(sizes: tuple[int, ...] = MODEL_N, per_node: int = 8) -> list[dict[str, float]]:
    """The coordinator's parse of a job of N members (a member and a ready record each, as
    ``JobReader.snapshot`` parses every round), in this process: decoded whole, and with the records
    of the round before held (``wire.snapshot.DecodedRecords``) when one node's members wrote their
    records again (a node joined or left). CPU-bound; medians of ``PARSE_REPS``."""
    keys = Keys(PREFIX, "parse")
    out = []
    for n in sizes:
        kvs = []
        for i in range(n):
            rec = bench_record(i, 4_194_304, per_node)
            kvs.append(KeyValue(keys.member(rec.member_id), encode(rec), 10 + i, 10 + i))
            ready = ReadyRecord(rec.member_id, 0, 1, 0, rec.signature)
            kvs.append(KeyValue(keys.ready(rec.member_id), encode(ready), 10 + n + i, 10 + n + i))
        whole, held = [], []
        for rep in range(PARSE_REPS):
            t0 = time.perf_counter()
            parse_snapshot(keys, kvs)
            whole.append(time.perf_counter() - t0)
            decoded = DecodedRecords()
            parse_snapshot(keys, kvs, decoded)
            changed = [
                KeyValue(kv.key, kv.value, kv.mod_revision + 4 * n + rep, kv.create_revision)
                if j < 2 * per_node
                else kv
                for j, kv in enumerate(kvs)
            ]
            t0 = time.perf_counter()
            parse_snapshot(keys, changed, decoded)
            held.append(time.perf_counter() - t0)
        w, h = sorted(whole)[PARSE_REPS // 2], sorted(held)[PARSE_REPS // 2]
        out.append({"members": n, "whole_s": w, "one_node_changed_s": h, "ratio": h / w})
    return out


def probe_txn_wall(store: EtcdClient, keys: Keys) -> dict[str, str]:
    """Send transactions of ``--max-txn-ops`` operations and of one more (a put and deletes, the shape
    of a publish that deletes its consumed ready keys): what this etcd answers (the wall measured, not only computed).

    Raises:
        EtcdUnavailable: etcd did not answer.
    """
    out = {}
    for ops in (STOCK_MAX_TXN_OPS, STOCK_MAX_TXN_OPS + 1):
        try:
            store.compare_and_put(
                f"{keys.job}/wall{ops}", 0, b"g", delete_keys=[keys.ready(f"m{i}") for i in range(ops - 1)]
            )
            out[str(ops)] = "accepted"
        except EtcdUnavailable as exc:
            if "rejected" not in str(exc):
                raise
            flat = " ".join(str(exc).split())
            found = re.search(r'details = "([^"]+)"', flat)  # etcd's own words, not gRPC's wrapping
            out[str(ops)] = f"refused: {found.group(1) if found else flat[:200]}"
    return out


def _plans(
    s: RendezvousSettings, endpoint: str, workdir: Path, relay_dir: str, job: str
) -> tuple[list[Plan], list[RelayPlan]]:
    """The member processes (``per_process`` members each) and, with ``relay_dir``, the relay
    processes (``NODES_PER_RELAY_PROCESS`` nodes' relays each, their sockets there)."""
    n = s.members
    nodes = sorted({bench_record(i, 0, s.per_node).node for i in range(n)}) if relay_dir else []
    relays = [
        RelayPlan(
            i,
            tuple(nodes[k : k + NODES_PER_RELAY_PROCESS]),
            s.timeouts(),
            endpoint,
            job,
            str(workdir / f"relays{i}.log"),
            relay_dir,
        )
        for i, k in enumerate(range(0, len(nodes), NODES_PER_RELAY_PROCESS))
    ]
    plans = [
        Plan(
            i,
            first,
            min(s.per_process, n - first),
            n,
            s.timeouts(),
            endpoint,
            job,
            str(workdir / f"members{i}.log"),
            s.per_node,
            relay_dir,
        )
        for i, first in enumerate(range(0, n, s.per_process))
    ]
    progress(
        f"starting {len(plans)} member processes for {n} members"
        + (f" and {len(relays)} relay processes for their {len(nodes)} nodes" if relays else "")
    )
    return plans, relays


def _measure(
    s: RendezvousSettings,
    etcd: EtcdServer,
    probe: Probe,
    client: EtcdClient,
    workdir: Path,
    relay_dir: str,
    phases: dict[str, dict[str, float | None]],
) -> None:
    """The join round, the idle window and the leave, into ``phases`` (as far as they got); with
    ``relay_dir``, the nodes' relays listen there.

    Raises:
        BenchError: a wait ran past its bound, a member failed, or a member process exited.
    """
    job = f"bench{time.time_ns()}"  # its own job: a given etcd may hold an earlier run's
    n, keys = s.members, Keys(PREFIX, job)
    plans, relays = _plans(s, etcd.endpoint, workdir, relay_dir, job)
    procs = MemberProcesses(plans, relays)
    try:

        def sample() -> dict[str, float]:
            return {
                "window_s": time.monotonic(),
                "etcd_cpu_s": probe.etcd_cpu_s(),
                "host_stolen_s": host_stolen_s(),
                **{f"etcd_{k}": v for k, v in probe.metrics().items()},
                **procs.counts(),
            }

        def measure_round(name: str, start: float, size: int, after: int, before: dict[str, float]) -> int:
            procs.wait_until(
                lambda: procs.complete(size, after, start) is not None,
                ROUND_TIMEOUT_S,
                f"{name}: a generation of {size} learned by all",
            )
            gen = procs.complete(size, after, start)
            assert gen is not None
            settled_at, last = time.monotonic() + SETTLE_MAX_S, -1.0
            while time.monotonic() < settled_at:
                time.sleep(SETTLE_S)
                now = procs.counts().get("member_watch_notifications", 0.0)
                if now == last:
                    break
                last = now
            counts = difference(before, sample())
            published = published_times(client, keys).get(gen)
            phases[name] = {
                **round_times(start, published, procs.learned_times(gen)),
                **counts,
                "generations": float(gen - after),
            }
            return gen

        progress(f"{n} members register at once")
        s0 = sample()
        for i in range(len(plans)):
            procs.send(i, "register")
        procs.wait_until(lambda: len(procs.registered) == n, ROUND_TIMEOUT_S, "the members to register")
        registering = {"register_s": round(max(procs.registered.values()) - min(procs.registering.values()), 3)}
        progress(f"join round: {n} members join at once")
        s_join = sample()
        for i in range(len(plans)):
            procs.send(i, "join")
        procs.wait_until(lambda: len(procs.joining) == n, ROUND_TIMEOUT_S, "the members to join")
        phases["register"] = {**registering, **difference(s0, s_join)}
        g1 = measure_round("join", min(procs.joining.values()), n, 0, s_join)
        progress(f"idle for {IDLE_S:g} s")
        s1 = sample()
        time.sleep(IDLE_S)
        s2 = sample()
        phases["idle_per_s"] = {k: v / IDLE_S for k, v in difference(s1, s2).items()}
        leaver = max((m for (m, g) in procs.learned if g == g1), key=lambda m: procs.learned[(m, g1)][0])
        progress(f"leave: {leaver} (rank {procs.learned[(leaver, g1)][0]}) closes its membership")
        procs.send(procs.owner[leaver], "leave", leaver)
        procs.wait_until(lambda: leaver in procs.left, REPLY_TIMEOUT_S, "the leave")
        # Leases lost under load may have formed generations since g1 (the join column counts their
        # re-registrations): the leave's generation is one newer than any learned before it.
        measure_round("leave", procs.left[leaver], n - 1, max(g for (_, g) in procs.learned), s2)
    finally:
        procs.stop()


def published_times(client: EtcdClient, keys: Keys) -> dict[int, float]:
    """generation -> when its ``generation_published`` event was written (the publisher's wall clock)."""
    out: dict[int, float] = {}
    for kv in client.get_prefix(keys.events):
        event = decode_event(kv.value)
        gen = event.detail.get("generation")
        if event.kind == EventKind.GENERATION_PUBLISHED and isinstance(gen, int):
            out[gen] = event.time
    return out


def run_rendezvous(s: RendezvousSettings, workdir: Path, etcd: EtcdServer | None = None) -> dict[str, object]:
    """Start etcd (unless one is given: a fresh one, left running), calibrate, measure the rounds,
    and model them; a round that could not be measured is named in ``errors`` (with the figures got
    so far)."""
    own = etcd is None
    if etcd is None:
        etcd = _TunedEtcd(s.etcd_max_txn_ops) if s.etcd_max_txn_ops else EtcdServer()
        etcd.start()
    timeouts = s.timeouts()
    client = EtcdClient(EtcdConfig(endpoints=(etcd.endpoint,)), timeouts, RetryPolicy())
    phases: dict[str, dict[str, float | None]] = {}
    errors: list[str] = []
    try:
        probe = Probe(etcd)
        progress("calibrating etcd's costs per operation")
        costs = calibrate(client, probe, Keys(PREFIX, "calibrate"))
        txn_wall = probe_txn_wall(client, Keys(PREFIX, "calibrate"))
        try:
            # the relays' sockets: a short path (at most 107 bytes), removed with the run
            with tempfile.TemporaryDirectory(prefix="elasticd-bench-relay-") as sockets:
                _measure(s, etcd, probe, client, workdir, sockets if s.per_node > 1 else "", phases)
        except BenchError as exc:
            errors.append(str(exc))
    finally:
        client.close()
        if own:
            etcd.stop()
    sizes = Sizes.of(bench_record(s.members, LONGEST_PID), Keys(PREFIX, "bench"))
    # how often each node's agent reads the job, at the agent's defaults (the bench runs no agents)
    agent_read_s = job_read_interval_s(AgentConfig(program=("train.py",), timeouts=timeouts), live_consumers=False)
    cores = float(len(os.sched_getaffinity(0)))  # the cores this process may run on (psutil counts the host's)
    return {
        "settings": asdict(s),
        "etcd": "stock" if not s.etcd_max_txn_ops else f"--max-txn-ops {s.etcd_max_txn_ops}",
        "cores": cores,
        "txn_wall": txn_wall,
        "phases": phases,
        "costs": asdict(costs),
        "sizes": asdict(sizes),
        "walls": wall_thresholds(sizes),
        "agent_read_s": agent_read_s,
        "load_walls": load_walls(sizes, costs, timeouts, s.per_node, agent_read_s),
        "model": model_rows(costs, sizes, timeouts, phases, s.members, cores, s.per_node, agent_read_s),
        "parse": parse_costs(per_node=max(1, s.per_node)),
        "errors": errors,
    }


FIGURES = (
    "register_s",
    "published_s",
    "first_learned_s",
    "median_learned_s",
    "all_learned_s",
    "generations",
    "window_s",
    "etcd_requests",
    "etcd_puts",
    "etcd_txns",
    "etcd_ranges",
    "etcd_deletes",
    "etcd_watch_events",
    "etcd_bytes_sent",
    "etcd_cpu_s",
    "member_cpu_s",
    "host_stolen_s",
)


def render(result: Mapping[str, object]) -> str:
    s, phases = result["settings"], result["phases"]
    assert isinstance(s, dict) and isinstance(phases, dict)
    procs = math.ceil(s["members"] / s["per_process"])
    relayed = (
        f", {s['per_node']} per node sharing its relay"
        if s.get("per_node", 1) > 1
        else ", each its own node (no relay)"
    )
    lines = [
        f"rendezvous: {s['members']} members, {s['per_process']} per process ({procs} processes){relayed}, one "
        f"local etcd ({result['etcd']}); lease TTL {s['lease_ttl_s']:g} s, keepalive {s['keepalive_s']:g} s "
        f"and every other timeout elasticd's defaults",
        "",
        f"{'figure':<28} {'register':>12} {'join':>12} {'idle, per s':>12} {'leave':>12}",
    ]
    names = list(FIGURES) + sorted({k for p in phases.values() for k in p if k.startswith("member_")} - set(FIGURES))
    for name in names:
        cells = [phases.get(p, {}).get(name) for p in ("register", "join", "idle_per_s", "leave")]
        lines.append(f"{name:<28} " + " ".join(f"{fmt(c if c is None or c != int(c) else int(c)):>12}" for c in cells))
    costs = result["costs"]
    assert isinstance(costs, dict)
    lines += [
        "",
        "calibration (costs per operation, this run): "
        + ", ".join(f"{k} {v * 1e6:.3g} us" if "byte" not in k else f"{k} {v * 1e9:.3g} ns" for k, v in costs.items()),
    ]
    lines += _model_lines(result, phases)
    lines += [
        "",
        "the coordinator's parse of the job each round (this process, one core), decoded whole against "
        "only the records of one node written again (the rest held from the round before):",
    ]
    for row in result.get("parse", []):  # type: ignore[attr-defined]
        lines.append(
            f"{row['members']:>8} members: whole {row['whole_s'] * 1e3:.1f} ms, one node changed "
            f"{row['one_node_changed_s'] * 1e3:.1f} ms (ratio {row['ratio']:.3f})"
        )
    walls_at = result["walls"]
    assert isinstance(walls_at, dict)
    lines += [
        "",
        "walls of a stock etcd: "
        + "; ".join(f"N >= {n}: {name.replace('_', ' ')}" for name, n in walls_at.items() if n is not None),
    ]
    load_at = result["load_walls"]
    assert isinstance(load_at, dict)
    lines += [
        "walls of the training load on one etcd core at this run's costs (the agents' reads every "
        f"{result['agent_read_s']:g} s): "
        + "; ".join(f"N >= {n}: {name.replace('_', ' ')}" for name, n in load_at.items() if n is not None),
    ]
    probe = result["txn_wall"]
    assert isinstance(probe, dict)
    lines += ["this etcd, sent a transaction of: " + "; ".join(f"{n} ops: {answer}" for n, answer in probe.items())]
    lines += [f"error: {e}" for e in result["errors"]]  # type: ignore[attr-defined]
    return "\n".join(lines)


def _model_lines(result: Mapping[str, object], phases: Mapping[str, Mapping[str, float | None]]) -> list[str]:
    """The model's table: its predictions at the measured N and at ``MODEL_N``."""
    lines: list[str] = []
    model = result["model"]
    assert isinstance(model, list)
    measured = [phases.get(p, {}).get("all_learned_s") for p in ("join", "leave")]
    lines += [
        "",
        f"model of the coordinated protocol, to the last member learned (predict(); here: all on "
        f"{result['cores']:g} cores, to check against the measured {fmt(measured[0])} s join, "
        f"{fmt(measured[1])} s leave; fleet: each member on its own host, etcd on {result['cores']:g} "
        "cores); a join round's etcd CPU and bytes sent with the reads per member measured here ("
        + ", ".join(f"{r:.1f}" for r in model[0]["reads_per_member"])
        + " per join, leave)",
        f"{'members':>8} {'join here':>10} {'join fleet':>11} {'leave here':>11} {'leave fleet':>12} "
        f"{'etcd cpu':>9} {'sent':>9} {'no coordinator':>14} {'renewals/s':>11} {'their cores':>12} {'idle cores':>10} "
        f"{'progress cores':>14} {'agent reads cores':>17}  "
        "walls on a stock etcd",
    ]
    for row in model:
        lines.append(
            f"{row['members']:>8} {row['join_here_s']:>9.2f}s {row['join_fleet_s']:>10.2f}s "
            f"{row['leave_here_s']:>10.2f}s {row['leave_fleet_s']:>11.2f}s {row['join_etcd_cpu_s']:>8.1f}s "
            f"{row['join_bytes_sent'] / 1e9:>7.3f}GB {row['join_fleet_s_before']:>13.1f}s "
            f"{row['renewals_per_s']:>11.0f} {row['renewal_etcd_cores']:>12.3f} {row['idle_etcd_cores']:>10.3f} "
            f"{row['progress_etcd_cores']:>14.2f} {row['agent_reads_etcd_cores']:>17.2f}  "
            f"{'; '.join(row['walls']) or '-'}"
        )
    return lines


def add_args(p: argparse.ArgumentParser) -> None:
    """``rendezvous``'s flags."""
    d = RendezvousSettings()
    p.add_argument("--members", type=int, default=d.members, help="lightweight members (N)")
    p.add_argument(
        "--nodes",
        type=int,
        default=0,
        help="nodes of --per-node members each (sets --members to their product; "
        f"--per-process defaults to {NODES_PER_PROCESS} nodes' members)",
    )
    p.add_argument("--per-process", type=int, default=d.per_process, help="members per process, as threads (K)")
    p.add_argument(
        "--per-node",
        type=int,
        default=d.per_node,
        help="members per node (dividing --per-process): more than 1, a node's members read and "
        "watch the job through its relay, as an agent with relay on serves its workers",
    )
    p.add_argument(
        "--etcd-max-txn-ops",
        type=int,
        default=d.etcd_max_txn_ops,
        help="raise etcd's --max-txn-ops (default: a stock etcd, 128) to measure past the publish wall",
    )
    p.add_argument(
        "--lease-ttl-s",
        type=float,
        default=d.lease_ttl_s,
        help="the members' lease TTL (default: elasticd's); with --keepalive-s, what N members' "
        "renewals cost: on a few cores, at the defaults, they alone saturate the CPU near 1,000",
    )
    p.add_argument("--keepalive-s", type=float, default=d.keepalive_s, help="the members' renewal interval")


def run_cmd(args: argparse.Namespace) -> int:
    """``rendezvous``: run it, print the figures; 1 when a round could not be measured."""
    if args.nodes:
        if args.nodes < 1 or args.per_node < 2:
            raise SystemExit("--nodes takes --per-node of at least 2 (a node's members share its relay)")
        args.members = args.nodes * args.per_node
        if args.per_process == RendezvousSettings().per_process:
            args.per_process = NODES_PER_PROCESS * args.per_node
    if args.members < 2 or args.per_process < 1:
        raise SystemExit("--members must be >= 2 (one leaves) and --per-process >= 1")
    if args.per_node < 1 or args.per_process % args.per_node or args.members % args.per_node:
        raise SystemExit(
            "--per-node must be >= 1 and divide --per-process and --members (a node's members live in one process)"
        )
    s = RendezvousSettings(
        members=args.members,
        per_process=args.per_process,
        per_node=args.per_node,
        etcd_max_txn_ops=args.etcd_max_txn_ops,
        lease_ttl_s=args.lease_ttl_s,
        keepalive_s=args.keepalive_s,
    )
    return run_subcommand(args, "elasticd-bench-rendezvous-", lambda workdir: run_rendezvous(s, workdir), render)
