"""A peer's death while this rank enqueues must fail the enqueue, not deadlock the process
(`backends/horovod/pinned_handles.py`: Horovod's loop finalizing under its table mutex waited for
the GIL that the enqueuing main thread held; 1 random kill in 20 never recovered)."""

from __future__ import annotations

import pytest

from tests.support.jobs import PYTHON, wait_for, write_discovery
from tests.support.paths import SCRIPTS


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_peer_killed_during_a_stream_of_enqueues_fails_the_enqueue(tmp_path, jobs):
    _, discover = write_discovery(tmp_path, "localhost:2")
    cmd = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver", "-np", "2", "--min-np", "1",
           "--host-discovery-script", str(discover), "--network-interface", "lo",
           "--gloo-timeout-seconds", "60", PYTHON, str(SCRIPTS / "enqueue_while_peer_dies.py")]
    job = jobs.start(cmd, name="enqueue")
    # before the pins: no line ever (every Python thread stopped, 4 of 4 runs); after: ~1 s
    wait_for(lambda: "rank 0: enqueue failed" in job.output(), 40,
             "rank 0's enqueue to fail after rank 1 was killed (a deadlock holds it)", job)
    assert "HorovodInternalError" in job.output().split("rank 0: enqueue failed")[1][:200]
