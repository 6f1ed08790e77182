"""``elasticctl status`` against a real etcd and a real running job, run as a user runs it.

Every command is a fresh interpreter (``python -m elasticd.cli``) with no ``ELASTICD_*`` variables
but the ones a test sets. Command-line errors and ``elasticd`` are checked in-process: they stop
before any logging is configured or etcd is contacted.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from elasticd.cli import agent_main, ctl_main
from elasticd.ops.status import WorkerState, read_status
from elasticd.store.etcd import EtcdClient
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import REPO_ROOT, free_port
from elasticd.wire.keys import Keys

pytestmark = pytest.mark.timeout(180)

# Long enough that the job is still running after every command below (each starts a Python
# interpreter); the workers are killed when the test ends.
WORKLOAD = ("--steps", "3000", "--step-sleep", "0.02")
CLI_TIMEOUT_S = 60


def elasticctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICD_")}
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "elasticd.cli", *args],
        cwd=REPO_ROOT,
        env=clean,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )


@pytest.fixture
def running_job(local_job: Any, client: EtcdClient) -> Any:
    """Two workers of agents/mlp.py in one generation, each with a published progress record."""
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn(*WORKLOAD)
    keys = Keys("/elasticd", job.job_id)

    def training_with_progress() -> bool:
        st = read_status(client, keys, now=0.0)
        return (
            st.generation is not None
            and st.generation.world_size == 2
            and len(st.members) == 2
            and all(m.state is WorkerState.TRAINING and m.committed_step for m in st.members)
        )

    job.wait_for(training_with_progress, 90, "a generation of 2 whose members published progress")
    return job


def test_status_json_lists_every_member_and_the_exit_code_follows_health(
    running_job: Any, etcd_server: EtcdServer
) -> None:
    job = running_job
    base = ["--etcd", etcd_server.endpoint, "status", "--job", job.job_id, "--json"]

    proc = elasticctl(*base, "--min-workers", "2", "--max-workers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert (data["job"], data["health"], data["exit_code"]) == (job.job_id, "healthy", 0), data
    gen = data["generation"]
    assert gen["world_size"] == 2 and gen["number"] >= 1
    members = data["members"]
    assert [m["member_id"] for m in members] == gen["members"]
    assert [m["rank"] for m in members] == [0, 1]
    assert sorted(m["pid"] for m in members) == sorted(w.pid for w in job.workers)
    assert sorted(m["local_rank"] for m in members) == [0, 1]
    for m in members:
        assert m["node"] == "testnode" and m["host"] and m["state"] == "training", m
        assert isinstance(m["committed_step"], int) and m["committed_step"] >= 1, m
        assert m["step_time_s"] is None or m["step_time_s"] > 0, m
        assert isinstance(m["recoveries"], int) and m["recoveries"] >= 0, m  # the first join is not a recovery
        assert isinstance(m["heartbeat_age_s"], float) and m["heartbeat_age_s"] < 30, m
    assert data["missing"] == [] and data["malformed"] == [] and data["finished"] is None

    # Below max_workers: degraded, exit 1. Endpoint and job come from the environment this time.
    proc = elasticctl(
        "status",
        "--json",
        "--max-workers",
        "3",
        env={"ELASTICD_ETCD_ENDPOINTS": etcd_server.endpoint, "ELASTICD_JOB_ID": job.job_id},
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert (data["health"], data["max_workers"]) == ("degraded", 3)
    assert len(data["members"]) == 2

    # The table, without bounds: every live member is in the generation, so healthy.
    proc = elasticctl("--etcd", etcd_server.endpoint, "status", "--job", job.job_id)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "HEALTHY: all 2 live members are in generation" in proc.stdout
    assert all(m["member_id"] in proc.stdout for m in members)
    assert "MEMBER" in proc.stdout and "training" in proc.stdout


def test_garbage_in_etcd_is_listed_as_malformed_and_status_still_answers(
    running_job: Any, etcd_server: EtcdServer, client: EtcdClient
) -> None:
    job = running_job
    keys = Keys("/elasticd", job.job_id)
    client.put(keys.member("garbage"), b"not json")
    client.put(keys.progress("garbage"), b"\xff\xfe")
    client.put(f"{keys.job}/other/x", b"keys it does not know are not listed")
    client.put(keys.event("x"), b"an event that does not parse is listed")
    client.put(keys.node("y"), b"[1, 2]")
    proc = elasticctl("--etcd", etcd_server.endpoint, "status", "--job", job.job_id, "--json", "--max-workers", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["health"] == "healthy" and len(data["members"]) == 2
    bad = sorted(s.split(": ", 1)[0] for s in data["malformed"])
    assert bad == sorted([keys.member("garbage"), keys.progress("garbage"), keys.event("x"), keys.node("y")]), data[
        "malformed"
    ]

    proc = elasticctl("--etcd", etcd_server.endpoint, "status", "--job", job.job_id)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "malformed records (4, ignored):" in proc.stdout and keys.member("garbage") in proc.stdout


def test_watch_prints_one_json_line_per_frame(running_job: Any, etcd_server: EtcdServer) -> None:
    proc = elasticctl(
        "--etcd",
        etcd_server.endpoint,
        "status",
        "--job",
        running_job.job_id,
        "--json",
        "--watch",
        "--interval",
        "0.2",
        "--count",
        "3",
        "--max-workers",
        "3",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    frames = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(frames) == 3 and all(f["health"] == "degraded" for f in frames)


def test_no_such_job_is_down(etcd_server: EtcdServer) -> None:
    proc = elasticctl("--etcd", etcd_server.endpoint, "status", "--job", "nosuchjob", "--json")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    data = json.loads(proc.stdout)
    assert data["health"] == "down" and "no such job" in data["reason"] and data["members"] == []


def test_a_dead_endpoint_before_a_live_one_fails_over(etcd_server: EtcdServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    proc = elasticctl("--etcd", f"{dead},{etcd_server.endpoint}", "status", "--job", "nosuchjob")
    assert proc.returncode == 2 and "no such job" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stderr == ""


def test_unreachable_etcd_exits_2_with_one_clear_line() -> None:
    dead = f"127.0.0.1:{free_port()}"
    proc = elasticctl("--etcd", dead, "status", "--job", "j", "--json")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"elasticctl: etcd at {dead} did not answer"), proc.stderr
    assert "ELASTICD_ETCD_ENDPOINTS" in proc.stderr


def test_a_bad_variable_is_named_when_a_flag_falls_back_on_the_environment() -> None:
    proc = elasticctl("status", env={"ELASTICD_ETCD_ENDPOINTS": "no-port-here"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("elasticctl: etcd_endpoints: expected host:port"), proc.stderr


# -- in-process: argparse errors and the agent stub (nothing is configured or contacted) ----------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required: COMMAND"),
        (["--etcd", "no-port", "status"], "argument --etcd: etcd_endpoints: expected host:port"),
        (["--etcd", ",", "status"], "argument --etcd: expected host:port"),
        (["--prefix", "elasticd/", "status"], "argument --prefix: etcd_prefix"),
        (["status", "--job", "a/b"], "argument --job: job_id"),
        (["status", "--interval", "0"], "argument --interval: expected a positive number"),
        (["status", "--interval", "nan"], "argument --interval: expected a positive number"),
        (["status", "--max-workers", "0"], "argument --max-workers: expected an integer >= 1"),
        (["status", "--min-workers", "3", "--max-workers", "2"], "--min-workers (3) must be <= --max-workers (2)"),
        (["status", "--count", "2"], "--count only applies with --watch"),
        (["status", "--stall-after-s", "-1"], "argument --stall-after-s: expected a number of seconds >= 0"),
        (["status", "--stall-after-s", "inf"], "argument --stall-after-s: expected a number of seconds >= 0"),
        (["status", "--bogus"], "unrecognized arguments: --bogus"),
        (["drain"], "required: NODE"),
        (["drain", "a/b"], "argument NODE: node_id: must be 1 to 128 of the characters"),
        (["drain", "a", "--timeout", "5"], "--timeout only applies with --wait"),
        (["drain", "a", "--wait", "--timeout", "-1"], "argument --timeout: expected a positive number"),
        (["events", "--limit", "0"], "argument --limit: expected an integer >= 1"),
    ],
)
def test_bad_command_lines_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        ctl_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: elasticctl" in err and message in err, err


def test_elasticd_agent_without_a_program_exits_2_naming_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    err = io.StringIO()
    assert agent_main([], stderr=err) == 2
    assert err.getvalue().startswith("elasticd: program: no training program given")
    with pytest.raises(SystemExit) as info:
        agent_main(["--node", "x"])  # no abbreviations: --node is not --node-id
    assert info.value.code == 2
    assert "unrecognized arguments: --node" in capsys.readouterr().err
