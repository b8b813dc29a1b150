"""One job per run, whatever dies: a job never outlives `hvd-resilient run` (`launch/job_guard.py`).

SIGKILL of the supervisor (the OOM killer, an impatient operator) gives it no chance to stop
anything: every process of the job must still be gone within 2 s, on every launcher, and
nothing more may be written to the run."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from hvd_resilient.launch.job_guard import JOB_ENV
from tests.support.jobs import PYTHON, events, free_port, wait_for
from tests.support.paths import ROOT

HVD = str(Path(PYTHON).parent / "hvd-resilient")
DIGITS = str(ROOT / "examples" / "digits.py")
GONE_WITHIN_S = 2.0


def _launcher_args(launcher: str) -> list[str]:
    return {"horovod": ["--network-interface", "lo"], "mpi": [], "inplace": [],
            "torchrun": ["--rdzv-endpoint", f"127.0.0.1:{free_port()}"]}[launcher]


def _job_processes(token: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(JOB_ENV) == token:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def _ended(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _token_of(supervisor_pid: int) -> str:
    """The job's token, read off a child of the supervisor (the supervisor never has it)."""
    for child in psutil.Process(supervisor_pid).children(recursive=True):
        try:
            token = child.environ().get(JOB_ENV)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if token:
            return token
    return ""


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("launcher", ["horovod", "mpi", "torchrun", "inplace"])
def test_sigkill_of_run_ends_every_process_of_the_job(launcher, tmp_path, jobs):
    run = tmp_path / "run"
    cmd = [HVD, "run", "--launcher", launcher, "--np", "2", "--run-id", "k", "--run-dir",
           str(run), "--checkpoint", f"file://{tmp_path}/ckpt", *_launcher_args(launcher), "--",
           PYTHON, DIGITS, "--epochs", "1000", "--commit-every", "5", "--checkpoint-every", "40"]
    job = jobs.start(cmd, name=launcher)
    log = run / "events.jsonl"
    training = lambda: (len({e["rank"] for e in events(log) if e["event"] == "start"}) == 2  # noqa: E731
                        and any(e["event"] in ("commit", "memory_commit") and e["step"] >= 10
                             for e in events(log)))
    wait_for(training, 120, "both ranks training", job)
    token = _token_of(job.proc.pid)
    assert token, "the launcher's environment carries no job token"
    before = _job_processes(token)
    assert len(before) >= 3, f"launcher and 2 ranks expected, found {before}"

    t0 = time.monotonic()
    job.proc.send_signal(signal.SIGKILL)
    job.proc.wait(10)
    left = _job_processes(token)
    while left and time.monotonic() - t0 < 10:
        time.sleep(0.02)
        left = _job_processes(token)
    gone_after = time.monotonic() - t0
    assert not left, f"still running 10 s after the supervisor died: {left}"
    assert gone_after < GONE_WITHIN_S, f"the job took {gone_after:.2f}s to end"

    # nothing writes to the run any more: the event log and the checkpoints stay as they are
    ended = wait_for(lambda: [e for e in events(log) if e["event"] == "job_ended_with_supervisor"],
                     10, "the guard's event")
    assert ended[0]["processes"] >= len(before)
    snapshot = (log.stat().st_size, sorted(p.name for p in (tmp_path / "ckpt").glob("*")))
    wait_for(lambda: not job.processes(), 10, "the guard to exit")
    assert (log.stat().st_size, sorted(p.name for p in (tmp_path / "ckpt").glob("*"))) \
        == snapshot
    assert not [e for e in events(log) if e["event"] == "done"]
    # every event of the job says which job of the run wrote it: the supervisor's, the
    # driver's, the workers'
    unmarked = {e["event"] for e in events(log) if e.get("lease_epoch") != 1
                and e["event"] != "job_ended_with_supervisor"}
    assert not unmarked, f"events without the job's lease epoch: {unmarked}"


TRAINING = ("commit", "memory_commit", "checkpoint_saved", "checkpoint_fenced", "epoch_end",
            "done")
"""Events only a training rank writes: which lease epoch trained when."""


def _inplace_cmd(tmp_path: Path, epochs: int) -> list[str]:
    return [HVD, "run", "--launcher", "inplace", "--np", "2", "--run-id", "k", "--run-dir",
            str(tmp_path / "run"), "--checkpoint", f"file://{tmp_path}/ckpt", "--", PYTHON,
            DIGITS, "--epochs", str(epochs), "--commit-every", "5", "--checkpoint-every", "10"]


def _trained(log: Path, epoch: int) -> list[dict]:
    return [e for e in events(log) if e["event"] in TRAINING and e["rank"] >= 0
            and e.get("lease_epoch") == epoch]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_relaunch_right_after_a_sigkill_of_run_never_trains_beside_the_old_job(tmp_path, jobs):
    """The relaunch takes the run with the next lease epoch; the old epoch's last training
    event comes before the new one's first, and the run ends with every rank equal."""
    log = tmp_path / "run" / "events.jsonl"
    old = jobs.start(_inplace_cmd(tmp_path, 40), name="old")
    wait_for(lambda: any(e["event"] == "checkpoint_saved" for e in _trained(log, 1)), 120,
             "the first job checkpointing", old)
    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait(10)
    new = jobs.start(_inplace_cmd(tmp_path, 40), name="new")
    assert new.wait(180) == 0, new.output()[-3000:]
    first, second = _trained(log, 1), _trained(log, 2)
    assert first and second
    assert max(e["ts"] for e in first) < min(e["ts"] for e in second), "two jobs trained at once"
    done = [e for e in events(log) if e["event"] == "done"]
    assert {e["lease_epoch"] for e in done} == {2} and len(done) == 2
    assert len({e["params_sha256"] for e in done}) == 1
    assert [e["lease_epoch"] for e in events(log) if e["event"] == "lease_taken"] == [1, 2]
    report = subprocess.run([HVD, "report", str(tmp_path / "run")], capture_output=True,
                            text=True, timeout=60)
    assert "2 (lease epochs 1, 2), one at a time" in report.stdout, report.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_job_taken_over_is_refused_its_checkpoints_and_stops_itself(tmp_path, jobs):
    """The old job's supervisor, the lease holder, is frozen (SIGSTOP: alive, holding the run)
    while its workers train on. The relaunch waits for the lease to lapse, takes the run with
    epoch 2 and raises the store's fence: the old workers stop themselves (exit 78) at their
    next checkpoint, which the store refuses, or when their lease watch sees epoch 2. The old
    supervisor, resumed, finds the run taken, ends what is left
    of its job and exits 78 with one line; the relaunch finishes with every rank equal."""
    log = tmp_path / "run" / "events.jsonl"
    old = jobs.start(_inplace_cmd(tmp_path, 1000), name="old")
    wait_for(lambda: any(e["event"] == "checkpoint_saved" for e in _trained(log, 1)), 120,
             "the first job checkpointing", old)
    supervisor = psutil.Process(old.proc.pid)
    workers = [p for p in supervisor.children(recursive=True)
               if "digits.py" in " ".join(p.cmdline()) and p.ppid() != supervisor.pid]
    assert len(workers) == 2, workers
    supervisor.suspend()
    try:
        new = jobs.start(_inplace_cmd(tmp_path, 60), name="new")
        # ended, as zombies: their parents wait for the frozen supervisor
        wait_for(lambda: all(_ended(p) for p in workers), 120,
                 "the old job's workers to stop themselves", new)
        assert "is held by a live job" in new.output()
        taken = [e["ts"] for e in events(log) if e["event"] == "lease_taken"
                 and e["lease_epoch"] == 2]
        # whichever came first: the store refused a checkpoint, or the lease watch saw epoch 2
        stopped = [e for e in events(log) if e["event"] in ("checkpoint_fenced", "lease_lost")
                   and e["rank"] >= 0]
        assert stopped and {e["lease_epoch"] for e in stopped} == {1} and taken
        # the fence check and the manifest write are two steps: a publish that passed the check
        # as the fence rose lands within milliseconds, never later
        late = [e for e in _trained(log, 1) if e["event"] == "checkpoint_saved"
                and e["ts"] > taken[0] + 0.5]
        assert not late, f"the old job published after the takeover: {late}"
    finally:
        supervisor.resume()
    assert old.wait(30) == 78, old.output()[-3000:]
    assert "taken over by" in old.output().split("hvd-resilient run: stopped")[0]  # workers
    assert "hvd-resilient run: stopped: run" in old.output()
    assert new.wait(180) == 0, new.output()[-3000:]
    done = [e for e in events(log) if e["event"] == "done"]
    assert {e["lease_epoch"] for e in done} == {2}
    assert len({e["params_sha256"] for e in done}) == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_plain_torchrun_launch_holds_the_run_and_yields_it_to_a_take_over(tmp_path, jobs):
    """No supervisor: the ranks of a plain torchrun launch take the run's lease themselves,
    under their launch's name, and renew it. `hvd-resilient run --take-over` takes the run
    with the next epoch; the plain job's ranks stop by themselves within seconds."""
    log = tmp_path / "run" / "events.jsonl"
    torchrun = str(Path(PYTHON).parent / "torchrun")
    plain = jobs.start([torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                        DIGITS, "--epochs", "1000", "--commit-every", "5", "--checkpoint-every",
                        "10", "--run-id", "k", "--run-dir", str(tmp_path / "run"),
                        "--checkpoint-url", f"file://{tmp_path}/ckpt"], name="plain")
    wait_for(lambda: any(e["event"] == "checkpoint_saved" for e in _trained(log, 1)), 120,
             "the plain launch checkpointing under lease epoch 1", plain)
    cmd = _inplace_cmd(tmp_path, 60)
    new = jobs.start([*cmd[:cmd.index("--")], "--take-over", *cmd[cmd.index("--"):]],
                     name="new")
    assert plain.wait(30) != 0, plain.output()[-3000:]
    assert "taken over" in plain.output()
    stopped = [e for e in events(log) if e["event"] in ("lease_lost", "checkpoint_fenced")]
    assert stopped and {e["lease_epoch"] for e in stopped} == {1}
    assert new.wait(180) == 0, new.output()[-3000:]
    done = [e for e in events(log) if e["event"] == "done"]
    assert {e["lease_epoch"] for e in done} == {2}
    assert len({e["params_sha256"] for e in done}) == 1
