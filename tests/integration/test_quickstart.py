"""README's worker (``agents/quickstart.py``, shown in README.md as it is) in a job of real
processes: one worker SIGKILLed mid-run, a newcomer joining; every step committed once."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from elasticd.testing.audit import check_dir

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "agents" / "quickstart.py"


def test_the_readme_shows_the_program_as_it_is() -> None:
    code = PROGRAM.read_text()
    body = code[code.index("import torch") :].rstrip()
    assert body in (ROOT / "README.md").read_text(), "README.md's worker differs from agents/quickstart.py"


def test_the_readme_worker_survives_a_kill_and_a_join(local_job) -> None:
    # two at least: the job starts with both (the README's worker trains 200 steps in a few seconds,
    # faster than a second process starts on a loaded machine), and after the kill the survivor
    # holds the job's state until the newcomer joins it
    job = local_job(min_workers=2)
    for _ in range(2):
        job.spawn(program=str(PROGRAM), audit=False, audit_dir=job.dir)
    audits = job.dir / job.job_id

    def committed() -> list[int]:
        return [len(p.read_text().splitlines()) for p in audits.glob("*.jsonl")]

    def both_training() -> bool:
        lines = committed()
        return len(lines) == 2 and max(lines) > 40 and min(lines) >= 10

    job.wait_for(both_training, 60, "both workers training")
    job.workers[1].proc.send_signal(signal.SIGKILL)
    job.spawn(program=str(PROGRAM), audit=False, audit_dir=job.dir)  # a newcomer
    codes = job.wait_all(120)
    assert codes[0] == 0 and codes[1] == -signal.SIGKILL and codes[2] == 0, job.logs_tail()
    rep = check_dir(audits, 2048)
    assert rep.ok, rep.violations
    assert rep.last_step == 200 and len(set(rep.final_checksums)) == 1, rep
    assert "200 steps" in job.workers[0].log_text()
