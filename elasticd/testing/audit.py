"""The invariant checker over the trainer's audit logs (one JSON line per commit and per sync).

Owns the proof that nothing was lost: committed steps go up by exactly one with no gap or repeat,
each committed step was committed by every member of one generation with the same global loss, the
ranks of every generation hold identical state after its sync, and each sample of an epoch is used
exactly once. Pure logic over parsed lines (and ``as_int``/``as_float``, their fields' readers): used
by the tests, the demo, chaos and the benchmarks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class AuditReport:
    """What the logs prove, and every violation found."""

    steps: list[int] = field(default_factory=list)
    losses: dict[int, float] = field(default_factory=dict)
    generations: dict[int, int] = field(default_factory=dict)  # generation -> world size
    step_world: dict[int, int] = field(default_factory=dict)
    epochs_complete: int = 0
    final_checksums: list[str] = field(default_factory=list)
    finals_by_step: dict[int, set[str]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def last_step(self) -> int:
        return max(self.steps, default=0)


def read_lines(paths: Iterable[Path]) -> list[dict[str, object]]:
    """Every audit line of ``paths``, in order. A last line without its newline is left out: its
    writer is still writing it (a reader of a live job's audit can see half of one)."""
    out: list[dict[str, object]] = []
    for p in paths:
        if not p.exists():
            continue
        lines = p.read_text().split("\n")
        for line in lines[:-1]:  # the part after the last newline is not a whole line yet
            if line.strip():
                out.append(json.loads(line))
    return out


def as_int(value: object) -> int:
    """An audit field as an int (the lines hold numbers; a string of one is taken too)."""
    assert isinstance(value, (int, float, str)), value
    return int(value)


def as_float(value: object) -> float:
    """An audit field as a float (the lines hold numbers; a string of one is taken too)."""
    assert isinstance(value, (int, float, str)), value
    return float(value)


def check(records: list[dict[str, object]], dataset_size: int, loss_rtol: float = 1e-4) -> AuditReport:
    """Check the invariants over the audit lines of every worker of one job."""
    rep = AuditReport()
    commits: dict[int, list[dict[str, object]]] = defaultdict(list)
    syncs: dict[int, list[dict[str, object]]] = defaultdict(list)
    # a sharded job's ranks hold their shard of the state: sync and final lines say which ("shard"),
    # and checksums are compared among the ranks of one shard
    finals: dict[tuple[int, int], set[str]] = {}
    for r in records:
        if r["event"] == "commit":
            commits[int(r["step"])].append(r)  # type: ignore[call-overload]
        elif r["event"] == "sync":
            syncs[int(r["generation"])].append(r)  # type: ignore[call-overload]
        elif r["event"] == "final" and not (r.get("branch") or r.get("never_joined")):  # not the job's bytes
            rep.final_checksums.append(str(r["checksum"]))
            key = (int(r["step"]), int(r.get("shard", 0)))  # type: ignore[call-overload]
            finals.setdefault(key, set()).add(str(r["checksum"]))
    rep.finals_by_step = {step: sums for (step, shard), sums in finals.items() if shard == 0}
    v = rep.violations
    rep.steps = sorted(commits)
    if rep.steps and rep.steps != list(range(1, rep.steps[-1] + 1)):
        missing = sorted(set(range(1, rep.steps[-1] + 1)) - set(rep.steps))
        v.append(f"committed steps have gaps: missing {missing[:10]}")
    for gen, rows in sorted(syncs.items()):
        rep.generations[gen] = int(rows[0]["world_size"])  # type: ignore[call-overload]
        for shard in sorted({int(r.get("shard", 0)) for r in rows}):  # type: ignore[call-overload]
            sums = {str(r["checksum"]) for r in rows if int(r.get("shard", 0)) == shard}  # type: ignore[call-overload]
            if len(sums) != 1:
                of = f" (shard {shard})" if shard else ""
                v.append(f"generation {gen}: ranks hold different state after sync{of}: {sorted(sums)}")
        ranks = sorted(int(r["rank"]) for r in rows)  # type: ignore[call-overload]
        if len(set(ranks)) != len(ranks):
            v.append(f"generation {gen}: a rank synced twice: {ranks}")
    shares: list[tuple[int, list[dict[str, object]], list[dict[str, object]], list[int], int]] = []
    last_of_generation: dict[int, int] = {}  # generation -> its last committed step
    for step in rep.steps:
        for r in commits[step]:
            gen_of_row = int(r["generation"])  # type: ignore[call-overload]
            last_of_generation[gen_of_row] = max(last_of_generation.get(gen_of_row, 0), step)
    absent_at_last: dict[int, set[int]] = {}  # generation -> the ranks without a line for its last step
    for gen, last in last_of_generation.items():
        rows_at_last = [r for r in commits[last] if int(r["generation"]) == gen]  # type: ignore[call-overload]
        absent_at_last[gen] = set(range(int(rows_at_last[0]["world_size"]))) - {  # type: ignore[call-overload]
            int(r["rank"]) for r in rows_at_last
        }  # type: ignore[call-overload]
    for step in rep.steps:
        all_rows = commits[step]
        gens = {int(r["generation"]) for r in all_rows}  # type: ignore[call-overload]
        if len(gens) != 1:
            v.append(f"step {step} committed in several generations {sorted(gens)} (repeated)")
            continue
        by_gen: dict[int, list[dict[str, object]]] = defaultdict(list)
        for r in all_rows:
            by_gen[int(r["generation"])].append(r)  # type: ignore[call-overload]
        absent_of: dict[int, list[int]] = {}
        for gen, gen_rows in sorted(by_gen.items()):
            world = int(gen_rows[0]["world_size"])  # type: ignore[call-overload]
            ranks = sorted(int(r["rank"]) for r in gen_rows)  # type: ignore[call-overload]
            if len(set(ranks)) != len(ranks) or not set(ranks) <= set(range(world)):
                v.append(f"step {step}: committed by ranks {ranks} of a world of {world}")
            # A rank may lack a line only for the last step of its generation (it contributed and then
            # died, or was fenced off, before logging: which is also why the generation ended there),
            # and for the one before it if it lacks the last too: a line is written once the step is
            # confirmed, by the next sum (docs/design/commit-protocol.md), and it died before that sum reached it.
            absent_of[gen] = sorted(set(range(world)) - set(ranks))
            last = last_of_generation[gen]
            if (
                absent_of[gen]
                and step != last
                and not (step == last - 1 and set(absent_of[gen]) <= absent_at_last.get(gen, set()))
            ):
                v.append(
                    f"step {step}: ranks {absent_of[gen]} of generation {gen} did not commit it, yet the generation went on"
                )
        # the samples: of one generation's shares (all of them where some generation has all)
        gen = min(absent_of, key=lambda g: (len(absent_of[g]), -g))
        rows, absent, world = by_gen[gen], absent_of[gen], int(by_gen[gen][0]["world_size"])  # type: ignore[call-overload]
        shares.append((step, all_rows, rows, absent, world))
    _check_stream([sh[1] for sh in shares if "blocks" in sh[1][0]], dataset_size, rep)
    _check_spans([sh for sh in shares if "blocks" not in sh[1][0]], dataset_size, loss_rtol, rep)
    for (step, shard), sums in sorted(finals.items()):
        if len(sums) > 1:
            of = f" (shard {shard})" if shard else ""
            v.append(f"members that left at step {step} hold different parameters{of}: {sorted(sums)}")
    return rep


def _check_spans(
    shares: list[tuple[int, list[dict[str, object]], list[dict[str, object]], list[int], int]],
    dataset_size: int,
    loss_rtol: float,
    rep: AuditReport,
) -> None:
    """The trainer's samples: each step's global batch a span of its epoch's order (one
    generation's ``rows`` hold its shares; ``absent``: ranks without a line), the spans of an
    epoch tiling it, the loss agreed."""
    v = rep.violations
    per_epoch: dict[int, list[int]] = defaultdict(list)
    spans: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for step, all_rows, rows, absent, world in shares:
        batch_keys = {(int(r["epoch"]), int(r["position"]), int(r.get("global_size", 0))) for r in all_rows}  # type: ignore[call-overload]
        if len(batch_keys) != 1:
            v.append(f"step {step}: ranks disagree on the global batch {sorted(batch_keys)}")
        losses = [float(r["loss"]) for r in all_rows]  # type: ignore[arg-type]
        if max(losses) - min(losses) > loss_rtol * max(1.0, abs(losses[0])):
            v.append(f"step {step}: ranks disagree on the loss {losses}")
        rep.losses[step] = losses[0]
        rep.step_world[step] = world
        epoch, position, size = sorted(batch_keys)[0]
        spans[epoch].append((position, size))
        used = [int(i) for r in rows for i in r["indices"]]  # type: ignore[attr-defined]
        if not absent and len(set(used)) != size:
            v.append(f"step {step}: the ranks' shares hold {len(set(used))} samples, not the global batch of {size}")
        per_epoch[epoch].extend(used)
    last_epoch = max(spans, default=0)
    for epoch, used in sorted(per_epoch.items()):
        dupes = len(used) - len(set(used))
        if dupes:
            v.append(f"epoch {epoch}: {dupes} samples used more than once")
        # The committed global batches of an epoch must tile its order: no overlap, no hole.
        cursor = 0
        for position, size in sorted(spans[epoch]):
            if position != cursor:
                v.append(f"epoch {epoch}: global batches jump from position {cursor} to {position}")
                break
            cursor = position + size
        else:
            if epoch < last_epoch and cursor != dataset_size:
                v.append(f"epoch {epoch}: {dataset_size - cursor} samples never used")
            elif cursor == dataset_size:
                rep.epochs_complete += 1


def _check_stream(steps: list[list[dict[str, object]]], dataset_size: int, rep: AuditReport) -> None:
    """The drop-in form's samples: each stream block used by one committed step at most, every
    block below the lowest unused one used, and in each epoch of the stream no sample used twice
    (each rank's own indices) and, where complete, every sample used."""
    if not steps:
        return
    v = rep.violations
    for rows in steps:
        step = int(rows[0]["step"])  # type: ignore[call-overload]
        rep.step_world[step] = int(rows[0]["world_size"])  # type: ignore[call-overload]
        if len({tuple(r["blocks"]) for r in rows}) != 1:  # type: ignore[arg-type]
            v.append(f"step {step}: ranks disagree on the step's blocks")
    blocks = [int(b) for rows in steps for b in rows[0]["blocks"]]  # type: ignore[attr-defined]
    if len(set(blocks)) != len(blocks):
        v.append(f"stream blocks used twice: {sorted(b for b in set(blocks) if blocks.count(b) > 1)[:10]}")
        return
    per_epoch: dict[int, list[int]] = defaultdict(list)
    for rows in steps:
        step_blocks = [int(b) for b in rows[0]["blocks"]]  # type: ignore[attr-defined]
        per_rank = len(step_blocks) // int(rows[0]["world_size"])  # type: ignore[call-overload]
        for r in rows:
            mine = step_blocks[int(r["rank"]) * per_rank : (int(r["rank"]) + 1) * per_rank]  # type: ignore[call-overload]
            indices = [int(i) for i in r["indices"]]  # type: ignore[attr-defined]
            size = len(indices) // max(1, len(mine))
            for k, b in enumerate(mine):
                for offset, i in enumerate(indices[k * size : (k + 1) * size]):
                    per_epoch[(b * size + offset) // dataset_size].append(i)
    taken, frontier = set(blocks), 0
    while frontier in taken:
        frontier += 1
    above = sum(1 for b in taken if b > frontier)
    if above > 64:  # blocks of the last steps, around one a member left in flight: a few
        v.append(f"{above} stream blocks used above the unused block {frontier}: samples were skipped")
    for epoch, samples in sorted(per_epoch.items()):
        if len(samples) != len(set(samples)):
            v.append(f"epoch {epoch}: {len(samples) - len(set(samples))} samples used more than once")
        elif len(samples) == dataset_size:
            rep.epochs_complete += 1


def first_commit_times(directory: Path) -> dict[int, float]:
    """Each committed step's first commit time (the wall clock ``t`` of its earliest ``commit``
    line), over every ``audit*.jsonl`` in ``directory``."""
    out: dict[int, float] = {}
    for r in read_lines(sorted(directory.glob("audit*.jsonl"))):
        if r.get("event") == "commit":
            step, t = int(r["step"]), float(r["t"])  # type: ignore[call-overload, arg-type]
            out[step] = min(t, out.get(step, t))
    return out


def check_dir(directory: Path, dataset_size: int) -> AuditReport:
    """Check every ``*.jsonl`` audit log in ``directory``."""
    return check(read_lines(sorted(directory.glob("*.jsonl"))), dataset_size)
