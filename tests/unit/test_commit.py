"""The step's verdict ``commit_outcome``: a table over hand-built tallies, and proof that nothing but
the tally enters it (its signature, and the imports of the step path's rule)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import elasticd.worker.step.commit as commit
from elasticd.worker.step.commit import VOTE_SLOTS, Outcome, Tally, Vote, commit_outcome

pytestmark = pytest.mark.timeout(30)

WORLD = 3


def tally(vetoes: int = 0, regroups: int = 0, voters: int = WORLD, nonfinite: int = 0, finished: int = 0) -> Tally:
    return Tally(loss=1.5, vetoes=vetoes, regroups=regroups, voters=voters, nonfinite=nonfinite, finished=finished)


CASES = [
    # (what, tally, outcome, regroup[, skip])
    ("every member voted", tally(), Outcome.APPLY, False),
    ("a member's gradients are not finite: applied with no update", tally(nonfinite=1), Outcome.APPLY, False, True),
    (
        "not finite, and a regroup asked: skipped, then regroup",
        tally(nonfinite=2, regroups=1),
        Outcome.APPLY,
        True,
        True,
    ),
    ("a veto wins over gradients that are not finite", tally(nonfinite=1, vetoes=1), Outcome.ABORT, False),
    ("a vote missing wins over them too", tally(nonfinite=1, voters=2), Outcome.ABORT, False),
    ("a newcomer waits or a member drains: apply, then regroup", tally(regroups=1), Outcome.APPLY, True),
    ("every member asks to regroup", tally(regroups=3), Outcome.APPLY, True),
    ("a member knows the generation is abandoned: nobody applies", tally(vetoes=1), Outcome.ABORT, False),
    ("a veto wins over a regroup", tally(vetoes=1, regroups=2), Outcome.ABORT, False),
    ("a vote missing (a sum of another world size)", tally(voters=2), Outcome.ABORT, False),
    ("more votes than members (a late sum of a larger generation)", tally(voters=4), Outcome.ABORT, False),
    ("every member's goodbye: the job ends at the step they hold", tally(finished=3), Outcome.FINISH, False),
    ("a newcomer's step met the others' goodbye: nobody applies it", tally(finished=2), Outcome.FINISH, False),
    ("a goodbye wins over a regroup and a veto", tally(finished=1, regroups=1, vetoes=1), Outcome.FINISH, False),
    ("a goodbye wins over gradients that are not finite", tally(finished=1, nonfinite=1), Outcome.FINISH, False),
    ("a vote missing wins over a goodbye", tally(finished=2, voters=2), Outcome.ABORT, False),
]


@pytest.mark.parametrize(
    ("what", "t", "outcome", "regroup", "skip"), [(*c, False)[:5] for c in CASES], ids=[c[0] for c in CASES]
)
def test_commit_outcome(what: str, t: Tally, outcome: Outcome, regroup: bool, skip: bool) -> None:
    v = commit_outcome(t, WORLD)
    assert (v.outcome, v.regroup, v.skip) == (outcome, regroup, skip), v.reason
    assert v.reason


def test_the_verdict_takes_the_tally_and_the_world_size_alone() -> None:
    """No clock, lease, fence or etcd read is a parameter of the verdict."""
    assert list(inspect.signature(commit_outcome).parameters) == ["tally", "world_size"]


def test_the_rule_module_imports_nothing_that_could_read_a_clock_a_lease_or_etcd() -> None:
    tree = ast.parse(Path(commit.__file__).read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {(node.module or "").split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "collections", "dataclasses", "enum"}, imported


def test_vote_slots_round_trip_through_a_sum() -> None:
    votes = [
        Vote(0.5, False, False),
        Vote(0.25, False, True),
        Vote(0.25, True, False),
        Vote(0.0, False, False, finished=True),
    ]
    summed = [sum(v.slots()[i] for v in votes) for i in range(VOTE_SLOTS)]
    assert Tally.from_slots(summed) == Tally(loss=1.0, vetoes=1, regroups=1, voters=4, finished=1)
    with pytest.raises(ValueError):
        Tally.from_slots(summed[:-1])


def test_the_step_path_hands_the_verdict_the_tally_and_the_world_size_and_reads_no_clock() -> None:
    """``worker/step/protocol.py`` (one member's step) calls the verdict with the summed vote and the
    generation's size only, and imports nothing that reads a clock, a lease or etcd."""
    import elasticd.worker.step.protocol as step

    tree = ast.parse(Path(step.__file__).read_text())
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "commit_outcome"]
    assert [ast.unparse(a) for c in calls for a in c.args] == ["op.tally", "group.world_size"], calls
    assert all(not c.keywords for c in calls)
    modules = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
    modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    names = {alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for alias in n.names}
    assert not modules & {"time", "elasticd.rendezvous.lease", "elasticd.store.etcd", "elasticd.store.kv"}, modules
    assert not names & {"Clock", "Lease", "Reachability"}, names
