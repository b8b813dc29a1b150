"""Stragglers in real jobs: three digits workers under the project's Horovod driver.

One rule for all three runs (windows of 20 steps, the default 1.3x ratio and 20 ms floor, 3
windows in a row): a fault-free run on this shared 2-core machine reports nothing although its
windows are judged; a worker made 50 ms slower per step (`slow:` fault) is reported, as the right
rank, once; with eviction on it is ended and the job goes on without it.
"""

from __future__ import annotations

import socket

import pytest

from tests.support.jobs import PYTHON, events, horovodrun_elastic, write_discovery
from tests.support.paths import ROOT
from tests.support.runs import assert_faults_fired, final_digests, sizes_seen

pytestmark = pytest.mark.slow

DIGITS = str(ROOT / "examples" / "digits.py")
RULE = ("--observability-straggler-window-steps", "20", "--observability-straggler-windows", "3")
SLOW = "slow:rank=1:step=20:seconds=0.05"


def _job(tmp_path, jobs, name: str, *extra: str, fault: str = "", epochs: int = 6):
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:3")
    cmd = horovodrun_elastic(discover, 3, 2, 3, "--gloo-timeout-seconds", "120",
                             "--blacklist-cooldown-range", "2", "4")
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    cmd += [PYTHON, DIGITS, "--run-dir", str(run), "--epochs", str(epochs), "--batch-size", "16",
            "--commit-every", "5", "--observability-log-level", "DEBUG", *RULE, *extra]
    env = jobs.env(HVD_RESILIENT_FAULT=fault) if fault else jobs.env()
    return run, jobs.start(cmd, env=env, name=name)


def _judged_windows(evs: list[dict]) -> list[dict]:
    return [e for e in evs if e["event"] == "step_times" and e["judged"]]


def _pid_of_rank(evs: list[dict], rank: int) -> int:
    return next(e["pid"] for e in evs if e["event"] == "start" and e["rank"] == rank)


def test_a_fault_free_run_reports_no_straggler(tmp_path, jobs):
    run, job = _job(tmp_path, jobs, "clean", epochs=8)
    assert job.wait(300) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    reported = [e for e in evs if e["event"].startswith("straggler")]
    assert reported == [], reported
    judged = _judged_windows(evs)
    assert len(judged) >= 8, f"the rule was hardly applied: {judged}"  # 240+ steps / 20
    print("highest ratio per window:", [max(e["ratios"]) for e in judged])


def test_a_slow_worker_is_reported_as_the_right_rank(tmp_path, jobs):
    run, job = _job(tmp_path, jobs, "slow", fault=SLOW)
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    reports = [e for e in evs if e["event"] == "straggler"]
    assert len(reports) == 1, reports  # still slow afterwards, but reported once
    (r,) = reports
    assert r["pid"] == _pid_of_rank(evs, 1) and r["host"] == socket.gethostname(), r
    assert r["ratio"] > 1.3 and r["compute_seconds"] - r["others_seconds"] >= 0.04, r
    assert not [e for e in evs if e["event"] == "straggler_evicted"]
    if not [e for e in evs if e["event"] == "reset" and e["ts"] < r["ts"]]:
        # no unrelated reset renumbered the ranks first (a loaded machine can evict a starved
        # worker): then it is rank 1, three windows after it turned slow at step 20
        assert r["rank"] == 1 and r["step"] == 80, r
        assert f"straggler: rank 1 on {r['host']} (pid {r['pid']})" in job.output()


def test_eviction_ends_the_straggler_and_the_job_goes_on(tmp_path, jobs):
    run, job = _job(tmp_path, jobs, "evict", "--observability-straggler-evict", fault=SLOW)
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    (report,) = [e for e in evs if e["event"] == "straggler"]
    (evicted,) = [e for e in evs if e["event"] == "straggler_evicted"]
    assert evicted["pid"] == report["pid"] == _pid_of_rank(evs, 1), evicted
    assert evicted["exit_code"] == 77 and "exit with status code 77" in job.output()
    after = [e for e in evs if e["ts"] > evicted["ts"]]
    assert any(e["event"] == "failure_detected" for e in after), [e["event"] for e in after]
    assert any(e["event"] == "reset" and e["new_size"] == 2 for e in after)
    assert sizes_seen(run)[:2] == [3, 2], sizes_seen(run)
    starts = [e for e in evs if e["event"] == "start"]
    assert report["pid"] not in [e["pid"] for e in starts if e["ts"] > evicted["ts"]]
    assert report["pid"] not in [p.pid for p in job.processes()]
    assert len(set(final_digests(run).values())) == 1
    assert any(e["event"] == "done" for e in after)
