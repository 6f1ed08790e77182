"""One torch.distributed process group per generation, built and abandoned in-process.

Owns the c10d store and the gloo/NCCL group objects. Every worker hosts a ``TCPStore`` server from
its start, listening on its advertised address only; generation g uses the server of its rank 0
(always a live member) under the key prefix ``gen/<g>/``, so stores of different generations never
collide, sealed under the generation's token (``store_seal``), so that what its members exchange
can be neither read nor forged by a process that reaches the port. The build is preceded by an
arrival barrier that can be abandoned, so a member that dies between publication and build does
not hold the others for the whole build timeout. NCCL groups are built and aborted by ``nccl.py``
(device bound, non-blocking init, bounded abort). Never retries and never decides membership.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (  # typed here, unlike torch.distributed
    Store,
    TCPStore,
)

from elasticd.config import Timeouts
from elasticd.errors import CollectiveError, CollectiveTimeout, ConfigError, PeerLost
from elasticd.retry import Bound, Deadline
from elasticd.worker.group.nccl import NcclGroups, TorchNccl
from elasticd.worker.group.store_seal import generation_store

log = structlog.get_logger(__name__)

# One attempt to reach rank 0's store lasts at most this long, so the build can notice an abandoned
# generation between attempts; the whole connection is bounded by group_build_s.
STORE_CONNECT_ATTEMPT_S = 1.0
STORE_CONNECT_MIN_S = 0.5  # c10d needs some time for one TCP connect + handshake


def resolve_backend(requested: str) -> str:
    """``auto`` means NCCL when CUDA is available, else gloo."""
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return requested


@dataclass
class Group:
    """The process group of one generation."""

    pg: dist.ProcessGroup
    generation: int
    rank: int
    world_size: int
    backend: str
    device: torch.device
    # The store the group was built over: C++ holds it without keeping the Python half of a
    # ``SealedStore`` alive, so the group keeps it until the group itself is gone.
    store: Store | None = None


def listen_on(host: str) -> socket.socket:
    """A TCP socket listening on ``host`` only (not on every interface), on a free port.

    Raises:
        ConfigError: ``host`` does not resolve, or is not an address of this machine.
    """
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise ConfigError(f"advertise_addr: {host!r} does not resolve: {exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"advertise_addr: cannot listen on {host!r} (not an address of this host?): {exc}") from exc
    return sock


class StoreServer:
    """This worker's ``TCPStore`` server; it serves every generation in which this worker is rank 0.

    It listens on ``host`` (the advertised address, where gloo listens too) only: given a port,
    c10d would listen on every interface, so the socket is bound here and handed over.

    Raises:
        ConfigError: ``host`` is not an address of this machine.
    """

    def __init__(self, host: str, timeouts: Timeouts) -> None:
        self.host = host
        self._timeouts = timeouts
        listener = listen_on(host)
        self.port = int(listener.getsockname()[1])
        # From here the store owns the fd: libuv closes it with the store, and on a failed start
        # (a Python socket object would close it under the store, or close a reused fd number).
        self.store = TCPStore(
            host,
            self.port,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeouts.group_build_s),
            master_listen_fd=listener.detach(),
            use_libuv=True,
        )


class GroupFactory:
    """Builds the group of a generation and retires the groups of old ones."""

    def __init__(
        self,
        server: StoreServer,
        advertise_addr: str,
        backend: str,
        local_rank: int,
        timeouts: Timeouts,
        nccl: NcclGroups | None = None,
    ) -> None:
        """``nccl``: the NCCL sequence on this worker's device (default: ``NcclGroups(TorchNccl(), ...)``,
        made only for the NCCL backend; it sets NCCL's environment and the CUDA device)."""
        self._server = server
        self._addr = advertise_addr
        self.backend = resolve_backend(backend)
        self._timeouts = timeouts
        self.device = (
            torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self._nccl = (nccl or NcclGroups(TorchNccl(), self.device, timeouts)) if self.backend == "nccl" else None
        self._client: Store | None = None
        self._client_addr: tuple[str, int] | None = None
        self._retiring: list[threading.Thread] = []
        self._bases: dict[int, tuple[Store, str]] = {}  # generation -> its base store and token

    def _store_for(self, host: str, port: int, bound: Bound) -> Store:
        # Rank 0 too talks to its own server through a client connection of its own, never through
        # the server's store object: a c10d store runs one call at a time per connection, and an
        # abandoned build left stuck in gloo's connect (a member that arrived and died before it
        # published its address) holds its connection for up to group_build_s. A build given up
        # drops the connection (``_meet``), so the next generation's build opens a fresh one.
        if (host, port) == (self._addr, self._server.port) or (
            port == self._server.port and host in (self._server.host, "127.0.0.1", "localhost")
        ):
            host = self._server.host
        if self._client_addr == (host, port) and self._client is not None:
            return self._client
        self._client, self._client_addr = None, None  # drop the old connection before opening one
        while True:
            if bound.abandoned():
                raise PeerLost(f"generation abandoned while connecting to store {host}:{port}")
            try:
                client = TCPStore(
                    host,
                    port,
                    is_master=False,
                    timeout=timedelta(
                        seconds=max(STORE_CONNECT_MIN_S, min(STORE_CONNECT_ATTEMPT_S, bound.remaining_s()))
                    ),
                )
            except (RuntimeError, dist.DistError) as exc:
                if bound.expired():
                    raise CollectiveTimeout(f"store {host}:{port} unreachable: {exc}") from exc
                continue
            client.set_timeout(timedelta(seconds=self._timeouts.group_build_s))
            self._client, self._client_addr = client, (host, port)
            return client

    def build(
        self,
        generation: int,
        rank: int,
        world_size: int,
        store_host: str,
        store_port: int,
        bound: Bound,
        *,
        token: str = "",
    ) -> Group:
        """Build generation ``generation``'s group, with every member of it, within ``bound``;
        ``token`` is the generation record's secret, under which its keys are sealed ("": a plain
        key prefix).

        Raises:
            PeerLost: the generation was abandoned while waiting for peers to arrive.
            CollectiveTimeout: not every member arrived before ``bound``'s deadline.
            CollectiveError: the backend failed to connect.
        """
        started = time.monotonic()
        base = self._store_for(store_host, store_port, bound)
        self._bases = {generation: (base, token)}  # subgroups are built only in the newest generation
        store = generation_store(base, f"gen/{generation}/", token)
        pg = self._meet(store, rank, world_size, bound, f"generation {generation}")
        log.info(
            "process_group_rebuilt",
            generation=generation,
            rank=rank,
            world_size=world_size,
            backend=self.backend,
            duration_s=round(time.monotonic() - started, 4),
        )
        return Group(pg, generation, rank, world_size, self.backend, self.device, store)

    def build_subgroup(self, parent: Group, ranks: Sequence[int], name: str, bound: Bound) -> Group:
        """A group of some ranks of ``parent`` (this rank among them), over the parent's store under
        ``gen/<generation>/<name>/``; rank i of the subgroup is ``ranks[i]``. Every rank in ``ranks``
        must call this with the same ``ranks`` and ``name``; retire it like any group.

        Raises:
            PeerLost, CollectiveTimeout, CollectiveError: as ``build``.
        """
        assert parent.rank in ranks and len(set(ranks)) == len(ranks), (parent.rank, ranks)
        assert parent.generation in self._bases, f"build() generation {parent.generation} first"
        base, token = self._bases[parent.generation]
        started = time.monotonic()
        store = generation_store(base, f"gen/{parent.generation}/{name}/", token)
        sub_rank = list(ranks).index(parent.rank)
        pg = self._meet(store, sub_rank, len(ranks), bound, f"subgroup {name} of generation {parent.generation}")
        log.debug(
            "subgroup_built",
            generation=parent.generation,
            rank=parent.rank,
            name=name,
            members=list(ranks),
            duration_s=round(time.monotonic() - started, 4),
        )
        return Group(pg, parent.generation, sub_rank, len(ranks), self.backend, self.device, store)

    def _meet(self, store: Store, rank: int, world_size: int, bound: Bound, what: str) -> dist.ProcessGroup:
        """An abandonable arrival barrier on ``store``, then the backend's group over it.

        Both run on a helper thread while this one polls ``bound`` (abandoned, expired): a store
        call to a rank 0 frozen mid-build blocks for the store's timeout (``group_build_s``), and
        the backend's constructor waits for every peer's address for its own (``collective_s``),
        and neither can be interrupted. A build left behind finishes (or fails) on its thread,
        which then drops the group it made (a NCCL one aborted first).
        """
        outcome: list[dist.ProcessGroup | BaseException] = []
        done, cancelled = threading.Event(), threading.Event()

        def run() -> None:
            try:
                outcome.append(
                    self._meet_blocking(store, rank, world_size, bound.abandoned_also_when(cancelled.is_set), what)
                )
            except BaseException as exc:  # handed to the caller below
                outcome.append(exc)
            finally:
                done.set()
                if cancelled.is_set():
                    late = outcome[0] if outcome and not isinstance(outcome[0], BaseException) else None
                    outcome.clear()  # a late group is destroyed here, never on the training thread
                    if late is not None and self._nccl is not None:
                        self._nccl.abort(late, what)  # a NCCL one is aborted first, never destroyed

        t = threading.Thread(target=run, name="elasticd-group-build", daemon=True)
        t.start()
        while not done.wait(bound.poll_s / 4):
            if bound.abandoned() or bound.expired():
                cancelled.set()
                self._client, self._client_addr = None, None  # a stuck call may hold its connection
                self._retiring = [r for r in self._retiring if r.is_alive()] + [t]
                if bound.abandoned():
                    raise PeerLost(f"{what} abandoned while it was being built")
                raise CollectiveTimeout(f"{what}: not built in time")
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _meet_blocking(self, store: Store, rank: int, world_size: int, bound: Bound, what: str) -> dist.ProcessGroup:
        try:
            store.add("arrived", 1)
            while int(store.add("arrived", 0)) < world_size:
                if bound.abandoned():
                    raise PeerLost(f"{what} abandoned while waiting for peers")
                if bound.expired():
                    raise CollectiveTimeout(f"{what}: peers did not arrive in time")
                time.sleep(bound.poll_s / 4)
            if self._nccl is not None:
                return self._nccl.build(store, rank, world_size, bound, what)
            return self._make(store, rank, world_size)
        except (RuntimeError, dist.DistError) as exc:
            raise CollectiveError(f"building {what} failed: {exc}") from exc

    def _make(self, store: Store, rank: int, world_size: int) -> dist.ProcessGroup:
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timedelta(seconds=self._timeouts.collective_s)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self._addr)]
        return dist.ProcessGroupGloo(store, rank, world_size, opts)  # type: ignore[return-value]

    def retire(self, group: Group | None) -> None:
        """Let go of an old group without waiting on collectives stuck in it.

        NCCL groups are aborted first (``NcclGroups.abort``: bounded by ``group_abort_s``, past
        which the worker exits); every group is dropped on a short-lived thread so that a
        destructor joining a stuck worker thread never blocks training.
        """
        if group is None or group.pg is None:
            return
        # The retire thread must hold the only reference: if the last one were dropped here, the
        # destructor would run on the training thread and wait for the stuck collective.
        holder = [group.pg]
        group.pg = None  # type: ignore[assignment]
        stores = [group.store] if group.store is not None else []
        group.store = None
        pg = holder[0]
        if self._nccl is not None:
            self._nccl.abort(pg, f"generation {group.generation}")
        del pg
        t = threading.Thread(target=_drop, args=(holder, stores), name="elasticd-retire", daemon=True)
        t.start()
        self._retiring = [r for r in self._retiring if r.is_alive()] + [t]

    def drain(self, deadline: Deadline) -> None:
        """Wait until retired groups are destroyed (a group whose collective is stuck on a frozen
        peer is destroyed only when the backend's own timeout, ``collective_s``, ends that
        collective). Destroying one during interpreter exit aborts the process, so exit waits."""
        alive = [t for t in self._retiring if t.is_alive()]
        if alive:
            log.info("waiting_for_abandoned_groups", count=len(alive), bound_s=round(deadline.remaining_s(), 1))
        for t in alive:
            t.join(deadline.remaining_s())
        still = [t for t in self._retiring if t.is_alive()]
        if still:
            log.warning("abandoned_groups_still_closing", count=len(still))


def _drop(holder: list[dist.ProcessGroup], stores: list[Store]) -> None:
    started = time.monotonic()
    holder.clear()
    stores.clear()  # after the group: its destructor may still use the store
    log.debug("process_group_released", duration_s=round(time.monotonic() - started, 3))
