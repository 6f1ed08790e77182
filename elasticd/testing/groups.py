"""A fixed gloo group of spawned local processes, for benchmarks and tests of the worker's pieces.

Owns ``fixed_gloo_group``: rank 0 hosts the store and hands its port to the others through a queue;
every rank builds generation 1 of ``world`` ranks on loopback. Nothing aborts such a group. Imports
torch (through the worker's process group); never touches etcd.
"""

from __future__ import annotations

from multiprocessing import Queue

from elasticd.config import Timeouts
from elasticd.retry import Bound
from elasticd.worker.group.process_group import Group, GroupFactory, StoreServer

BUILD_BOUND_S = 60.0  # bound on handing out the port and on building the group


def fixed_gloo_group(
    rank: int, world: int, port_q: Queue[int], timeouts: Timeouts | None = None
) -> tuple[Timeouts, GroupFactory, Group]:
    """(timeouts, factory, group) of this rank in a gloo group of ``world`` local processes."""
    timeouts = timeouts or Timeouts()
    server = StoreServer("127.0.0.1", timeouts)
    if rank == 0:
        for _ in range(world - 1):
            port_q.put(server.port)
        port = server.port
    else:
        port = port_q.get(timeout=BUILD_BOUND_S)
    factory = GroupFactory(server, "127.0.0.1", "gloo", rank, timeouts)
    group = factory.build(1, rank, world, "127.0.0.1", port, Bound.after(BUILD_BOUND_S, poll_s=timeouts.abort_poll_s))
    return timeouts, factory, group
