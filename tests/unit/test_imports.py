"""``elasticctl`` starts at once: the control-plane modules import without torch.

STYLE: ``agent``, ``status`` and ``cli`` import without torch, so ``elasticctl status`` starts
instantly. Each check runs in a fresh interpreter (this test process has long imported torch).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from elasticd.testing.localcluster import REPO_ROOT, free_port

pytestmark = pytest.mark.timeout(60)

LIGHT_MODULES = [
    "elasticd",
    "elasticd.errors",
    "elasticd.config",
    "elasticd.settings",
    "elasticd.retry",
    "elasticd.log",
    "elasticd.events",
    "elasticd.store.kv",
    "elasticd.store.etcd",
    "elasticd.wire.keys",
    "elasticd.wire.records",
    "elasticd.wire.snapshot",
    "elasticd.wire.ops",
    "elasticd.wire.restart",
    "elasticd.rendezvous.decide",
    "elasticd.rendezvous.membership",
    "elasticd.rendezvous.lease",
    "elasticd.rendezvous.publish",
    "elasticd.rendezvous.watch",
    "elasticd.agent.elastic",
    "elasticd.agent.restart",
    "elasticd.agent.daemon",
    "elasticd.agent.elastic_decide",
    "elasticd.agent.restart_decide",
    "elasticd.agent.supervisor",
    "elasticd.agent.presence",
    "elasticd.agent.jobview",
    "elasticd.agent.metrics",
    "elasticd.agent.sdnotify",
    "elasticd.ops.status",
    "elasticd.ops.health",
    "elasticd.ops.parse",
    "elasticd.ops.render",
    "elasticd.ops.drain",
    "elasticd.cli",
]
# A cold start of a small Python program, plus two refused etcd connections, on a slow CI machine.
STARTUP_BOUND_S = 3.0


def _python(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_control_plane_module_imports_without_torch(module: str) -> None:
    # Importing torch is made to fail, so the traceback names the module that imports it.
    proc = _python(f"import importlib, sys\nsys.modules['torch'] = None\nimportlib.import_module({module!r})\n")
    assert proc.returncode == 0, f"importing {module} imports torch:\n{proc.stderr[-3000:]}"


@pytest.mark.parametrize("module", ["elasticd.worker.trainer", "elasticd.worker.dropin", "elasticd"])
def test_a_data_parallel_worker_imports_no_sharding_module(module: str) -> None:
    # torch.distributed.tensor (with sympy) and torch.distributed.checkpoint were most of a worker's
    # import time; sharded training imports them itself. Made to fail, the traceback names the importer.
    blocked = ("torch.distributed.tensor", "torch.distributed.checkpoint", "torch.distributed.fsdp")
    code = f"import importlib, sys\nfor m in {blocked!r}: sys.modules[m] = None\nimportlib.import_module({module!r})\n"
    proc = _python(code, timeout=120)
    assert proc.returncode == 0, f"importing {module} imports a sharding module:\n{proc.stderr[-3000:]}"


def test_elasticctl_against_unreachable_etcd_fails_fast_and_clearly() -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    proc = _python(
        "import sys; from elasticd.cli import ctl_main; sys.exit(ctl_main())",
        "--etcd",
        endpoint,
        "status",
        "--job",
        "nojob",
    )
    took = time.monotonic() - started
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"elasticctl: etcd at {endpoint} did not answer"), proc.stderr
    assert took < STARTUP_BOUND_S, f"elasticctl took {took:.1f} s to report an unreachable etcd"


@pytest.mark.parametrize("command", [["drain", "somenode"], ["events"]])
def test_drain_and_events_against_unreachable_etcd_fail_fast_and_clearly(command: list[str]) -> None:
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.monotonic()
    proc = _python(
        "import sys; from elasticd.cli import ctl_main; sys.exit(ctl_main())",
        "--etcd",
        endpoint,
        *command,
        "--job",
        "nojob",
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"elasticctl: etcd at {endpoint} did not answer"), proc.stderr
    assert time.monotonic() - started < STARTUP_BOUND_S
