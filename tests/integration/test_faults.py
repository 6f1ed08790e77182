"""Faults done for real: SIGKILL, SIGSTOP, joins, against a real etcd and real gloo workers."""

from __future__ import annotations

import signal

import pytest

pytestmark = pytest.mark.timeout(180)

SLOW = ("--step-sleep", "0.02")


def test_sigkill_mid_step_survivors_finish_at_world_2(local_job):
    job = local_job(min_workers=2)
    for _ in range(3):
        job.spawn("--steps", "150", *SLOW)
    job.wait_for(lambda: job.committed() >= 30, 60, "30 committed steps")
    job.workers[2].signal(signal.SIGKILL)
    codes = job.wait_all(120)
    assert codes[:2] == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == 150
    assert rep.step_world[rep.last_step] == 2
    assert sorted(set(rep.generations.values()))[:1] == [2]
