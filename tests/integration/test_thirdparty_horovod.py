"""Horovod's own `pytorch_mnist_elastic.py`, unchanged but for the migration page's lines
(`port.patch`) and what this CPU machine forces (`cpu.patch`: synthetic MNIST-shaped data),
under `hvd-resilient run` with a discovery script: 3 workers on one machine (slot hosts).

What each test guards (all failed before the ported loop got its own events, watchdog and
sampler): a host added used to hang every rank for ever (the old ranks' `DistributedSampler`
kept the world it was built for); a killed driver was not relaunched (no rank wrote `start`);
the report called a finished run silent at step 0. The driver-kill tests failed before the
ported loop got the memory tier and durable checkpoints (`training/ported.py`): the relaunch
trained from epoch 1 again.
"""

from __future__ import annotations

import math
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from hvd_resilient.checkpoint.manifest import MANIFEST_NAME, step_dir
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


@pytest.fixture(autouse=True)
def _memory_tier(memory_tier_dir: str) -> str:
    """Every run here keeps its commits in a memory tier of its own (never the machine's
    /dev/shm/hvd_resilient), removed after the test."""
    return memory_tier_dir


def start(tmp_path: Path, jobs, name: str, *, epochs: int, hosts: str = "localhost:3",
          max_restarts: int = 0, run_args: tuple[str, ...] = (), **env: str):
    """The ported script under `hvd-resilient run` (``run_args``: more of its flags; ``env``:
    more of the workers' environment): (run folder, hosts file, job)."""
    script = prepare("horovod_elastic", tmp_path / "script", ("port.patch", "cpu.patch"))
    run = tmp_path / "run"
    hosts_file, discover = write_discovery(tmp_path, hosts)
    cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "horovod",
           "--discovery", str(discover), "--np", "3", "--min-np", "1", "--max-np", "4",
           "--network-interface", "lo", "--run-id", name, "--run-dir", str(run),
           "--max-restarts", str(max_restarts), *run_args,
           "--", PYTHON, SCRIPT, "--epochs", str(epochs)]
    job = jobs.start(cmd, env=jobs.env(MNIST_SYNTHETIC_TRAIN=str(N_TRAIN), **env), cwd=script,
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
    """Also the durable policy of a ported loop with `--checkpoint` and checkpoint_every 0:
    one at the first commit of each new epoch (its epoch end is not a point the wrapper
    sees) and a final one."""
    run, _, job = start(tmp_path, jobs, "mnist-plain", epochs=2,
                        run_args=("--checkpoint", (tmp_path / "ckpt").as_uri()))
    assert job.wait(JOB_TIMEOUT_S) == 0, job.output()[-3000:]
    done = assert_ranks_equal(run, 3)
    per_epoch = batches(N_TRAIN, 3)
    assert done["step"] == 2 * per_epoch, done  # one commit a batch
    saved = [(e["ckpt_step"], e["epoch"]) for e in events(run / "events.jsonl")
             if e["event"] == "checkpoint_saved"]
    assert saved == [(per_epoch + 1, 2), (2 * per_epoch, 2)], saved
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


def kill_driver(run: Path, job) -> float:
    """SIGKILLs horovodrun's driver (its local workers get SIGTERM from their middlemen and
    die: every worker is lost) and waits for the relaunched rank 0's `start`. Returns when
    the driver was killed."""
    (driver,) = launchers_of(job.proc.pid)
    assert "horovod" in " ".join(driver.cmdline()), driver.cmdline()
    killed = time.time()
    driver.kill()
    relaunched = wait_for(lambda: next((e for e in events(run / "events.jsonl")
                                        if e["event"] == "start" and e["ts"] > killed
                                        and e["rank"] == 0), None),
                          JOB_TIMEOUT_S, "a start after the driver was killed", job)
    print(f"[mnist] driver killed -> relaunched rank 0 started: {relaunched['ts'] - killed:.2f} s")
    return killed


def assert_resumed(run: Path, killed: float, source: str, total: int) -> dict:
    """One `resume` after the kill, from ``source`` at a commit > 0; rank 0's commits after it
    go on from there, one by one; the run ends at ``total`` commits (an uninterrupted run's)
    within one commit interval (one batch here), every rank with the same state. Returns the
    resume event."""
    evs = events(run / "events.jsonl")
    assert [e["attempt"] for e in evs if e["event"] == "restart"] == [1], evs[-5:]
    (resume,) = [e for e in evs if e["event"] == "resume"]
    assert resume["ts"] > killed and resume["source"] == source, resume
    assert resume["from_step"] > 0, resume
    after = [e["step"] for e in evs if e["event"] == "commit" and e["rank"] == 0
             and e["ts"] > resume["ts"]]
    assert after == list(range(resume["from_step"] + 1, after[-1] + 1)), after[:5]
    done = assert_ranks_equal(run, 3, launch_ts=killed)
    assert abs(done["step"] - total) <= 1, (done["step"], total, resume)
    assert done["step"] == after[-1], (done, after[-3:])
    text = report(run)
    assert "finished at commit" in text and "2 launches" in text, text
    assert f"resumed from commit {resume['from_step']} ({source})" in text, text
    return resume


def test_driver_killed_relaunch_resumes_from_the_memory_tier(tmp_path, jobs,
                                                             memory_tier_dir):
    """The relaunch goes on from the last commit in host memory, in the epoch it was in (the
    example loops `for state.epoch in range(state.epoch, ...)`): not from epoch 1."""
    epochs, per_epoch = 3, batches(N_TRAIN, 3)
    run, _, job = start(tmp_path, jobs, "mnist-driver", epochs=epochs, max_restarts=1)
    into = per_epoch + 5  # well into epoch 2
    wait_for(lambda: any(e["event"] == "memory_commit" and e["ckpt_step"] >= into
                         for e in events(run / "events.jsonl")),
             JOB_TIMEOUT_S, f"a memory commit at step >= {into}", job)
    killed = kill_driver(run, job)
    assert job.wait(JOB_TIMEOUT_S) == 0, job.output()[-3000:]
    committed = max(e["ckpt_step"] for e in events(run / "events.jsonl")
                    if e["event"] == "memory_commit" and e["ts"] < killed)
    resume = assert_resumed(run, killed, "memory", epochs * per_epoch)
    assert resume["from_step"] >= committed >= into, (resume, committed)
    assert resume["epoch"] == 2, resume  # the committed epoch, not the example's epoch=1
    assert not list(Path(memory_tier_dir).glob("*/*/*")), "the finished run left its commits"


def test_driver_killed_relaunch_resumes_from_the_durable_checkpoint(tmp_path, jobs):
    """`--checkpoint URL`: durable checkpoints every 8 commits and a final one; with the
    memory tier off, a relaunch after every worker is lost resumes from the newest one."""
    epochs, per_epoch = 3, batches(N_TRAIN, 3)
    ckpt = tmp_path / "ckpt"
    run, _, job = start(tmp_path, jobs, "mnist-durable", epochs=epochs, max_restarts=1,
                        run_args=("--checkpoint", ckpt.as_uri()),
                        HVD_RESILIENT_CHECKPOINT_EVERY="8",
                        HVD_RESILIENT_MEMORY_TIER_ENABLED="0")
    saved = wait_for(lambda: next((e for e in events(run / "events.jsonl")
                                   if e["event"] == "checkpoint_saved"
                                   and e["ckpt_step"] >= 24), None),
                     JOB_TIMEOUT_S, "a durable checkpoint at step >= 24", job)
    killed = kill_driver(run, job)
    assert job.wait(JOB_TIMEOUT_S) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    before = [e["ckpt_step"] for e in evs if e["event"] == "checkpoint_saved"
              and e["ts"] < killed]
    assert before and all(s % 8 == 0 for s in before), before
    resume = assert_resumed(run, killed, "durable", epochs * per_epoch)
    assert resume["from_step"] == max(before) >= saved["ckpt_step"], (resume, before)
    assert resume["epoch"] == 2, resume  # step 24: batch 4 of epoch 2
    assert not [e for e in evs if e["event"] == "memory_commit"], "the memory tier was off"
    done = [e for e in evs if e["event"] == "done"][-1]
    final = [e for e in evs if e["event"] == "checkpoint_saved" and e["ts"] > killed]
    assert final and final[-1]["ckpt_step"] == done["step"], (final, done)
    assert (ckpt / step_dir(done["step"]) / MANIFEST_NAME).is_file(), sorted(ckpt.iterdir())
