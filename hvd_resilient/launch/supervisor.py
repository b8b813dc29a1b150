"""Keeps a job alive across full restarts: relaunch with backoff, stop on what a restart
cannot fix.

In-process recovery (Horovod Elastic) covers lost workers; this covers the rest: an MPI job
that ends when one rank dies, a driver that dies, preemption. Each relaunch resumes from the
newest durable checkpoint because the training script does so on start. The supervisor
decides from the run's event log, not from console text: a launch in which no rank got as far
as training, or a rank reported a `fatal` error, is not retried. "Got as far as training" is
one of two events of a rank (rank >= 0) in this launch:
- `start`: the library's trainer began (it resumes from the run's checkpoints);
- `first_step`: a worker of our torchrun launcher took its first optimizer step
  (`launch/torchrun_worker.py`), whatever the script: one that writes no events of its own
  (PyTorch's DDP tutorial keeps its own snapshot) got past its imports, its arguments, its
  process group and its snapshot, so what failed is not what fails every launch. Whether it
  resumes is the script's business; the `restart` event says which evidence was used
  (`evidence`), and such a launch has committed nothing, so the backoff for launches that
  trained nothing still grows (1, 2, 4 s ...) and --max-restarts still bounds it.
A script that fails at import writes neither, and is not relaunched. The launcher's output
passes through the supervisor (`launcher_output`) only so that the message of a launch without
events can say what the output showed.
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

from hvd_resilient import event_names as ev
from hvd_resilient.errors import FATAL_EXIT_CODE
from hvd_resilient.events import EventLog, read_events
from hvd_resilient.fatal_events import fatal_events
from hvd_resilient.launch.job_guard import JOB_ENV, Guard, end_job
from hvd_resilient.launch.launcher_output import OutputFacts, Tee
from hvd_resilient.run_lease import Renewal

logger = logging.getLogger(__name__)
SUPERVISOR_RANK = -1
PROGRESS = (ev.COMMIT, ev.MEMORY_COMMIT, ev.CHECKPOINT_SAVED)
"""Events that say a launch trained: what it did is kept, and a relaunch goes on from it."""


def trained_evidence(evs: list[dict]) -> str | None:
    """The event that shows a launch got as far as training (module doc): "start", else
    FIRST_STEP, else None. Only ranks' events count (rank >= 0), never the supervisor's."""
    for name in (ev.START, ev.FIRST_STEP):
        if any(e["event"] == name and e["rank"] >= 0 for e in evs):
            return name
    return None


@dataclass
class Outcome:
    exit_code: int
    restarts: int
    reason: str


class Supervisor:
    def __init__(self, cmd: list[str], env: dict[str, str], run_dir: str, *,
                 max_restarts: int = 3, backoff: tuple[float, float] = (1.0, 60.0),
                 sleep: Callable[[float], None] = time.sleep,
                 graceful: signal.Signals | None = None, signal_group: bool = True,
                 renewal: Renewal | None = None) -> None:
        """``graceful``: the signal the launcher passes on to every rank as a preemption (the
        workers' final checkpoint), sent in place of the first SIGTERM or SIGINT. mpirun's own
        answer to SIGTERM is to kill its ranks, with no time for that checkpoint.
        ``signal_group``: a signal goes to the launcher's whole process group (torchrun's
        workers are in it); off, to the launcher alone: Horovod's driver ends its workers
        itself, and the forkserver its middlemen come from must outlive the signal to report
        their exits (killed with the group, every worker's exit read 255).
        ``renewal``: of the run's lease this launch took (renewed from the moment it was
        taken). Should a relaunch take the run over, the job is ended and not relaunched."""
        self.cmd = cmd
        self.env = env
        self.events_path = Path(run_dir) / "events.jsonl"
        self.renewal = renewal
        self.events = EventLog(self.events_path, rank=SUPERVISOR_RANK, size=0, step=0,
                               lease_epoch=renewal.lease.epoch if renewal else None)
        self._lost = ""
        self.max_restarts = max_restarts
        self.backoff = backoff
        self._sleep = sleep
        self._child: subprocess.Popen | None = None
        self._stopping = False
        self.graceful = graceful
        self.signal_group = signal_group

    def _on_signal(self, signum: int, _frame: object) -> None:
        """The supervisor itself is being stopped: pass it on, and do not restart."""
        self._stopping = True
        if self.graceful is not None and signum in (signal.SIGTERM, signal.SIGINT):
            signum, self.graceful = self.graceful, None  # once: a second signal is as given
        if self._child is not None and self._child.poll() is None:
            if self.signal_group:
                os.killpg(self._child.pid, signum)
            else:
                self._child.send_signal(signum)

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

    def _delay(self, evs: list[dict], streak: int) -> tuple[float, int]:
        """Seconds before the next launch, and the count of launches in a row that trained
        nothing. A launch that committed progress failed on something new (a dead rank under
        mpirun): at once, every second counts. Backing off is for crash loops, launches that
        fail before their first commit: 1, 2, 4 s ... up to the maximum."""
        began = max((e.get("from_step", 0) for e in evs if e["event"] == ev.RESUME), default=0)
        if any(e["event"] in PROGRESS and e["rank"] >= 0 and e.get("step", 0) > began
               for e in evs):
            return 0.0, 0
        return min(self.backoff[1], self.backoff[0] * 2**streak), streak + 1

    def run(self) -> Outcome:
        """Launches until done. With `JOB_ENV` in the launchers' environment, a guard process
        ends every process of the job if this one dies (`launch/job_guard.py`)."""
        guard = Guard(self.env[JOB_ENV], str(self.events_path.parent)) \
            if JOB_ENV in self.env else None
        if self.renewal is not None:
            self.events.emit(ev.LEASE_TAKEN, holder=self.renewal.lease.holder)
            self.renewal.on_lost = self._lease_lost
        try:
            return self._run()
        finally:
            if guard is not None:
                guard.close()

    def _lease_lost(self, why: str) -> None:
        """A relaunch took the run over (a newer lease epoch): every process of this job is
        ended, and the supervisor does not relaunch."""
        self._lost = why
        self._stopping = True
        self.events.emit(ev.LEASE_LOST, error=why)
        logger.error("%s; ending this job", why)
        if JOB_ENV in self.env:
            end_job(self.env[JOB_ENV])

    def _run(self) -> Outcome:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)
        attempt = streak = 0
        while True:
            t0 = time.time()
            self.events.emit(ev.LAUNCH, attempt=attempt, command=self.cmd[0])
            code, facts = self._launch()
            evs = self._events_since(t0)
            self.events.emit(ev.LAUNCHER_EXIT, attempt=attempt, exit_code=code)
            fatal = fatal_events(self.events_path, t0, tail_bytes=None)
            if fatal:
                # Checked before the exit code: a launcher can exit 0 after a rank reported a
                # fatal error (the others trained on), and that is never success.
                return Outcome(FATAL_EXIT_CODE, attempt,
                               f"not restarting: {fatal[0].get('error')}")
            if self._lost:
                return Outcome(FATAL_EXIT_CODE, attempt, f"stopped: {self._lost}")
            if code == 0:
                return Outcome(0, attempt, "finished")
            if self._stopping:
                return Outcome(code, attempt, "stopped by a signal to the supervisor")
            evidence = trained_evidence(evs)
            if evidence is None:
                # A script that writes no events (a plain Horovod one) may well have trained:
                # say what is known, and only that.
                return Outcome(code, attempt, f"not restarting: no rank wrote a `start` event "
                               f"(nor `{ev.FIRST_STEP}`, a torchrun worker's first optimizer "
                               f"step) to {self.events_path}, so a relaunch is not known to "
                               f"get further; the launcher exited with code {code}; "
                               f"{facts.describe()} (its output is above)")
            if attempt >= self.max_restarts:
                return Outcome(code, attempt, f"gave up after {attempt} restarts")
            delay, streak = self._delay(evs, streak)
            preempted = any(e["event"] == ev.PREEMPTED for e in evs)
            logger.warning("launcher exited with %d%s; restart %d/%d in %gs%s", code,
                           " after preemption" if preempted else "", attempt + 1,
                           self.max_restarts, delay, "" if evidence == ev.START else
                           f" (no rank wrote `start`; {ev.FIRST_STEP} events say ranks trained: "
                           "the script resumes only if it keeps its own snapshot)")
            self.events.emit(ev.RESTART, attempt=attempt + 1, delay=delay, exit_code=code,
                             preempted=preempted, evidence=evidence)
            self._sleep(delay)
            if self._stopping:
                return Outcome(code, attempt, "stopped by a signal to the supervisor")
            attempt += 1
