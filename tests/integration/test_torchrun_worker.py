"""Workers of our torchrun launcher (`launch/torchrun_worker.py`) as torchrun runs them.

A survivor blocked in C++ (a Gloo wait that the dead rank is no part of) must end on the
agent's SIGTERM: forked from the agent, it used to inherit torchrun's Python SIGTERM handler,
which never runs while the main thread is in C++, and the agent waited 30 s
(torch/multiprocessing/spawn.py) before its SIGKILL; measured 34.7 s from the failure to
torchrun's exit, 1.2 s with the default disposition restored (plain torchrun: 1.7 s).
"""

from __future__ import annotations

import re
import time

import pytest

from tests.support.jobs import PYTHON, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BLOCKED = """
import os, time
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
dist.barrier()
if rank == 0:
    print(f"FAIL_AT {time.time()}", flush=True)
    os._exit(1)
# ranks 1 and 2 wait on each other, in C++: the dead rank 0 is no peer of this wait
dist.recv(torch.zeros(1), src=3 - rank)
"""


@pytest.mark.parametrize("fork", ["1", "0"])
def test_survivors_blocked_in_a_collective_end_at_once(tmp_path, jobs, fork):
    script = tmp_path / "blocked.py"
    script.write_text(BLOCKED)
    job = jobs.start(
        [PYTHON, "-m", "hvd_resilient.launch.warm.torchrun", "--nproc-per-node", "3",
         "--max-restarts", "0", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(script)],
        env=jobs.env(HVD_RESILIENT_TORCHRUN_FORK=fork), name=f"blocked-{fork}")
    assert job.wait(60) == 1, job.output()[-3000:]
    ended = time.time()
    failed = float(re.search(r"FAIL_AT ([0-9.]+)", job.output()).group(1))
    # torchrun's own grace for SIGTERM is 30 s: anything near it means the signal was lost
    assert ended - failed < 10, (ended - failed, job.output()[-3000:])
    assert "Unable to shutdown process" not in job.output()
