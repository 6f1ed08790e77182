"""The recovery benchmark's transfer phase runs end to end on a small state: sync, raw broadcast and
raw send are each timed every round, on the same bytes, with no error."""

from __future__ import annotations

import pytest

from elasticd.bench.recovery import RecoverySettings, run_transfer

pytestmark = pytest.mark.timeout(120)


def test_transfer_phase_times_sync_broadcast_and_send_of_the_same_bytes() -> None:
    result = run_transfer(RecoverySettings(transfer_hidden=256, transfer_rounds=2))
    assert result.error is None, result.error
    assert result.bytes > 0
    assert len(result.sync_s) == len(result.raw_s) == len(result.send_s) == 2
    assert all(x > 0 for x in result.sync_s + result.raw_s + result.send_s)
