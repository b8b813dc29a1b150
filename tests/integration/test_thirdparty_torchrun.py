"""PyTorch's DDP tutorial scripts (pytorch/examples, distributed/ddp-tutorial-series), unchanged
but for `cpu.patch` (Gloo, CPU), under `hvd-resilient run --launcher torchrun`.

They know nothing of this library: they call `init_process_group(backend="gloo")` (env://),
keep their own `snapshot.pt` (rank 0 saves it every `save_every` epochs, every rank loads it
at start) and end with `destroy_process_group()`. A worker killed mid-run must cost a restart
of the round, not the job: the restarted round forms its group (it read the dead round's
addresses from torchrun's shared store before, `launch/torchrun_worker.py`), the script
resumes from its snapshot, and every rank ends with the same parameters (the probe's digests,
tests/support/thirdparty.py).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from tests.support.jobs import PYTHON, Job, events, free_port, wait_for
from tests.support.thirdparty import prepare, probe_env, probed_digests

pytestmark = [pytest.mark.slow, pytest.mark.timeout(170)]
HVD = str(Path(PYTHON).parent / "hvd-resilient")
NP = 3
EPOCHS, SAVE_EVERY = 10, 2  # ~0.8 s an epoch here (22 steps of 32 per rank)


def marks(probe: Path) -> list[dict]:
    """The probe's `group` and `step` marks (rank, pid, restart count, time), in order."""
    f = probe / "marks.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()] \
        if f.exists() else []


def start(jobs, tmp: Path, script: str, *extra: str,
          fork: str = "1") -> tuple[Job, Path, Path]:
    """The tutorial script, prepared into its own folder (its snapshot.pt lands there), run
    under our torchrun launcher with the digest probe on (a folder prepared already is
    kept as it is)."""
    work = tmp / "script"
    if not work.exists():
        prepare("pytorch_ddp_tutorial", work, ("cpu.patch",))
    probe, run = tmp / "probe", tmp / "run"
    cmd = [HVD, "run", "--launcher", "torchrun", "--np", str(NP), *extra,
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-id", tmp.name,
           "--run-dir", str(run), "--", PYTHON, script, str(EPOCHS), str(SAVE_EVERY)]
    env = probe_env(jobs.env(HVD_RESILIENT_TORCHRUN_FORK=fork), probe)
    return jobs.start(cmd, env=env, cwd=work, name=tmp.name), \
        probe, work


def assert_ranks_equal(probe: Path) -> None:
    digests = probed_digests(probe)
    assert sorted(digests) == list(range(NP)), digests
    assert len(set(digests.values())) == 1, digests


@pytest.mark.extended  # the kill test below runs the same script to its end
def test_tutorial_script_fault_free(tmp_path, jobs):
    job, probe, work = start(jobs, tmp_path, "multigpu_torchrun.py")
    assert job.wait(90) == 0, job.output()[-3000:]
    assert_ranks_equal(probe)
    assert "Loading snapshot" not in job.output()
    assert {m["restart"] for m in marks(probe)} == {0}
    assert (work / "snapshot.pt").exists()


def kill_rank1_after_a_snapshot(job: Job, probe: Path, work: Path) -> dict:
    """SIGKILL to rank 1's process once rank 0 has saved the snapshot of epoch 2 (the one
    the restart must resume from) and training goes on; returns the killed process' mark."""
    wait_for(lambda: f"Epoch {SAVE_EVERY} | Training snapshot saved" in job.output(), 60,
             "the snapshot of epoch 2", job)
    victim = next(m for m in marks(probe) if m["mark"] == "group" and m["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    return victim


@pytest.mark.parametrize("fork", ["1", pytest.param("0", marks=pytest.mark.extended)])
def test_tutorial_script_worker_killed_restarts_from_its_snapshot(tmp_path, jobs, fork):
    """fork "0": workers are new interpreters (`python -m hvd_resilient.launch.torchrun_worker
    SCRIPT`), the path taken when the agent cannot fork them."""
    job, probe, work = start(jobs, tmp_path, "multigpu_torchrun.py", fork=fork)
    victim = kill_rank1_after_a_snapshot(job, probe, work)
    assert job.wait(100) == 0, job.output()[-4000:]
    out = job.output()
    assert "Loading snapshot" in out and "Resuming training from snapshot at Epoch" in out, \
        out[-3000:]
    seen = marks(probe)
    restarted = {m["rank"] for m in seen if m["mark"] == "step" and m["restart"] >= 1}
    assert restarted == set(range(NP)), seen  # the new round formed its group and trained
    assert victim["pid"] not in {m["pid"] for m in seen if m["restart"] >= 1}
    assert_ranks_equal(probe)
    # torchrun restarted the round in the job; the supervisor had nothing to relaunch
    assert not [e for e in events(tmp_path / "run" / "events.jsonl")
                if e["event"] == "restart"]


@pytest.mark.extended  # the second variant: two agents on one machine
def test_multinode_script_on_two_agents_a_worker_killed_on_one(tmp_path, jobs):
    """multinode.py (the same script keyed by the global rank) on two torchrun agents, two
    "nodes" of one machine with one c10d rendezvous (`--nnodes 2`, 2 workers each, one
    supervisor each, sharing the run). A worker of the second node is killed: both agents
    restart their workers into the next rendezvous round, whose group must form across the
    nodes (the store prefix is the rendezvous round, which both agents agree on)."""
    extra = ("--nnodes", "2", "--np", "2")
    endpoint = f"127.0.0.1:{free_port()}"
    work = prepare("pytorch_ddp_tutorial", tmp_path / "script", ("cpu.patch",))
    probe, run = tmp_path / "probe", tmp_path / "run"
    cmd = [HVD, "run", "--launcher", "torchrun", *extra, "--rdzv-endpoint", endpoint,
           "--run-id", "two", "--run-dir", str(run), "--", PYTHON, "multinode.py",
           str(EPOCHS), str(SAVE_EVERY)]
    env = probe_env(jobs.env(), probe)
    nodes = [jobs.start(cmd, env=env, cwd=work, name=f"node{n}") for n in (0, 1)]
    wait_for(lambda: any(f"Epoch {2 * SAVE_EVERY} | Training snapshot saved" in n.output()
                         for n in nodes), 90, "the snapshot of epoch 4", nodes[0])
    victim = next(m for m in marks(probe) if m["mark"] == "group" and m["rank"] == 3)
    os.kill(victim["pid"], signal.SIGKILL)
    for node in nodes:
        assert node.wait(100) == 0, node.output()[-4000:]
    assert any("Resuming training from snapshot at Epoch" in n.output() for n in nodes)
    restarted = {m["rank"] for m in marks(probe) if m["mark"] == "step" and m["restart"] >= 1}
    assert restarted == {0, 1, 2, 3}, marks(probe)
    digests = probed_digests(probe)
    assert sorted(digests) == [0, 1, 2, 3] and len(set(digests.values())) == 1, digests


def test_supervisor_relaunches_a_script_without_events_that_trained(tmp_path, jobs):
    """torchrun allowed no restart in the job (--torchrun-restarts 0): the kill ends the
    launch. The script writes no events, but its workers' first optimizer steps are on record
    (`first_step`), so the supervisor relaunches it, and the relaunch resumes from the
    script's own snapshot."""
    job, probe, work = start(jobs, tmp_path, "multigpu_torchrun.py", "--torchrun-restarts", "0",
                             "--max-restarts", "1")
    kill_rank1_after_a_snapshot(job, probe, work)
    assert job.wait(100) == 0, job.output()[-4000:]
    assert "Resuming training from snapshot at Epoch" in job.output()
    evs = events(tmp_path / "run" / "events.jsonl")
    restarts = [e for e in evs if e["event"] == "restart"]
    assert [(e["attempt"], e["evidence"]) for e in restarts] == [(1, "first_step")], restarts
    launches = [e["ts"] for e in evs if e["event"] == "launch"]
    stepped = {(e["rank"], e["ts"] > launches[1]) for e in evs if e["event"] == "first_step"}
    assert stepped == {(r, again) for r in range(NP) for again in (False, True)}, stepped
    assert_ranks_equal(probe)


def test_a_torn_snapshot_fails_the_job_without_a_relaunch_loop(tmp_path, jobs):
    """The script's torch.save is not atomic: rank 0 killed during a save leaves a torn
    snapshot.pt, which every start fails to load. No worker steps, so neither torchrun's
    restarts nor the supervisor go on for ever: the job ends, and says why."""
    work = prepare("pytorch_ddp_tutorial", tmp_path / "script", ("cpu.patch",))
    (work / "snapshot.pt").write_bytes(b"PK\x03\x04 torn by a kill during torch.save")
    job, probe, _ = start(jobs, tmp_path, "multigpu_torchrun.py", "--torchrun-restarts", "1")
    assert job.wait(90) != 0, job.output()[-3000:]
    out = job.output()
    assert "not restarting: no rank wrote a `start` event (nor `first_step`" in out, out[-3000:]
    assert not [e for e in events(tmp_path / "run" / "events.jsonl")
                if e["event"] in ("restart", "first_step")]
