"""The Kubernetes deployment (deploy/kubernetes/): the Helm chart rendered by Helm's own engine
(helm-python-sdk, Helm's Go SDK in a shared library: no helm binary), every rendered manifest
validated against the Kubernetes schema (kubernetes-validate, strict: unknown fields are errors)
for the oldest and the newest Kubernetes version the chart supports, the committed plain manifests
equal to the chart rendered with its default values, the agent's environment accepted by the
agent's own settings loader, the readiness probe run against real `elasticctl status --json`
output, and every value of the chart documented.

Regenerate the plain manifests after a change to the chart:
    PYTHONPATH=. python tests/unit/test_kubernetes_deploy.py
"""

from __future__ import annotations

import copy
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run as a script: the repository's packages

from elasticd.ops.render import render_json  # noqa: E402
from elasticd.settings import AGENT_SETTINGS, load_agent_config  # noqa: E402
from tests.unit.test_status import KEYS, Job, encode, member, progress, status_of  # noqa: E402

pytestmark = pytest.mark.timeout(120)

CHART = ROOT / "deploy" / "kubernetes" / "chart" / "elasticd"
MANIFESTS = ROOT / "deploy" / "kubernetes" / "manifests"
DOC = ROOT / "docs" / "deploy-kubernetes.md"
UNIT = ROOT / "systemd" / "elasticd.service"
RELEASE = "elasticd"  # the release name the plain manifests are rendered with
# The oldest Kubernetes the chart supports (Chart.yaml's kubeVersion) and the newest schema at hand.
KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")
# Each template of the chart and the plain manifest it becomes.
PLAIN = {"etcd.yaml": "etcd.yaml", "job.yaml": "job.yaml"}
HEADER = (
    "# Rendered from deploy/kubernetes/chart/elasticd with its default values (release {release}).\n"
    "# Do not edit: change the chart, then run: PYTHONPATH=. python tests/unit/test_kubernetes_deploy.py\n"
)

# Values that reach every branch of the templates: the defaults, an external etcd with mutual TLS
# and no auth, a CPU job with checkpoints and extra settings, and etcd alone.
VALUE_SETS: Mapping[str, dict[str, object]] = {
    "defaults": {},
    "external-etcd-tls": {
        "etcd": {
            "deploy": False,
            "endpoints": ["https://etcd-a.example:2379", "https://etcd-b.example:2379"],
            "auth": {"enabled": False},
            "tls": {"secretName": "etcd-client-tls"},
        }
    },
    "cpu-checkpoints-settings": {
        "resources": {"gpus": 0},
        "job": {"workersPerPod": 2, "nodes": 4},
        "checkpoints": {"claimName": "elasticd-checkpoints"},
        "settings": {"lease_ttl_s": 5.0, "backend": "gloo", "spares_per_node": 1, "relay": True},
    },
    "etcd-only": {"job": {"enabled": False}},
}


def render(values: Mapping[str, object] | None = None, release: str = RELEASE) -> dict[str, str]:
    """The chart's templates rendered by Helm: template file name -> its text (empty ones left out)."""
    with helm.Chart.load(CHART) as chart:
        out = chart.render(dict(values or {}), name=release, namespace="default")
    return {Path(path).name: text for path, text in out.items() if text.strip()}


def documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def rendered_documents(values: Mapping[str, object]) -> list[dict]:
    return [d for text in render(values).values() for d in documents(text)]


def plain_manifests() -> dict[str, str]:
    """The plain manifests as they must be: file name -> text."""
    rendered = render()
    return {PLAIN[name]: HEADER.format(release=RELEASE) + text.lstrip("\n") for name, text in rendered.items()}


def the_job(values: Mapping[str, object]) -> dict:
    (job,) = [d for d in rendered_documents(values) if d["kind"] == "Job"]
    return job


def agent_container(values: Mapping[str, object]) -> dict:
    (container,) = the_job(values)["spec"]["template"]["spec"]["containers"]
    return container


# -- the plain manifests ------------------------------------------------------------------------


def test_the_plain_manifests_are_the_chart_rendered_with_its_default_values() -> None:
    want = plain_manifests()
    have = {p.name: p.read_text() for p in sorted(MANIFESTS.glob("*.yaml"))}
    assert sorted(have) == sorted(want), f"{MANIFESTS.relative_to(ROOT)} holds {sorted(have)}, not {sorted(want)}"
    drifted = [name for name in want if have[name] != want[name]]
    assert not drifted, f"{drifted} differ from the chart's rendering: run PYTHONPATH=. python {__file__}"


# -- the schema ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("case", sorted(VALUE_SETS))
def test_every_rendered_manifest_validates_against_the_kubernetes_schema(case: str, version: str) -> None:
    docs = rendered_documents(VALUE_SETS[case])
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError, naming the field


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_committed_plain_manifests_validate(version: str) -> None:
    docs = [d for p in sorted(MANIFESTS.glob("*.yaml")) for d in documents(p.read_text())]
    assert {d["kind"] for d in docs} == {"Service", "PodDisruptionBudget", "StatefulSet", "Job"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("spec", "backoffLimitPerIndx"), 3),  # a misspelt field
        (("spec", "completions"), "two"),  # a string for an integer
        (("spec", "template", "spec", "containers", 0, "readinessProbe", "exec", "command"), "elasticctl"),
    ],
)
def test_the_validation_rejects_a_broken_job(path: tuple, bad: object) -> None:
    job = copy.deepcopy(the_job({}))
    node = job
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSIONS[-1], strict=True)


# -- the agent's settings -----------------------------------------------------------------------


def agent_environ(container: dict, tmp_path: Path) -> dict[str, str]:
    """The container's environment as the pod gets it (downward API filled in; secret files here)."""
    fields = {"metadata.name": "elasticd-0-x7k2p", "status.podIP": "10.244.1.7"}
    env: dict[str, str] = {}
    for var in container["env"]:
        value = var["value"] if "value" in var else fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        for mount in container["volumeMounts"]:  # a file in a mounted Secret: make it exist here
            if value.startswith(mount["mountPath"] + "/") and mount["mountPath"].startswith("/etc/elasticd/"):
                local = tmp_path / value.lstrip("/")
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_text("a-password\n")
                value = str(local)
        env[var["name"]] = value
    return env


@pytest.mark.parametrize("case", sorted(set(VALUE_SETS) - {"etcd-only"}))
def test_the_agent_accepts_the_environment_the_chart_gives_it(case: str, tmp_path: Path) -> None:
    container = agent_container(VALUE_SETS[case])
    env = agent_environ(container, tmp_path)
    unknown = [k for k in env if k.startswith("ELASTICD_") and k not in {s.variable for s in AGENT_SETTINGS.values()}]
    assert not unknown, f"not elasticd settings: {unknown}"
    config = load_agent_config(program=container["args"][1:], environ=env, default_config_file=tmp_path / "none")
    assert config.node_id == "elasticd-0-x7k2p"
    assert config.advertise_addr == "10.244.1.7"
    assert config.world.job_id == "mlp-elastic"
    assert config.metrics_port == 9780 and config.metrics_addr == "0.0.0.0"
    assert config.program == ("python", "-m", "agents.mlp", "--steps", "20000")
    if case == "external-etcd-tls":
        assert config.etcd.ca_cert.endswith("/etcd-tls/ca.crt")
        assert config.etcd.user == ""
    else:
        assert config.etcd.user == "mlp-elastic" and config.etcd.insecure is True
    if case == "cpu-checkpoints-settings":
        assert config.timeouts.lease_ttl_s == 5.0 and config.spares_per_node == 1 and config.relay is True
        assert config.nproc_per_node == 2


@pytest.mark.parametrize("name", ["etcd_endpoints", "node_id", "metrics_port", "program"])
def test_a_setting_the_chart_sets_itself_is_refused_in_settings(name: str) -> None:
    with pytest.raises(helm.HelmError, match=f"settings.{name}"):
        render({"settings": {name: "x"}})


def test_tls_is_refused_with_the_charts_own_etcd() -> None:
    with pytest.raises(helm.HelmError, match="etcd.tls.secretName"):
        render({"etcd": {"tls": {"secretName": "x"}}})


def test_an_external_etcd_needs_its_endpoints() -> None:
    with pytest.raises(helm.HelmError, match="etcd.endpoints"):
        render({"etcd": {"deploy": False}})


def test_the_agent_reaches_every_etcd_member_by_its_dns_name() -> None:
    docs = rendered_documents({})
    (sts,) = [d for d in docs if d["kind"] == "StatefulSet"]
    env = {v["name"]: v.get("value") for v in agent_container({})["env"]}
    peers = sts["spec"]["serviceName"]
    name = sts["metadata"]["name"]
    want = [f"{name}-{i}.{peers}:2379" for i in range(sts["spec"]["replicas"])]
    assert sts["spec"]["replicas"] == 3 and env["ELASTICD_ETCD_ENDPOINTS"].split(",") == want
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster = next(a for a in args if a.startswith("--initial-cluster="))
    assert cluster.count("=http://") == 3


# -- stopping, failing, replacing -----------------------------------------------------------------


def test_the_job_fails_on_the_exit_codes_systemd_does_not_restart() -> None:
    unit = re.search(r"^RestartPreventExitStatus=(.*)$", UNIT.read_text(), re.M)
    assert unit is not None
    rules = the_job({})["spec"]["podFailurePolicy"]["rules"]
    fail = [r for r in rules if r["action"] == "FailJob"]
    assert [sorted(r["onExitCodes"]["values"]) for r in fail] == [sorted(int(c) for c in unit.group(1).split())]
    assert any(
        r["action"] == "Ignore" and r["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
        for r in rules
    )
    spec = the_job({})["spec"]
    assert spec["podReplacementPolicy"] == "Failed" and spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]


def test_the_drain_fits_in_the_pods_stop_budget() -> None:
    job = the_job({})
    grace = job["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    command = agent_container({})["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["sh", "-c"] and 'elasticctl drain "$ELASTICD_NODE_ID" --wait' in command[2]
    timeout = int(re.search(r"--timeout (\d+)", command[2]).group(1))
    default_shutdown_grace_s = AGENT_SETTINGS["shutdown_grace_s"].field.default
    assert default_shutdown_grace_s < timeout < grace


def test_gpus_are_requested_and_limited_and_the_metrics_port_is_announced() -> None:
    c = agent_container({})
    assert c["resources"]["limits"]["nvidia.com/gpu"] == c["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in agent_container({"resources": {"gpus": 0}})["resources"]["limits"]
    notes = the_job({})["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/port"] == str(
        c["ports"][0]["containerPort"]
    )


# -- the readiness probe --------------------------------------------------------------------------


def probe(tmp_path: Path, status_output: str, node: str) -> int:
    """Run the chart's readiness probe with an `elasticctl` on PATH that prints ``status_output``."""
    command = agent_container({})["readinessProbe"]["exec"]["command"]
    fake = tmp_path / "bin" / "elasticctl"
    fake.parent.mkdir(exist_ok=True)
    (tmp_path / "out.json").write_text(status_output)
    fake.write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'status --json' ] || exit 9\ncat {tmp_path / 'out.json'}\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    python = Path(sys.executable).parent
    env = {"PATH": f"{fake.parent}:{python}:/usr/bin:/bin", "ELASTICD_NODE_ID": node}
    argv = [sys.executable if command[0] == "python" else command[0], *command[1:]]
    return subprocess.run(argv, env=env, timeout=30, capture_output=True).returncode


def two_pod_job() -> Job:
    """pod-a's worker trains in generation 2; pod-b's has registered and waits."""
    job = Job()
    job.put(KEYS.member("pod-a.0.11"), encode(member("pod-a.0.11", node="pod-a", pid=11)))
    job.put(KEYS.member("pod-b.0.12"), encode(member("pod-b.0.12", node="pod-b", pid=12)))
    job.generation(2, ["pod-a.0.11"])
    job.put(KEYS.progress("pod-a.0.11"), progress(40, generation=2, rank=0))
    return job


@pytest.mark.parametrize(("node", "ready"), [("pod-a", True), ("pod-b", False), ("pod-c", False)])
def test_the_readiness_probe_passes_while_a_worker_of_the_pod_trains(tmp_path: Path, node: str, ready: bool) -> None:
    output = render_json(status_of(two_pod_job()))
    assert (probe(tmp_path, output, node) == 0) is ready


def test_the_readiness_probe_fails_when_elasticctl_prints_nothing(tmp_path: Path) -> None:
    assert probe(tmp_path, "", "pod-a") != 0


# -- the documentation ----------------------------------------------------------------------------


def leaf_keys(values: Mapping[str, object], prefix: str = "") -> Iterator[str]:
    for key, value in values.items():
        if isinstance(value, dict) and value:
            yield from leaf_keys(value, f"{prefix}{key}.")
        else:
            yield prefix + key


def test_every_value_of_the_chart_is_documented() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    text = DOC.read_text()
    missing = [k for k in leaf_keys(values) if f"| `{k}` |" not in text]
    assert not missing, f"values not in the table of {DOC.relative_to(ROOT)}: {missing}"


def write_plain_manifests() -> None:
    MANIFESTS.mkdir(parents=True, exist_ok=True)
    for old in MANIFESTS.glob("*.yaml"):
        old.unlink()
    for name, text in plain_manifests().items():
        (MANIFESTS / name).write_text(text)
        print(f"wrote {(MANIFESTS / name).relative_to(ROOT)}")


if __name__ == "__main__":
    os.chdir(ROOT)
    write_plain_manifests()
