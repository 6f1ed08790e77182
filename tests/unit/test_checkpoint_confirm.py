"""Rank 0's durable save waits for its step's confirmation: a real TrainingState, Journal and
Checkpoints writing into a real directory (the membership and its store in memory, never started).

A save confirms nothing: its files are written at the step boundary, and the checkpoint becomes
visible (manifest in place, ``checkpoint`` record) only once the journal confirms its step; a
discard of the step deletes its files, whether the verdict comes before or after the write ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elasticd.config import CheckpointConfig, WorkerEnv, WorldConfig
from elasticd.rendezvous.membership import Membership
from elasticd.wire.keys import Keys
from elasticd.wire.records import MemberRecord, decode_checkpoint
from elasticd.worker.state import durable
from elasticd.worker.checkpoints import Checkpoints
from elasticd.worker.state.durable import load_latest
from elasticd.worker.state.durable_format import job_dir, scan
from elasticd.worker.step.journal import Journal
from elasticd.worker.data.sampler import Batch
from elasticd.worker.state.training import TrainingState
from tests.fakes import FakeKeyValueStore
from tests.unit.test_checkpoint import make_state, train

pytestmark = pytest.mark.timeout(30)

JOB = "job"
KEYS = Keys("/elasticd", JOB)
WAIT_S = 10.0


@dataclass
class Rank0:
    """One rank 0: its state, journal and checkpoints, and the store its records go to."""

    state: TrainingState
    journal: Journal
    checkpoints: Checkpoints
    store: FakeKeyValueStore
    directory: Path

    def apply(self, step: int) -> None:
        """Apply ``step`` over the state of the step before (train, then the journal's record of
        it, unconfirmed)."""
        self.state.counters.step = step - 1
        train(self.state, 1, seed=step)
        batch = Batch(step=step, epoch=0, position=0, indices=[0], global_size=1, world_size=1, rank=0)
        self.journal.committed(batch, step, 0.0, generation=1, world_size=1, duration_s=0.0)

    def save(self, step: int) -> None:
        self.checkpoints.maybe_save(step, generation=1)

    def settled(self) -> None:
        assert self.checkpoints.wait_idle(WAIT_S)

    def loadable_step(self) -> int | None:
        loaded = load_latest(self.directory, make_state(seed=9))
        return None if loaded is None else loaded.manifest.step

    def record_step(self) -> int | None:
        kv = self.store.get(KEYS.checkpoint)
        return None if kv is None else decode_checkpoint(kv.value).step

    def files(self) -> list[str]:
        return sorted(p.name for p in self.directory.iterdir()) if self.directory.exists() else []


@pytest.fixture
def rank0(tmp_path: Path) -> Iterator[Rank0]:
    store = FakeKeyValueStore()
    env = WorkerEnv(node_id="n0", world=WorldConfig(job_id=JOB))
    member = MemberRecord(member_id="m0", node="n0", local_rank=0, pid=1, host="127.0.0.1", store_port=1, signature="s")
    membership = Membership(store, KEYS, member, env.world, env.timeouts)
    journal = Journal(env, store, None, audit_in_memory=False, log_interval_s=60.0)
    journal.open(membership, store, "m0", time.time())
    state = make_state(0)
    config = CheckpointConfig(
        checkpoint_dir=str(tmp_path), checkpoint_every_steps=1, checkpoint_keep=3, checkpoint_wait_s=WAIT_S
    )
    checkpoints = Checkpoints(config, JOB, "n0", state, journal)
    rig = Rank0(state, journal, checkpoints, store, job_dir(tmp_path, JOB))
    try:
        yield rig
    finally:
        checkpoints.close()
        journal.close_events(1.0)


@pytest.fixture
def held_write(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every file write of the checkpoint writer until the event is set (at most WAIT_S)."""
    gate = threading.Event()
    write_parts = durable.write_parts

    def gated(*args: object, **kwargs: object) -> None:
        gate.wait(WAIT_S)
        write_parts(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(durable, "write_parts", gated)
    return gate


def test_a_save_of_a_step_later_discarded_leaves_nothing(rank0: Rank0) -> None:
    rank0.apply(1)
    rank0.save(1)
    rank0.settled()
    assert rank0.journal.confirmed_step == 0  # the save confirmed nothing
    assert rank0.loadable_step() is None and rank0.record_step() is None
    assert not [e for e in scan(rank0.directory) if e.manifest_path is not None]
    assert any(name.endswith(".ckpt") for name in rank0.files())  # written, not visible

    rank0.journal.discard("a branch the job left")
    rank0.settled()
    assert rank0.files() == []
    assert rank0.loadable_step() is None and rank0.record_step() is None


def test_a_save_becomes_visible_when_its_step_is_confirmed(rank0: Rank0) -> None:
    rank0.apply(1)
    rank0.save(1)
    rank0.settled()
    assert rank0.loadable_step() is None and rank0.record_step() is None

    rank0.apply(2)
    rank0.journal.confirm()  # step 2's sum confirms step 1 (and here, 2)
    rank0.settled()
    assert rank0.loadable_step() == 1 and rank0.record_step() == 1
    assert [(e.step, e.manifest_path is not None) for e in scan(rank0.directory)] == [(1, True)]
    assert not [n for n in rank0.files() if ".tmp." in n]

    rank0.save(2)  # already confirmed: visible as soon as written
    rank0.settled()
    assert rank0.loadable_step() == 2 and rank0.record_step() == 2

    rank0.apply(3)
    rank0.save(3)
    rank0.journal.discard("a branch the job left")  # step 3 is never published; 1 and 2 stay
    rank0.settled()
    assert [e.step for e in scan(rank0.directory)] == [2, 1]
    assert rank0.loadable_step() == 2 and rank0.record_step() == 2


def test_a_confirmation_before_the_write_ends_publishes_it_after(rank0: Rank0, held_write: threading.Event) -> None:
    rank0.apply(1)
    rank0.save(1)
    assert rank0.journal.confirmed_step == 0  # the save confirmed nothing
    assert not rank0.checkpoints.wait_idle(0.05)  # still writing
    rank0.apply(2)
    rank0.journal.confirm()
    assert rank0.loadable_step() is None and rank0.record_step() is None
    held_write.set()
    rank0.settled()
    assert rank0.loadable_step() == 1 and rank0.record_step() == 1
    assert not [n for n in rank0.files() if ".tmp." in n]


def test_a_discard_before_the_write_ends_deletes_it_after(rank0: Rank0, held_write: threading.Event) -> None:
    rank0.apply(1)
    rank0.save(1)
    assert not rank0.checkpoints.wait_idle(0.05)  # still writing
    rank0.journal.discard("a branch the job left")
    held_write.set()
    rank0.settled()
    assert rank0.files() == []
    assert rank0.loadable_step() is None and rank0.record_step() is None

    rank0.apply(1)  # the job's step 1, taken again and confirmed: this save is published
    rank0.save(1)
    rank0.apply(2)
    rank0.journal.confirm()
    rank0.settled()
    assert rank0.loadable_step() == 1 and rank0.record_step() == 1


def test_a_save_unconfirmed_at_close_is_deleted_and_never_published(rank0: Rank0) -> None:
    rank0.apply(1)
    rank0.save(1)
    rank0.checkpoints.close()
    rank0.journal.confirm()  # too late: the writer is closed
    assert rank0.files() == []
    assert rank0.loadable_step() is None and rank0.record_step() is None
