"""audit.check on hand-built histories: a clean one passes, each kind of damage is named."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from elasticd.testing.audit import check, check_dir, read_lines
from elasticd.worker.data.sampler import ElasticSampler

pytestmark = pytest.mark.timeout(60)

DATASET = 20
Record = dict[str, object]


def history(worlds: list[tuple[int, int]], steps: int, gbs: int = 6) -> list[Record]:
    """What workers would log: ``worlds`` is a list of (generation, world size), changing every
    ``steps // len(worlds)`` steps; each generation starts with a sync line per rank."""
    sampler = ElasticSampler(DATASET, gbs, seed=1)
    out: list[Record] = []
    epoch, position = 0, 0
    per = max(1, steps // len(worlds))
    current = None
    for step in range(1, steps + 1):
        generation, world = worlds[min((step - 1) // per, len(worlds) - 1)]
        if generation != current:
            current = generation
            for rank in range(world):
                out.append(
                    {
                        "event": "sync",
                        "generation": generation,
                        "rank": rank,
                        "world_size": world,
                        "step": step - 1,
                        "checksum": f"{step:016x}",
                    }
                )
        batches = [sampler.batch(step, epoch, position, r, world) for r in range(world)]
        for b in batches:
            out.append(
                {
                    "event": "commit",
                    "step": step,
                    "generation": generation,
                    "rank": b.rank,
                    "world_size": world,
                    "epoch": b.epoch,
                    "position": b.position,
                    "global_size": b.global_size,
                    "indices": list(b.indices),
                    "loss": 1.0 / step,
                }
            )
        epoch, position = ElasticSampler.after(batches[0])
    for rank in range(worlds[-1][1]):
        out.append({"event": "final", "rank": rank, "step": step, "checksum": "feedface"})
    return out


# 9 steps of 6 samples over 20: epochs 0 (steps 1-4, the last one short) and 1 (steps 5-8), and a
# partial epoch 2 (step 9). Generations 1, 2, 3 with worlds 3, 2, 4.
CLEAN = history([(1, 3), (2, 2), (3, 4)], steps=9)


def commits(records: list[Record], step: int) -> list[Record]:
    return [r for r in records if r["event"] == "commit" and r["step"] == step]


def test_clean_history_passes() -> None:
    rep = check(copy.deepcopy(CLEAN), DATASET)
    assert rep.ok, rep.violations
    assert rep.steps == list(range(1, 10)) and rep.last_step == 9
    assert rep.generations == {1: 3, 2: 2, 3: 4}
    assert rep.step_world == {1: 3, 2: 3, 3: 3, 4: 2, 5: 2, 6: 2, 7: 4, 8: 4, 9: 4}
    assert rep.epochs_complete == 2
    assert rep.losses[4] == pytest.approx(0.25)
    assert rep.final_checksums == ["feedface"] * 4


def test_empty_history_passes() -> None:
    rep = check([], DATASET)
    assert rep.ok and rep.steps == [] and rep.last_step == 0


def test_gap_in_committed_steps() -> None:
    records = [r for r in CLEAN if not (r["event"] == "commit" and r["step"] == 5)]
    rep = check(records, DATASET)
    assert not rep.ok
    assert any("gaps" in v and "[5]" in v for v in rep.violations), rep.violations


def test_history_must_start_at_step_one() -> None:
    records = [r for r in CLEAN if not (r["event"] == "commit" and r["step"] == 1)]
    rep = check(records, DATASET)
    assert any("gaps" in v and "[1]" in v for v in rep.violations), rep.violations


def test_step_repeated_in_a_later_generation() -> None:
    again = copy.deepcopy(commits(CLEAN, 6))
    for r in again:
        r["generation"] = 3  # step 6 was committed in generation 2, then again in 3
    rep = check(copy.deepcopy(CLEAN) + again, DATASET)
    assert any("step 6" in v and "repeated" in v and "[2, 3]" in v for v in rep.violations), rep.violations


def test_sync_checksum_mismatch() -> None:
    records = copy.deepcopy(CLEAN)
    syncs = [r for r in records if r["event"] == "sync" and r["generation"] == 2]
    syncs[1]["checksum"] = "0000000000000bad"
    rep = check(records, DATASET)
    assert [v for v in rep.violations if "generation 2" in v and "different state" in v], rep.violations
    assert len(rep.violations) == 1


def test_rank_synced_twice() -> None:
    records = copy.deepcopy(CLEAN)
    records.append(dict(next(r for r in records if r["event"] == "sync" and r["generation"] == 3)))
    rep = check(records, DATASET)
    assert any("generation 3" in v and "synced twice" in v for v in rep.violations), rep.violations


def test_duplicate_sample_in_an_epoch() -> None:
    records = copy.deepcopy(CLEAN)
    first, second = commits(records, 1)[0], commits(records, 2)[0]
    second["indices"] = [first["indices"][0], *second["indices"][1:]]  # type: ignore[index]
    rep = check(records, DATASET)
    assert any("epoch 0" in v and "1 samples used more than once" in v for v in rep.violations), rep.violations


def test_duplicate_sample_in_the_last_partial_epoch() -> None:
    records = copy.deepcopy(CLEAN)
    last = commits(records, 9)
    last[1]["indices"] = list(last[0]["indices"])  # type: ignore[call-overload]
    rep = check(records, DATASET)
    assert any("epoch 2" in v and "more than once" in v for v in rep.violations), rep.violations


def test_missing_samples_in_a_finished_epoch() -> None:
    records = copy.deepcopy(CLEAN)
    victim = commits(records, 3)[2]
    victim["indices"] = victim["indices"][1:]  # type: ignore[index]
    rep = check(records, DATASET)
    assert any("step 3" in v and "hold 5 samples, not the global batch of 6" in v for v in rep.violations), (
        rep.violations
    )


def test_partial_last_epoch_is_not_missing_samples() -> None:
    rep = check(copy.deepcopy(CLEAN), DATASET)
    assert not [v for v in rep.violations if "never used" in v]
    assert 2 in {int(r["epoch"]) for r in CLEAN if r["event"] == "commit"}  # type: ignore[call-overload]


def test_step_not_committed_by_every_rank() -> None:
    records = copy.deepcopy(CLEAN)
    lost = commits(records, 7)[1]
    records.remove(lost)
    rep = check(records, DATASET)
    assert any("step 7" in v and "ranks [1]" in v and "went on" in v for v in rep.violations), rep.violations


def test_a_rank_that_died_after_contributing_to_the_last_step_of_its_generation_is_fine() -> None:
    records = copy.deepcopy(CLEAN)
    last_of_gen2 = max(int(r["step"]) for r in records if r["event"] == "commit" and r["generation"] == 2)
    records.remove(commits(records, last_of_gen2)[1])
    assert check(records, DATASET).ok


def test_a_rank_that_died_after_contributing_to_the_last_step_lacks_the_one_before_too() -> None:
    # its line for the step before is written once the last step's sum confirms it, and it died first
    records = copy.deepcopy(CLEAN)
    for step in (5, 6):  # the last two of generation 2
        records.remove(commits(records, step)[1])
    assert check(records, DATASET).ok


def test_a_rank_without_the_step_before_the_last_but_with_the_last_is_a_violation() -> None:
    records = copy.deepcopy(CLEAN)
    records.remove(commits(records, 5)[1])
    rep = check(records, DATASET)
    assert any("step 5" in v and "ranks [1]" in v and "went on" in v for v in rep.violations), rep.violations
    records = copy.deepcopy(CLEAN)
    for step in (4, 6):  # the last step and one two before it
        records.remove(commits(records, step)[1])
    assert any("step 4" in v and "went on" in v for v in check(records, DATASET).violations)


def test_ranks_disagree_on_the_loss() -> None:
    records = copy.deepcopy(CLEAN)
    commits(records, 2)[1]["loss"] = 0.75
    rep = check(records, DATASET)
    assert any("step 2" in v and "loss" in v for v in rep.violations), rep.violations


def test_loss_tolerance_is_relative() -> None:
    records = copy.deepcopy(CLEAN)
    for r in commits(records, 2):
        r["loss"] = 1000.0
    commits(records, 2)[1]["loss"] = 1000.05  # 5e-5 relative: within 1e-4
    assert check(records, DATASET).ok


def test_final_parameters_differ() -> None:
    records = copy.deepcopy(CLEAN)
    [r for r in records if r["event"] == "final"][2]["checksum"] = "deadbeef"
    rep = check(records, DATASET)
    assert any("hold different parameters" in v for v in rep.violations), rep.violations


def test_members_leaving_at_different_steps_may_hold_different_parameters() -> None:
    records = copy.deepcopy(CLEAN)
    final = [r for r in records if r["event"] == "final"][2]
    final["checksum"], final["step"] = "deadbeef", 1  # left earlier, with the state of that step
    assert check(records, DATASET).ok


def test_check_dir_reads_every_worker_log(tmp_path: Path) -> None:
    by_rank: dict[int, list[Record]] = {}
    for r in CLEAN:
        by_rank.setdefault(int(r["rank"]), []).append(r)  # type: ignore[call-overload]
    for rank, rows in by_rank.items():
        (tmp_path / f"audit{rank}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    (tmp_path / "notes.txt").write_text("not an audit log")
    rep = check_dir(tmp_path, DATASET)
    assert rep.ok, rep.violations
    assert rep.last_step == 9 and rep.generations == {1: 3, 2: 2, 3: 4}
    (tmp_path / "audit0.jsonl").unlink()
    assert not check_dir(tmp_path, DATASET).ok  # rank 0's commits are gone


def test_read_lines_leaves_out_a_last_line_still_being_written(tmp_path: Path) -> None:
    """A reader of a live job's audit can see half of the line being written: it is not a line yet."""
    audit = tmp_path / "a.jsonl"
    audit.write_text('{"event": "commit", "step": 1}\n{"event": "commit", "step": 2}\n{"event": "com')
    assert [r["step"] for r in read_lines([audit])] == [1, 2]
    audit.write_text('{"event": "commit", "step": 1}\n\n{"event": "commit", "step": 2}\n')
    assert [r["step"] for r in read_lines([audit, tmp_path / "missing.jsonl"])] == [1, 2]
