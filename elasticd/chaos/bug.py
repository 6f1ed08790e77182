"""The bug scenario of a chaos run (``--scenario bug``): no fault, a bug. Every rank of the workload
raises the same exception at one step (``agents/mlp.py --raise-at-step S``), and the job must stop
instead of restarting its workers again and again.

Owns ``BugEvidence`` and ``judge_bug`` (pure: every agent exits 3, ``EXIT_JOB_FAILED``; every agent
stopped within 2 x lease TTL + one restart of the first failure record; ``elasticctl status``
reports health ``failed`` naming the step and the exception; no step at or past S committed, and
the job got to S - 2 at least: the commit line of S - 1 waits for a confirmation that never comes),
``render_bug`` (the PASS/FAIL report) and ``bug_timestamp``. It reads nothing and runs nothing:
``__main__``'s ``run_bug`` starts the agents, waits for their exits and gathers the evidence.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from elasticd.chaos.judge import Invariant

EXIT_JOB_FAILED = 3  # the agent's exit code when the job failed (elasticd.agent.daemon)
BUG_EXCEPTION = "ScriptBug"  # the exception agents/mlp.py --raise-at-step raises
ONE_RESTART_S = 3.0  # one worker restart: the backoff, a start, the step again


@dataclass(frozen=True)
class BugEvidence:
    step: int  # the step every rank raises at
    codes: Mapping[str, int | None]  # node -> its agent's exit code (None: still running at the bound)
    stopped_t: Mapping[str, float]  # node -> wall time of its agent's agent_stopped line
    first_failure_t: float | None  # wall time of the job's first failure record (elasticctl status)
    status: Mapping[str, object] | None  # elasticctl status --json once the agents exited
    status_error: str  # why there is no status ("" when there is)
    last_step: int  # the last step with a commit line (audit)
    lease_ttl_s: float


def _bug_of(status: Mapping[str, object] | None) -> Mapping[str, object]:
    bug = status.get("bug") if status is not None else None
    return bug if isinstance(bug, dict) else {}


def judge_bug(ev: BugEvidence) -> list[Invariant]:
    """The invariants of a bug scenario over its evidence."""
    codes = ", ".join(f"{n}: {c}" for n, c in sorted(ev.codes.items()))
    all_three = bool(ev.codes) and all(c == EXIT_JOB_FAILED for c in ev.codes.values())
    bound = 2 * ev.lease_ttl_s + ONE_RESTART_S
    missing = sorted(set(ev.codes) - set(ev.stopped_t))
    late = max(ev.stopped_t.values(), default=math.inf) - (ev.first_failure_t or math.inf)
    in_time = ev.first_failure_t is not None and not missing and late <= bound
    if ev.first_failure_t is None:
        when = "no failure record"
    elif missing:
        when = f"no agent_stopped line of {missing}"
    else:
        when = f"the last agent stopped {late:.2f} s after the first failure record"
    health = ev.status.get("health") if ev.status is not None else None
    bug = _bug_of(ev.status)
    exception = str(bug.get("exception", ""))
    kind = exception.partition(": ")[0].rsplit(".", 1)[-1]  # the class, without its module (__main__.)
    named = health == "failed" and bug.get("step") == ev.step and kind == BUG_EXCEPTION
    said = ev.status_error or f"health {health}; bug at step {bug.get('step')}: {exception[:120]}"
    return [
        Invariant(f"every agent exits {EXIT_JOB_FAILED}", all_three, codes or "no agent"),
        Invariant(f"stopped within 2 x TTL + {ONE_RESTART_S:g} s = {bound:g} s", in_time, when),
        Invariant(f"status: failed at step {ev.step}, naming {BUG_EXCEPTION}", named, said),
        # A step's commit line is written once the next step's sum confirms it: S - 1 may have none.
        Invariant(
            f"no step at or past {ev.step} committed",
            ev.step - 2 <= ev.last_step < ev.step,
            f"the last step committed is {ev.last_step}",
        ),
    ]


def render_bug(invariants: Sequence[Invariant], step: int, nodes: int, workdir: str) -> str:
    """The report of a bug scenario: one PASS/FAIL line per invariant, and the result."""
    ok = all(i.ok for i in invariants)
    lines = [f"elasticd chaos: scenario bug: every rank raises {BUG_EXCEPTION} at step {step}; {nodes} nodes", ""]
    lines += [f"  {'PASS' if i.ok else 'FAIL'}  {i.name:<48} {i.detail}" for i in invariants]
    lines += ["", f"result: {'PASS' if ok else 'FAIL'}", f"work dir: {workdir}", ""]
    return "\n".join(lines)


def bug_timestamp(stamp: object) -> float | None:
    """A log line's ISO timestamp as wall time (None: not one)."""
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
