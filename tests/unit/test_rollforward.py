"""rollforward.roll_forward (pure) as a table, and one member's kept sum through its lifecycle."""

from __future__ import annotations

import pytest
import torch

from elasticd.worker.rollforward import KeptSum, Roll, RollForward, roll_forward
from elasticd.worker.sampler import ElasticSampler

pytestmark = pytest.mark.timeout(30)


def kept(step: int, base: int, gen: int, size: int = 64, world: int = 3) -> list[int]:
    return KeptSum(step, base, gen, size, world, []).slots()


@pytest.mark.parametrize("steps, lineages, keeps, want", [
    # nobody kept a sum: no roll
    ([9, 9], [4, 4], [None, None], None),
    # rank 1 refused step 10 of generation 4, whose appliers are gone: rank 0 holds 9 of lineage 4
    ([9, 9], [4, 4], [None, kept(10, 4, 4)], Roll(10, 4, 64, 3, source=1)),
    # rank 0 kept it itself (it is ranked first for holding the newest step)
    ([9, 5], [4, -1], [kept(10, 4, 4, 48, 2), None], Roll(10, 4, 48, 2, source=0)),
    # an applier survived: rank 0 holds step 10 already, the kept sum is stale
    ([10, 9], [4, 4], [None, kept(10, 4, 4)], None),
    # the state moved on further
    ([12, 9], [6, 4], [None, kept(10, 4, 4)], None),
    # the same step number on another lineage's state: not the state the sum was computed on
    ([9, 9], [7, 4], [None, kept(10, 4, 4)], None),
    # rank 0 holds no state (a fresh start): nothing to roll onto
    ([-1, -1], [-1, -1], [None, kept(0, -1, 4)], None),
    # several keepers of the same sum: the lowest rank sends it
    ([9, 9, 9], [4, 4, 4], [None, kept(10, 4, 4), kept(10, 4, 4)], Roll(10, 4, 64, 3, source=1)),
    # a rolled step that failed: its sum (of generation 2) sits on generation 6's state, which
    # every member of 6 held; the next sync (rank 0 at 9 of lineage 6) rolls it again
    ([9, 9, 9], [6, 6, 6], [None, kept(10, 6, 2), kept(10, 6, 2)], Roll(10, 2, 64, 3, source=1)),
])
def test_roll_forward(steps, lineages, keeps, want) -> None:
    assert roll_forward(steps, lineages, keeps) == want


def test_a_kept_sum_lives_until_the_sync_that_does_not_use_it_or_the_commit_of_its_step() -> None:
    sums = [torch.ones(3)]
    rf = RollForward()
    assert rf.slots() is None and rf.rolling(10) is None
    rf.keep(KeptSum(10, 4, 4, 64, 3, sums))
    assert rf.slots() == [10, 4, 4, 64, 3]
    roll = Roll(10, 4, 64, 3, source=1)
    rf.synced(roll, 5)
    assert rf.rolling(10) == roll and rf.rolling(11) is None
    assert rf.source_sums(1) is sums and rf.source_sums(0) is None  # rank 1 sends, the others receive
    # it now sits on generation 5's state: a failed rolled step is rolled again by the next sync
    assert rf.slots() == [10, 5, 4, 64, 3]
    assert roll_forward([9, 9], [5, 5], [None, rf.slots()]) == Roll(10, 4, 64, 3, source=1)
    rf.committed(10)
    assert rf.slots() is None and rf.rolling(10) is None
    rf.keep(KeptSum(12, 6, 6, 64, 3, sums))
    rf.synced(None, 7)  # the sync said the state is past it (or of another lineage): it can never apply
    assert rf.slots() is None


def test_a_rolled_step_takes_its_generations_global_batch() -> None:
    # linear_scaling: 3 ranks of 16 took 48 samples; the new generation of 2 takes the same 48
    s = ElasticSampler(200, 16, seed=3, mode="linear_scaling")
    first = [s.batch(10, 0, 96, r, 3) for r in range(3)]
    again = [s.batch(10, 0, 96, r, 2, size=48) for r in range(2)]
    assert sorted(i for b in again for i in b.indices) == sorted(i for b in first for i in b.indices)
    assert {b.global_size for b in again} == {48} and s.after(again[0]) == s.after(first[0])
