"""One job per run, whatever dies: a job never outlives `hvd-resilient run` (`launch/job_guard.py`).

SIGKILL of the supervisor (the OOM killer, an impatient operator) gives it no chance to stop
anything: every process of the job must still be gone within 2 s, on every launcher, and
nothing more may be written to the run."""

from __future__ import annotations

import signal
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
