"""The Slurm recipe's text (deploy/slurm/elasticd.sbatch) and the test cluster's pure parts
(elasticd/testing/slurmcluster.py). The recipe itself runs on a real Slurm in
tests/integration/test_slurm_deploy.py."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from elasticd.settings import AGENT_SETTINGS
from elasticd.testing.slurmcluster import SlurmNode, sbatch_job_id, slurm_conf, slurm_unusable

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "deploy" / "slurm" / "elasticd.sbatch"
DOC = ROOT / "docs" / "deploy-slurm.md"


def test_the_recipe_is_valid_bash() -> None:
    bash = shutil.which("bash")
    assert bash is not None
    done = subprocess.run([bash, "-n", str(RECIPE)], capture_output=True, text=True, timeout=10, check=False)
    assert done.returncode == 0, done.stderr


def test_the_recipe_asks_slurm_not_to_end_the_job_on_a_lost_node() -> None:
    text = RECIPE.read_text()
    assert "#SBATCH --no-kill" in text
    sruns = [line for line in text.splitlines() if line.lstrip().startswith("srun ")]
    assert len(sruns) == 2  # etcd's step and the agents'
    assert all("--no-kill" in s and "--kill-on-bad-exit=0" in s for s in sruns)


def test_every_setting_the_recipe_reads_is_in_its_header_and_the_doc_table() -> None:
    text, doc = RECIPE.read_text(), DOC.read_text()
    header = text.split("set -euo pipefail", 1)[0]
    own = set(re.findall(r"\bELASTICD_SLURM_[A-Z_]+\b", text)) - {
        "ELASTICD_SLURM_ETCD_CLUSTER"
    }  # passed to the etcd step
    assert own
    for name in sorted(own):
        assert name in header, f"{name} is read by the recipe but not described in its header"
        assert f"| `{name}` |" in doc, f"{name} is not in the settings table of docs/deploy-slurm.md"


def test_every_agent_variable_the_recipe_names_is_a_setting() -> None:
    text = RECIPE.read_text()
    named = set(re.findall(r"\bELASTICD_([A-Z_]+)\b", text))
    agent = {n for n in named if not n.startswith("SLURM_")}
    assert agent >= {"JOB_ID", "ETCD_ENDPOINTS", "NODE_ID", "ADVERTISE_ADDR"}
    variables = {s.variable for s in AGENT_SETTINGS.values()}
    assert {f"ELASTICD_{n}" for n in agent} <= variables


@pytest.mark.parametrize(
    ("euid", "missing", "netns_error", "want"),
    [
        (0, [], "", ""),
        (0, ["slurmd", "munged"], "", "no slurmd, munged (apt-get install slurmctld slurmd munge"),
        (1000, [], "", "not root"),
        (0, [], "RTNETLINK answers: Operation not permitted", "no network namespaces: RTNETLINK"),
        (1000, ["sbatch"], "", "no sbatch"),  # the missing packages are named first
    ],
)
def test_why_a_slurm_cluster_cannot_be_made(euid: int, missing: list[str], netns_error: str, want: str) -> None:
    got = slurm_unusable(euid, missing, netns_error)
    assert got.startswith(want) if want else got == ""


@pytest.mark.parametrize(("out", "want"), [("42\n", 42), ("7;cluster\n", 7)])
def test_sbatch_job_id(out: str, want: int) -> None:
    assert sbatch_job_id(out) == want


def test_sbatch_job_id_refuses_an_answer_without_one() -> None:
    with pytest.raises(ValueError, match="no job id"):
        sbatch_job_id("sbatch: error: Batch job submission failed")


def test_the_cluster_config_keeps_every_path_private_and_gives_each_node_its_address(tmp_path: Path) -> None:
    nodes = [SlurmNode("node0", "10.213.5.10", "ns0"), SlurmNode("node1", "10.213.5.11", "ns1")]
    sock = tmp_path / "munge" / "munge.socket"
    conf = slurm_conf(tmp_path, "vm", "10.213.5.1", 6817, 6818, sock, nodes)
    keys = dict(line.split("=", 1) for line in conf.splitlines() if not line.startswith(("NodeName", "PartitionName")))
    for key in ("StateSaveLocation", "SlurmdSpoolDir", "SlurmctldPidFile", "SlurmdPidFile", "SlurmctldLogFile"):
        assert keys[key].startswith(str(tmp_path)), key
    assert keys["AuthInfo"] == f"socket={sock}"
    assert keys["SlurmctldHost"] == "vm(10.213.5.1)"
    assert "%n" in keys["SlurmdSpoolDir"]  # one spool directory per slurmd
    assert "NodeName=node1 NodeAddr=10.213.5.11 NodeHostname=vm" in conf
    assert keys["ProctrackType"] == "proctrack/pgid"
