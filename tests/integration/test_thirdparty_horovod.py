"""Horovod's own `pytorch_mnist_elastic.py`, unchanged but for the migration page's lines
(`port.patch`) and what this CPU machine forces (`cpu.patch`: synthetic MNIST-shaped data),
under `hvd-resilient run` with a discovery script: 3 workers on one machine (slot hosts).

What each test guards (all failed before the ported loop got its own events, watchdog and
sampler): a host added used to hang every rank for ever (the old ranks' `DistributedSampler`
kept the world it was built for); a killed driver was not relaunched (no rank wrote `start`);
the report called a finished run silent at step 0.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.support.jobs import (
    PYTHON,
    VENV_BIN,
    events,
    launchers_of,
    set_hosts,
    wait_for,
    write_discovery,
)
from tests.support.runs import commits, sizes_seen
from tests.support.thirdparty import prepare

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SCRIPT = "pytorch_mnist_elastic.py"
N_TRAIN = 3840  # cpu.patch's synthetic training set (MNIST_SYNTHETIC_TRAIN)
BATCH = 64  # the script's default --batch-size
JOB_TIMEOUT_S = 150  # the longest run here takes ~30 s; a hang fails, it never passes


def batches(n: int, size: int) -> int:
    """Batches per rank for `n` samples over `size` ranks (padded as torch pads)."""
    return math.ceil(math.ceil(n / size) / BATCH)


def start(tmp_path: Path, jobs, name: str, *, epochs: int, hosts: str = "localhost:3",
          max_restarts: int = 0):
    """The ported script under `hvd-resilient run`: (run folder, hosts file, job)."""
    script = prepare("horovod_elastic", tmp_path / "script", ("port.patch", "cpu.patch"))
    run = tmp_path / "run"
    hosts_file, discover = write_discovery(tmp_path, hosts)
    cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--backend", "horovod",
           "--discovery", str(discover), "--np", "3", "--min-np", "1", "--max-np", "4",
           "--network-interface", "lo", "--run-id", name, "--run-dir", str(run),
           "--max-restarts", str(max_restarts),
           "--", PYTHON, SCRIPT, "--epochs", str(epochs)]
    job = jobs.start(cmd, env=jobs.env(MNIST_SYNTHETIC_TRAIN=str(N_TRAIN)), cwd=script,
                     name=name)
    return run, hosts_file, job


def wait_commits(run: Path, job, n: int, size: int | None = None) -> dict:
    return wait_for(lambda: next((c for c in commits(run) if c["step"] >= n
                                  and (size is None or c["size"] == size)), None),
                    JOB_TIMEOUT_S, f"commit {n}" + (f" at size {size}" if size else ""), job)


def assert_ranks_equal(run: Path, n: int, launch_ts: float = 0.0) -> dict:
    """Ranks 0..n-1 wrote `done` (in the launch after `launch_ts`) with the same parameters
    and the same digest of every component."""
    done = [e for e in events(run / "events.jsonl") if e["event"] == "done"
            and e["ts"] >= launch_ts]
    assert sorted(e["rank"] for e in done) == list(range(n)), done
    assert len({e["params_sha256"] for e in done}) == 1, [e["params_sha256"] for e in done]
    assert len({str(sorted(e["digests"].items())) for e in done}) == 1, done
    assert {e["step_unit"] for e in done} == {"commit"}, done
    return done[0]


def report(run: Path) -> str:
    r = subprocess.run([str(VENV_BIN / "hvd-resilient"), "report", str(run / "events.jsonl")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_fault_free_run_writes_the_events_the_report_reads(tmp_path, jobs):
    run, _, job = start(tmp_path, jobs, "mnist-plain", epochs=2)
    assert job.wait(JOB_TIMEOUT_S) == 0, job.output()[-3000:]
    done = assert_ranks_equal(run, 3)
    assert done["step"] == 2 * batches(N_TRAIN, 3), done  # one commit a batch
    starts = [e for e in events(run / "events.jsonl") if e["event"] == "start"]
    assert sorted(e["rank"] for e in starts) == [0, 1, 2], starts
    text = report(run)
    assert f"finished at commit {done['step']}; 1 launch; world size 3" in text, text
    assert "commits redone 0" in text, text


def test_worker_killed_training_goes_on_at_two(tmp_path, jobs):
    run, _, job = start(tmp_path, jobs, "mnist-kill", epochs=4)
    wait_commits(run, job, 10)
    (victim,) = [e["pid"] for e in events(run / "events.jsonl")
                 if e["event"] == "start" and e["rank"] == 1]
    killed = time.time()
    psutil.Process(victim).kill()
    smaller = wait_commits(run, job, 0, size=2)
    print(f"[mnist] kill -> first commit at size 2: {smaller['ts'] - killed:.2f} s")
    assert job.wait(JOB_TIMEOUT_S) == 0, job.output()[-3000:]
    assert sizes_seen(run)[:2] == [3, 2], sizes_seen(run)
    final = sizes_seen(run)[-1]  # the slot may come back after its cooldown
    assert_ranks_equal(run, final)
    restores = [e for e in events(run / "events.jsonl") if e["event"] == "restore"]
    assert restores and all(r["lost_steps"] <= 1 for r in restores), restores


def test_host_added_through_discovery_every_rank_finishes_equal(tmp_path, jobs):
    """Before the drop-in sampler the newcomer's epoch was shorter than the old ranks', and
    every rank blocked in mismatched collectives for good: this test then timed out."""
    epochs = 6
    run, hosts, job = start(tmp_path, jobs, "mnist-join", epochs=epochs)
    wait_commits(run, job, 10)
    added = time.time()
    set_hosts(hosts, "localhost:4")
    bigger = wait_commits(run, job, 0, size=4)
    print(f"[mnist] host added -> first commit at size 4: {bigger['ts'] - added:.2f} s")
    assert job.wait(JOB_TIMEOUT_S) == 0, job.output()[-3000:]
    assert sizes_seen(run) == [3, 4], sizes_seen(run)
    done = assert_ranks_equal(run, 4)
    # Each sample used once an epoch: the epoch of the join finishes its remaining samples
    # over 4 ranks, every later epoch is 4-way; the commit count says so exactly.
    (reset,) = {e["step"] for e in events(run / "events.jsonl") if e["event"] == "reset"}
    per3, per4 = batches(N_TRAIN, 3), batches(N_TRAIN, 4)
    full, into = divmod(reset, per3)
    left = N_TRAIN - into * 3 * BATCH
    later = epochs - full - (1 if into else 0)  # whole epochs at size 4
    expected = reset + (batches(left, 4) if into else 0) + later * per4
    assert done["step"] == expected, (done["step"], expected, reset)
    text = report(run)
    assert "finished at commit" in text and "world size 3/4" in text, text


def test_driver_killed_supervisor_relaunches_and_the_job_finishes(tmp_path, jobs):
    run, _, job = start(tmp_path, jobs, "mnist-driver", epochs=3, max_restarts=1)
    wait_commits(run, job, 10)
    (driver,) = launchers_of(job.proc.pid)
    assert "horovod" in " ".join(driver.cmdline()), driver.cmdline()
    killed = time.time()
    driver.kill()
    relaunched = wait_for(lambda: next((e for e in events(run / "events.jsonl")
                                        if e["event"] == "start" and e["ts"] > killed
                                        and e["rank"] == 0), None),
                          JOB_TIMEOUT_S, "a start after the driver was killed", job)
    assert job.wait(JOB_TIMEOUT_S) == 0, job.output()[-3000:]
    print(f"[mnist] driver killed -> relaunched rank 0 started: {relaunched['ts'] - killed:.2f} s")
    evs = events(run / "events.jsonl")
    assert [e["attempt"] for e in evs if e["event"] == "restart"] == [1], job.output()[-3000:]
    done = assert_ranks_equal(run, 3, launch_ts=killed)
    # No durable checkpoint in this script: the relaunch trains from scratch (the docs say so)
    assert done["step"] == 3 * batches(N_TRAIN, 3), done
    text = report(run)
    assert "finished at commit" in text and "2 launches" in text, text
