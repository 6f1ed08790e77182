"""The code is formatted and linted: ``ruff format --check`` and ``ruff check`` (configured in
pyproject.toml) pass over the package, the tests and the training programs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PATHS = ("elasticd", "tests", "agents")


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "check"])
def test_ruff(command: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ruff", *command, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, (
        f"ruff {' '.join(command)} failed (fix with `.venv/bin/ruff format {' '.join(PATHS)}` and "
        f"`.venv/bin/ruff check --fix {' '.join(PATHS)}`):\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    )
