"""Faults done for real: SIGKILL, SIGSTOP, joins, against a real etcd and real gloo workers."""

from __future__ import annotations

import signal
import time

import pytest

pytestmark = pytest.mark.timeout(180)

SLOW = ("--step-sleep", "0.02")


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
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


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_fourth_worker_joins_mid_run_and_gets_rank0_state(local_job):
    job = local_job(min_workers=3)
    for _ in range(3):
        job.spawn("--steps", "400", *SLOW)
    job.wait_for(lambda: job.committed() >= 40, 60, "40 committed steps")
    joiner = job.spawn("--steps", "400", *SLOW)
    codes = job.wait_all(120)
    assert codes == [0, 0, 0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == 400
    assert 4 in rep.generations.values(), rep.generations
    assert rep.step_world[400] == 4
    assert "transferred_bytes" in joiner.log_text()
    # the joiner's own sync line shows it received bytes, and its checksum equals the others'
    # (checked for every generation by audit.check); its final parameters equal the others' too
    assert len(set(rep.final_checksums)) == 1 and len(rep.final_checksums) == 4


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_sigstop_peer_is_dropped_after_lease_expiry_and_rejoins_on_resume(local_job):
    # collective_s bounds how long a group stuck on the frozen peer lingers (and so the exit)
    job = local_job(min_workers=2, collective_s=5)
    for _ in range(3):
        job.spawn("--steps", "200", *SLOW)
    job.wait_for(lambda: job.committed() >= 30, 60, "30 committed steps")
    frozen = job.workers[1]
    frozen.signal(signal.SIGSTOP)
    at_stop = job.committed()
    # the others go on once the frozen member's lease (2 s) expires
    job.wait_for(lambda: job.committed() >= at_stop + 20, 30, "survivors to go on without the frozen peer")
    frozen.signal(signal.SIGCONT)
    codes = job.wait_all(120)
    assert codes == [0, 0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == 200
    log = frozen.log_text()
    assert log.count('"member_registered"') >= 2, log[-3000:]  # its lease expired; it came back anew
    assert rep.step_world[200] == 3  # it rejoined as a newcomer
    assert len(set(rep.final_checksums)) == 1 and len(rep.final_checksums) == 3


def test_fds_and_threads_stay_bounded_over_50_generation_changes(local_job):
    job = local_job(min_workers=1, join_window_s=0.05)
    survivor = job.spawn("--steps", "1000000", "--step-sleep", "0.005")
    job.wait_for(lambda: job.committed() >= 5, 60, "the survivor to train")
    churn = job.spawn("--cycles", "26", "--audit-dir", str(job.dir), program="tests/programs/churn.py", audit=False)
    assert churn.wait(150) == 0, job.logs_tail()
    survivor.stop()
    syncs = [
        r
        for r in __import__("elasticd.testing.audit", fromlist=["x"]).read_lines([job.dir / "audit0.jsonl"])
        if r["event"] == "sync"
    ]
    assert len(syncs) >= 50, len(syncs)
    early, late = syncs[5], syncs[-1]
    assert late["fds"] <= early["fds"] + 4, (early, late)
    assert late["threads"] <= early["threads"] + 4, (early, late)
    rep = job.audit()
    assert rep.ok, rep.violations


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_etcd_restart_and_freezes_are_ridden_out(local_job, etcd_server):
    """etcd is off the hot path. A restart (keys and leases survive on disk) and a freeze shorter
    than lease_ttl_s - keepalive_s do not stop training. A freeze longer than the lease TTL pauses
    commits (no member can prove its membership then: commit fencing), and training resumes once
    etcd answers, losing and repeating nothing."""
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn("--steps", "400", *SLOW)
    job.wait_for(lambda: job.committed() >= 30, 60, "30 committed steps")
    etcd_server.restart()
    job.wait_for(lambda: job.committed() >= 80, 60, "training to go on after the etcd restart")
    steady = job.committed() + 40  # renewals back on their cadence before the next fault
    job.wait_for(lambda: job.committed() >= steady, 60, "steady training")

    before = job.committed()
    etcd_server.signal(signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 1.0  # inside the fencing window of 2 - 0.5 s
        while time.monotonic() < deadline and job.committed() == before:
            time.sleep(0.02)
        assert job.committed() > before, "no commit while etcd was briefly frozen"
    finally:
        etcd_server.signal(signal.SIGCONT)

    at = job.committed()
    etcd_server.signal(signal.SIGSTOP)
    try:
        stop = time.monotonic() + 5.0  # longer than the 2 s lease
        while time.monotonic() < stop:
            time.sleep(0.1)
    finally:
        etcd_server.signal(signal.SIGCONT)
    job.wait_for(lambda: job.committed() >= at + 20, 60, "training to resume after a long etcd freeze")
    codes = job.wait_all(120)
    assert codes == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == 400


def test_garbage_written_into_etcd_is_reported_and_the_job_goes_on(local_job, etcd_server):
    from elasticd.config import EtcdConfig, RetryPolicy, Timeouts
    from elasticd.store.etcd import EtcdClient

    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn("--steps", "200", *SLOW)
    job.wait_for(lambda: job.committed() >= 30, 60, "30 committed steps")
    client = EtcdClient(EtcdConfig(endpoints=(etcd_server.endpoint,)), Timeouts(), RetryPolicy())
    prefix = f"/elasticd/{job.job_id}"
    for key, value in [
        ("members/garbage", b"not json"),
        ("ready/x", b'{"member_id": 5}'),
        ("abort", b"\xff\xfe"),
        ("generation", b"[[[["),
    ]:
        client.put(f"{prefix}/{key}", value)
    codes = job.wait_all(120)
    assert codes == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert rep.last_step == 200
    assert "malformed_record_ignored" in job.workers[0].log_text()


def test_an_etcd_outage_without_a_membership_change_does_not_stop_training(local_job, etcd_server):
    """With no membership change the data plane does not need etcd: through an outage
    of several lease TTLs (etcd SIGKILLed, restarted on the same data dir), training goes on, no
    worker exits, nothing regroups, and when etcd is back the leases are renewed in place."""
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn("--steps", "100000", *SLOW)
    job.wait_for(lambda: job.committed() >= 30, 60, "30 committed steps")
    etcd_server.kill()
    try:
        at_kill = job.committed()
        job.wait_for(lambda: job.committed() >= at_kill + 100, 60, "commits during the etcd outage")
        outage_end = time.monotonic() + 8.0  # 4 lease TTLs in all, then etcd comes back
        while time.monotonic() < outage_end:
            assert all(w.alive() for w in job.workers), job.logs_tail()
            time.sleep(0.1)
        during = job.committed() - at_kill
    finally:
        etcd_server.start()
    after_restart = job.committed()
    job.wait_for(lambda: job.committed() >= after_restart + 100, 60, "training after etcd returned")
    for w in job.workers:
        w.signal(signal.SIGTERM)  # drain: finish the step and leave
    codes = job.wait_all(60)
    assert codes == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert during >= 100, during
    assert list(rep.generations) == [1], rep.generations  # no regroup: one generation throughout
    for w in job.workers:
        text = w.log_text()
        assert '"step_failed"' not in text, text[-3000:]
        assert "etcd_unreachable" in text and "etcd_reachable_again" in text, text[-3000:]


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_a_standby_beyond_max_workers_waits_without_forcing_generations(local_job):
    """A worker started while the job is at max_workers does not make every step vote a regroup (a
    new generation every few steps): it waits as a standby; when a member dies it takes its place."""
    job = local_job(min_workers=1, max_workers=2)
    for _ in range(2):
        job.spawn("--steps", "100000", *SLOW)
    job.wait_for(lambda: job.committed() >= 20, 60, "the job at max_workers")
    standby = job.spawn("--steps", "100000", *SLOW)
    job.wait_for(lambda: "standby_waiting" in standby.log_text(), 30, "the standby to wait")
    before = set(job.audit().generations)
    at = job.committed()
    job.wait_for(lambda: job.committed() >= at + 150, 60, "training with a standby waiting")
    rep = job.audit()
    assert rep.ok, rep.violations
    assert set(rep.generations) == before, (before, rep.generations)  # no generation forced by the standby
    assert job.committed(2) == 0  # the standby committed nothing
    job.workers[0].signal(signal.SIGKILL)  # a member dies: the standby takes its place
    job.wait_for(lambda: job.committed(2) > 0, 60, "the standby to be admitted")
    for w in job.workers[1:]:
        w.signal(signal.SIGTERM)
    codes = job.wait_all(60)
    assert codes[1:] == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert len(rep.generations) <= 3, rep.generations


@pytest.mark.soak  # its behaviour is also in the default suite: docs/testing.md#soak-tests
def test_etcd_restarts_mixed_with_worker_kills_repeat_no_step(local_job, etcd_server):
    """A mix that can commit a step twice: etcd SIGKILLed and restarted, and a worker
    SIGKILLed right after, again and again, with replacements joining. Every step is committed
    in exactly one generation, by every member of it (the audit checks both)."""
    job = local_job(min_workers=2)
    for _ in range(3):
        job.spawn("--steps", "100000", *SLOW)
    job.wait_for(lambda: job.committed() >= 30, 60, "30 committed steps")
    for round_ in range(3):
        etcd_server.kill()
        time.sleep(0.5 + 0.5 * round_)
        etcd_server.start()
        time.sleep(0.2 * round_)
        victim = next(w for w in job.workers if w.alive())
        victim.signal(signal.SIGKILL)
        job.spawn("--steps", "100000", *SLOW)
        at = job.committed()
        job.wait_for(lambda: job.committed() >= at + 40, 90, f"training after round {round_}")
    for w in job.workers:
        if w.alive():
            w.signal(signal.SIGTERM)
    job.wait_all(60)
    rep = job.audit()
    assert rep.ok, rep.violations
