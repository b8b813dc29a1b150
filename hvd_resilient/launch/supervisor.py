"""Keeps a job alive across full restarts: relaunch with backoff, stop on what a restart
cannot fix.

In-process recovery (Horovod Elastic) covers lost workers; this covers the rest: an MPI job
that ends when one rank dies, a driver that dies, preemption. Each relaunch resumes from the
newest durable checkpoint because the training script does so on start. The supervisor
decides from the run's event log, not from console text: a launch in which no rank ever
started training, or a rank reported a `fatal` error, is not retried.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hvd_resilient.errors import FATAL_EXIT_CODE
from hvd_resilient.events import EventLog, read_events
from hvd_resilient.log import get

log = get("supervisor")
SUPERVISOR_RANK = -1


@dataclass
class Outcome:
    exit_code: int
    restarts: int
    reason: str


class Supervisor:
    def __init__(self, cmd: list[str], env: dict[str, str], run_dir: str, *,
                 max_restarts: int = 3, backoff: tuple[float, float] = (1.0, 60.0),
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.cmd = cmd
        self.env = env
        self.events_path = Path(run_dir) / "events.jsonl"
        self.events = EventLog(self.events_path, rank=SUPERVISOR_RANK, size=0, step=0)
        self.max_restarts = max_restarts
        self.backoff = backoff
        self._sleep = sleep
        self._child: subprocess.Popen | None = None
        self._stopping = False

    def _on_signal(self, signum: int, _frame: object) -> None:
        """The supervisor itself is being stopped: pass it on, and do not restart."""
        self._stopping = True
        if self._child is not None and self._child.poll() is None:
            os.killpg(self._child.pid, signum)

    def _events_since(self, t0: float) -> list[dict]:
        return [e for e in read_events(self.events_path) if e["ts"] >= t0]

    def run(self) -> Outcome:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        attempt = 0
        while True:
            t0 = time.time()
            self.events.emit("launch", attempt=attempt, command=self.cmd[0])
            self._child = subprocess.Popen(self.cmd, env=self.env, start_new_session=True)
            code = self._child.wait()
            evs = self._events_since(t0)
            self.events.emit("launcher_exit", attempt=attempt, exit_code=code)
            fatal = [e for e in evs if e["event"] == "fatal"]
            if fatal:
                # Checked before the exit code: a launcher can exit 0 after a rank reported a
                # fatal error (the others trained on), and that is never success.
                return Outcome(FATAL_EXIT_CODE, attempt,
                               f"not restarting: {fatal[0].get('error')}")
            if code == 0:
                return Outcome(0, attempt, "finished")
            if self._stopping:
                return Outcome(code, attempt, "stopped by a signal to the supervisor")
            if not any(e["event"] == "start" and e["rank"] >= 0 for e in evs):
                return Outcome(code, attempt, "not restarting: the training script exited "
                               "before any rank started training (see its output above)")
            if attempt >= self.max_restarts:
                return Outcome(code, attempt, f"gave up after {attempt} restarts")
            delay = min(self.backoff[1], self.backoff[0] * 2**attempt)
            preempted = any(e["event"] == "preempted" for e in evs)
            log.warning("launcher exited with %d%s; restart %d/%d in %.0fs", code,
                        " after preemption" if preempted else "", attempt + 1,
                        self.max_restarts, delay)
            self.events.emit("restart", attempt=attempt + 1, delay=delay, exit_code=code,
                             preempted=preempted)
            self._sleep(delay)
            if self._stopping:
                return Outcome(code, attempt, "stopped by a signal to the supervisor")
            attempt += 1
