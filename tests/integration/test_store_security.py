"""Rank 0's c10d store while a real gloo job trains: it listens on the advertised
address only, and a stray client that reaches its port, without the generation's token from etcd,
can neither find, read nor forge what the members exchange, through two generations."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch.distributed as dist
from torch._C._distributed_c10d import TCPStore

from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
from elasticd.store.etcd import EtcdClient
from elasticd.wire.keys import Keys
from elasticd.wire.records import GenerationRecord, decode_generation
from elasticd.worker.group.store_seal import MAGIC, Seal

pytestmark = pytest.mark.timeout(90)

SLOW = ("--step-sleep", "0.02")
# 12 s and more of training: the joiner starts and joins before the end even on a loaded machine,
# where a worker's imports alone can take seconds
STEPS = 600
STRAY_TIMEOUT = timedelta(seconds=0.5)  # a stray's get or wait of a key that is not there


def _generation(client: EtcdClient, job_id: str) -> GenerationRecord | None:
    kv = client.get(Keys("/elasticd", job_id).generation)
    return decode_generation(kv.value) if kv is not None else None


def _listeners(pids: list[int]) -> dict[int, tuple[str, int]]:
    """port -> (address, pid) of every listening TCP socket of these processes."""
    out: dict[int, tuple[str, int]] = {}
    for pid in pids:
        for c in psutil.Process(pid).net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN:
                out[c.laddr.port] = (c.laddr.ip, pid)
    return out


def _check_store(rec: GenerationRecord, pids: list[int], planted: set[str]) -> TCPStore:
    """Check generation ``rec``'s store (but the keys a stray ``planted``); return a stray client."""
    assert len(rec.token) == 32 and int(rec.token, 16) >= 0, rec
    listeners = _listeners(pids)
    # (a) every worker's sockets, the store's and gloo's, listen on the advertised address only
    assert rec.store_port in listeners, (rec.store_port, listeners)
    assert {ip for ip, _ in listeners.values()} == {"127.0.0.1"}, listeners
    # (b) a stray client, without the token: nothing under any name the members use
    stray = TCPStore(rec.store_host, rec.store_port, is_master=False, timeout=STRAY_TIMEOUT)
    g = rec.generation
    plain = [f"gen/{g}//arrived", f"gen/{g}//0/0", f"gen/{g}//0/1", f"{rec.token}/gen/{g}//arrived"]
    for key in set(plain) - planted:
        assert not stray.check([key]), key
    if f"gen/{g}//0/0" not in planted:
        with pytest.raises(dist.DistError):
            stray.get(f"gen/{g}//0/0")
    # ...and what it can list names neither the generation, nor the token, and holds no plain value
    listed = [k for k in stray.list_keys() if k not in planted]
    assert listed and not any(rec.token in k or "gen/" in k or "arrived" in k for k in listed), listed
    seal = Seal.from_token(rec.token)
    arrived = seal.name(f"gen/{g}//arrived")
    assert arrived in listed
    mine = 0
    for key in listed:
        raw = stray.get(key)
        assert raw.startswith(MAGIC) or int(raw) >= 2**20, (key, raw)  # sealed, or a counter offset by a secret
        if key == arrived:  # the arrival count, offset by a secret: the token reads it
            assert int(raw) - seal.counter_offset(key) == rec.world_size
        elif raw.startswith(MAGIC):
            try:
                seal.open(key, raw)  # gloo's addresses: sealed under this generation's token
                mine += 1
            except ValueError:
                pass  # an older generation's
    assert mine >= rec.world_size  # every rank's address
    return stray


def test_the_store_listens_on_the_advertised_address_and_hides_its_keys(local_job: Any, etcd_server: Any) -> None:
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), Timeouts(), RetryPolicy())
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn("--steps", str(STEPS), *SLOW)
    job.wait_for(lambda: job.committed() >= 20, 60, "20 committed steps")
    first = _generation(client, job.job_id)
    assert first is not None and first.world_size == 2 and first.store_host == "127.0.0.1"
    planted: set[str] = set()
    stray = _check_store(first, [w.pid for w in job.workers], planted)
    # Garbage under the names the members use, plain and under the token's prefix, for the next
    # generations too: with a plain prefix the joiner's generation would build over it.
    for g in range(first.generation, first.generation + 4):
        for key in (f"gen/{g}//arrived", f"{first.token}/gen/{g}//arrived"):
            stray.add(key, 100)
            planted.add(key)
        for rank in range(4):
            for key in (f"gen/{g}//0/{rank}", f"{first.token}/gen/{g}//0/{rank}"):
                stray.set(key, "garbage")
                planted.add(key)
    job.spawn("--steps", str(STEPS), *SLOW)  # a joiner: the next generation builds on rank 0's store
    job.wait_for(
        lambda: (g := _generation(client, job.job_id)) is not None and g.world_size == 3, 60, "the joiner's generation"
    )
    second = _generation(client, job.job_id)
    assert second is not None and second.token != first.token
    job.wait_for(lambda: job.committed(2) > 0, 60, "the joiner to commit")
    _check_store(second, [w.pid for w in job.workers], planted)
    codes = job.wait_all(60)
    assert codes == [0, 0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == STEPS and rep.step_world[STEPS] == 3
