"""What the nan_grads and checkpoint fault kinds must leave behind, checked over a run's evidence
(pure).

Owns ``nan_findings`` (a worker's NaN gradients are named by it, skipped on every member and never
applied) and ``checkpoint_findings`` (a save fails only while the checkpoint filesystem is faulted,
with the errno of the fault, the earlier checkpoints stay, and saves succeed again after). Each
returns the problems found and a summary for the report; ``judge`` makes them invariants. It reads
nothing and runs nothing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from elasticd.chaos.evidence import CheckpointFault, Commit, FaultRecord, Mark
from elasticd.chaos.schedule import CHECKPOINT_EVERY_STEPS, NAN_GRAD_STEPS, FaultKind

NAN_NAMED_BOUND_S = 30.0  # after nan_grads, its node names a non-finite step by then (unless other faults came)
CHECKPOINT_SLACK_S = 2.0  # a save begun while the filesystem was faulted may fail this long after its restore
RESUME_STEPS = 3 * CHECKPOINT_EVERY_STEPS  # this many steps after a restore, a save has succeeded
EXPECTED_ERRNO = {FaultKind.CHECKPOINT_READONLY.value: "EROFS", FaultKind.CHECKPOINT_FULL.value: "ENOSPC"}


def nan_findings(
    nan_faults: Sequence[FaultRecord], marks: Sequence[Mark], commits: Sequence[Commit], faults: Sequence[FaultRecord]
) -> tuple[list[str], str]:
    """(problems, summary) of the NaN gradients: every ``gradients_not_finite`` comes from a node
    poisoned before (by a nan_grads fault), and each fault's node names 1..NAN_GRAD_STEPS steps (none
    is a problem only if the node went on committing and no other fault came within
    NAN_NAMED_BOUND_S: a regroup may abort a poisoned step before its vote); every named step was
    skipped by every member that committed it; the steps committed with a non-finite loss are
    exactly named ones (a NaN applied would make every later loss NaN, named by nobody)."""
    out: list[str] = []
    named = [m for m in marks if m.event == "gradients_not_finite"]
    skipped: dict[int, set[str]] = {}
    for m in marks:
        if m.event == "step_skipped":
            skipped.setdefault(m.step, set()).add(m.node)
    for m in named:
        if not any(f.target == m.node and f.t <= m.t for f in nan_faults):
            out.append(f"{m.node}: gradients not finite at step {m.step}, and no nan_grads was injected on it")
    for f in nan_faults:
        until = min((g.t for g in nan_faults if g.target == f.target and g.t > f.t), default=math.inf)
        steps = sorted({m.step for m in named if m.node == f.target and f.t <= m.t < until})
        if len(steps) > NAN_GRAD_STEPS:
            out.append(
                f"{f.target}: {len(steps)} steps named non-finite after one nan_grads ({NAN_GRAD_STEPS} poisoned)"
            )
        elif not steps:
            went_on = any(c.node == f.target and c.t > f.t + NAN_NAMED_BOUND_S for c in commits)
            others = any(g is not f and f.t < g.t <= f.t + NAN_NAMED_BOUND_S for g in faults)
            if went_on and not others:
                out.append(f"{f.target}: poisoned, yet no step named its gradients non-finite")
    committers: dict[int, set[str]] = {}
    for c in commits:
        committers.setdefault(c.step, set()).add(c.node)
    named_steps = sorted({m.step for m in named})
    for step in named_steps:
        missing = committers.get(step, set()) - skipped.get(step, set())
        if missing:
            out.append(f"step {step}: named non-finite, yet {sorted(missing)} committed it without skipping it")
    nonfinite = sorted({c.step for c in commits if c.loss is not None and not math.isfinite(c.loss)})
    unnamed = [s for s in nonfinite if s not in set(named_steps)]
    if unnamed:
        out.append(f"steps committed with a non-finite loss that no member named (a NaN applied?): {unnamed[:10]}")
    summary = (
        f"{len(nan_faults)} fault(s); steps {named_steps[:10]} named, skipped on every member; every other loss finite"
    )
    return out, summary


def checkpoint_findings(
    cfaults: Sequence[CheckpointFault], marks: Sequence[Mark], commits: Sequence[Commit]
) -> tuple[list[str], str]:
    """(problems, summary) of the checkpoint filesystem faults: a save fails only while one is in
    flight (or CHECKPOINT_SLACK_S after), with its errno (EROFS, ENOSPC); the newest complete
    checkpoint from before each is still there at its end, or a newer one is; and once the job
    committed RESUME_STEPS steps after a restore, a save after it succeeded."""
    out: list[str] = []
    failed = [m for m in marks if m.event == "checkpoint_save_failed"]
    saved = [m for m in marks if m.event == "checkpoint_saved"]
    for m in failed:
        around = [w for w in cfaults if w.start <= m.t <= w.end + CHECKPOINT_SLACK_S]
        expected = {EXPECTED_ERRNO.get(w.kind, "") for w in around}
        if not around:
            out.append(f"{m.node}: the save of step {m.step} failed ({m.errno}) with no checkpoint fault in flight")
        elif m.errno not in expected:
            out.append(
                f"{m.node}: the save of step {m.step} failed with {m.errno or 'no errno'}, not {sorted(expected)}"
            )
    last_step = max((c.step for c in commits), default=0)
    for w in cfaults:
        if w.end == math.inf:
            out.append(f"{w.kind}: the checkpoint filesystem was still faulted at the end")
            continue
        newest = max(w.before, default=None)
        if newest is not None and not any(seq >= newest for seq in w.after):
            out.append(
                f"{w.kind}: checkpoint seq {newest}, the newest before the fault, is gone and none newer is there"
            )
        at_end = max((c.step for c in commits if c.t <= w.end), default=0)
        if last_step - at_end >= RESUME_STEPS and not any(m.t > w.end for m in saved):
            out.append(f"{w.kind}: no save succeeded after the filesystem was restored ({last_step - at_end} steps on)")
    errnos = sorted({m.errno for m in failed})
    summary = (
        f"{len(cfaults)} fault(s): {len(failed)} save(s) failed {errnos}, none outside a fault; "
        f"earlier checkpoints kept; saves succeeded after each"
    )
    return out, summary
