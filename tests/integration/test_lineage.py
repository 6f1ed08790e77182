"""The lineage travels with the state: a member that unpacks rank 0's state and then fails the sync
holds rank 0's lineage, and the steps it applied on its own lineage are discarded with the bytes
that carried them. Real processes in real gloo groups; rank 0 dies between the transfer and the
checksum round.

The interleaving this closes: a member applied step s alone (a last hop) in generation g; the
others redid s in g+1 and committed it; the member unpacks their state in g+2 and the sync fails;
had it kept g's label and its pending line, and become rank 0 of a later generation, its sync would
have confirmed s@g: step s committed in two generations."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path
from queue import Queue

import pytest

pytestmark = pytest.mark.timeout(120)

HELD_STEP, HELD_LINEAGE = 7, 5  # rank 0's state
OWN_STEP, OWN_LINEAGE = 6, 3  # the member's: step 6 applied in generation 3, not confirmed


class _Membership:
    """What the journal hands its progress records to: nothing here reads them."""

    def set_progress(self, payload: object) -> None:
        pass


def _state(seed: int, step: int):  # type: ignore[no-untyped-def]
    import torch

    from elasticd.worker.state.training import TrainingState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TrainingState(model, opt)
    model(torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))).sum().backward()
    opt.step()
    opt.zero_grad()
    state.counters.step = step
    return state


def _rank0(port_q: Queue[int]) -> None:
    """Sends its state, then dies before the checksum round (the sync's second all_reduce)."""
    from elasticd.log import configure_logging
    from elasticd.retry import Bound
    from elasticd.testing.groups import fixed_gloo_group
    from elasticd.worker.state import sync

    configure_logging(json=True, level=40)
    timeouts, _, group = fixed_gloo_group(0, 2, port_q)
    state = _state(seed=1, step=HELD_STEP)
    state.lineage = HELD_LINEAGE
    reduce, calls = sync._max_reduce, [0]

    def dies_at_the_checksum_round(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return reduce(*args, **kwargs)

    sync._max_reduce = dies_at_the_checksum_round
    sync.sync_state(group, state, Bound.after(60, poll_s=timeouts.abort_poll_s))


def _member(port_q: Queue[int], audit: str, res_q: Queue[dict[str, object]]) -> None:
    from elasticd.errors import CollectiveError
    from elasticd.log import configure_logging
    from elasticd.retry import Bound
    from elasticd.testing.groups import fixed_gloo_group
    from elasticd.worker.step.journal import Journal
    from elasticd.worker.data.sampler import Batch
    from elasticd.worker.state.sync import sync_state
    from elasticd.config import WorkerEnv
    from tests.fakes import FakeKeyValueStore, ManualClock

    configure_logging(json=True, level=40)
    store = FakeKeyValueStore(ManualClock())
    journal = Journal(WorkerEnv(), store, audit, False, 0.0)
    journal.open(_Membership(), store, "member", 0.0)  # type: ignore[arg-type]
    timeouts, _, group = fixed_gloo_group(1, 2, port_q)
    state = _state(seed=2, step=OWN_STEP - 1)
    state.lineage = OWN_LINEAGE
    state.counters.step = OWN_STEP  # it applied step 6 in generation 3; nothing confirmed it yet
    journal.committed(Batch(OWN_STEP, 0, 0, [0], 1, 2, 1), OWN_STEP, 1.0, OWN_LINEAGE, 2, 0.01)
    out: dict[str, object] = {}
    try:
        sync_state(group, state, Bound.after(30, poll_s=timeouts.abort_poll_s), discard=journal.discard)
        out["first"] = "completed"
    except CollectiveError as exc:
        out["first"] = type(exc).__name__
    out["after_failure"] = (state.counters.step, state.lineage)
    # It is rank 0 of the next generation, alone: its completed sync confirms what it holds pending.
    _, _, alone = fixed_gloo_group(0, 1, multiprocessing.get_context("spawn").Queue())
    sync_state(alone, state, Bound.after(30, poll_s=timeouts.abort_poll_s), discard=journal.discard)
    journal.confirm()
    journal.close(state.counters.step, state.checksum)
    res_q.put(out)
    res_q.close()
    res_q.join_thread()


def test_a_member_that_unpacked_rank_0s_state_and_failed_the_sync_never_confirms_its_own_branch(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    port_q: Queue[int] = ctx.Queue()
    res_q: Queue[dict[str, object]] = ctx.Queue()
    audit = tmp_path / "audit.jsonl"
    procs = [
        ctx.Process(target=_rank0, args=(port_q,), daemon=True),
        ctx.Process(target=_member, args=(port_q, str(audit), res_q), daemon=True),
    ]
    try:
        for p in procs:
            p.start()
        out = res_q.get(timeout=90)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    assert out["first"] == "CollectiveError", out  # rank 0 died after the transfer
    assert tuple(out["after_failure"]) == (HELD_STEP, HELD_LINEAGE), out  # type: ignore[arg-type]
    rows = [json.loads(line) for line in audit.read_text().splitlines()]
    commits = [r for r in rows if r["event"] == "commit"]
    assert commits == [], commits  # step 6 of generation 3 was never the job's commit here
    assert rows[-1]["event"] == "final" and rows[-1]["step"] == HELD_STEP
