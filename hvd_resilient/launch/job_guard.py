"""The job ends with its supervisor, however the supervisor dies (SIGKILL included).

`hvd-resilient run` starts its launcher in a session of its own (so that a terminal's Ctrl-C
reaches the supervisor, which stops the job in order), and Horovod's middlemen, mpirun's ranks
and torchrun's workers make sessions and process groups of their own below it: no signal to a
group, and no parent-death signal on the launcher, reaches every process of the job. What every
one of them does share is the environment the supervisor gave the launcher. The supervisor
marks it with a token (`JOB_ENV`), and starts this guard:

    python -m hvd_resilient.launch.job_guard TOKEN RUN_DIR   (stdin: a pipe from the supervisor)

The guard lives in a session of its own (a signal to the supervisor's group does not reach
it) and blocks on its stdin, whose only writer is the supervisor: the kernel closes it when the
supervisor ends, by any means, and the guard wakes at once. A supervisor that ends in order
writes `done` first: the job is over by then, and the guard only ends what was left behind.
Otherwise the guard SIGKILLs every process of this machine whose environment carries the token,
again and again until a scan finds none (a process forking as it is scanned is found by the next
scan), and writes one `job_ended_with_supervisor` event to the run's log.

Processes on other hosts carry the token too (the launchers forward `HVD_RESILIENT_*`), but no
guard runs there: a Horovod worker ends when its driver watch finds the driver gone
(`backends/horovod/driver_watch.py`, about 5 s), an Open MPI rank when its orted loses mpirun.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from hvd_resilient import event_names as ev

JOB_ENV = "HVD_RESILIENT_JOB"
"""The token in the environment of every process of one supervised job."""

SCAN_FOR_S = 5.0
"""How long the guard keeps scanning for processes that are still being forked."""


def job_pids(token: str, proc: str = "/proc") -> list[int]:
    """Pids of this machine whose environment carries `JOB_ENV=token` (not this process).
    A process of another user, or one gone while it is read, is skipped."""
    needle = f"{JOB_ENV}={token}".encode()
    me, out = os.getpid(), []
    for name in os.listdir(proc):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"{proc}/{name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            out.append(int(name))
    return out


def end_job(token: str, scan_for_s: float = SCAN_FOR_S) -> int:
    """SIGKILLs every process of the job on this machine; returns how many were signalled.
    Scans until one scan finds none, or `scan_for_s` has passed. A zombie has no environment
    left to read, so the ended are never waited for."""
    killed: set[int] = set()
    deadline = time.monotonic() + scan_for_s
    while True:
        fresh = job_pids(token)  # a zombie's environment reads empty: never found again
        if not fresh:
            return len(killed)
        for pid in fresh:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            killed.add(pid)
        if time.monotonic() > deadline:
            return len(killed)
        time.sleep(0.01)


class Guard:
    """The supervisor's handle: starts the guard process, and tells it when it ends in order."""

    def __init__(self, token: str, run_dir: str) -> None:
        read, self._write = os.pipe()  # both ends non-inheritable: the launcher gets neither
        env = {k: v for k, v in os.environ.items() if k != JOB_ENV}  # never ends itself
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hvd_resilient.launch.job_guard", token, run_dir],
                stdin=read, env=env, start_new_session=True)
        finally:
            os.close(read)

    def close(self, timeout: float = 10.0) -> None:
        """The supervisor is done (its launcher ended): the guard ends what is left, and exits."""
        try:
            os.write(self._write, b"done\n")
        except OSError:
            pass
        os.close(self._write)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(argv: list[str]) -> int:
    token, run_dir = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the supervisor's
    said = b""
    while True:
        chunk = os.read(0, 64)
        if not chunk:
            break
        said += chunk
    t0 = time.time()
    ended = end_job(token)
    if b"done" not in said:
        from hvd_resilient.events import EventLog

        log = EventLog(Path(run_dir) / "events.jsonl", rank=-1, size=0, step=0, lease_epoch=0)
        log.emit(ev.JOB_ENDED_WITH_SUPERVISOR, processes=ended,
                 seconds=round(time.time() - t0, 3))
        print(f"hvd-resilient run: the supervisor is gone; ended its job ({ended} processes)",
              file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
