"""The read model ``status`` and its renderers, on hand-built records.

Every case is a list of raw keys as etcd would return them, a fixed wall clock ``NOW`` and optional
bounds; nothing touches a real store or a clock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from elasticd.ops.health import EXIT_DEGRADED, EXIT_DOWN, EXIT_OK, Health
from elasticd.ops.render import render_json, render_table
from elasticd.ops.status import WorkerState, build_status, read_status
from elasticd.store.kv import KeyValue
from elasticd.wire.keys import Keys
from elasticd.wire.records import (
    AbortRecord,
    FinishedRecord,
    GenerationRecord,
    MemberRecord,
    ReadyRecord,
    encode,
)
from tests.fakes import FakeKeyValueStore

pytestmark = pytest.mark.timeout(60)

SIG = "a" * 64
NOW = 1_700_000_000.0
KEYS = Keys("/elasticd", "job")

# -- builders -----------------------------------------------------------------------------------


def member(mid: str, node: str = "n1", pid: int = 100) -> MemberRecord:
    return MemberRecord(
        mid,
        node=node,
        local_rank=int(mid[-1]) if mid[-1].isdigit() else 0,
        pid=pid,
        host="10.0.0.1",
        store_port=29500,
        signature=SIG,
    )


def gen(number: int, members: Sequence[str], reason: str = "start", step: int = 0) -> GenerationRecord:
    return GenerationRecord(
        number,
        tuple(members),
        store_host="10.0.0.1",
        store_port=29500,
        signature=SIG,
        committed_step=step,
        reason=reason,
    )


def progress(
    step: int,
    generation: int = 1,
    rank: int = 0,
    step_time_s: float | None = 0.02,
    recoveries: int = 0,
    age_s: float = 1.5,
) -> bytes:
    return json.dumps(
        {
            "step": step,
            "generation": generation,
            "rank": rank,
            "step_time_s": step_time_s,
            "recoveries": recoveries,
            "time": NOW - age_s,
        }
    ).encode()


@dataclass
class Job:
    """Raw keys of a job, in the order they were written (create_revision grows with it)."""

    rows: list[tuple[str, bytes]] = field(default_factory=list)

    def put(self, key: str, value: bytes) -> Job:
        self.rows.append((key, value))
        return self

    def alive(self, *mids: str) -> Job:
        for m in mids:
            self.put(KEYS.member(m), encode(member(m)))
        return self

    def ready(self, mid: str, step: int = -1, prev_gen: int = 0) -> Job:
        return self.put(KEYS.ready(mid), encode(ReadyRecord(mid, step, prev_gen, 0, SIG)))

    def generation(self, number: int, members: Sequence[str], **kw: object) -> Job:
        return self.put(KEYS.generation, encode(gen(number, members, **kw)))  # type: ignore[arg-type]

    def abort(self, number: int, reason: str = "peer lost") -> Job:
        return self.put(KEYS.abort, encode(AbortRecord(number, "m0", reason)))

    def finished(self, number: int, step: int) -> Job:
        return self.put(KEYS.finished, encode(FinishedRecord(number, step)))

    def kvs(self) -> list[KeyValue]:
        return [KeyValue(k, v, mod_revision=10 + i, create_revision=10 + i) for i, (k, v) in enumerate(self.rows)]


def status_of(job: Job, min_workers: int | None = None, max_workers: int | None = None):  # noqa: ANN201
    return build_status(KEYS, job.kvs(), now=NOW, min_workers=min_workers, max_workers=max_workers)


# -- health classification ----------------------------------------------------------------------

CASES = [
    # (name, job, min, max, health, words in the reason)
    ("no keys at all", Job(), None, None, Health.DOWN, "no such job"),
    (
        "registered, no generation yet",
        Job().alive("m0", "m1").ready("m0"),
        2,
        None,
        Health.DOWN,
        "no generation yet: 2 registered, 1 ready of min_workers 2",
    ),
    (
        "all live members in the generation",
        Job().alive("m0", "m1").generation(1, ["m0", "m1"]),
        None,
        None,
        Health.HEALTHY,
        "all 2 live members",
    ),
    (
        "a live member left out, no max known",
        Job().alive("m0", "m1", "m2").ready("m2").generation(1, ["m0", "m1"]),
        None,
        None,
        Health.DEGRADED,
        "1 live member(s) not in generation 1",
    ),
    ("at max", Job().alive("m0", "m1").generation(1, ["m0", "m1"]), 1, 2, Health.HEALTHY, "= max_workers 2"),
    (
        "at max with a newcomer that cannot fit",
        Job().alive("m0", "m1", "m2").ready("m2").generation(1, ["m0", "m1"]),
        1,
        2,
        Health.HEALTHY,
        "= max_workers 2",
    ),
    ("below max", Job().alive("m0", "m1").generation(1, ["m0", "m1"]), 2, 3, Health.DEGRADED, "2 < max_workers 3"),
    ("below min", Job().alive("m0", "m1").generation(1, ["m0", "m1"]), 3, 4, Health.DOWN, "2 < min_workers 3"),
    (
        "a generation member lost its lease",
        Job().alive("m0").generation(1, ["m0", "m1"]),
        None,
        2,
        Health.DOWN,
        "lost 1 of 2",
    ),
    (
        "the generation was aborted",
        Job().alive("m0", "m1").generation(2, ["m0", "m1"]).abort(2),
        None,
        2,
        Health.DOWN,
        "generation 2 was aborted",
    ),
    (
        "an abort of an older generation is history",
        Job().alive("m0", "m1").abort(1).generation(2, ["m0", "m1"]),
        None,
        2,
        Health.HEALTHY,
        "= max_workers 2",
    ),
    (
        "finished, members gone",
        Job().generation(3, ["m0", "m1"]).finished(3, 400),
        2,
        2,
        Health.FINISHED,
        "finished at step 400",
    ),
    ("finished without any generation", Job().finished(1, 5), None, None, Health.FINISHED, "at step 5"),
    (
        "finished long ago, a newer generation runs",
        Job().alive("m0").finished(1, 5).generation(2, ["m0"]),
        None,
        None,
        Health.HEALTHY,
        "all 1 live members",
    ),
    (
        "garbage generation record",
        Job().alive("m0").put(KEYS.generation, b"[[[["),
        None,
        None,
        Health.DOWN,
        "generation record is malformed",
    ),
]


@pytest.mark.parametrize(("name", "job", "lo", "hi", "health", "reason"), CASES, ids=[c[0] for c in CASES])
def test_health(name: str, job: Job, lo: int | None, hi: int | None, health: Health, reason: str) -> None:
    st = status_of(job, lo, hi)
    assert st.health is health, st.reason
    assert reason in st.reason
    assert (
        st.exit_code
        == {Health.HEALTHY: EXIT_OK, Health.FINISHED: EXIT_OK, Health.DEGRADED: EXIT_DEGRADED, Health.DOWN: EXIT_DOWN}[
            health
        ]
    )


def test_exit_codes_are_0_1_2() -> None:
    assert [h.exit_code for h in Health] == [0, 1, 2, 2, 0, 2]  # healthy, degraded, down, stalled, finished, failed


# -- members ------------------------------------------------------------------------------------


def _job_with_everyone() -> Job:
    """m1 is rank 0 and m0 rank 1 of generation 4; m2 waits; m3 is only registered; m9's lease is gone."""
    return (
        Job()
        .alive("m0", "m1", "m2", "m3")
        .generation(4, ["m1", "m0", "m9"], reason="join", step=120)
        .ready("m2", step=-1)  # written after the generation (an older one counts as spent)
        .ready("m3x", step=7)  # a ready record without a member record: not a live member
        .put(KEYS.progress("m0"), progress(130, generation=4, rank=1, recoveries=2, age_s=0.25))
        .put(KEYS.progress("m1"), progress(131, generation=4, rank=0, step_time_s=None, age_s=-0.5))
        .put(KEYS.progress("m9"), progress(99))  # stale progress of a gone member: ignored
        .put(KEYS.job + "/unknown/x", b"whatever")  # keys the read model does not know are not its business
    )


def test_members_have_rank_state_and_progress_in_rank_order() -> None:
    st = status_of(_job_with_everyone())
    rows = {m.member_id: m for m in st.members}
    assert [m.member_id for m in st.members] == ["m1", "m0", "m2", "m3"]
    assert [(m.rank, m.state) for m in st.members] == [
        (0, WorkerState.TRAINING),
        (1, WorkerState.TRAINING),
        (None, WorkerState.WAITING),
        (None, WorkerState.REGISTERED),
    ]
    m0, m1 = rows["m0"], rows["m1"]
    assert (m0.node, m0.local_rank, m0.pid, m0.host) == ("n1", 0, 100, "10.0.0.1")
    assert (m0.committed_step, m0.step_time_s, m0.recoveries) == (130, 0.02, 2)
    assert m0.heartbeat_age_s == pytest.approx(0.25)
    assert m1.step_time_s is None and m1.heartbeat_age_s == pytest.approx(-0.5)  # clock skew shows
    assert rows["m2"].committed_step is None and rows["m2"].heartbeat_age_s is None
    assert rows["m3"].recoveries is None
    assert st.generation is not None
    assert (
        st.generation.number,
        st.generation.world_size,
        st.generation.members,
        st.generation.reason,
        st.generation.committed_step,
    ) == (4, 3, ("m1", "m0", "m9"), "join", 120)
    assert st.missing == ("m9",) and st.health is Health.DOWN
    assert st.job_id == "job" and st.prefix == "/elasticd/job/"


def test_waiting_member_shows_the_step_of_its_ready_record() -> None:
    st = status_of(Job().alive("m0", "m1").generation(1, ["m0"]).ready("m1", step=57))
    assert [(m.member_id, m.state, m.committed_step) for m in st.members] == [
        ("m0", WorkerState.TRAINING, None),
        ("m1", WorkerState.WAITING, 57),
    ]


def test_malformed_records_are_listed_and_never_fatal() -> None:
    job = (
        Job()
        .alive("m0", "m1")
        .generation(2, ["m0", "m1"])
        .put(KEYS.member("garbage"), b"not json")
        .put(KEYS.ready("x"), b'{"member_id": 5}')
        .put(KEYS.abort, b"\xff\xfe")
        .put(KEYS.progress("m0"), b'{"step": "ten"}')
        .put(KEYS.progress("m1"), b"[]")
        .put(KEYS.progress("m2"), b'{"step": 1, "generation": 2}')  # the agent's tolerant read takes it
    )
    st = status_of(job, max_workers=2)
    assert st.health is Health.HEALTHY
    assert st.last_abort is None
    bad = sorted(s.split(":")[0] for s in st.malformed)
    assert bad == sorted(
        [
            KEYS.member("garbage"),
            KEYS.ready("x"),
            KEYS.abort,
            KEYS.progress("m0"),
            KEYS.progress("m1"),
            KEYS.progress("m2"),
        ]
    )
    assert all(m.committed_step is None for m in st.members)


def test_last_abort_and_finished_are_reported() -> None:
    st = status_of(Job().alive("m0").abort(3, "collective timed out").generation(4, ["m0"]).finished(4, 300))
    assert st.last_abort == AbortRecord(3, "m0", "collective timed out")
    assert st.finished == FinishedRecord(4, 300)


def test_read_status_reads_one_prefix_of_a_store_and_no_other_job() -> None:
    store = FakeKeyValueStore()
    for key, value in Job().alive("m0", "m1").generation(1, ["m0", "m1"]).rows:
        store.put(key, value)
    other = Keys("/elasticd", "jobx")  # a job whose id starts with ours
    store.put(other.member("z"), encode(member("z")))
    store.put(other.generation, b"garbage")
    before = store.revision
    st = read_status(store, KEYS, now=NOW, max_workers=2)
    assert st.health is Health.HEALTHY and [m.member_id for m in st.members] == ["m0", "m1"]
    assert st.malformed == ()
    assert store.revision == before  # read only


# -- renderers ----------------------------------------------------------------------------------

JSON_KEYS = [
    "job",
    "prefix",
    "health",
    "reason",
    "exit_code",
    "min_workers",
    "max_workers",
    "generation",
    "members",
    "nodes",
    "recoveries",
    "drains",
    "missing",
    "finished",
    "last_abort",
    "malformed",
    "restart",
    "checkpoint",
    "save_failed",
    "bug",
    "failures",
    "stall_after_s",
    "last_activity_age_s",
]
MEMBER_KEYS = [
    "member_id",
    "node",
    "local_rank",
    "pid",
    "host",
    "rank",
    "state",
    "committed_step",
    "step_time_s",
    "compute_s",
    "straggler_score",
    "recoveries",
    "heartbeat_age_s",
    "restarts",
    "rss_bytes",
    "cpu_percent",
]
NODE_KEYS = [
    "node",
    "host",
    "agent_pid",
    "state",
    "workers_running",
    "workers",
    "restarts",
    "heartbeat_age_s",
    "drain_requested",
]


@pytest.mark.parametrize("job", [Job(), _job_with_everyone(), Job().finished(1, 5).abort(1)])
def test_json_is_one_object_on_one_line_with_stable_keys(job: Job) -> None:
    text = render_json(status_of(job, 1, 4))
    assert "\n" not in text
    data = json.loads(text)
    assert list(data) == JSON_KEYS
    for m in data["members"]:
        assert list(m) == MEMBER_KEYS
    for n in data["nodes"]:
        assert list(n) == NODE_KEYS
    for r in data["recoveries"]:
        assert list(r) == ["time", "generation", "cause", "duration_s"]


def test_json_values() -> None:
    data = json.loads(render_json(status_of(_job_with_everyone(), 2, 3)))
    assert data["health"] == "down" and data["exit_code"] == 2
    assert data["generation"] == {
        "number": 4,
        "world_size": 3,
        "members": ["m1", "m0", "m9"],
        "reason": "join",
        "committed_step": 120,
    }
    assert data["members"][1] == {
        "member_id": "m0",
        "node": "n1",
        "local_rank": 0,
        "pid": 100,
        "host": "10.0.0.1",
        "rank": 1,
        "state": "training",
        "committed_step": 130,
        "step_time_s": 0.02,
        "recoveries": 2,
        "heartbeat_age_s": 0.25,
        "restarts": None,
        "rss_bytes": None,
        "cpu_percent": None,
        "compute_s": None,
        "straggler_score": None,
    }
    assert (data["nodes"], data["recoveries"], data["drains"]) == ([], [], [])
    assert data["missing"] == ["m9"] and data["finished"] is None and data["last_abort"] is None
    assert (data["min_workers"], data["max_workers"]) == (2, 3)


def test_table_columns_are_aligned() -> None:
    text = render_table(status_of(_job_with_everyone(), 2, 3))
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("MEMBER"))
    table = lines[header : header + 5]
    for col in ("NODE", "RANK", "STATE", "STEP", "HEARTBEAT"):
        at = table[0].index(col)
        for row in table[1:]:
            assert row[at - 2 : at] == "  " and row[at] != " ", (col, row)
    assert "training" in table[1] and "130" in table[2] and "0.2s ago" in table[2]
    assert "waiting" in table[3] and "registered" in table[4]
    assert "HEALTH" not in text and "DOWN: generation 4 lost 1 of 3" in text
    assert "missing (in the generation, lease gone): m9" in text


def test_table_lists_malformed_and_empty_jobs() -> None:
    text = render_table(status_of(Job().put(KEYS.member("garbage"), b"not json")))
    assert "no live members" in text
    assert f"malformed records (1, ignored):\n  {KEYS.member('garbage')}: " in text
    assert "not stored in etcd" in text


def test_table_escapes_control_characters_from_records() -> None:
    job = Job().put(KEYS.member("m0"), encode(MemberRecord("m0", "evil\x1b[2J", 0, 1, "h\n", 1, SIG)))
    text = render_table(status_of(job.generation(1, ["m0"])))
    assert "\x1b" not in text and "evil\\x1b[2J" in text and "h\\n" in text


def test_checkpoint_record_is_shown_in_table_and_json() -> None:
    from elasticd.wire.records import CheckpointRecord

    ck = CheckpointRecord(
        step=120,
        path="/ckpt/job/00000012-step000000000120.ckpt",
        node="n2",
        generation=3,
        seq=12,
        bytes=104857664,
        time=NOW - 4.0,
    )
    job = Job().alive("a.0").put(KEYS.generation, encode(gen(3, ["a.0"]))).put(KEYS.checkpoint, encode(ck))
    st = status_of(job)
    assert st.checkpoint == ck
    table = render_table(st)
    assert "checkpoint  step 120 on n2: /ckpt/job/00000012-step000000000120.ckpt (104857664 bytes, 4.0s ago)" in table
    data = json.loads(render_json(st))["checkpoint"]
    assert data == {"step": 120, "path": ck.path, "node": "n2", "generation": 3, "bytes": 104857664, "age_s": 4.0}
    none = status_of(Job().alive("a.0").put(KEYS.generation, encode(gen(3, ["a.0"]))))
    assert "checkpoint  none recorded" in render_table(none) and json.loads(render_json(none))["checkpoint"] is None
    bad = status_of(Job().alive("a.0").put(KEYS.generation, encode(gen(3, ["a.0"]))).put(KEYS.checkpoint, b"{"))
    assert bad.checkpoint is None and any(KEYS.checkpoint in m for m in bad.malformed)


# -- restart mode (unmodified torchrun scripts) -------------------------------------------------


def _restart_rows(
    *, failed: int = 0, finished: int = 0, agents: Sequence[str] = ("a", "b"), garbage: bool = False
) -> list[KeyValue]:
    from elasticd.wire.records import encode
    from elasticd.wire.restart import (
        AgentRecord,
        FailedRecord,
        FinishedRecord,
        RoundRecord,
    )

    rows = [
        KeyValue(
            KEYS.restart_round,
            encode(
                RoundRecord(
                    round=3,
                    nodes=("a", "b"),
                    nproc_per_node=2,
                    master_addr="10.0.0.1",
                    master_port=29500,
                    restart_count=1,
                    reason="worker_failed",
                )
            ),
            5,
            5,
        )
    ]
    rows += [KeyValue(KEYS.restart_agent(n), encode(AgentRecord(node=n, host="h", pid=1)), 2, 2) for n in agents]
    if failed:
        rows.append(
            KeyValue(
                KEYS.restart_failed,
                encode(FailedRecord(round=failed, node="a", cause="worker_failed", detail="x")),
                6,
                6,
            )
        )
    if finished:
        rows.append(KeyValue(KEYS.restart_finished, encode(FinishedRecord(round=finished)), 7, 7))
    if garbage:
        rows.append(KeyValue(KEYS.restart_agent("zz"), b"{not json", 8, 8))
    return rows


@pytest.mark.parametrize(
    ("kw", "lo", "hi", "health", "words"),
    [
        ({}, 1, 4, Health.HEALTHY, "round 3 runs with world size 4"),
        ({}, 1, 8, Health.DEGRADED, "world size 4 < max_workers 8"),
        ({}, 6, 8, Health.DOWN, "world size 4 < min_workers 6"),
        ({"failed": 3}, None, None, Health.DOWN, "round 3 ended"),
        ({"agents": ("a",)}, None, None, Health.DOWN, "lost the agent of b"),
        ({"finished": 3}, None, None, Health.FINISHED, "round 3 finished"),
    ],
)
def test_a_restart_mode_job_is_shown_by_its_round(
    kw: dict, lo: int | None, hi: int | None, health: Health, words: str
) -> None:
    st = build_status(KEYS, _restart_rows(**kw), now=NOW, min_workers=lo, max_workers=hi)
    assert st.health is health and words in st.reason, st.reason
    data = json.loads(render_json(st))["restart"]
    assert data["round"] == 3 and data["world_size"] == 4 and data["nodes"] == ["a", "b"]
    assert data["master"] == "10.0.0.1:29500" and data["restart_count"] == 1
    assert "mode restart: round 3 (worker_failed), world size 4 = 2 node(s) x 2" in render_table(st)


def test_garbage_under_restart_is_listed_not_fatal() -> None:
    st = build_status(KEYS, _restart_rows(garbage=True), now=NOW, min_workers=1, max_workers=4)
    assert st.health is Health.HEALTHY
    assert any("/restart/agents/zz" in m for m in st.malformed), st.malformed


def test_an_elastic_job_has_no_restart_section() -> None:
    assert json.loads(render_json(status_of(_job_with_everyone(), 1, 4)))["restart"] is None


# -- health from live records: a malformed generation, stalls, failed saves ----------------------

from elasticd.ops.health import (  # noqa: E402
    STALL_AFTER_S,
    last_activity,
    save_failing,
    stall_bound,
)
from elasticd.wire.ops import (  # noqa: E402
    EventRecord,
    SaveFailedRecord,
    encode_event,
    encode_save_failed,
    event_name,
    save_failed_key,
)
from elasticd.wire.failures import FailureRecord, encode_failure  # noqa: E402
from elasticd.wire.records import CheckpointRecord  # noqa: E402

SAVE_FAILED = save_failed_key(KEYS.job)


def failed_save(step: int, age_s: float, errno: str | None = "EROFS") -> bytes:
    return encode_save_failed(
        SaveFailedRecord(
            time=NOW - age_s,
            step=step,
            generation=1,
            node="n1",
            directory="/ckpt/job",
            error="[Errno 30] Read-only file system",
            errno=errno,
        )
    )


def raised(member: str, step: int) -> bytes:
    return encode_failure(FailureRecord(member, "n1", 0, 1, step, "ValueError", "bad sample N", "Traceback", NOW))


def checkpoint(step: int, age_s: float) -> bytes:
    return encode(
        CheckpointRecord(
            step=step, path=f"/ckpt/job/x-step{step}.ckpt", node="n1", generation=1, seq=1, bytes=10, time=NOW - age_s
        )
    )


def published(number: int, age_s: float) -> tuple[str, bytes]:
    ev = EventRecord(time=NOW - age_s, kind="generation_published", source="m0", detail={"generation": number})
    return KEYS.event(event_name(int(ev.time * 1e9), "m0")), encode_event(ev)


def training(*, age_s: float = 1.5, step_time_s: float | None = 0.02) -> Job:
    """m0 and m1 train in generation 1; their progress records are ``age_s`` old."""
    return (
        Job()
        .alive("m0", "m1")
        .generation(1, ["m0", "m1"])
        .put(KEYS.progress("m0"), progress(50, rank=0, age_s=age_s, step_time_s=step_time_s))
        .put(KEYS.progress("m1"), progress(50, rank=1, age_s=age_s + 0.3, step_time_s=step_time_s))
    )


LIVE_CASES = [
    # (name, job, stall_after_s, health, words in the reason)
    (
        "malformed generation, live members report training",
        Job()
        .alive("m0", "m1")
        .put(KEYS.generation, b"[[[[")
        .put(KEYS.progress("m0"), progress(80, generation=3, rank=0))
        .put(KEYS.progress("m1"), progress(79, generation=3, rank=1)),
        STALL_AFTER_S,
        Health.DEGRADED,
        "2 live member(s) train in generation 3",
    ),
    (
        "malformed generation, progress too old to count",
        Job().alive("m0").put(KEYS.generation, b"[[[[").put(KEYS.progress("m0"), progress(80, generation=3, age_s=500)),
        STALL_AFTER_S,
        Health.DOWN,
        "generation record is malformed",
    ),
    (
        "malformed generation, only a gone member's progress",
        Job().alive("m0").put(KEYS.generation, b"[[[[").put(KEYS.progress("m9"), progress(80, generation=3)),
        STALL_AFTER_S,
        Health.DOWN,
        "malformed",
    ),
    ("committing", training(), STALL_AFTER_S, Health.HEALTHY, "all 2 live members"),
    (
        "one worker's exception: no bug yet",
        training().put(KEYS.failure("m2"), raised("m2", 30)),
        STALL_AFTER_S,
        Health.HEALTHY,
        "all 2 live members",
    ),
    (
        "the same exception at one step twice: failed",
        training().put(KEYS.failure("m2"), raised("m2", 30)).put(KEYS.failure("m3"), raised("m3", 30)),
        STALL_AFTER_S,
        Health.FAILED,
        "stopped by a bug at step 30: ValueError: bad sample N",
    ),
    (
        "no commit for longer than the bound",
        training(age_s=STALL_AFTER_S + 5),
        STALL_AFTER_S,
        Health.STALLED,
        f"no step committed for {STALL_AFTER_S + 5:.1f}s (> {STALL_AFTER_S:g}s)",
    ),
    ("a smaller bound given", training(age_s=30), 10.0, Health.STALLED, "generation 1 (step 50)"),
    ("stall checks off", training(age_s=9999), 0.0, Health.HEALTHY, "all 2 live members"),
    (
        "slow steps get more time",
        training(age_s=150, step_time_s=20.0),
        STALL_AFTER_S,
        Health.HEALTHY,
        "all 2 live members",
    ),
    ("slow steps, still too long", training(age_s=250, step_time_s=20.0), STALL_AFTER_S, Health.STALLED, "> 200s"),
    (
        "joined long ago, never committed",
        Job().alive("m0").generation(2, ["m0"]).put(*published(2, 500)),
        STALL_AFTER_S,
        Health.STALLED,
        "(no step yet)",
    ),
    (
        "joined just now",
        Job().alive("m0").generation(2, ["m0"]).put(*published(2, 3)),
        STALL_AFTER_S,
        Health.HEALTHY,
        "all 1 live members",
    ),
    (
        "an older generation's event says nothing",
        Job().alive("m0").generation(2, ["m0"]).put(*published(1, 500)),
        STALL_AFTER_S,
        Health.HEALTHY,
        "all 1 live members",
    ),
    (
        "a member lost is down, not stalled",
        Job().alive("m0").generation(1, ["m0", "m1"]).put(KEYS.progress("m0"), progress(5, age_s=500)),
        STALL_AFTER_S,
        Health.DOWN,
        "lost 1 of 2",
    ),
    (
        "the latest save failed",
        training().put(KEYS.checkpoint, checkpoint(40, 60)).put(SAVE_FAILED, failed_save(50, 5)),
        STALL_AFTER_S,
        Health.DEGRADED,
        "the last checkpoint save failed (step 50: EROFS)",
    ),
    (
        "a failed save, and no good one ever",
        training().put(SAVE_FAILED, failed_save(10, 5, errno=None)),
        STALL_AFTER_S,
        Health.DEGRADED,
        "save failed (step 10: [Errno 30]",
    ),
    (
        "a good save since the failure",
        training().put(SAVE_FAILED, failed_save(40, 60)).put(KEYS.checkpoint, checkpoint(50, 5)),
        STALL_AFTER_S,
        Health.HEALTHY,
        "all 2 live members",
    ),
    (
        "a failed save on top of a small world",
        training().put(SAVE_FAILED, failed_save(40, 5)),
        STALL_AFTER_S,
        Health.DEGRADED,
        "2 < max_workers 3; the last checkpoint save failed",
    ),
    (
        "stalled wins over a failed save",
        training(age_s=500).put(SAVE_FAILED, failed_save(40, 5)),
        STALL_AFTER_S,
        Health.STALLED,
        "no step committed",
    ),
]


@pytest.mark.parametrize(
    ("name", "job", "stall_after_s", "health", "reason"), LIVE_CASES, ids=[c[0] for c in LIVE_CASES]
)
def test_health_from_live_records(name: str, job: Job, stall_after_s: float, health: Health, reason: str) -> None:
    hi = 3 if "small world" in name else None
    st = build_status(KEYS, job.kvs(), now=NOW, max_workers=hi, stall_after_s=stall_after_s)
    assert st.health is health, st.reason
    assert reason in st.reason, st.reason
    assert (
        st.exit_code
        == {
            Health.HEALTHY: EXIT_OK,
            Health.DEGRADED: EXIT_DEGRADED,
            Health.DOWN: EXIT_DOWN,
            Health.STALLED: EXIT_DOWN,
            Health.FAILED: EXIT_DOWN,
        }[health]
    )


def test_a_malformed_generation_shows_the_members_that_train_by_their_progress() -> None:
    job = (
        Job()
        .alive("m0", "m1", "m2")
        .put(KEYS.generation, b"{}")
        .put(KEYS.progress("m0"), progress(80, generation=3, rank=1))
        .put(KEYS.progress("m1"), progress(81, generation=3, rank=0))
        .put(KEYS.progress("m2"), progress(20, generation=2, rank=0))
    )  # left behind in an older one
    st = status_of(job)
    assert [(m.member_id, m.rank, m.state) for m in st.members] == [
        ("m1", 0, WorkerState.TRAINING),
        ("m0", 1, WorkerState.TRAINING),
        ("m2", None, WorkerState.REGISTERED),
    ]
    assert st.generation is None and any(KEYS.generation in m for m in st.malformed)


@pytest.mark.parametrize(
    ("stall_after_s", "step_times", "bound"),
    [
        (120.0, [], 120.0),
        (120.0, [None, 0.5], 120.0),
        (120.0, [3.0, 20.0], 200.0),
        (0.0, [1.0], 10.0),
    ],
)
def test_stall_bound(stall_after_s: float, step_times: list[float | None], bound: float) -> None:
    assert stall_bound(stall_after_s, step_times) == bound


def test_last_activity_is_the_newest_progress_or_the_generation_published() -> None:
    from elasticd.wire.progress import ProgressRecord

    p = {
        "m0": ProgressRecord(5, 1, 0, 0.1, 0, time=100.0),
        "m1": ProgressRecord(5, 1, 1, 0.1, 0, time=105.0),
        "x": ProgressRecord(9, 1, 0, 0.1, 0, time=900.0),
    }
    assert last_activity(["m0", "m1"], p, None) == 105.0
    assert last_activity(["m0", "m1"], p, 110.0) == 110.0
    assert last_activity(["m2"], p, None) is None
    assert last_activity(["m2"], p, 50.0) == 50.0


@pytest.mark.parametrize(
    ("failed_at", "failed_step", "ck_time", "ck_step", "failing"),
    [
        (None, 0, 100.0, 10, False),  # nothing failed
        (200.0, 20, None, 0, True),  # failed, and no checkpoint recorded
        (200.0, 20, 100.0, 10, True),  # failed after the last good one
        (100.0, 10, 200.0, 20, False),  # a good one since
        (200.0, 20, 0.0, 30, False),  # a record without time: by step, a newer step was saved
        (200.0, 30, 0.0, 20, True),
    ],
)
def test_save_failing(
    failed_at: float | None, failed_step: int, ck_time: float | None, ck_step: int, failing: bool
) -> None:
    failed = None if failed_at is None else SaveFailedRecord(failed_at, failed_step, 1, "n", "/d", "e", None)
    ck = None if ck_time is None else CheckpointRecord(step=ck_step, path="p", node="n", time=ck_time)
    assert save_failing(failed, ck) is failing


def test_a_failed_save_is_shown_in_table_and_json() -> None:
    st = status_of(training().put(KEYS.checkpoint, checkpoint(40, 60)).put(SAVE_FAILED, failed_save(50, 5)))
    table = render_table(st)
    assert "health      DEGRADED: the last checkpoint save failed (step 50: EROFS)" in table
    assert (
        "save error  the latest save: step 50 at 2023-11-14T22:13:15Z on n1 into /ckpt/job: "
        "[Errno 30] Read-only file system"
    ) in table
    data = json.loads(render_json(st))
    assert data["save_failed"] == {
        "time": NOW - 5,
        "step": 50,
        "generation": 1,
        "node": "n1",
        "directory": "/ckpt/job",
        "errno": "EROFS",
        "error": "[Errno 30] Read-only file system",
        "failing": True,
    }
    assert data["stall_after_s"] == STALL_AFTER_S and data["last_activity_age_s"] == 1.5
    healed = status_of(training().put(SAVE_FAILED, failed_save(40, 60)).put(KEYS.checkpoint, checkpoint(50, 5)))
    assert "save error  a good checkpoint was saved since: step 40" in render_table(healed)
    assert json.loads(render_json(healed))["save_failed"]["failing"] is False
    none = status_of(training())
    assert "save error" not in render_table(none) and json.loads(render_json(none))["save_failed"] is None
    bad = status_of(training().put(SAVE_FAILED, b"{"))
    assert bad.save_failed is None and bad.health is Health.HEALTHY and any(SAVE_FAILED in m for m in bad.malformed)


def test_a_stalled_job_says_so_in_the_table() -> None:
    st = build_status(KEYS, training(age_s=300).kvs(), now=NOW, stall_after_s=60)
    assert render_table(st).splitlines()[1] == (
        "health      STALLED: no step committed for 300.0s (> 60s) by the 2 live member(s) of generation 1 (step 50)"
    )
    assert json.loads(render_json(st))["health"] == "stalled" and st.exit_code == EXIT_DOWN
