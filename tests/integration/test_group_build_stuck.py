"""A generation's group build on rank 0 must not wait behind an abandoned build of the generation
before it that is stuck in gloo's connect (a member arrived, then died before it published its
address: gloo's constructor waits for it in the store for up to ``group_build_s``). Two real
GroupFactory objects (ranks 0 and 1) over rank 0's real TCPStore, in threads of this process."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import TCPStore

from elasticd.config import Timeouts
from elasticd.errors import CollectiveError
from elasticd.retry import Bound
from elasticd.worker.group.process_group import GroupFactory, StoreServer
from elasticd.worker.group.store_seal import generation_store

pytestmark = pytest.mark.timeout(60)

HOST = "127.0.0.1"
T = Timeouts(group_build_s=8.0, collective_s=8.0)


def test_rank_0s_next_build_does_not_wait_for_an_abandoned_build_stuck_in_gloo_connect() -> None:
    servers = [StoreServer(HOST, T) for _ in range(2)]
    factories = [GroupFactory(servers[r], HOST, "gloo", r, T) for r in range(2)]
    port = servers[0].port
    # Generation 3 of three: the third member arrives at the barrier and dies (its connection
    # closes) before it publishes its gloo address, so ranks 0 and 1 pass the barrier and wait in
    # gloo's connect for rank 2, until the generation is abandoned.
    ghost = TCPStore(HOST, port, is_master=False, timeout=timedelta(seconds=5))
    generation_store(ghost, "gen/3/", "03" * 16).add("arrived", 1)
    del ghost
    abandoned = threading.Event()
    errors: list[BaseException] = []

    def build3(r: int) -> None:
        try:
            bound = Bound.after(T.group_build_s, poll_s=T.abort_poll_s, abandon=abandoned.is_set)
            factories[r].build(3, r, 3, HOST, port, bound, token="03" * 16)
        except CollectiveError as exc:  # PeerLost, once abandoned
            errors.append(exc)

    threads = [threading.Thread(target=build3, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # both are past the barrier, in gloo's connect
    abandoned.set()
    for t in threads:
        t.join(5)
    assert len(errors) == 2, errors
    # Generation 4 of ranks 0 and 1: built at once, not after generation 3's stuck connect ends.
    built: list[float] = []

    def build4(r: int) -> None:
        started = time.monotonic()
        bound = Bound.after(T.group_build_s, poll_s=T.abort_poll_s)
        group = factories[r].build(4, r, 2, HOST, port, bound, token="04" * 16)
        built.append(time.monotonic() - started)
        factories[r].retire(group)

    threads = [threading.Thread(target=build4, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T.group_build_s + 5)
    assert len(built) == 2 and max(built) < 2.0, built
