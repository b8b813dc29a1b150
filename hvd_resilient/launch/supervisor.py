"""Keeps a job alive across full restarts: relaunch with backoff, stop on what a restart
cannot fix.

In-process recovery (Horovod Elastic) covers lost workers; this covers the rest: an MPI job
that ends when one rank dies, a driver that dies, preemption. Each relaunch resumes from the
newest durable checkpoint because the training script does so on start. The supervisor
decides from the run's event log, not from console text: a launch in which no rank wrote a
`start` event (so nothing says a relaunch would resume), or a rank reported a `fatal` error,
is not retried. The launcher's output passes through the supervisor (`launcher_output`) only
so that the message of a launch without events can say what the output showed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hvd_resilient.errors import FATAL_EXIT_CODE
from hvd_resilient.events import EventLog, read_events
from hvd_resilient.fatal_events import fatal_events
from hvd_resilient.launch.launcher_output import OutputFacts, Tee

logger = logging.getLogger(__name__)
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

    def _launch(self) -> tuple[int, OutputFacts]:
        """One launch, its output passed through to ours as it comes and read on the way."""
        facts, lock = OutputFacts(), threading.Lock()
        self._child = subprocess.Popen(self.cmd, env=self.env, start_new_session=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert self._child.stdout is not None and self._child.stderr is not None
        tees = [Tee(os.dup(stream.fileno()), fd, facts, lock)
                for stream, fd in ((self._child.stdout, 1), (self._child.stderr, 2))]
        self._child.stdout.close()
        self._child.stderr.close()
        code = self._child.wait()
        for tee in tees:  # the launcher's own children may hold the pipes open: bounded
            tee.thread.join(timeout=5.0)
        return code, facts

    def run(self) -> Outcome:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        attempt = 0
        while True:
            t0 = time.time()
            self.events.emit("launch", attempt=attempt, command=self.cmd[0])
            code, facts = self._launch()
            evs = self._events_since(t0)
            self.events.emit("launcher_exit", attempt=attempt, exit_code=code)
            fatal = fatal_events(self.events_path, t0, tail_bytes=None)
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
                # A script that writes no events (a plain Horovod one) may well have trained:
                # say what is known, and only that.
                return Outcome(code, attempt, f"not restarting: no rank wrote a `start` event "
                               f"to {self.events_path}, so a relaunch is not known to resume; "
                               f"the launcher exited with code {code}; {facts.describe()} "
                               "(its output is above)")
            if attempt >= self.max_restarts:
                return Outcome(code, attempt, f"gave up after {attempt} restarts")
            delay = min(self.backoff[1], self.backoff[0] * 2**attempt)
            preempted = any(e["event"] == "preempted" for e in evs)
            logger.warning("launcher exited with %d%s; restart %d/%d in %.0fs", code,
                        " after preemption" if preempted else "", attempt + 1,
                        self.max_restarts, delay)
            self.events.emit("restart", attempt=attempt + 1, delay=delay, exit_code=code,
                             preempted=preempted)
            self._sleep(delay)
            if self._stopping:
                return Outcome(code, attempt, "stopped by a signal to the supervisor")
            attempt += 1
