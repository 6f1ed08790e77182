"""The ``rendezvous`` benchmark's lightweight members: processes of threads, each a ``Membership``.

Owns the member processes of ``python -m elasticd.bench rendezvous``: ``MemberProcesses`` starts
them (spawned, never forked: the bench holds gRPC channels), tracked by PID, and drives them over a
pipe ("register", "join", "leave", "counts", "exit"); each runs ``Plan.count`` members as threads, over one
``EtcdClient`` wrapped in a ``CountingStore`` per member, and reports when each began and ended its
registration (``Membership.start``), began its first ``join()``, learned a generation (a ``join()``
returned) or left. With more than one member per node, relay processes (``RelayPlan``) run the
nodes' relays, as each node's agent runs its relay in a process apart from its workers, and count
what they ask etcd the same way. As a trainer does, a member registers when it starts and joins once its
process is ready (here: once every member registered). A member reacts to ``must_abandon()`` and
``join_pending()`` as the trainer does: it joins again. Measures nothing itself (``bench.rendezvous``
does) and never changes the protocol: it only calls ``Membership``.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import queue
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

from elasticd.bench.common import BenchError
from elasticd.config import EtcdConfig, RetryPolicy, Timeouts, WorldConfig
from elasticd.errors import ElasticdError, EtcdUnavailable
from elasticd.log import configure_logging
from elasticd.rendezvous.membership import Membership
from elasticd.relay.node import NodeRelay
from elasticd.relay.store import RelayedStore
from elasticd.retry import Deadline
from elasticd.store.etcd import EtcdClient
from elasticd.store.kv import KeyValue, KeyValueStore, RangeQuery, RangeResult
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord

SPAWN_TIMEOUT_S = 120.0  # bound on starting the member processes (imports, N clients, on 2 cores)
REPLY_TIMEOUT_S = 30.0  # bound on a member process's answer to one command
EXIT_GRACE_S = 5.0  # a member process that has not exited this long after "exit" is killed
POLL_S = 0.05  # how often the bench and the member processes look at their pipes
PREFIX = "/elasticd"
# A member process's GIL switch interval (Python's default is 0.005 s). Its members are threads of one
# interpreter where a fleet's workers each have their own: when a change wakes hundreds of them
# at once, every thread waiting for the GIL wakes every switch interval to ask for it, and at the
# default those wakeups alone take the cores (measured: 1,024 members, 4 processes, 70 % system
# time and node leases lost). Their waits are on sockets and events, which release the GIL.
MEMBER_SWITCH_INTERVAL_S = 0.05


class CountingStore:
    """A ``KeyValueStore`` that counts what its member asks etcd, into its process's counter."""

    def __init__(
        self,
        inner: KeyValueStore,
        counts: Counter[str],
        lock: threading.Lock,
        generation_key: str,
        on_error: Callable[[str], None],
    ) -> None:
        self._inner, self._counts, self._lock = inner, counts, lock
        self._generation_key, self._on_error = generation_key, on_error

    def _n(self, what: str, k: int = 1) -> None:
        with self._lock:
            self._counts[what] += k

    def get(self, key: str) -> KeyValue | None:
        self._n("get")
        return self._inner.get(key)

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        self._n("get_prefix")
        return self._inner.get_prefix(prefix)

    def get_prefixes(self, prefixes: Sequence[str]) -> list[KeyValue]:
        kvs = self._inner.get_prefixes(prefixes)
        self._n("reads")
        self._n("bytes_read", sum(len(kv.key) + len(kv.value) for kv in kvs))
        return kvs

    def read_ranges(self, queries: Sequence[RangeQuery]) -> tuple[int, list[RangeResult]]:
        revision, results = self._inner.read_ranges(queries)
        self._n("reads")
        self._n("bytes_read", sum(len(kv.key) + len(kv.value) for r in results for kv in r.kvs))
        return revision, results

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        self._n("put")
        return self._inner.put(key, value, lease)

    def put_many(self, items: Sequence[tuple[str, bytes, int]]) -> int:
        self._n("put_many")
        self._n("put_many_items", len(items))
        return self._inner.put_many(items)

    def delete(self, key: str) -> None:
        self._n("delete")
        self._inner.delete(key)

    def delete_held(self, items: Sequence[tuple[str, bytes | None]], lease: int) -> int:
        self._n("delete_held", len(items))
        return self._inner.delete_held(items, lease)

    def compare_and_put(
        self,
        key: str,
        expected_mod_revision: int,
        value: bytes,
        delete_keys: Iterable[str] = (),
        put_keys: Mapping[str, bytes] | None = None,
        lease: int = 0,
        delete_ranges: Iterable[tuple[str, str]] = (),
    ) -> bool:
        publish = key == self._generation_key
        self._n("publish_attempts" if publish else "compare_and_put")
        try:
            won = self._inner.compare_and_put(
                key, expected_mod_revision, value, delete_keys, put_keys, lease, delete_ranges
            )
        except EtcdUnavailable as exc:
            if "rejected" in str(exc):  # etcd answered no (a limit): the protocol would retry it forever
                self._on_error(f"{'publish' if publish else 'compare_and_put'}: {exc}"[:400])
            else:
                self._n("unanswered")
            raise
        if publish and won:
            self._n("publish_wins")
        return won

    def grant_lease(self, ttl_s: float) -> int:
        self._n("grant_lease")
        return self._inner.grant_lease(ttl_s)

    def refresh_lease(self, lease: int) -> float:
        self._n("refresh_lease")
        return self._inner.refresh_lease(lease)

    def revoke_lease(self, lease: int) -> None:
        self._n("revoke_lease")
        self._inner.revoke_lease(lease)

    def raft_term(self) -> int:
        return self._inner.raft_term()

    def watch_prefix(self, prefix: str, callback: Callable[[], None]) -> Callable[[], None]:
        self._n("watches")

        def counted() -> None:
            self._n("watch_notifications")
            callback()

        return self._inner.watch_prefix(prefix, counted)


@dataclass(frozen=True)
class Plan:
    """One member process: its members' numbers, the etcd and the job."""

    index: int
    first: int  # the number of its first member
    count: int
    members: int  # N, all processes together
    timeouts: Timeouts
    endpoint: str
    job_id: str
    log_path: str
    per_node: int = 1  # members per node: more than 1, each node's members share its relay (relay.node)
    relay_dir: str = ""  # where the relays' sockets are (one per node, named after it): "" for no relay


@dataclass(frozen=True)
class RelayPlan:
    """One relay process: the relays of ``nodes``, as each node's agent runs its own (a process apart
    from its workers), each listening at ``relay_dir``/<node>."""

    index: int
    nodes: tuple[str, ...]
    timeouts: Timeouts
    endpoint: str
    job_id: str
    log_path: str
    relay_dir: str


def _member_process(conn: Connection, plan: Plan) -> None:
    """A member process: ``plan.count`` members as threads, driven by the bench over ``conn``."""
    sys.stdout = open(plan.log_path, "a", buffering=1)  # noqa: SIM115 (the bench's stdout holds its result)
    configure_logging(json=True, level=logging.WARNING)
    sys.setswitchinterval(MEMBER_SWITCH_INTERVAL_S)
    out, timeouts = queue.Queue[tuple[object, ...]](), plan.timeouts
    # min_workers N-1: the survivors of the leave form a generation; max_workers N: the join round
    # publishes at once when all N are ready (its join window is cut short at max size).
    world = WorldConfig(job_id=plan.job_id, min_workers=max(1, plan.members - 1), max_workers=plan.members)
    keys = Keys(PREFIX, plan.job_id)
    counts: Counter[str] = Counter()
    lock, stop, seen = threading.Lock(), threading.Event(), set[str]()

    def error(msg: str) -> None:
        with lock:
            if msg in seen:
                return
            seen.add(msg)
        out.put(("error", msg))

    members: dict[str, Membership] = {}
    # One etcd client (one gRPC channel, one watch stream) per process, shared by its members, as
    # the workers of one node could share their agent's: a channel per member costs each a
    # polling thread, and a process of hundreds of them measures gRPC's threads, not the protocol.
    client = EtcdClient(EtcdConfig(endpoints=(plan.endpoint,)), timeouts, RetryPolicy())
    for i in range(plan.first, plan.first + plan.count):
        record = bench_record(i, os.getpid(), plan.per_node)
        store: KeyValueStore = CountingStore(client, counts, lock, keys.generation, error)
        if plan.relay_dir:  # its node's relay runs in a relay process, as an agent runs apart from its workers
            store = RelayedStore(store, keys, os.path.join(plan.relay_dir, record.node), timeouts, RetryPolicy())
        members[record.member_id] = Membership(store, keys, record, world, timeouts)
    wake = {mid: threading.Event() for mid in members}
    left: set[str] = set()

    joining = threading.Event()  # the bench said "join": every member registered

    def run(mid: str) -> None:
        m = members[mid]
        try:
            out.put(("registering", mid, time.time()))
            m.start()
            out.put(("registered", mid, time.time()))
            while not joining.wait(REPLY_TIMEOUT_S):  # set on "join" and on "exit"; rarely polled:
                if stop.is_set():  # 1,000 threads polling often would load the cores
                    return
            if stop.is_set():
                return
            out.put(("joining", mid, time.time()))
            while not stop.is_set():
                joined = m.join(0, Deadline.after(timeouts.join_s))
                out.put(("learned", mid, joined.generation, joined.rank, joined.world_size, time.time()))
                while not stop.is_set() and mid not in left and not (m.must_abandon() or m.join_pending()):
                    wake[mid].wait(REPLY_TIMEOUT_S)  # set by watch_abandon, a leave and "exit"
                    wake[mid].clear()
                if mid in left:
                    return
        except ElasticdError as exc:
            error(f"{mid}: {type(exc).__name__}: {exc}"[:400])

    def watch_abandon() -> None:  # as the trainer polls must_abandon() (every abort_poll_s)
        while not stop.wait(timeouts.abort_poll_s):
            for mid, m in members.items():
                if m.must_abandon() or m.join_pending():
                    wake[mid].set()

    def handle(cmd: tuple[object, ...]) -> bool:
        if cmd[0] == "register":
            for target, args in [(watch_abandon, ())] + [(run, (mid,)) for mid in members]:
                threading.Thread(target=target, args=args, daemon=True).start()
        elif cmd[0] == "join":
            joining.set()
        elif cmd[0] == "leave":
            mid = str(cmd[1])
            left.add(mid)
            out.put(("left", mid, time.time()))
            members[mid].close()  # revokes its lease: its keys vanish at once
            wake[mid].set()
        elif cmd[0] == "exit":
            stop.set()
            joining.set()
            for w in wake.values():
                w.set()
            return False
        return True

    _serve_commands(conn, out, counts, lock, handle)


def _serve_commands(
    conn: Connection,
    out: queue.Queue[tuple[object, ...]],
    counts: Counter[str],
    lock: threading.Lock,
    handle: Callable[[tuple[object, ...]], bool],
) -> None:
    """A bench process's loop: say it is up, pass on what its threads reported, answer "counts",
    hand other commands to ``handle`` until it returns False or the bench goes away; then exit."""
    conn.send(("up", os.getpid()))
    try:
        while True:
            while not out.empty():
                conn.send(out.get_nowait())
            if not conn.poll(POLL_S):
                continue
            cmd = conn.recv()
            if cmd[0] == "counts":
                with lock:
                    conn.send(("counts", dict(counts), time.process_time()))
            elif not handle(cmd):
                break
    except (EOFError, OSError):
        pass  # the bench went away
    sys.stdout.flush()
    os._exit(0)  # gRPC and watch threads would hold the process; its leases just expire


def _relay_process(conn: Connection, plan: RelayPlan) -> None:
    """A relay process: the relays of ``plan.nodes``, each at ``plan.relay_dir``/<node>, over one etcd
    client; counts what they ask etcd, as the member processes count their members'."""
    sys.stdout = open(plan.log_path, "a", buffering=1)  # noqa: SIM115 (the bench's stdout holds its result)
    configure_logging(json=True, level=logging.WARNING)
    out, keys = queue.Queue[tuple[object, ...]](), Keys(PREFIX, plan.job_id)
    counts: Counter[str] = Counter()
    lock = threading.Lock()
    client = EtcdClient(EtcdConfig(endpoints=(plan.endpoint,)), plan.timeouts, RetryPolicy())
    for node in plan.nodes:
        store = CountingStore(client, counts, lock, keys.generation, lambda msg: out.put(("error", msg)))
        NodeRelay(store, keys, node, os.path.join(plan.relay_dir, node), plan.timeouts).start()
    _serve_commands(conn, out, counts, lock, lambda cmd: cmd[0] != "exit")


def bench_record(i: int, pid: int, per_node: int = 1) -> MemberRecord:
    """Member ``i``'s record (local rank ``i % per_node`` of node ``i // per_node``): an id as
    ``new_member_id`` makes them, a sha256 signature as the trainer's."""
    node, local = f"node{i // per_node:05d}", i % per_node
    return MemberRecord(
        member_id=f"{node}.{local}.{pid}",
        node=node,
        local_rank=local,
        pid=pid,
        host="127.0.0.1",
        store_port=29500,
        signature=hashlib.sha256(b"bench").hexdigest(),
    )


class MemberProcesses:
    """The member processes, tracked by PID, and what they reported."""

    def __init__(self, plans: Sequence[Plan], relays: Sequence[RelayPlan] = ()) -> None:
        """Start the relay processes (``relays``), once they listen the member processes (``plans``):
        process ``i`` of ``plans`` is ``conns[i]``; the relay processes' follow."""
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        self.registering: dict[str, float] = {}  # member -> when its start() began (wall clock)
        self.registered: dict[str, float] = {}  # ... and returned
        self.joining: dict[str, float] = {}  # ... when its first join() began
        self.owner: dict[str, int] = {}  # member -> the index of its process
        self.learned: dict[tuple[str, int], tuple[int, int, float]] = {}  # (member, gen) -> (rank, size, time)
        self.left: dict[str, float] = {}
        self.errors: list[str] = []
        self._counts: dict[int, tuple[dict[str, int], float]] = {}
        self._up: set[int] = set()
        try:
            self._spawn(_relay_process, relays, "relays")
            self._spawn(_member_process, plans, "members")
        except BenchError:
            self.stop()
            raise
        n = len(relays)  # the member processes first: conns[i] runs plans[i]
        self.conns, self.procs = self.conns[n:] + self.conns[:n], self.procs[n:] + self.procs[:n]

    def _spawn(self, target: Callable[..., None], plans: Sequence[Plan] | Sequence[RelayPlan], what: str) -> None:
        ctx = mp.get_context("spawn")  # never fork a process that holds gRPC channels
        for plan in plans:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=target, args=(theirs, plan), daemon=True, name=f"{what}{plan.index}")
            p.start()
            self.conns.append(mine)
            self.procs.append(p)
        self.wait_until(lambda: len(self._up) == len(self.conns), SPAWN_TIMEOUT_S, f"the {what} processes to start")

    def receive(self, timeout: float) -> None:
        for conn in wait(self.conns, timeout):
            assert isinstance(conn, Connection)
            i = self.conns.index(conn)
            try:
                msg = conn.recv()
            except EOFError as exc:
                raise BenchError(f"member process {i} exited (code {self.procs[i].exitcode})") from exc
            kind, rest = msg[0], msg[1:]
            if kind == "up":
                self._up.add(i)
            elif kind == "registering":
                self.registering[rest[0]], self.owner[rest[0]] = rest[1], i
            elif kind == "registered":
                self.registered[rest[0]] = rest[1]
            elif kind == "joining":
                self.joining[rest[0]] = rest[1]
            elif kind == "learned":
                self.learned[(rest[0], rest[1])] = (rest[2], rest[3], rest[4])
            elif kind == "left":
                self.left[rest[0]] = rest[1]
            elif kind == "counts":
                self._counts[i] = (rest[0], rest[1])
            elif kind == "error":
                self.errors.append(rest[0])

    def complete(self, size: int, after: int = 0, since: float = 0.0) -> int | None:
        """The newest generation after ``after`` of ``size`` members that all of them learned, each at
        ``since`` (wall clock) or later."""
        got = Counter(g for (_, g), (_, world, t) in self.learned.items() if g > after and world == size and t >= since)
        done = [g for g, k in got.items() if k == size]
        return max(done) if done else None

    def learned_times(self, gen: int) -> list[float]:
        return [t for (_, g), (_, _, t) in self.learned.items() if g == gen]

    def wait_until(self, done: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if self.errors:
                raise BenchError(f"while waiting for {what}: {self.errors[0]}")
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
            self.receive(POLL_S)

    def send(self, i: int, *cmd: object) -> None:
        self.conns[i].send(cmd)

    def counts(self) -> dict[str, float]:
        """The members' counts summed over the processes, and their CPU seconds (``member_cpu_s``)."""
        self._counts.clear()
        for i in range(len(self.conns)):
            self.send(i, "counts")
        self.wait_until(lambda: len(self._counts) == len(self.conns), REPLY_TIMEOUT_S, "the members' counts")
        total: Counter[str] = Counter()
        for c, _ in self._counts.values():
            total.update(c)
        return {
            **{f"member_{k}": float(v) for k, v in total.items()},
            "member_cpu_s": sum(c for _, c in self._counts.values()),
        }

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("exit",))
            except OSError:
                pass
        deadline = time.monotonic() + EXIT_GRACE_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()  # SIGKILL by PID
                p.join(EXIT_GRACE_S)
