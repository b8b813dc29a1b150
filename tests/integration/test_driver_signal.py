"""SIGTERM to the Horovod driver ends the job, a frozen worker or not, and says so.

Horovod's elastic launcher answers SIGTERM (a scheduler's stop, `timeout`, `docker stop`) by
ending its workers and nothing else; what follows depends on timing (`patches/stop_signal.py`):
here, without the patch, both runs ended with exit 1 and "processes exited with non-zero status
... Exit code: 143" (137 with the frozen worker), which reads as a crash. With it the driver
stops with its workers, starts none, and exits 128 + 15 with one line naming the signal.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from tests.support.jobs import PYTHON, events, wait_for, write_discovery
from tests.support.paths import SCRIPTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ENDED_S = 15.0
"""Signal to the driver's exit: Horovod's middleman gives each worker 5 s after its SIGTERM
before the SIGKILL (`safe_shell_exec.GRACEFUL_TERMINATION_TIME_S`), a frozen one included."""


def _trained(run) -> list[dict]:
    path = run / "samples.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("frozen", [False, True], ids=["running", "a-worker-frozen"])
def test_sigterm_to_the_driver_ends_the_job_and_starts_no_worker(tmp_path, jobs, frozen):
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:2")
    cmd = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver", "-np", "2", "--min-np", "1",
           "--max-np", "2", "--host-discovery-script", str(discover),
           "--network-interface", "lo", "--blacklist-cooldown-range", "1", "2",
           PYTHON, str(SCRIPTS / "elastic_job.py"), "--run-dir", str(run),
           "--step-time", "0.02", "--heartbeat-timeout", "30"]
    job = jobs.start(cmd, env=jobs.env(HVD_RESILIENT_RUN_DIR=str(run)), name="sigterm")
    wait_for(lambda: len({s["rank"] for s in _trained(run) if s["step"] >= 10}) == 2, 120,
             "both workers past step 10", job)
    workers = sorted({e["pid"] for e in events(run / "events.jsonl") if e["event"] == "start"})
    assert len(workers) == 2, workers
    if frozen:
        os.kill(workers[1], signal.SIGSTOP)
    t_signal = time.time()
    job.proc.send_signal(signal.SIGTERM)
    code = job.wait(60)
    ended = time.time() - t_signal
    assert ended < ENDED_S, f"the driver ended {ended:.1f} s after its SIGTERM"
    assert code == 128 + signal.SIGTERM, (code, job.output()[-3000:])
    assert "stopped by SIGTERM" in job.output(), job.output()[-3000:]
    late = [e for e in events(run / "events.jsonl")
            if e["event"] in ("start", "reset") and e["ts"] > t_signal]
    assert not late, f"the driver went on after the signal: {late}"
    alive = [p for p in workers if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"workers {alive} outlived the driver"
