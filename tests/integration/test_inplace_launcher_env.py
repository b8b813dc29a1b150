"""Workers the in-place agent starts know their launcher rank before any backend is up (a
script writes its data on one rank only: `examples/gpt.py`), and it follows the generations.

Real agent, real workers (tiny scripts, no training): each prints what `launcher_rank()` and
`launcher_size()` say."""

from __future__ import annotations

import re

import pytest

from tests.support.jobs import PYTHON

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SAY = """
import os
from hvd_resilient.launcher_place import launcher_rank, launcher_size
os.write(1, f"place {launcher_rank()} {launcher_size()}\\n".encode())
"""
# (one write a line: two workers' prints interleaved on one line in CI)

# Member 0 fails at once; the others report it as the in-place backend does and wait for the
# generation without it, then say where they are in it.
AFTER_A_FAULT = """
import os, sys
from hvd_resilient.backends.inplace.membership import MEMBER_ENV, Membership
from hvd_resilient.launcher_place import launcher_rank, launcher_size
if os.environ[MEMBER_ENV] == "0":
    sys.exit(3)
m = Membership(30.0)
m.report_fault(0)
g = m.wait_beyond(0)
os.write(1, f"place {launcher_rank()} {launcher_size()} generation {g}\\n".encode())
"""


def agent(jobs, nproc: int, code: str, **env: str):
    cmd = [PYTHON, "-m", "hvd_resilient.launch.inplace_agent", "--nproc", str(nproc), "--",
           PYTHON, "-c", code]
    return jobs.start(cmd, env=jobs.env(**env), name="agent")


def places(output: str) -> list[tuple[str, ...]]:
    return sorted(tuple(m) for m in re.findall(r"^place (\S+) (\S+)(.*)$", output, re.M))


def test_every_worker_has_its_own_rank(jobs):
    """Also where the agent itself was started by a launcher (srun, a torchrun-style RANK):
    the workers inherit those variables, which name the agent's rank, not theirs."""
    nproc = 2
    job = agent(jobs, nproc, SAY, SLURM_PROCID="0", SLURM_NTASKS="1", RANK="0",
                WORLD_SIZE="1")
    assert job.wait(90) == 0, job.output()[-3000:]
    assert places(job.output()) == [(str(r), str(nproc), "") for r in range(nproc)], \
        job.output()[-3000:]


def test_the_ranks_follow_the_generation_after_a_fault(jobs):
    """Members 1 and 2 go on without member 0: they are ranks 0 and 1 of generation 1."""
    job = agent(jobs, 3, AFTER_A_FAULT)
    assert job.wait(90) == 0, job.output()[-3000:]
    out = job.output()
    assert "generation 1: members [1, 2]" in out, out[-3000:]
    assert places(out) == [("0", "2", " generation 1"), ("1", "2", " generation 1")], out[-3000:]
