"""This rank's replica: K processes that shard one copy of the model among themselves.

Owns ``Replica``: the replica's own process group, the default ``torch.distributed`` group of the
process, built once when the worker starts over a store its shard 0 serves (``replica_store``, an
address its agent picked) and kept for the process's life; the device mesh FSDP2 shards the model
over (``mesh``); and ``agree``, the one collective over it that the step path and the sync use:
the replica's K ranks learn what every one of them got, so that all of them apply a step (or take a
sync) or none does. elasticd's generation groups are groups of their own and never the default
one, so the default group is free for this.

A replica is all or nothing: when ``agree`` itself fails, a rank cannot know what the others did,
and it ends its process (``ReplicaBroken``); its agent ends the others and starts the replica
again, whole. Never builds a generation's groups (``group.process_group`` does) and never decides
a verdict (``step.commit`` does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import structlog
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, TCPStore

from elasticd.config import WorkerEnv
from elasticd.errors import ConfigError, ReplicaBroken
from elasticd.retry import Bound

log = structlog.get_logger(__name__)


def parse_store(address: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets) as (host, port). Pure.

    Raises:
        ConfigError: it is not one.
    """
    host, sep, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"replica_store: expected host:port, got {address!r}")
    return host, int(port)


class Replica:
    """The replica of this rank (``env.replica``, shard ``env.shard`` of ``env.replica_size``)."""

    def __init__(self, env: WorkerEnv, device: torch.device) -> None:
        """Meet the replica's other ranks and make the replica's group the default process group.

        Raises:
            ConfigError: ``replica_store`` is malformed, or a default process group exists already.
            ReplicaBroken: the replica's ranks did not all meet within ``group_build_s``.
        """
        if dist.is_initialized():
            raise ConfigError(
                "replica_size > 1: elasticd makes the replica's process group the default one; "
                "do not call torch.distributed.init_process_group in the script"
            )
        self.size, self.shard, self.id = env.replica_size, env.shard, env.replica
        self.device = device
        host, port = parse_store(env.replica_store)
        t = env.timeouts
        try:
            store = TCPStore(
                host,
                port,
                world_size=self.size,
                is_master=self.shard == 0,
                timeout=timedelta(seconds=t.group_build_s),
                wait_for_workers=False,
                use_libuv=True,
            )
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                store=PrefixStore(f"replica/{self.id}/", store),
                rank=self.shard,
                world_size=self.size,
                timeout=timedelta(seconds=t.collective_s),
                device_id=device if device.type == "cuda" else None,
            )
        except (RuntimeError, dist.DistError) as exc:
            raise ReplicaBroken(f"replica {self.id}: its {self.size} ranks did not meet: {exc}") from exc
        self._store = store  # the group holds it without keeping the Python object alive
        self._checkpoint_group: dist.ProcessGroup | None = None
        self._prefixed = PrefixStore(f"replica/{self.id}/agree/", store)
        self.group = dist.group.WORLD
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(device.type, (self.size,))
        log.info("replica_joined", replica=self.id, shard=self.shard, size=self.size, backend=backend)

    def agree(self, values: Sequence[float], what: str) -> list[float]:
        """The sum over the replica's ranks of each rank's ``values`` (the same length on every rank).

        Raises:
            ReplicaBroken: the sum did not complete (a rank of the replica is gone or stopped past
                ``collective_s``): what the others did is unknown, so the replica ends.
        """
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        try:
            dist.all_reduce(t, group=self.group)
        except (RuntimeError, dist.DistError) as exc:
            raise ReplicaBroken(f"replica {self.id}: {what} across its ranks failed: {exc}") from exc
        return [float(x) for x in t.tolist()]

    def checkpoint_group(self, timeout_s: float) -> dist.ProcessGroup:
        """A gloo group of the replica's ranks for the collectives of its durable saves (DCP's, on
        the writer thread, apart from the training's): made at the first call, which every rank of
        the replica makes at the same point (the trainer's start); ``timeout_s`` bounds how long a
        rank waits there for the others' writes.

        Raises:
            ReplicaBroken: the replica's ranks did not all make it.
        """
        if self._checkpoint_group is None:
            try:
                self._checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            except (RuntimeError, dist.DistError) as exc:
                raise ReplicaBroken(f"replica {self.id}: its checkpoint group could not be made: {exc}") from exc
        assert self._checkpoint_group is not None
        return self._checkpoint_group

    def outcome(self, key: str, values: tuple[int, int], bound: Bound) -> list[tuple[int, int]] | None:
        """Every rank's ``values`` for ``key`` (in shard order), through the replica's store: this
        rank's are written, then the others' read once all are there. None: not all were there
        before ``bound`` ended or its generation was abandoned."""
        store = self._prefixed
        names = [f"{key}/{i}" for i in range(self.size)]
        try:
            store.set(names[self.shard], f"{values[0]},{values[1]}")
            while not store.check(names):
                if bound.abandoned() or bound.expired():
                    return None
                time.sleep(bound.poll_s / 4)
            return [tuple(int(x) for x in store.get(n).decode().split(",")) for n in names]  # type: ignore[misc]
        except (RuntimeError, dist.DistError) as exc:  # shard 0, which serves the store, is gone
            raise ReplicaBroken(f"replica {self.id}: its store is gone: {exc}") from exc


_JOINED: Replica | None = None  # this process's replica, once joined (``join``)


def join(env: WorkerEnv | None = None) -> Replica:
    """This process's replica, joined at the first call (``env``: default the ``ELASTICD_*``
    variables): its K ranks meet, and their group becomes the default process group.

    Raises:
        ConfigError: this worker is not a replica's (``replica_size`` 1), or its settings are malformed.
        ReplicaBroken: the replica's ranks did not all meet within ``group_build_s``.
    """
    global _JOINED
    if _JOINED is None:
        from elasticd.settings import worker_env_from_environ
        from elasticd.worker.group.process_group import resolve_backend

        env = env if env is not None else worker_env_from_environ()
        if env.replica_size <= 1:
            raise ConfigError(
                "replica_mesh: this worker is not one of a replica's ranks (replica_size 1, data parallel); "
                "start the agent with --replica-size K to shard the model over K workers of a node"
            )
        if resolve_backend(env.backend) == "nccl":
            device = torch.device("cuda", env.local_rank % max(1, torch.cuda.device_count()))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        _JOINED = Replica(env, device)
    return _JOINED


def replica_mesh() -> object:
    """The device mesh of this worker's replica, to shard the model over: ``fully_shard(model,
    mesh=elasticd.replica_mesh())`` (each layer, then the model), before its optimizer and the
    ``ElasticTrainer`` are made. The first call joins the replica (``join``).

    Raises:
        ConfigError: this worker is not a replica's (the agent's ``replica_size`` is 1).
    """
    return join().mesh
