"""Bad input gets one clear error, and a running job is not disturbed."""

from __future__ import annotations

import signal

import pytest

from elasticd.testing.localcluster import free_port

pytestmark = pytest.mark.timeout(120)


def test_unreachable_etcd_at_start_fails_clearly_after_etcd_outage_s(local_job):
    """A worker that starts while etcd is down waits for it (a restarted worker during an outage
    must not burn its agent's restart budget), up to etcd_outage_s; then it fails clearly."""
    job = local_job()
    job.etcd_endpoint_override = f"127.0.0.1:{free_port()}"
    w = job.spawn("--steps", "5", etcd_endpoints=job.etcd_endpoint_override, etcd_attempts=3, etcd_outage_s=3)
    assert w.wait(60) == 2, w.log_text()[-2000:]
    text = w.log_text()
    assert "EtcdUnavailable" in text and job.etcd_endpoint_override in text and "3 attempts" in text, text[-2000:]
    assert "register_waiting_for_etcd" in text, text[-2000:]


INVALID = [  # (setting, value, what the error names)
    ("lease_ttl_s", "abc", "ELASTICD_LEASE_TTL_S"),
    ("min_workers", "5", "min_workers"),
    ("etcd_endpoints", "no-port-here", "etcd_endpoints"),
    ("keepalive_s", "9", "keepalive_s"),
]


def test_invalid_settings_name_the_setting(local_job):
    """One worker per invalid setting, started together: each exits 2 with a ConfigError naming it."""
    job = local_job(max_workers=4)
    workers = [job.spawn("--steps", "5", **{setting: value}) for setting, value, _ in INVALID]
    for (setting, value, named), w in zip(INVALID, workers, strict=True):
        assert w.wait(90) == 2, f"{setting}={value}\n{w.log_text()[-2000:]}"
        assert "ConfigError" in w.log_text() and named in w.log_text(), f"{setting}={value}\n{w.log_text()[-2000:]}"


def test_worker_with_a_different_model_is_rejected_and_the_job_goes_on(local_job):
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn("--steps", "1000000", "--step-sleep", "0.02")
    job.wait_for(lambda: job.committed() >= 20, 60, "20 committed steps")
    bad = job.spawn("--steps", "1000000", "--hidden", "64", audit=False)
    assert bad.wait(60) == 2, bad.log_text()[-2000:]
    assert "ModelMismatch" in bad.log_text(), bad.log_text()[-2000:]
    at = job.committed()
    job.wait_for(lambda: job.committed() >= at + 20, 30, "the job to go on after the rejection")
    for w in job.workers[:2]:
        w.signal(signal.SIGTERM)  # drain: finish the current step, leave
    codes = [w.wait(60) for w in job.workers[:2]]
    assert codes == [0, 0], job.logs_tail()
    rep = job.audit()
    assert rep.ok, rep.violations
    assert set(rep.generations.values()) == {2}  # the bad worker never entered a generation
