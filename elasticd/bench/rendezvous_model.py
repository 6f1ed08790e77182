"""The ``rendezvous`` benchmark's model and report arithmetic, pure.

Owns what the rendezvous bench computes without I/O: the sizes of the records a member writes
(``Sizes``), the walls a stock etcd puts in the way of a generation of N (``walls``,
``wall_thresholds``: the publish transaction's operations against ``--max-txn-ops``, its bytes
against ``--max-request-bytes``, a member's full read against gRPC's message limit), the current
protocol's operations per round (``current_protocol``) and a round's predicted time from the costs
per operation measured by the bench's calibration (``predict``, ``model_rows``), and the figures'
arithmetic (``parse_metrics`` of etcd's /metrics, ``difference``, ``round_times``).

A new protocol gets its own counting function beside ``current_protocol``; ``predict`` stays.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from elasticd.config import Timeouts
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord, ReadyRecord, encode
from elasticd.wire.progress import ProgressRecord, encode_progress
from elasticd.wire.roster import buckets_for

# etcd's defaults (v3.4/3.5) and gRPC's: the walls of a stock deployment.
STOCK_MAX_TXN_OPS = 128  # etcd --max-txn-ops
STOCK_MAX_REQUEST_BYTES = 1536 * 1024  # etcd --max-request-bytes (1.5 MiB)
GRPC_MAX_RECEIVE_BYTES = 4 * 1024 * 1024  # gRPC's default largest message a client receives
KV_OVERHEAD_B = 30  # protobuf framing of one KeyValue in a range response (revisions, version, lease)
MODEL_N = (1024, 4096, 16384)  # 128, 512 and 2,048 nodes of 8
# Writes on a round's critical path, one after another (each waits for etcd's WAL fsync; the reads
# between them are the sweeps): join = a ready put, the publish; leave = the revoke, a ready put,
# the publish.
JOIN_SEQ_WRITES, LEAVE_SEQ_WRITES = 2, 3
# Sweeps of full reads on a round's critical path (``current_protocol``): join 2 + 2; leave 1 (the
# survivors see the leaver gone) + 1 (their ready puts land) + 2 + 2.
JOIN_SWEEPS, LEAVE_SWEEPS = 4.0, 6.0
# Requests per member per round besides its reads: grant, TTL, member put, ready put (join); ready put (leave).
JOIN_FIXED_REQUESTS, LEAVE_FIXED_REQUESTS = 4, 1
# etcd's /metrics counters reported per phase (name there -> name here).
ETCD_METRICS = {
    "etcd_debugging_mvcc_events_total": "watch_events",
    "etcd_mvcc_put_total": "puts",
    "etcd_mvcc_txn_total": "txns",
    "etcd_mvcc_range_total": "ranges",
    "etcd_mvcc_delete_total": "deletes",
    "etcd_network_client_grpc_sent_bytes_total": "bytes_sent",
}
DEFAULT_READS_PER_MEMBER = 2.0
DIGEST_B = 256  # the job's digest (wire.digest): four times, a few counts, the spares by node
VIEW_FIXED_B = 1024  # a member's view without the roster: generation pointer, verdict, coordinator, ... (framed)
COORDINATED_FIXED_REQUESTS = 1  # a member's requests in a round besides its reads: its ready put
# The coordinator's reads of the job on a round's critical path (with no round measured: a
# member's two readers, the join loop and the watcher, read once each).
COORDINATOR_READS = 2.0


@dataclass(frozen=True)
class Sizes:
    """Bytes of the records one member writes, as etcd stores and sends them."""

    member_kv: int  # members/<id>: key, value and framing
    ready_kv: int  # ready/<id>
    member_id: int  # one id's length (the generation record and its event list them all)
    ready_key: int  # the ready key's length (the publish deletes each)
    progress_kv: int = 0  # progress/<id>: what a training member writes every keepalive_s
    member_key: int = 0  # the member key's length

    @staticmethod
    def of(record: MemberRecord, keys: Keys) -> Sizes:
        ready = ReadyRecord(record.member_id, 0, 1, 0, record.signature)
        progress = ProgressRecord(123456, 1234, 16383, 0.512, 3, 0.1, "worker_kill", 1.8e9, 0.48)
        return Sizes(
            len(keys.member(record.member_id)) + len(encode(record)) + KV_OVERHEAD_B,
            len(keys.ready(record.member_id)) + len(encode(ready)) + KV_OVERHEAD_B,
            len(record.member_id),
            len(keys.ready(record.member_id)),
            len(keys.progress(record.member_id)) + len(encode_progress(progress)) + KV_OVERHEAD_B,
            len(keys.member(record.member_id)),
        )

    def full_read(self, n: int) -> int:
        """One member's read while all N are registered and ready (and a generation lists them)."""
        return n * (self.member_kv + self.ready_kv + self.member_id + 4)

    def join_read(self, n: int) -> int:
        """The coordinator's read of the job in a join round, at most (``store.mirror``: what changed
        since its last read): every member's ready record, written meanwhile, and the small records."""
        return VIEW_FIXED_B + n * self.ready_kv

    def listing(self, n: int) -> int:
        """The coordinator's read of the job after a member left (``store.mirror``: a key was
        deleted): every member and ready key without its value, and the small records."""
        return VIEW_FIXED_B + n * (self.member_key + self.ready_key + 2 * KV_OVERHEAD_B)

    def agent_read(self, n: int) -> int:
        """The coordinator's node's agent's read of the whole job while it trains
        (``agent.jobview.JobReader``, ``store.mirror``): what changed since its last, every
        member's progress record (written each ``keepalive_s``) and the small records."""
        return VIEW_FIXED_B + n * self.progress_kv

    def node_read(self, per_node: int) -> int:
        """Every other agent's read (``agent.jobview.node_prefixes``): the small records, the digest
        and its own node's member, ready and progress records."""
        return VIEW_FIXED_B + DIGEST_B + per_node * (self.member_kv + self.ready_kv + self.progress_kv)

    def view(self, n: int) -> int:
        """One member's reads after a change under the coordinated protocol: its view (the small
        records, ``VIEW_FIXED_B``) and its node's roster bucket (``wire.roster``; the whole list
        while the generation lists its members)."""
        buckets = buckets_for(n)
        per_bucket = n if buckets == 0 else math.ceil(n / buckets)
        return VIEW_FIXED_B + per_bucket * (self.member_id + 8)

    def publish_request(self, n: int, deletes: bool = False) -> int:
        """The publish transaction: the generation record and its event (both list the N ids, as
        ``"id", ``), plus ~1 kB of rest; ``deletes``: and one delete per consumed ready key (a
        publish that deletes them, as an alternative design would)."""
        return 1024 + 2 * n * (self.member_id + 4) + (n * (self.ready_key + 4) if deletes else 0)


def publish_ops(n: int, deletes: bool = False) -> int:
    """Operations in the publish transaction (``Membership.join``): the generation put and the
    ``generation_published`` event put; ``deletes``: and one delete per consumed ready key (a
    publish that deletes them, where elasticd consumes them by revision, ``wire.snapshot.consumed``)."""
    return 2 + (n if deletes else 0)


def walls(n: int, sizes: Sizes, deletes: bool = False) -> list[str]:
    """What stops a generation of ``n`` on a stock etcd (empty: nothing known); ``deletes``: with a
    publish that deletes its consumed ready keys."""
    out = []
    if publish_ops(n, deletes) > STOCK_MAX_TXN_OPS:
        out.append(f"publish txn has {publish_ops(n, deletes)} ops > --max-txn-ops {STOCK_MAX_TXN_OPS}: cannot publish")
    if sizes.publish_request(n, deletes) > STOCK_MAX_REQUEST_BYTES:
        out.append(f"publish request {sizes.publish_request(n, deletes) / 2**20:.2f} MiB > --max-request-bytes 1.5 MiB")
    if sizes.full_read(n) > GRPC_MAX_RECEIVE_BYTES:
        out.append(
            f"a full read {sizes.full_read(n) / 2**20:.2f} MiB > gRPC's default 4 MiB message (the "
            "coordinator's and status' clients raise it: store.etcd)"
        )
    return out


def first_n(over: Callable[[int], bool], limit: int = 10**6) -> int | None:
    """The smallest N >= 1 for which ``over(N)`` holds (monotonic in N), by bisection; None if none."""
    if not over(limit):
        return None
    lo, hi = 1, limit
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if over(mid) else (mid + 1, hi)
    return lo


def wall_thresholds(sizes: Sizes) -> dict[str, int | None]:
    """The first N at which each wall of a stock etcd applies (``*_deleting_ready``: with a publish
    that deletes the consumed ready keys)."""
    return {
        "publish_txn_ops": first_n(lambda n: publish_ops(n) > STOCK_MAX_TXN_OPS),
        "publish_txn_ops_deleting_ready": first_n(lambda n: publish_ops(n, True) > STOCK_MAX_TXN_OPS),
        "publish_request_bytes": first_n(lambda n: sizes.publish_request(n) > STOCK_MAX_REQUEST_BYTES),
        "publish_request_bytes_deleting_ready": first_n(
            lambda n: sizes.publish_request(n, True) > STOCK_MAX_REQUEST_BYTES
        ),
        "full_read_grpc_message": first_n(lambda n: sizes.full_read(n) > GRPC_MAX_RECEIVE_BYTES),
    }


@dataclass(frozen=True)
class Costs:
    """Per-operation costs measured by ``calibrate`` (seconds)."""

    request_rtt_s: float  # one small read, as a client sees it
    write_rtt_s: float  # one small put, as a client sees it (etcd's WAL fsync included)
    etcd_per_request_s: float  # etcd CPU per small request
    etcd_per_event_s: float  # etcd CPU per watch event delivered
    etcd_per_byte_s: float  # etcd CPU per byte read (a range response)
    member_per_request_s: float  # a member's CPU per small request (gRPC, Python)
    member_per_event_s: float  # a member's CPU per watch event received
    member_per_byte_s: float  # a member's CPU per byte read (decode and ``parse_snapshot``)


@dataclass(frozen=True)
class RoundCounts:
    """What one round of a protocol costs in operations, and its critical path."""

    members: int  # the members that take part
    requests: float  # all members' requests besides their full reads
    events: float  # watch events delivered
    read_bytes: int  # one member's full read
    reads_per_member: float  # full reads per member over the whole round, its tail included
    sweeps: float  # sweeps (every member reads once) on the critical path
    seq_writes: int  # writes one after another on the critical path
    fixed_wait_s: float  # waits the protocol imposes
    coordinator_reads: float = 0.0  # reads of the job by one reader (the coordinator) on the critical path
    full_bytes: int = 0  # ... each of this size (what changed since its last read: ``store.mirror``)
    readers: int = 0  # who read etcd in a sweep (0: every member; with node relays: the nodes)


def coordinated_protocol(
    n: int, reads_per_member: float, sizes: Sizes, timeouts: Timeouts, leave: bool, per_node: int = 1
) -> RoundCounts:
    """The coordinated protocol's round (``rendezvous.coordinator``). Only the coordinator watches
    and reads ``members/`` and ``ready/``; a member watches the generation, abort, finished,
    verdict and coordinator records and reads its small view and its node's roster bucket
    (``Sizes.view``). Join: each ready put reaches the coordinator (N events), the generation put
    every member (N): 2N. Leave (``rendezvous.survivors``, no ready round), M = N-1
    survivors: the leaver's key and the generation reach the coordinator (2), the generation every
    survivor (M): M + 2, and no member writes. Critical path, join: a ready put, the coordinator's
    reads of the job (the one in flight missed it, the next sees it: ``COORDINATOR_READS``), the
    publish, then one sweep of the members' reads (view and bucket: 2 requests each); leave: the
    revoke, the coordinator's reads, the publish, the same sweep, and the trainer's poll
    (``abort_poll_s``) before each survivor joins from the view it read. ``reads_per_member``
    (measured) gives the round's etcd CPU and bytes, not its time.

    ``per_node`` > 1: node relays (``relay.node``): a node's relay watches and reads for its
    ``per_node`` members, so the sweeps read etcd once per node (``readers``) and the generation
    reaches one watcher per node; the ready puts of a join still reach the coordinator one each."""
    m = n - 1 if leave else n
    nodes = math.ceil(m / per_node)
    watchers = nodes if per_node > 1 else m
    events = watchers + 2 if leave else m + watchers
    return RoundCounts(
        m,
        0 if leave else m * COORDINATED_FIXED_REQUESTS,
        events,
        sizes.view(n),
        reads_per_member,
        2.0,
        2,
        timeouts.abort_poll_s if leave else 0.0,
        coordinator_reads=COORDINATOR_READS,
        full_bytes=sizes.listing(n) if leave else sizes.join_read(n),
        readers=nodes if per_node > 1 else 0,
    )


def current_protocol(
    n: int, reads_per_member: float, sizes: Sizes, timeouts: Timeouts, leave: bool, deletes: bool = False
) -> RoundCounts:
    """The protocol without a coordinator, kept for comparison. Every member watches ``members/``,
    ``ready/`` and the generation, so each ready put and the generation put reach all members
    (join: N^2+N events; leave, with M = N-1 survivors: the leaver's delete, then M^2+M);
    ``deletes``: the publish also deletes the N consumed ready keys, each reaching all members
    (join 2N^2+N, leave 2M^2+2M). Each member re-reads both prefixes in full on an event. Reads
    are coalesced (events that arrive during a read cause one more), so while events arrive every member reads back to back: a
    "sweep". The generation is published at most ~2 sweeps after the last ready record lands (the
    read in flight missed it, the next one sees it) and learned by all ~2 sweeps later: 4 sweeps
    (``JOIN_SWEEPS``); a leave adds the survivors' read that sees the leaver gone and their ready
    puts landing (``LEAVE_SWEEPS``). The join window is cut short at ``max_workers`` (N here);
    a leave waits for the trainer's poll of ``must_abandon`` (``abort_poll_s``).
    ``reads_per_member`` (measured) counts the whole round's reads, its tail after the last
    member learned included: it gives the round's etcd CPU and bytes, not its time."""
    m = n - 1 if leave else n
    events = (2 if deletes else 1) * m * m + m + (m if leave else 0)
    fixed = LEAVE_FIXED_REQUESTS if leave else JOIN_FIXED_REQUESTS
    return RoundCounts(
        m,
        m * fixed,
        events,
        sizes.full_read(n),
        reads_per_member,
        LEAVE_SWEEPS if leave else JOIN_SWEEPS,
        LEAVE_SEQ_WRITES if leave else JOIN_SEQ_WRITES,
        timeouts.abort_poll_s if leave else 0.0,
    )


@dataclass(frozen=True)
class Prediction:
    etcd_cpu_s: float  # the whole round's, its tail included
    bytes_sent: float  # by etcd, in full reads, over the whole round
    fleet_s: float  # to the last member learned: each member on its own host, etcd on ``cores`` cores
    here_s: float  # ... everything on ``cores`` cores (this machine: checked against the measured points)


def predict(r: RoundCounts, c: Costs, cores: float) -> Prediction:
    """A round's time to the last member learned: the protocol's waits, the writes in sequence on
    its critical path, the watch events' delivery and ``r.sweeps`` sweeps of full reads, the CPU work spread
    evenly over ``cores`` (no queueing beyond it). Here, the members' work shares the cores with
    etcd's; on a fleet, each member's own work runs on its host."""
    read_etcd = c.etcd_per_request_s + r.read_bytes * c.etcd_per_byte_s  # one member's read, etcd's side
    read_member = c.member_per_request_s + r.read_bytes * c.member_per_byte_s  # ... the member's side
    full_etcd = c.etcd_per_request_s + r.full_bytes * c.etcd_per_byte_s  # the coordinator's read of the job
    coordinator = r.coordinator_reads * (full_etcd + c.member_per_request_s + r.full_bytes * c.member_per_byte_s)
    events_etcd, events_member = r.events * c.etcd_per_event_s, r.events * c.member_per_event_s
    requests_etcd, requests_member = r.requests * c.etcd_per_request_s, r.requests * c.member_per_request_s
    base = r.fixed_wait_s + r.seq_writes * c.write_rtt_s + coordinator
    if r.readers:  # node relays: one read per node, then each member decodes the relay's frame
        decode = r.read_bytes * c.member_per_byte_s
        sweep_here = (r.readers * (read_etcd + read_member) + r.members * decode) / cores
        sweep_fleet = r.readers * read_etcd / cores + read_member + decode
    else:
        sweep_here = r.members * (read_etcd + read_member) / cores
        sweep_fleet = r.members * read_etcd / cores + read_member
    here = base + r.sweeps * sweep_here + (events_etcd + events_member + requests_etcd + requests_member) / cores
    fleet = base + r.sweeps * sweep_fleet + (events_etcd + requests_etcd) / cores + events_member / max(1, r.members)
    reads = r.members * r.reads_per_member
    return Prediction(
        requests_etcd + events_etcd + reads * read_etcd + r.coordinator_reads * full_etcd,
        reads * r.read_bytes + r.coordinator_reads * r.full_bytes,
        fleet,
        here,
    )


def parse_metrics(text: str) -> dict[str, float]:
    """etcd's /metrics text -> ``ETCD_METRICS``' counters, plus ``requests``: every gRPC call etcd
    handled but watches and health checks (a lease renewal is one keep-alive stream)."""
    out = dict.fromkeys(ETCD_METRICS.values(), 0.0) | {"requests": 0.0}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        base = name.split("{", 1)[0]
        if base in ETCD_METRICS:
            out[ETCD_METRICS[base]] += float(value)
        elif base == "grpc_server_handled_total" and "Watch" not in name and "Health" not in name:
            out["requests"] += float(value)
    return out


def difference(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


def round_times(start: float, published: float | None, learned: Iterable[float]) -> dict[str, float | None]:
    """A round's times from its start (wall clock): to the generation record, to the first, the
    median and the last member's join() return."""
    got = sorted(learned)
    return {
        "published_s": None if published is None else round(published - start, 3),
        "first_learned_s": round(got[0] - start, 3) if got else None,
        "median_learned_s": round(got[len(got) // 2] - start, 3) if got else None,
        "all_learned_s": round(got[-1] - start, 3) if got else None,
    }


def renewals_per_s(n: int, per_node: int, timeouts: Timeouts) -> float:
    """etcd's lease renewals per second for ``n`` members at ``per_node`` per node: one per node per
    ``keepalive_s`` with node relays (the node's one lease: ``relay.leases``), one per member
    without. Pure."""
    holders = math.ceil(n / per_node) if per_node > 1 else n
    return holders / timeouts.keepalive_s


def idle_etcd_cores(n: int, per_node: int, sizes: Sizes, costs: Costs, timeouts: Timeouts) -> float:
    """etcd's cores while nothing changes, for ``n`` members at ``per_node`` per node: the lease
    renewals (``renewals_per_s``), one view read per holder per ``view_poll_s`` (each node's relay,
    or each member without one: the safety net; a relay's heartbeats read nothing) and the idle
    coordinator's read of the job per ``view_poll_s`` (``store.mirror``: nothing changed, nothing
    but the counts sent). Pure."""
    holders = math.ceil(n / per_node) if per_node > 1 else n
    requests = renewals_per_s(n, per_node, timeouts) + (holders + 1) / timeouts.view_poll_s
    read_bytes = VIEW_FIXED_B / timeouts.view_poll_s  # the coordinator's
    return requests * costs.etcd_per_request_s + read_bytes * costs.etcd_per_byte_s


def training_etcd_cores(
    n: int, per_node: int, sizes: Sizes, costs: Costs, timeouts: Timeouts, agent_read_s: float
) -> tuple[float, float]:
    """etcd's cores while a job of ``n`` trains, besides the idle load: (the workers' progress puts,
    the agents' reads). Each worker puts its progress record every ``keepalive_s``: a node's relay
    writes its workers' in one transaction per ``keepalive_s`` (``relay.node``), a worker without
    one its own; every ``agent_read_s`` (``agent.jobview.job_read_interval_s``) each node's agent
    reads its own node's records and the digest, and the coordinator's node's agent the whole job. Pure."""
    nodes = math.ceil(n / per_node)
    puts = (nodes if per_node > 1 else n) / timeouts.keepalive_s * costs.etcd_per_request_s
    read_bytes = (nodes - 1) * sizes.node_read(per_node) + sizes.agent_read(n)
    reads = (nodes * costs.etcd_per_request_s + read_bytes * costs.etcd_per_byte_s) / agent_read_s
    return puts, reads


def load_walls(
    sizes: Sizes, costs: Costs, timeouts: Timeouts, per_node: int, agent_read_s: float
) -> dict[str, int | None]:
    """The first N at which the training load alone takes one etcd core at this run's costs:
    the progress puts, the agents' reads (``training_etcd_cores``)."""

    def load(n: int) -> tuple[float, float]:
        return training_etcd_cores(n, per_node, sizes, costs, timeouts, agent_read_s)

    return {
        "progress_puts_one_core": first_n(lambda n: load(n)[0] > 1.0),
        "agent_reads_one_core": first_n(lambda n: load(n)[1] > 1.0),
    }


def model_rows(
    costs: Costs,
    sizes: Sizes,
    timeouts: Timeouts,
    phases: Mapping[str, Mapping[str, float | None]],
    measured_n: int,
    cores: float,
    per_node: int = 1,
    agent_read_s: float = 2.5,
) -> list[dict[str, object]]:
    """The model's predictions at the measured N and at ``MODEL_N``, with the reads per member per
    round measured here, and ``per_node`` members per node (pure)."""

    def reads(name: str, members: int) -> float:
        got = phases.get(name, {}).get("member_reads")
        return got / members if got else DEFAULT_READS_PER_MEMBER

    r_join, r_leave = reads("join", measured_n), reads("leave", max(1, measured_n - 1))
    rows: list[dict[str, object]] = []
    for n in (measured_n, *MODEL_N):
        join = predict(coordinated_protocol(n, r_join, sizes, timeouts, leave=False, per_node=per_node), costs, cores)
        leave = predict(coordinated_protocol(n, r_leave, sizes, timeouts, leave=True, per_node=per_node), costs, cores)
        before = predict(current_protocol(n, r_join, sizes, timeouts, leave=False), costs, cores)
        rows.append(
            {
                "members": n,
                "join_here_s": join.here_s,
                "join_fleet_s": join.fleet_s,
                "join_etcd_cpu_s": join.etcd_cpu_s,
                "join_bytes_sent": join.bytes_sent,
                "leave_here_s": leave.here_s,
                "leave_fleet_s": leave.fleet_s,
                "leave_etcd_cpu_s": leave.etcd_cpu_s,
                "leave_bytes_sent": leave.bytes_sent,
                "join_fleet_s_before": before.fleet_s,
                "renewals_per_s": renewals_per_s(n, per_node, timeouts),
                "renewal_etcd_cores": renewals_per_s(n, per_node, timeouts) * costs.etcd_per_request_s,
                "idle_etcd_cores": idle_etcd_cores(n, per_node, sizes, costs, timeouts),
                "progress_etcd_cores": training_etcd_cores(n, per_node, sizes, costs, timeouts, agent_read_s)[0],
                "agent_reads_etcd_cores": training_etcd_cores(n, per_node, sizes, costs, timeouts, agent_read_s)[1],
                "reads_per_member": (r_join, r_leave),
                "walls": walls(n, sizes),
            }
        )
    return rows
