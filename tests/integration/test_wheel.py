"""A wheel built from the tree holds every subpackage, installs, and its entry points run.

An editable install (what the test command uses) imports from the source tree, so a package list
in pyproject.toml that misses a subpackage (store, wire, rendezvous, ...) goes unnoticed there and
ships a broken wheel. Here the wheel is built without build isolation (no network), installed
without dependencies into a fresh venv, and run from outside the tree; the dependencies (torch,
etcd3, ...) come from this interpreter's site-packages through a path file, which adds their
directory but processes none of its own path files (so the editable install is not seen).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from elasticd.testing.localcluster import REPO_ROOT

pytestmark = pytest.mark.timeout(300)


def _run(argv: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_a_wheel_built_from_the_tree_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    # A clean copy: a build/ directory left by an earlier build would lend the wheel its files.
    src = tmp_path / "src"
    shutil.copytree(
        REPO_ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache", ".ruff_cache"
        ),
    )
    dist = tmp_path / "dist"
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(src)],
        cwd=tmp_path,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = dist.glob("elasticd-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    packages = sorted({str(p.parent.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "elasticd").rglob("__init__.py")})
    for package in packages:
        assert f"{package}/__init__.py" in names, f"{package} is missing from the wheel"
    modules = {str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "elasticd").rglob("*.py")}
    assert modules <= set(names), f"missing from the wheel: {sorted(modules - set(names))}"

    venv = tmp_path / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(
        _run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path
        ).stdout.strip()
    )
    installed = _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], cwd=tmp_path
    )
    assert installed.returncode == 0, installed.stderr[-3000:]
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    where = _run(
        [str(python), "-c", "import elasticd, elasticd.rendezvous.membership as m; print(m.__file__)"], cwd=tmp_path
    )
    assert where.returncode == 0, where.stderr[-3000:]
    assert where.stdout.strip().startswith(str(venv)), f"imported from {where.stdout.strip()}, not the wheel"
    ctl = _run([str(venv / "bin" / "elasticctl"), "--help"], cwd=tmp_path)
    assert ctl.returncode == 0 and "status" in ctl.stdout, ctl.stderr[-3000:]
    agent = _run([str(venv / "bin" / "elasticd"), "--help"], cwd=tmp_path)
    assert agent.returncode == 0 and "--node-id" in agent.stdout, agent.stderr[-3000:]
    bench = _run([str(python), "-m", "elasticd.bench", "--help"], cwd=tmp_path)
    assert bench.returncode == 0 and "agent" in bench.stdout, bench.stderr[-3000:]
