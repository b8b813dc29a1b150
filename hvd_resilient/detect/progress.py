"""The progress watchdog: a rank that is alive but makes no progress ends itself, with its stacks.

A deadlock, a stuck collective or an endless loop in user code keeps a process alive with its
connections open, so nothing hangs up and every peer waits out the Gloo or process-group
timeout (or, under mpirun, forever). A thread in each worker therefore watches the training
loop's heartbeat (`step()`): when no step ends within the budget, it writes every thread's stack
to the run folder, records a `hang_detected` event naming that file, and ends the process with
HUNG_EXIT_CODE. A dead process is the failure every launcher already handles at once: its
connections hang up (the peers' hang-up watch resets them in milliseconds under Horovod),
torchrun's agent restarts the workers, mpirun ends the job and `hvd-resilient run` relaunches.

A hung rank stalls its peers too: they wait for it inside the step's collective. So the
training loop marks where a rank waits for the others (`waiting_for_peers()`: Horovod's
`optimizer.step()`, DDP's backward); a rank stalled there is a victim and gives the culprit
`VICTIM_FACTOR` times the budget to be found and ended (its death then resets the victims in
milliseconds) before it concludes that the collective itself is stuck and ends itself too.

The budget adapts to the job: `factor` times the slowest step seen so far, never under `floor_s`
(a fixed `timeout_s` replaces both). Phases that are not steps get their own budget as declared
sections: the first step (compilation, loader warm-up) and a synchronous checkpoint have long
ones; waiting for a reset (the driver may wait minutes for hosts) has none. A frozen process
(SIGSTOP, a paused VM) cannot run this thread at all: its peers detect it (`detect/heartbeat.py`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.errors import HUNG_EXIT_CODE, exit_now

logger = logging.getLogger(__name__)

FIRST_STEP_S = 600.0
"""Default budget of the first step: it compiles, warms the loader, faults in the optimizer."""
VICTIM_FACTOR = 3.0
"""A rank stalled while waiting for its peers waits this many budgets before it fires."""
LOOK_AGAIN_S = 1.0
"""The watchdog's longest sleep (an unbounded section's, for one)."""


class ProgressWatchdog:
    """One per worker process; `step()` after every training step, `section()` around the
    phases that are not steps."""

    def __init__(self, *, run_dir: str, rank: Callable[[], int], emit: Callable[..., Any],
                 timeout_s: float = 0.0, floor_s: float = 30.0, factor: float = 10.0,
                 first_step_s: float = FIRST_STEP_S, poll_s: float = 0.1,
                 on_hang: Callable[[], None] | None = None,
                 diagnose: Callable[[], str] | None = None) -> None:
        """``diagnose``: asked once, when the watchdog fires, for a known cause of the hang
        ("" when it sees none); its answer goes on the rank's one line and on the event."""
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.emit = emit
        self.timeout_s = timeout_s
        self.floor_s = floor_s
        self.factor = factor
        self.poll_s = poll_s
        self.on_hang = on_hang or (lambda: exit_now(HUNG_EXIT_CODE))
        self.slowest_s = 0.0
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._section: tuple[str, float | None] = ("first step", first_step_s)
        self._stop = threading.Event()
        self._poke = threading.Event()  # a new budget to sleep towards, or the stop
        self._thread: threading.Thread | None = None
        self._waiting = False
        self._waiting_on = ""  # what this rank waits for, when the loop said
        self.diagnose = diagnose
        self.fired = False

    # -- what the training loop calls ---------------------------------------------------
    def step(self) -> None:
        """A step ended: progress. The first one ends the 'first step' section."""
        now = time.monotonic()
        with self._lock:
            if self._section[0] == "first step":
                self._section = ("", None)
            elif not self._section[0]:
                self.slowest_s = max(self.slowest_s, now - self._last)
            self._last = now

    @contextlib.contextmanager
    def section(self, name: str, budget_s: float | None) -> Iterator[None]:
        """A phase that is not a step, with its own budget (None: unbounded, e.g. waiting for
        a reset). The step budget starts afresh when it ends."""
        self.end_wait()  # a wait that raised without ending (a failed collective) is over
        with self._lock:
            outer = self._section
            self._section, self._last = (name, budget_s), time.monotonic()
        self._poke.set()
        try:
            yield
        finally:
            with self._lock:
                self._section, self._last = outer, time.monotonic()
            self._poke.set()

    @contextlib.contextmanager
    def waiting_for_peers(self, what: str = "") -> Iterator[None]:
        """Around the part of a step that blocks on the other ranks (see the module doc);
        ``what`` names it on the line a hang writes."""
        self.begin_wait(what)
        try:
            yield
        except BaseException:
            # The collective failed (a peer died): recovery starts now, and it must not be
            # charged with the time this rank spent waiting for the culprit.
            with self._lock:
                self._last = time.monotonic()
            raise
        finally:
            self.end_wait()

    def begin_wait(self, what: str = "") -> None:
        """`waiting_for_peers` for hooks that cannot wrap the wait (an optimizer's step
        pre-hook); `end_wait` ends it."""
        self._waiting_on, self._waiting = what, True

    def end_wait(self) -> None:
        self._waiting = False

    def budget(self) -> tuple[str, float | None]:
        """The current phase and how long it may go without progress."""
        with self._lock:
            name, budget = self._section
        if name:
            return name, budget
        if self.timeout_s > 0:
            return "step", self.timeout_s
        return "step", max(self.floor_s, self.factor * self.slowest_s)

    # -- the thread ---------------------------------------------------------------------
    def start(self) -> ProgressWatchdog:
        self._thread = threading.Thread(target=self._watch, name="hvd-resilient-watchdog",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _watch(self) -> None:
        due = self.poll_s
        while True:
            self._poke.wait(due)
            if self._stop.is_set():
                return
            self._poke.clear()  # before reading: a section that starts now pokes again
            name, budget = self.budget()
            with self._lock:
                idle = time.monotonic() - self._last
            if budget is not None and self._waiting:
                name, budget = f"{name} (waiting for peers)", budget * VICTIM_FACTOR
            # Asleep until the budget could run out (or a section starts or ends: it pokes),
            # not every poll_s: each wake-up takes the GIL from training (`wakeup.py`).
            due = min(LOOK_AGAIN_S, max(self.poll_s, (budget or LOOK_AGAIN_S) - idle))
            if budget is not None and idle > budget:
                self._fire(name, idle, budget)
                return

    def _fire(self, name: str, idle: float, budget: float) -> None:
        self.fired = True
        rank = self.rank()
        path = self.dump_stacks(rank)
        on = self._waiting_on if self._waiting else ""
        cause = self._diagnosis()
        self.emit(ev.HANG_DETECTED, section=name, idle_seconds=round(idle, 3),
                  budget_seconds=round(budget, 3), stacks=str(path) if path else None,
                  exit_code=HUNG_EXIT_CODE, waiting_on=on or None, cause=cause or None)
        logger.error("rank %s made no progress for %.1fs in %s%s (budget %.1fs)%s; stacks in "
                     "%s; ending this rank so the job recovers now", rank, idle,
                     name or "a step", f", waiting on {on}" if on else "", budget,
                     f"; likely cause: {cause}" if cause else "", path or "(not written)")
        self.on_hang()

    def _diagnosis(self) -> str:
        if self.diagnose is None:
            return ""
        try:
            return self.diagnose()
        except Exception as e:  # a diagnosis must never stop the rank from ending
            return f"(the diagnosis failed: {type(e).__name__}: {e})"

    def dump_stacks(self, rank: int) -> Path | None:
        """Every thread's Python stack, written with faulthandler (no locks taken: it works
        whatever the hung thread holds)."""
        folder = self.run_dir / "hangs"
        path = folder / f"rank{rank}-pid{os.getpid()}-{time.strftime('%Y%m%dT%H%M%S')}.txt"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(f"# hvd-resilient: rank {rank} pid {os.getpid()} made no progress; "
                        "every thread's stack, most recent call first\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            return path
        except OSError as e:
            logger.error("cannot write the stacks of the hung rank to %s: %s", folder, e)
            faulthandler.dump_traceback(all_threads=True)  # stderr, at least
            return None


_current: ProgressWatchdog | None = None


def install(dog: ProgressWatchdog | None) -> None:
    """Makes `dog` the process's watchdog (None: none), for code below the trainer (the
    backends' reset loops) that declares sections through `section()`."""
    global _current
    _current = dog


def declared_section() -> str:
    """The section this worker is in, as declared to the installed watchdog ("" in a step, or
    with no watchdog); any thread may ask."""
    dog = _current
    if dog is None:
        return ""
    with dog._lock:
        return dog._section[0]


def installed() -> ProgressWatchdog | None:
    """The process's watchdog (None: none): a loop runner that finds one installed knows
    its caller (the Trainer) watches progress itself."""
    return _current


def made() -> None:
    """Progress (`ProgressWatchdog.step`) on the installed watchdog; nothing when none."""
    dog = _current
    if dog is not None:
        dog.step()


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
    """`ProgressWatchdog.waiting_for_peers` of the installed watchdog; nothing when none."""
    dog = _current
    if dog is None:
        yield
        return
    with dog.waiting_for_peers(what):
        yield


@contextlib.contextmanager
def section(name: str, budget_s: float | None) -> Iterator[None]:
    """`ProgressWatchdog.section` of the installed watchdog; nothing when there is none."""
    dog = _current
    if dog is None:
        yield
        return
    with dog.section(name, budget_s):
        yield
