"""A restart of every worker resumes from the last commit kept in host memory (the memory
tier), not from the last durable checkpoint: under mpirun (a rank killed, the supervisor
relaunches), under a relaunched horovodrun driver, and with a corrupt copy skipped. The runs
write durable checkpoints only every 1000 steps, so a resume from memory is the only way to
lose no more than one commit interval. Each run ends with the parameters of a run never
killed, every sample used exactly once, and nothing of it left in the memory tier."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from tests.support.exactly_once import assert_exactly_once
from tests.support.jobs import PYTHON, events, launchers_of, wait_for
from tests.support.paths import ROOT, SCRIPTS
from tests.support.runs import assert_faults_fired, resumed_from_last_commit

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HVD = str(Path(PYTHON).parent / "hvd-resilient")
JOB = str(SCRIPTS / "elastic_job.py")
DIGITS = str(ROOT / "examples" / "digits.py")
N_SAMPLES = 2048


def mpi_job(jobs, tmp: Path, name: str, *, restarts: int = 2, fault: str = ""):
    run = tmp / name
    env = jobs.env(HVD_RESILIENT_FAULT=fault) if fault else jobs.env()
    job = jobs.start([HVD, "run", "--launcher", "mpi", "--np", "2", "--run-id", name,
                      "--run-dir", str(run), "--max-restarts", str(restarts), "--", PYTHON,
                      JOB, "--run-dir", str(run), "--steps", "90", "--commit-every", "5",
                      "--checkpoint-url", f"file://{tmp}/ckpt-{name}",
                      "--checkpoint-every", "1000", "--memory-tier"], env=env, name=name)
    return run, job


def digests(run: Path) -> set[str]:
    return {e["params_sha256"] for e in events(run / "events.jsonl") if e["event"] == "done"}


def segments(root: str) -> list[str]:
    """Every file the memory tier holds (the lock files aside)."""
    return sorted(str(Path(d, n).relative_to(root)) for d, _, names in os.walk(root)
                  for n in names if not n.startswith("."))


def test_mpi_rank_killed_resumes_from_memory_exactly_once(tmp_path, jobs, memory_tier_dir):
    ref, job = mpi_job(jobs, tmp_path, "ref")
    assert job.wait(300) == 0, job.output()[-3000:]
    (reference,) = digests(ref)

    run, job = mpi_job(jobs, tmp_path, "run", fault="kill:rank=1:step=33")
    assert job.wait(300) == 0, job.output()[-3000:]
    assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    assert [e["attempt"] for e in evs if e["event"] == "restart"] == [1]
    resume = resumed_from_last_commit(evs)
    assert resume["from_step"] == 30 and resume["durable_step"] == -1, resume
    assert digests(run) == {reference}, "the resumed run is not bit-identical"
    assert_exactly_once(run, N_SAMPLES)
    assert segments(memory_tier_dir) == [], "a finished run left its commits in memory"
    report = subprocess.run([HVD, "report", str(run)], capture_output=True, text=True,
                            timeout=120)
    assert "resumed from step 30 (memory)" in report.stdout, report.stdout


def test_a_corrupt_memory_copy_is_skipped_and_the_one_before_is_used(tmp_path, jobs,
                                                                     memory_tier_dir):
    run, job = mpi_job(jobs, tmp_path, "run", restarts=0, fault="kill:rank=1:step=33")
    assert job.wait(300) not in (0, None), "the job should have failed without restarts"
    data = sorted(Path(memory_tier_dir).rglob("step-*.data"))
    assert [p.name for p in data] == ["step-0000000025.data", "step-0000000030.data"], \
        segments(memory_tier_dir)
    with open(data[-1], "r+b") as f:  # one flipped byte in the newest commit
        f.seek(os.path.getsize(data[-1]) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))

    again = jobs.start([HVD, "run", "--launcher", "mpi", "--np", "2", "--run-id", "run",
                        "--run-dir", str(run), "--", PYTHON, JOB, "--run-dir", str(run),
                        "--steps", "90", "--commit-every", "5", "--checkpoint-url",
                        f"file://{tmp_path}/ckpt-run", "--checkpoint-every", "1000",
                        "--memory-tier"], name="again")
    assert again.wait(300) == 0, again.output()[-3000:]
    evs = events(run / "events.jsonl")
    skipped = [e for e in evs if e["event"] == "checkpoint_skipped"]
    assert [(e["tier"], e["ckpt_step"]) for e in skipped] == [("memory", 30)], skipped
    assert "digest mismatch" in skipped[0]["reason"]
    (resume,) = [e for e in evs if e["event"] == "resume"]
    assert (resume["source"], resume["from_step"]) == ("memory", 25), resume
    assert len(digests(run)) == 1
    assert_exactly_once(run, N_SAMPLES)
    assert segments(memory_tier_dir) == []


def _driver(job) -> psutil.Process:
    """The supervisor's one child that is not its warm pool or guard: horovodrun's driver."""
    (kid,) = launchers_of(job.proc.pid)
    assert "horovod" in " ".join(kid.cmdline()), kid.cmdline()
    return kid


def digits_run(jobs, tmp: Path, name: str, *flags: str):
    """`hvd-resilient run FLAGS` of examples/digits.py, commits every 5 steps and durable
    checkpoints only every 1000: (run folder, job)."""
    run = tmp / name
    return run, jobs.start(
        [HVD, "run", *flags, "--network-interface", "lo", "--run-id", name, "--run-dir",
         str(run), "--max-restarts", "2", "--", PYTHON, DIGITS, "--epochs", "6",
         "--commit-every", "5", "--checkpoint-every", "1000", "--seed", "4"], name=name)


def wait_for_memory_commit(run: Path, job, step: int) -> None:
    wait_for(lambda: any(e["event"] == "memory_commit" and e["ckpt_step"] >= step
                         for e in events(run / "events.jsonl")),
             240, f"a commit at step >= {step}", job)


def test_horovodrun_driver_killed_relaunch_resumes_from_memory(tmp_path, jobs,
                                                               memory_tier_dir):
    flags = ("--launcher", "horovod", "--np", "2")
    ref, job = digits_run(jobs, tmp_path, "ref", *flags)
    assert job.wait(300) == 0, job.output()[-3000:]
    (reference,) = digests(ref)

    run, job = digits_run(jobs, tmp_path, "run", *flags)
    wait_for_memory_commit(run, job, 40)
    _driver(job).send_signal(signal.SIGKILL)
    assert job.wait(300) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    assert [e["attempt"] for e in evs if e["event"] == "restart"] == [1]
    (resume,) = [e for e in evs if e["event"] == "resume"]
    committed = [e["ckpt_step"] for e in evs if e["event"] == "memory_commit"
                 and e["ts"] < resume["ts"]]
    # Nothing lost: local workers get SIGTERM from horovodrun's middleman when the driver
    # dies and stop with a final durable checkpoint (then their commits go); workers that
    # get no signal (a remote ssh session) exit as driver_lost, and the memory tier has it.
    assert resume["from_step"] >= max(committed) >= 40, (resume, committed[-3:])
    if resume["source"] == "durable":
        assert [e for e in evs if e["event"] == "preempted" and e["ts"] < resume["ts"]]
    else:
        assert resume["source"] == "memory", resume
    assert digests(run) == {reference}, "the resumed run is not bit-identical"
    assert segments(memory_tier_dir) == []


def test_horovodrun_driver_lost_over_ssh_relaunch_forks_from_the_supervisors_warm_pool(
        tmp_path, jobs, memory_tier_dir):
    """The driver and its middlemen SIGKILLed: the workers get no signal, as over ssh. Those
    on the driver's machine find its process gone in /proc (not after five failed probes),
    exit with their commits in memory, and the relaunched driver's workers are forked from
    the pool `hvd-resilient run --warm-pool` holds across launches (the driver's own pool
    would have died with it). The run ends bit-identical to one never killed."""
    from tests.support.jobs import write_discovery

    _, discover = write_discovery(tmp_path, "localhost:2")

    flags = ("--launcher", "horovod", "--discovery", str(discover), "--np", "2", "--min-np",
             "2", "--max-np", "2")
    ref, job = digits_run(jobs, tmp_path, "ref", *flags)
    assert job.wait(300) == 0, job.output()[-3000:]
    (reference,) = digests(ref)

    run, job = digits_run(jobs, tmp_path, "run", *flags, "--warm-pool")
    wait_for_memory_commit(run, job, 40)
    driver = _driver(job)
    for p in [*driver.children(), driver]:  # the middlemen first: no SIGTERM reaches a worker
        try:
            p.kill()
        except psutil.NoSuchProcess:  # a child that ended meanwhile (a discovery call)
            pass
    assert job.wait(300) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    assert [e["attempt"] for e in evs if e["event"] == "restart"] == [1]
    (restart,) = [e for e in evs if e["event"] == "restart"]
    lost = [e for e in evs if e["event"] == "driver_lost"]
    assert sorted(e["rank"] for e in lost) == [0, 1], lost
    assert {e["found_by"] for e in lost} == {"process"}, lost
    pools = [e for e in evs if e["event"] == "warm_pool_ready"]
    assert [e.get("held_by") for e in pools] == ["supervisor", "supervisor"], pools
    relaunched = [e for e in evs if e["event"] == "start" and e["ts"] > restart["ts"]]
    assert len(relaunched) == 2 and all(e.get("warm") for e in relaunched), relaunched
    resumed_from_last_commit(evs)
    assert digests(run) == {reference}, "the resumed run is not bit-identical"
    assert segments(memory_tier_dir) == []


def test_torchrun_a_node_without_its_copy_fetches_the_peers(tmp_path, jobs):
    """Two torchrun nodes (agents) on this machine, each with its own memory tier folder, as
    two hosts would have. Everything is SIGKILLed, the second node's memory is wiped (a
    replaced host), and both are started again: the second node's rank fetches the commit
    from the first node's copy over HTTP, and the run ends as if nothing had happened."""
    from hvd_resilient.launch.launchers.torchrun import torchrun_command
    from tests.support.jobs import free_port

    run = tmp_path / "run"
    memory = [str(tmp_path / f"shm-node{i}") for i in range(2)]
    train = [PYTHON, DIGITS, "--run-id", "peer", "--run-dir", str(run), "--checkpoint-url",
             f"file://{tmp_path}/ckpt", "--checkpoint-every", "1000", "--commit-every", "10",
             "--epochs", "8", "--seed", "5"]

    def nodes(endpoint: str) -> list:
        cmd = torchrun_command(1, "2", endpoint, 0, "peer", train)
        return [jobs.start(cmd, env=jobs.env(HVD_RESILIENT_MEMORY_TIER_DIR=memory[i]),
                           name=f"node{i}") for i in range(2)]

    first = nodes(f"127.0.0.1:{free_port()}")

    def on_both() -> set[int]:  # steps whose copies both nodes completed
        ranks: dict[int, set[int]] = {}
        for e in events(run / "events.jsonl"):
            if e["event"] == "memory_commit":
                ranks.setdefault(e["ckpt_step"], set()).add(e["rank"])
        return {s for s, r in ranks.items() if r == {0, 1}}

    wait_for(lambda: any(s >= 60 for s in on_both()), 240, "a commit at step >= 60 on both",
             first[0])
    for job in first:
        job.kill_all()
    for job in first:
        job.wait(30)
    held = [sorted(p.name for p in Path(m).rglob("step-*.json")) for m in memory]
    assert held[0] and held[1], held  # each node wrote its own copy
    shutil.rmtree(memory[1])

    again = nodes(f"127.0.0.1:{free_port()}")
    for job in again:
        assert job.wait(300) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    # the newest commit the first node held (not the newest any node reported: the kill may
    # land between the two nodes' copies of one step, and the second node's copy is gone)
    (resume,) = [e for e in evs if e["event"] == "resume"]
    assert resume["source"] == "peer" and resume["from_step"] >= 60, resume
    assert resume["fetched_by"] and resume["durable_step"] == -1, resume
    assert Path(held[0][-1]).stem == f"step-{resume['from_step']:010d}"
    done = [e for e in evs if e["event"] == "done"]
    assert len(done) == 2 and len({e["params_sha256"] for e in done}) == 1, done
    assert not [p for m in memory for p in Path(m).rglob("step-*")], "commits left in memory"


def test_torchrun_a_node_that_cannot_hold_the_tier_still_takes_part(tmp_path, jobs):
    """One torchrun node's memory folder cannot be created (its parent is a file): that node
    keeps no copy, but it must still join every collective of the tier (the commit's gather
    of random streams, the resume's agreement), or the job would hang at its first commit."""
    from hvd_resilient.launch.launchers.torchrun import torchrun_command
    from tests.support.jobs import free_port

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    memory = [str(tmp_path / "shm-node0"), str(blocker / "shm")]
    run = tmp_path / "run"
    train = [PYTHON, DIGITS, "--run-id", "half", "--run-dir", str(run), "--checkpoint-url",
             f"file://{tmp_path}/ckpt", "--commit-every", "10", "--epochs", "2", "--seed", "5"]
    cmd = torchrun_command(1, "2", f"127.0.0.1:{free_port()}", 0, "half", train)
    nodes = [jobs.start(cmd, env=jobs.env(HVD_RESILIENT_MEMORY_TIER_DIR=memory[i]),
                        name=f"node{i}") for i in range(2)]
    for job in nodes:
        assert job.wait(240) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    off = [e for e in evs if e["event"] == "memory_tier"]
    assert len(off) == 1 and off[0]["enabled"] is False and "shm" in off[0]["reason"], off
    writers = {e["rank"] for e in evs if e["event"] == "memory_commit"}
    assert writers and off[0]["rank"] not in writers, (writers, off)
    assert len([e for e in evs if e["event"] == "done"]) == 2
