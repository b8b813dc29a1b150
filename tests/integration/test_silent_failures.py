"""Failures that send no hang-up: a frozen worker (SIGSTOP) and a hung one (alive, no progress).

Without the heartbeats a frozen worker holds the job until the Gloo timeout and then forever
(the driver waits for it); without the progress watchdog a hung one holds it until the Gloo
timeout and stays behind. Both runs use a Gloo timeout far above what the detection takes, so a
job that finishes in time and reports the right event was recovered by the detector, not by it.
"""

from __future__ import annotations

import psutil
import pytest

from tests.support.exactly_once import assert_exactly_once
from tests.support.jobs import (
    PYTHON,
    VENV_BIN,
    events,
    free_port,
    horovodrun_elastic,
    write_discovery,
)
from tests.support.paths import ROOT, SCRIPTS
from tests.support.runs import (
    assert_faults_fired,
    final_digests,
    resumed_from_last_commit,
    sizes_seen,
)

DIGITS = str(ROOT / "examples" / "digits.py")
JOB = str(SCRIPTS / "elastic_job.py")
GLOO_TIMEOUT = "120"  # far above every detection under test: finishing in time proves it


def _slots_job(tmp_path, jobs, fault: str, name: str, *train: str):
    """Three one-slot workers on this machine under the project's driver."""
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:3")
    cmd = horovodrun_elastic(discover, 3, 2, 3, "--gloo-timeout-seconds", GLOO_TIMEOUT,
                             "--blacklist-cooldown-range", "2", "4")
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    train = train or (JOB, "--run-dir", str(run), "--expect-sizes", "3,2,3")
    job = jobs.start(cmd + [PYTHON, *train], env=jobs.env(HVD_RESILIENT_FAULT=fault), name=name)
    return run, job


def _assert_recovered(run, fired_at: float, event: str, within_s: float,
                      sizes: list[int]) -> list[dict]:
    evs = events(run / "events.jsonl")
    found = [e for e in evs if e["event"] == event]
    assert found, f"no {event} event: {[e['event'] for e in evs][-30:]}"
    detected = [e for e in evs if e["event"] == "failure_detected" and e["ts"] > fired_at]
    assert detected and detected[0]["ts"] - fired_at < within_s, detected[:1]
    for r in (e for e in evs if e["event"] == "restore"):
        assert 0 <= r["lost_steps"] <= 5, r
    assert sizes_seen(run)[:len(sizes)] == sizes, sizes_seen(run)
    assert len(set(final_digests(run).values())) == 1
    return evs


def test_a_frozen_worker_is_evicted_and_killed_not_waited_for(tmp_path, jobs):
    run, job = _slots_job(tmp_path, jobs, "freeze:rank=1:step=30", "freeze")
    assert job.wait(300) == 0, job.output()[-3000:]
    (fired_at,) = assert_faults_fired(run, 1)
    evs = _assert_recovered(run, fired_at, "peer_silent", within_s=10, sizes=[3, 2, 3])
    silent = next(e for e in evs if e["event"] == "peer_silent")
    assert silent["ranks"] == [1], silent
    stopped = [p for p in job.processes() if _status(p) == psutil.STATUS_STOPPED]
    assert not stopped, f"a frozen worker was left behind: {stopped}"
    assert_exactly_once(run, 2048)


def test_a_hung_worker_writes_its_stacks_and_is_ended(tmp_path, jobs):
    run, job = _slots_job(tmp_path, jobs, "hang:rank=2:step=30", "hang", DIGITS, "--run-dir",
                          str(tmp_path / "run"), "--epochs", "3", "--batch-size", "16",
                          "--commit-every", "5", "--recovery-progress-timeout-seconds", "3")
    assert job.wait(300) == 0, job.output()[-3000:]
    (fired_at,) = assert_faults_fired(run, 1)
    evs = _assert_recovered(run, fired_at, "hang_detected", within_s=15, sizes=[3, 2])
    hang = next(e for e in evs if e["event"] == "hang_detected")
    assert hang["rank"] == 2 and hang["section"] == "step", hang
    stacks = (run / "hangs").glob("rank2-*.txt")
    text = "".join(p.read_text() for p in stacks)
    assert "maybe_fire" in text and "Thread" in text, text[:2000]


def _status(p: psutil.Process) -> str:
    try:
        return p.status()
    except psutil.Error:
        return "gone"


# -- the same failures under restart-all launchers: torchrun and mpirun ----------------------
HVD = str(VENV_BIN / "hvd-resilient")
COMMON = ["--epochs", "6", "--commit-every", "5", "--checkpoint-every", "20", "--seed", "2"]


def _restart_job(tmp_path, jobs, backend: str, fault: str, *train: str):
    """`hvd-resilient run` with two workers on this machine; a torchrun restart or a
    supervisor relaunch brings the job back from its last commit (memory tier)."""
    run = tmp_path / "run"
    extra = (["--nnodes", "1:2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
             if backend == "torchrun" else [])
    job = jobs.start([HVD, "run", "--launcher", backend, "--np", "2", *extra, "--run-id", "run",
                      "--run-dir", str(run), "--max-restarts", "2", "--", PYTHON, DIGITS,
                      *COMMON, *train], env=jobs.env(HVD_RESILIENT_FAULT=fault), name=backend)
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    resume = resumed_from_last_commit(evs)  # not the durable checkpoint of step 60
    assert 70 - resume["from_step"] <= 5
    assert len({e["params_sha256"] for e in evs if e["event"] == "done"}) == 1
    return run, job, evs


@pytest.mark.parametrize("backend", ["torchrun", "mpi"])
def test_a_frozen_worker_ends_a_restart_all_job_now_not_at_its_timeout(tmp_path, jobs, backend):
    run, job, evs = _restart_job(tmp_path, jobs, backend, "freeze:rank=1:step=70",
                                 "--recovery-pg-timeout-seconds", "600")
    (silent,) = [e for e in evs if e["event"] == "peer_silent"]
    assert silent["ranks"] == [1] and silent["rank"] == 0, silent
    stopped = [p for p in job.processes() if _status(p) == psutil.STATUS_STOPPED]
    assert not stopped, f"a frozen worker was left behind: {stopped}"


@pytest.mark.parametrize("backend", ["torchrun", "mpi"])
def test_a_hung_worker_ends_a_restart_all_job_with_its_stacks(tmp_path, jobs, backend):
    run, job, evs = _restart_job(tmp_path, jobs, backend, "hang:rank=1:step=70",
                                 "--recovery-progress-timeout-seconds", "3")
    (hang,) = [e for e in evs if e["event"] == "hang_detected"]
    assert hang["rank"] == 1 and hang["section"] == "step", hang
    assert "maybe_fire" in "".join(p.read_text() for p in (run / "hangs").glob("rank1-*.txt"))


def test_long_first_step_and_a_long_stall_below_the_budget_are_not_failures(tmp_path, jobs):
    """A first step that takes 20 s (compilation, loader warm-up) and a 10 s busy stall later
    (a slow batch), under the default budgets (first step 600 s; later max(30 s, 10 x the
    slowest step)) and the default heartbeats: nothing may fire."""
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:2")
    cmd = horovodrun_elastic(discover, 2, 1, 2, "--gloo-timeout-seconds", GLOO_TIMEOUT)
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    job = jobs.start(
        cmd + [PYTHON, DIGITS, "--run-dir", str(run), "--epochs", "1", "--batch-size", "16",
               "--commit-every", "5"],
        env=jobs.env(HVD_RESILIENT_FAULT="stall:rank=0:step=0:seconds=20,"
                                         "stall:rank=1:step=20:seconds=10"), name="no-alarm")
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 2)
    evs = events(run / "events.jsonl")
    alarms = [e for e in evs if e["event"] in ("hang_detected", "peer_silent", "failure_detected",
                                               "reset")]
    assert not alarms, alarms
    assert len(set(final_digests(run).values())) == 1


def _elastic_two(tmp_path, jobs, *train: str, name: str):
    """Two workers on this machine under the Horovod driver, elastic, no fault planned."""
    run = tmp_path / name
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:2")
    cmd = horovodrun_elastic(discover, 2, 1, 2, "--gloo-timeout-seconds", GLOO_TIMEOUT)
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    job = jobs.start(cmd + [PYTHON, str(SCRIPTS / "long_phases_job.py"), "--run-dir",
                            str(run), *train], name=name)
    assert job.wait(400) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    alarms = [e for e in evs if e["event"] in ("hang_detected", "peer_silent",
                                               "failure_detected", "reset")]
    assert not alarms, alarms
    assert len(set(final_digests(run).values())) == 1
    return evs


def test_a_30s_evaluation_in_a_declared_section_is_not_a_hang(tmp_path, jobs):
    """Every rank evaluates for 30 s at step 12 inside `watchdog.section`, with the progress
    timeout at 3 s: the section's own budget holds, nothing fires."""
    evs = _elastic_two(tmp_path, jobs, "--eval-at", "12", "--eval-seconds", "30",
                       "--recovery-progress-timeout-seconds", "3", "--max-steps", "24",
                       "--epochs", "9", "--commit-every", "4", name="eval")
    assert len([e for e in evs if e["event"] == "evaluated"]) == 2


def test_a_1gb_state_copied_at_commits_and_checkpoints_is_not_a_failure(tmp_path, jobs):
    """A 1 GB state: every commit copies it (Horovod's commit and the memory tier), every
    checkpoint snapshots it, under the default heartbeats and progress budgets."""
    evs = _elastic_two(tmp_path, jobs, "--ballast-mb", "1024", "--max-steps", "12", "--epochs", "9",
                       "--commit-every", "4", "--checkpoint-every", "8", name="big")
    saved = [e for e in evs if e["event"] == "checkpoint_saved"]
    assert saved and all(e["bytes"] > 2**30 for e in saved), saved
    assert [e for e in evs if e["event"] == "memory_commit"]


def test_a_frozen_worker_on_another_node_does_not_hold_the_restart(tmp_path, jobs):
    """Two torchrun nodes of one worker each; node 1 has a hostname of its own (a UTS
    namespace), so node 0's worker cannot kill it: it finds rank 1 silent and exits, and node
    1's agent must end its stopped worker at once. torchrun alone sends SIGTERM, which a
    stopped process cannot act on, and SIGKILLs 30 s later ("Unable to shutdown process")."""
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"

    def node(i: int) -> list[str]:
        cmd = [HVD, "run", "--launcher", "torchrun", "--np", "1", "--nnodes", "2",
               "--rdzv-endpoint", endpoint, "--run-id", "run", "--run-dir", str(run),
               "--max-restarts", "2", "--", PYTHON, DIGITS, *COMMON]
        return cmd if i == 0 else ["unshare", "--uts", "sh", "-c",
                                   'hostname "$0" && exec "$@"', "node1", *cmd]

    started = [jobs.start(node(i), env=jobs.env(
        HVD_RESILIENT_FAULT="freeze:rank=1:step=70",
        HVD_RESILIENT_MEMORY_TIER_DIR=str(tmp_path / f"shm{i}")), name=f"node{i}")
        for i in range(2)]
    for job in started:
        assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    (silent,) = [e for e in evs if e["event"] == "peer_silent"]
    assert silent["ranks"] == [1] and silent["rank"] == 0, silent
    assert "Unable to shutdown process" not in started[1].output(), started[1].output()[-3000:]
    # node 1's copy of the last commit may be incomplete (its writer froze with it): then its
    # rank fetches node 0's, and the resume says so
    (source,) = {e["source"] for e in evs if e["event"] == "resume"}
    assert source in ("memory", "peer"), source
    resume = resumed_from_last_commit(evs, source)
    assert 70 - resume["from_step"] <= 5
    assert len({e["params_sha256"] for e in evs if e["event"] == "done"}) == 1
    assert not [p for job in started for p in job.processes()
                if _status(p) == psutil.STATUS_STOPPED]
