"""A member contributes to step k+1 in a group only after applying step k, whose sum it received
there: the reducer refuses otherwise (``ProtocolViolation``). This is what makes a completed
all_reduce a confirmation of the step before it on every member. A real gloo group (one rank)."""

from __future__ import annotations

import queue

import pytest
import torch

from elasticd.errors import ProtocolViolation
from elasticd.retry import Bound
from elasticd.testing.groups import fixed_gloo_group
from elasticd.worker.step.reducer import GradientReducer
from elasticd.worker.step.commit import Vote

pytestmark = pytest.mark.timeout(60)


def test_a_member_cannot_contribute_to_a_step_before_applying_the_one_it_received() -> None:
    torch.set_num_threads(1)
    timeouts, factory, group = fixed_gloo_group(0, 1, queue.Queue())
    model = torch.nn.Linear(4, 1)
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"))
    x = torch.ones(2, 4)

    def run(step: int) -> list[float]:
        reducer.begin(group, step, 1.0, lambda: Vote(1.0, False, False).slots())
        model(x).sum().backward()
        return reducer.finish(Bound.after(30, poll_s=timeouts.abort_poll_s))

    try:
        assert run(1)[3] == 1.0  # one voter (the slots: loss, veto, regroup, voters, nonfinite)
        with pytest.raises(ProtocolViolation, match="before applying step 1"):
            reducer.begin(group, 2, 1.0, lambda: Vote(1.0, False, False).slots())
        reducer.applied(1)
        assert run(2)[3] == 1.0
        reducer.cancel()  # a step abandoned (its group retired): nothing is owed to that group
        reducer.begin(group, 3, 1.0, lambda: Vote(1.0, False, False).slots())
    finally:
        reducer.close()
        factory.retire(group)
