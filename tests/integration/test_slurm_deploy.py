"""The Slurm recipe (deploy/slurm/elasticd.sbatch) on a real Slurm: a private munged, slurmctld,
and four slurmd nodes, each in a network namespace of its own (``testing.slurmcluster``).

One ``sbatch`` of the recipe trains the default workload across three Slurm nodes; a second
``sbatch`` joining the same job (``ELASTICD_SLURM_JOIN``) adds a fourth; then one node of the first
allocation is lost with everything on it (SIGKILL to its slurmd, slurmstepd, agent and workers).
The job goes on at three workers and finishes there; both Slurm jobs end, and the audit is clean:
every step committed exactly once, every sample of an epoch used once, identical final state.

The etcd is the test's own, on the bridge (the recipe's ``ELASTICD_ETCD_ENDPOINTS``). Needs root,
network namespaces and Debian's slurmctld, slurmd and munge (``.ci/bootstrap`` installs them);
skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticd.chaos.netns import unusable_here
from elasticd.testing.audit import check_dir
from elasticd.testing.etcd import EtcdServer
from elasticd.testing.localcluster import REPO_ROOT
from elasticd.testing.slurmcluster import SLURMD_TIMEOUT_S, SlurmCluster, missing_binaries, slurm_unusable
from tests.jobs import wait_until

pytestmark = pytest.mark.timeout(400)

RECIPE = REPO_ROOT / "deploy" / "slurm" / "elasticd.sbatch"
NODES = ("node0", "node1", "node2", "node3")
STEPS = 600  # the loss must come 200 or more steps before the end (asserted below)
SAMPLES = 2048  # the workload's default dataset size
LOST = "node2"  # a node of the first allocation, not its batch host (node0)
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _why_not() -> str:
    return slurm_unusable(os.geteuid(), missing_binaries(), unusable_here(os.getpid()) if os.geteuid() == 0 else "")


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmCluster]:
    why = _why_not()
    if why:
        pytest.skip(f"no Slurm cluster here: {why}")
    cluster = SlurmCluster(tmp_path / "slurm", NODES, say=lambda line: print(line, flush=True))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _agent_wrapper(path: Path) -> Path:
    """An ``elasticd`` executable running this checkout's agent under this interpreter."""
    path.write_text(
        "#!/bin/sh\n"
        f"exec {sys.executable} -c 'import sys; from elasticd.cli import agent_main; sys.exit(agent_main())' \"$@\"\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _commits(audit_dir: Path) -> list[dict[str, object]]:
    rows = []
    for p in audit_dir.glob("*.jsonl"):
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # the last line of a killed worker may be cut short
            if rec.get("event") == "commit":
                rows.append(rec | {"file": p.name})
    return rows


def _at_world(audit_dir: Path, world: int, after: int = 0) -> int:
    """Steps committed at ``world`` workers past step ``after`` (counted once, by rank 0's file)."""
    return len({r["step"] for r in _commits(audit_dir) if r["world_size"] == world and int(r["step"]) > after})


def _last_step(audit_dir: Path) -> int:
    return max((int(r["step"]) for r in _commits(audit_dir)), default=0)


def test_sbatch_trains_across_nodes_a_join_adds_one_and_a_lost_node_leaves_the_rest_to_finish(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    etcd = EtcdServer(host=slurm.bridge_addr).start()
    try:
        _run_job(slurm, etcd, tmp_path)
    finally:
        etcd.stop()


def _run_job(slurm: SlurmCluster, etcd: EtcdServer, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    audit_root = tmp_path / "audit"
    env = {
        "ELASTICD_SLURM_AGENT": str(_agent_wrapper(tmp_path / "elasticd")),
        "ELASTICD_ETCD_ENDPOINTS": etcd.endpoint,
        "ELASTICD_AUDIT_DIR": str(audit_root),
        "ELASTICD_LEASE_TTL_S": "3",
        "ELASTICD_KEEPALIVE_S": "1",
        "PYTHONPATH": str(REPO_ROOT),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }
    program = [sys.executable, str(REPO_ROOT / "agents" / "mlp.py"), "--steps", str(STEPS), "--step-sleep", "0.03"]
    first = slurm.sbatch(
        ["--nodes=3", f"--nodelist={','.join(NODES[:3])}", f"--chdir={work}"], RECIPE, program, env, work
    )
    audit = audit_root / f"slurm-{first}"

    def outputs() -> str:
        """The batch jobs' output and slurmctld's log, for a failed wait."""
        out = [
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:]) for p in work.glob("*.out")
        ]
        return "\n".join(out) + slurm.log_tail("slurmctld", 10)

    wait_until(lambda: _at_world(audit, 3) >= 10, 120, "the first allocation to train at 3 workers", outputs)
    assert sorted(slurm.job_nodes(first)) == list(NODES[:3])

    second = slurm.sbatch(
        ["--nodes=1", f"--nodelist={NODES[3]}", f"--chdir={work}"],
        RECIPE,
        program,
        env | {"ELASTICD_SLURM_JOIN": str(first)},
        work,
    )
    wait_until(lambda: _at_world(audit, 4) >= 10, 120, "the joining allocation's node to train with them", outputs)

    at_loss = _last_step(audit)
    assert at_loss < STEPS - 200, f"the job is at step {at_loss} of {STEPS} before the loss: too little left to show"
    killed = slurm.lose_node(LOST)
    assert killed, f"no process on {LOST}"
    # what the lost node committed before its processes died (some steps past at_loss, read a moment
    # before the loss, may be among them)
    lost_last = max((int(r["step"]) for r in _commits(audit) if r["file"].startswith(LOST)), default=0)
    wait_until(lambda: _at_world(audit, 3, after=at_loss) >= 20, 120, "the job to go on at 3 workers", outputs)

    wait_until(
        lambda: slurm.job_state(first) in DONE and slurm.job_state(second) in DONE,
        180 + 3 * SLURMD_TIMEOUT_S,
        "both Slurm jobs to end",
        outputs,
    )
    report = check_dir(audit, SAMPLES)
    assert report.ok, report.violations
    assert report.last_step == STEPS, outputs()
    assert report.step_world[STEPS] == 3
    assert set(report.step_world.values()) >= {3, 4}
    assert not any(int(r["step"]) > lost_last and r["file"].startswith(LOST) for r in _commits(audit))
    # --no-kill: the lost node left the first allocation, which went on and ended well.
    assert slurm.job_state(first) == "COMPLETED", outputs()
    assert slurm.job_state(second) == "COMPLETED", outputs()
    assert slurm.node_states()[LOST].startswith("down"), slurm.node_states()
    assert (work / f"elasticd-slurm-{first}.env").exists()  # the state file the join read, in the submit dir
