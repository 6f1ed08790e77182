"""The agent's read model of job progress: parsing a job's keys, finding a local worker by node and
pid, and the hang test's bookkeeping (marks advance only on real progress; a verdict needs a read
taken hang_timeout_s after the last advance that shows the job ahead)."""

from __future__ import annotations

import json

import pytest

from elasticd.agent.jobview import (
    JobView,
    ProgressMark,
    WorkerObservation,
    WorkerPhase,
    advance_mark,
    is_hung,
    observe_worker,
    read_job_view,
)
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.progress import ProgressRecord
from elasticd.wire.records import GenerationRecord, MemberRecord, ReadyRecord, encode

pytestmark = pytest.mark.timeout(30)

KEYS = Keys("/elasticd", "j")


def _kv(key: str, value: bytes, lease: int = 0) -> KeyValue:
    return KeyValue(key, value, 5, 5, lease)


def _member(mid: str, node: str, pid: int) -> KeyValue:
    return _kv(KEYS.member(mid), encode(MemberRecord(mid, node, 0, pid, "h", 1, "s")), lease=7)


def _progress(mid: str, step: int, generation: int = 1, **extra: object) -> KeyValue:
    rec = {
        "step": step,
        "generation": generation,
        "rank": 0,
        "step_time_s": 0.01,
        "recoveries": 0,
        "time": 1.0,
        **extra,
    }
    return _kv(KEYS.progress(mid), json.dumps(rec).encode(), lease=7)


def _generation(*members: str, step: int = 0) -> KeyValue:
    return _kv(KEYS.generation, encode(GenerationRecord(2, tuple(members), "h", 1, "s", step, "start")))


def test_read_job_view_takes_the_highest_committed_step_and_skips_garbage() -> None:
    rows = [
        _generation("n.0.7", "m.0.8", step=3),
        _member("n.0.7", "n", 7),
        _member("m.0.8", "m", 8),
        _progress("n.0.7", 10),
        _progress("m.0.8", 12, recoveries=2, last_recovery_s=0.4, last_recovery_cause="PeerLost"),
        _kv(KEYS.progress("junk"), b"not json"),
        _kv(KEYS.progress("bad"), json.dumps({"step": "x", "generation": 1}).encode()),
        _kv(KEYS.committed, json.dumps({"generation": 2, "step": 11}).encode()),
    ]
    v = read_job_view(KEYS, rows, read_at=50.0)
    assert (v.generation, v.world_size, v.job_step, v.read_at, v.finished) == (2, 2, 12, 50.0, False)
    done = read_job_view(KEYS, [*rows, _kv(KEYS.finished, json.dumps({"generation": 2, "step": 12}).encode())], 1.0)
    assert done.finished
    assert set(v.progress) == {"n.0.7", "m.0.8"}
    assert v.progress["m.0.8"] == ProgressRecord(
        step=12,
        generation=1,
        rank=0,
        step_time_s=0.01,
        recoveries=2,
        last_recovery_s=0.4,
        last_recovery_cause="PeerLost",
        time=1.0,
    )
    assert read_job_view(KEYS, [], 1.0).job_step == -1


def test_read_job_view_reads_progress_tolerantly() -> None:
    """A record that says where a worker is counts: only step and generation are required (the
    strict read's rules are elasticctl's; both are ``wire.progress``'s)."""
    rows = [
        _kv(KEYS.progress("n.0.7"), json.dumps({"step": 1, "generation": 1, "extra": [1]}).encode()),
        _kv(KEYS.progress("m.0.8"), json.dumps({"step": True, "generation": 1}).encode()),
    ]
    assert read_job_view(KEYS, rows, 1.0).progress == {"n.0.7": ProgressRecord(step=1, generation=1)}


def test_observe_worker_finds_it_by_node_and_pid_and_names_its_phase() -> None:
    rows = [
        _generation("n.0.7"),
        _member("n.0.7", "n", 7),
        _progress("n.0.7", 4),
        _member("n.1.9", "n", 9),
        _member("m.0.7", "m", 7),
        _kv(KEYS.ready("n.1.9"), encode(ReadyRecord("n.1.9", -1, 0, -1, "s")), lease=7),
    ]
    v = read_job_view(KEYS, rows, 1.0)
    assert observe_worker(v, "n", {7}) == WorkerObservation(WorkerPhase.TRAINING, "n.0.7", 4, 1, v.progress["n.0.7"])
    assert observe_worker(v, "n", {9}).phase is WorkerPhase.WAITING
    assert observe_worker(v, "n", {42}).phase is WorkerPhase.ABSENT
    assert observe_worker(v, "m", {7}).phase is WorkerPhase.REGISTERED  # alive, neither waiting nor training
    assert observe_worker(v, "n", {1, 9}).member_id == "n.1.9"  # a wrapper's child pid counts


def _view(at: float, job_step: int) -> JobView:
    return JobView(read_at=at, job_step=job_step)


TRAINING = WorkerObservation(WorkerPhase.TRAINING, "n.0.7", step=5, generation=1)


ADVANCE_CASES: list[tuple[str, ProgressMark | None, WorkerObservation, ProgressMark | None]] = [
    ("never seen, still absent: no mark", None, WorkerObservation(WorkerPhase.ABSENT), None),
    ("first sighting starts the mark", None, TRAINING, ProgressMark(("training", 1, 5), 10.0, 20)),
    (
        "same step again: the mark stays",
        ProgressMark(("training", 1, 5), 3.0, 9),
        TRAINING,
        ProgressMark(("training", 1, 5), 3.0, 9),
    ),
    (
        "a new step moves it",
        ProgressMark(("training", 1, 4), 3.0, 9),
        TRAINING,
        ProgressMark(("training", 1, 5), 10.0, 20),
    ),
    (
        "its record vanished (SIGSTOP, lease lost): no advance",
        ProgressMark(("training", 1, 5), 3.0, 9),
        WorkerObservation(WorkerPhase.ABSENT),
        ProgressMark(("training", 1, 5), 3.0, 9),
    ),
    (
        "waiting for a generation is always progress",
        ProgressMark(("waiting", 0, -1), 3.0, 9),
        WorkerObservation(WorkerPhase.WAITING, "n.0.7"),
        ProgressMark(("waiting", 0, -1), 10.0, 20),
    ),
    (
        "dropped from the generation but alive: a change, the clock restarts",
        ProgressMark(("training", 1, 5), 3.0, 9),
        WorkerObservation(WorkerPhase.REGISTERED, "n.0.7", 5, 1),
        ProgressMark(("registered", 1, 5), 10.0, 20),
    ),
]


@pytest.mark.parametrize(("mark", "obs", "expected"), [c[1:] for c in ADVANCE_CASES], ids=[c[0] for c in ADVANCE_CASES])
def test_advance_mark(mark: ProgressMark | None, obs: WorkerObservation, expected: ProgressMark | None) -> None:
    assert advance_mark(mark, obs, _view(10.0, 20)) == expected


@pytest.mark.parametrize(
    ("mark", "view", "timeout", "hung"),
    [
        (ProgressMark(("training", 1, 5), 0.0, 10), _view(5.0, 20), 3.0, True),
        (ProgressMark(("training", 1, 5), 0.0, 10), _view(2.9, 20), 3.0, False),  # not long enough
        (ProgressMark(("training", 1, 5), 0.0, 10), _view(60.0, 10), 3.0, False),  # the job did not advance
        (ProgressMark(("training", 1, 5), 0.0, 10), None, 3.0, False),  # no read at all (etcd down)
        (None, _view(60.0, 20), 3.0, False),  # never seen in etcd
        (ProgressMark(("training", 1, 5), 0.0, 10), _view(60.0, 20), 0.0, False),  # hang detection off
        # the job finished: a worker that reached the last step between two reads left (its record
        # vanished) while it exits; it is not hung
        (ProgressMark(("training", 1, 695), 0.0, 697), JobView(read_at=5.0, job_step=700, finished=True), 3.0, False),
    ],
    ids=[
        "stalled while the job grew",
        "not long enough",
        "whole job stalled",
        "no read",
        "never seen",
        "off",
        "job finished",
    ],
)
def test_is_hung(mark: ProgressMark | None, view: JobView | None, timeout: float, hung: bool) -> None:
    assert is_hung(mark, view, timeout) is hung
