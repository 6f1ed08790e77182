"""The drop-in form's reducer paths in a real one-rank gloo group: this rank's own gradients kept
when a step's buckets go out and summed again in another group (``replay``), and a step that
moves to another group between its micro-batches with what it accumulated (``rearm``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import HashStore

from elasticd.errors import ProtocolViolation
from elasticd.retry import Bound
from elasticd.worker.group.process_group import Group
from elasticd.worker.step.commit import Vote
from elasticd.worker.step.reducer import GradientReducer

VOTE = Vote(0.0, False, False).slots()


def _group(generation: int) -> Group:
    pg = dist.ProcessGroupGloo(HashStore(), 0, 1)
    return Group(pg, generation, 0, 1, "gloo", torch.device("cpu"))


def _backward(model: torch.nn.Linear, x: torch.Tensor) -> None:
    model(x).sum().backward()


def test_kept_gradients_are_summed_again_in_the_next_group() -> None:
    torch.manual_seed(0)
    model, x = torch.nn.Linear(3, 2), torch.randn(4, 3)
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"), keep_local=True)
    reducer.begin(_group(1), 1, 0.5, lambda: VOTE)
    _backward(model, x)
    reducer.finish(Bound.after(5.0, poll_s=0.05))
    want = [p.grad.clone() for p in model.parameters()]  # own gradients x 0.5, summed over one rank
    reducer.cancel()  # as if the sum had not arrived: the group is retired
    for p in model.parameters():
        p.grad.mul_(3.0)  # the script's clipping touched the failed step's .grad
    reducer.begin(_group(2), 1, 0.5, lambda: VOTE)  # zeroes the buckets
    reducer.replay()
    reducer.finish(Bound.after(5.0, poll_s=0.05))
    for p, w in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)
    reducer.close()


def test_replay_refuses_without_the_steps_kept_gradients() -> None:
    model = torch.nn.Linear(3, 2)
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"), keep_local=True)
    reducer.begin(_group(1), 5, 1.0, lambda: VOTE)
    with pytest.raises(ValueError, match="step 5"):
        reducer.replay()
    reducer.close()


def test_a_step_moves_to_a_new_group_between_micro_batches_with_what_it_accumulated() -> None:
    torch.manual_seed(0)
    model, x0, x1 = torch.nn.Linear(3, 2), torch.randn(4, 3), torch.randn(4, 3)
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"), keep_local=True)
    reducer.begin(_group(1), 1, 1.0, lambda: VOTE, sync=False)
    _backward(model, x0)
    reducer.rearm(_group(2), 0.25)  # the regroup happened before the last micro-batch
    reducer.sync_next()
    _backward(model, x1)
    reducer.finish(Bound.after(5.0, poll_s=0.05))
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    (ref(x0).sum() + ref(x1).sum()).backward()
    for p, r in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad * 0.25)
    with pytest.raises(ProtocolViolation):  # its buckets went out: it cannot move now
        reducer.rearm(_group(3), 1.0)
    reducer.close()


@pytest.mark.parametrize(
    ("poison", "check", "nonfinite"),
    [(None, True, False), (float("nan"), True, True), (float("inf"), True, True), (float("nan"), False, False)],
)
def test_the_vote_sees_whether_this_ranks_own_gradients_are_finite(
    poison: float | None, check: bool, nonfinite: bool
) -> None:
    """Each bucket is checked as it goes out, so the vote (written into the last one) knows; off
    where a GradScaler owns that decision."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    reducer = GradientReducer(list(model.parameters()), torch.device("cpu"), bucket_cap_bytes=40, check_finite=check)
    seen: list[bool] = []
    reducer.begin(_group(1), 1, 1.0, lambda: seen.append(reducer.local_nonfinite()) or VOTE)
    loss = model(torch.randn(2, 3)).sum()
    (loss * poison if poison is not None else loss).backward()
    reducer.finish(Bound.after(5.0, poll_s=0.05))
    assert seen == [nonfinite] and reducer.local_nonfinite() is nonfinite
    reducer.begin(_group(2), 2, 1.0, lambda: VOTE)  # a new step starts clean
    assert reducer.local_nonfinite() is False
    reducer.close()
