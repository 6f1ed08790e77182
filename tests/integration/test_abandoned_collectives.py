"""A collective abandoned by one rank can still complete later, when its peer reaches it (a peer
that was frozen or cut off resumes): it must not write into the buffers of a later step. Found by
`python -m elasticd.chaos` (link down then up): ranks' parameters diverged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elasticd.testing.localcluster import REPO_ROOT, free_port


@pytest.mark.timeout(60)
def test_a_late_all_reduce_lands_in_the_abandoned_buffer_not_in_the_next_steps_gradients() -> None:
    port = free_port()
    program = [sys.executable, "tests/programs/late_allreduce.py"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [*program, str(r), str(port)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=45) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    assert [p.returncode for p in procs] == [0, 0], outs
    grad = json.loads(outs[0][0].strip().splitlines()[-1])["grad"]
    assert grad == [2.0, 2.0, 2.0, 2.0], grad  # the new step's own backward; not the late sum (~1001)
