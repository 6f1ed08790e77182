"""The job's ``checkpoint`` record against a real etcd: every write is a compare-and-set ordered by
(step, seq), so a late writer (a rank 0 whose save finished after it lost its role) never sets it
back, and a writer that loses a race re-reads and decides again."""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from elasticd.config import Timeouts, WorkerEnv, WorldConfig
from elasticd.rendezvous.membership import Membership
from elasticd.rendezvous.publish import Publisher
from elasticd.store.etcd import EtcdClient
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import CheckpointRecord, MemberRecord, decode_checkpoint, encode
from elasticd.worker.state.durable import SavedCheckpoint
from elasticd.worker.state.durable_format import FORMAT, VERSION, Manifest
from elasticd.worker.step.journal import Journal

pytestmark = pytest.mark.timeout(60)

_jobs = itertools.count()


def _keys() -> Keys:
    return Keys("/elasticd", f"ckrec{os.getpid()}x{next(_jobs)}")


def _record(client: EtcdClient, keys: Keys) -> tuple[int, int] | None:
    kv = client.get(keys.checkpoint)
    if kv is None:
        return None
    r = decode_checkpoint(kv.value)
    return r.step, r.seq


def _saved(step: int, seq: int) -> SavedCheckpoint:
    name = f"{seq:08d}-step{step:012d}"
    manifest = Manifest(
        format=FORMAT,
        version=VERSION,
        job="j",
        seq=seq,
        step=step,
        generation=1,
        node="n0",
        signature="s",
        file=name + ".ckpt",
        file_bytes=1,
        header_bytes=1,
        payload_offset=0,
        payload_bytes=1,
        state_bytes=1,
        state_checksum=0,
        crc32=0,
        epoch=0,
        position=0,
        created=time.time(),
    )
    return SavedCheckpoint(Path("/ckpt") / (name + ".ckpt"), manifest, 0.0)


def test_a_late_checkpoint_writer_never_sets_the_record_back(client: EtcdClient) -> None:
    keys = _keys()
    env = WorkerEnv(node_id="n0", world=WorldConfig(job_id=keys.job.rsplit("/", 1)[1]))
    member = MemberRecord(member_id="m0", node="n0", local_rank=0, pid=1, host="127.0.0.1", store_port=1, signature="s")
    membership = Membership(client, keys, member, env.world, env.timeouts)  # never started: no threads
    journal = Journal(env, client, None, audit_in_memory=False, log_interval_s=60.0)
    journal.open(membership, client, "m0", time.time())
    try:
        journal.checkpoint_saved(_saved(step=20, seq=2))
        assert _record(client, keys) == (20, 2)
        journal.checkpoint_saved(_saved(step=10, seq=3))  # a late writer of an older step
        assert _record(client, keys) == (20, 2)
        journal.checkpoint_saved(_saved(step=20, seq=1))  # the same step, an older save
        assert _record(client, keys) == (20, 2)
        journal.checkpoint_saved(_saved(step=20, seq=4))  # the same step, a newer save
        assert _record(client, keys) == (20, 4)
        membership.publish_checkpoint(CheckpointRecord(step=5, path="/x", node="n1", seq=9))  # default flags
        assert _record(client, keys) == (20, 4)
        journal.checkpoint_saved(_saved(step=30, seq=5))
        assert _record(client, keys) == (30, 5)
    finally:
        journal.close_events(2.0)


class _RacingStore:
    """The real client, with another writer that puts ``racer`` right after the first read of
    ``key`` (between this writer's read and its compare-and-set)."""

    def __init__(self, store: EtcdClient, key: str, racer: bytes) -> None:
        self._store, self._key, self._racer = store, key, racer
        self.raced = False

    def get(self, key: str) -> KeyValue | None:
        kv = self._store.get(key)
        if key == self._key and not self.raced:
            self.raced = True
            self._store.put(key, self._racer)
        return kv

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.parametrize(
    ("racer_step", "expected"),
    [(30, (30, 7)), (12, (15, 8))],
    ids=["a_newer_record_wins", "an_older_record_is_replaced"],
)
def test_a_writer_that_loses_the_race_reads_again_and_decides_again(
    client: EtcdClient, racer_step: int, expected: tuple[int, int]
) -> None:
    keys = _keys()
    client.put(keys.checkpoint, encode(CheckpointRecord(step=10, path="/a", node="n0", seq=6)))
    racer = encode(CheckpointRecord(step=racer_step, path="/b", node="n1", seq=7))
    store = _RacingStore(client, keys.checkpoint, racer)
    publisher = Publisher(store, keys, "m0", Timeouts(), time.monotonic, threading.Event())  # type: ignore[arg-type]
    publisher.checkpoint(CheckpointRecord(step=15, path="/c", node="n0", seq=8))
    assert store.raced
    assert _record(client, keys) == expected
