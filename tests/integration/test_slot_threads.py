"""Slot hosts make every worker alone on its "host" (hvd.local_size() == 1); each must still
get only its share of the machine's cores, or N workers run N times the threads."""

from __future__ import annotations

import os

import pytest

from tests.support.jobs import PYTHON, events, horovodrun_elastic, write_discovery
from tests.support.paths import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_two_slot_workers_on_one_machine_share_its_cores(tmp_path, jobs):
    run = tmp_path / "run"
    _, discover = write_discovery(tmp_path, "localhost:2")
    cmd = horovodrun_elastic(discover, 2, 2, 2)
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    env = jobs.env()
    env.pop("OMP_NUM_THREADS", None)
    job = jobs.start(cmd + [PYTHON, str(ROOT / "examples" / "digits.py"), "--run-dir", str(run),
                            "--max-steps", "3"], env=env, name="threads")
    assert job.wait(240) == 0, job.output()[-3000:]
    watch = [e for e in events(run / "events.jsonl") if e["event"] == "watch"]
    assert sorted(e["rank"] for e in watch) == [0, 1]
    share = max(1, (os.cpu_count() or 1) // 2)
    assert {e["threads"] for e in watch} == {share}, watch
