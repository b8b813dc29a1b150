"""A time budget for one discovery run, enforced twice.

Horovod 0.28 runs the discovery script with no timeout of its own and waits for it before
the next round, so a script stuck on a dead API server freezes host discovery for the whole
job.  Every network call here takes ``Deadline.remaining()`` as its timeout, and two
watchdogs back that up:

1. a soft one: ``SIGALRM`` (``setitimer``) raises ``DeadlineExceeded`` in the main thread,
   which unwinds through library code (it is a ``BaseException``) so the runner can still
   fall back to the cached answer and print a clear reason;
2. a hard one (only for a real process, never inside pytest): a daemon thread that writes
   one line to stderr and calls ``os._exit(1)`` shortly after, for the cases the signal
   cannot reach (the main thread blocked in C code such as ``getaddrinfo``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import FrameType

from .errors import DeadlineExceeded

#: Default budget of one run, measured from the start of ``main()``.  Interpreter start-up
#: (~0.05-0.2 s) comes on top; 1.5 s keeps the whole process under Horovod's 2 s cadence.
DEFAULT_DEADLINE_S = 1.5
#: How long after the soft deadline the hard watchdog ends the process.
HARD_GRACE_S = 0.25


class Deadline:
    """Monotonic time budget.  ``remaining()`` is the timeout to give any blocking call."""

    def __init__(self, seconds: float, *, name: str = "discovery") -> None:
        if seconds <= 0:
            raise ValueError("deadline must be positive")
        self.seconds = seconds
        self.name = name
        self._end = time.monotonic() + seconds
        self._armed_signal = False
        self._previous_handler: object = None
        self._previous_timer: tuple[float, float] = (0.0, 0.0)
        self._armed_at = 0.0
        self._hard_stop: threading.Event | None = None

    def remaining(self) -> float:
        """Seconds left; raises ``DeadlineExceeded`` when there are none."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"no answer within {self.seconds:g} s")
        return left

    def expired(self) -> bool:
        return self._end - time.monotonic() <= 0

    def arm(self, *, hard_exit: bool = False) -> None:
        """Start the watchdogs.  The signal part only works in the main thread.

        Not reentrant: one armed ``Deadline`` per process at a time.
        """
        left = max(self._end - time.monotonic(), 0.001)
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            self._previous_handler = signal.signal(signal.SIGALRM, self._on_alarm)
            self._previous_timer = signal.setitimer(signal.ITIMER_REAL, left)
            self._armed_at = time.monotonic()
            self._armed_signal = True
        if hard_exit:
            stop = threading.Event()
            self._hard_stop = stop
            threading.Thread(
                target=self._hard_watchdog, args=(stop, left + HARD_GRACE_S),
                name="discovery-watchdog", daemon=True,
            ).start()

    def disarm(self) -> None:
        """Stop both watchdogs (idempotent); call before printing a fallback answer."""
        if self._armed_signal:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous_handler)  # type: ignore[arg-type]
            self._armed_signal = False
            # Give back a timer somebody else had running (pytest-timeout uses SIGALRM too
            # when a test calls main() in-process), minus the time we held it.
            delay, interval = self._previous_timer
            if delay > 0:
                left = max(delay - (time.monotonic() - self._armed_at), 0.001)
                signal.setitimer(signal.ITIMER_REAL, left, interval)
        if self._hard_stop is not None:
            self._hard_stop.set()
            self._hard_stop = None

    def _on_alarm(self, signum: int, frame: FrameType | None) -> None:
        raise DeadlineExceeded(f"no answer within {self.seconds:g} s")

    def _hard_watchdog(self, stop: threading.Event, after: float) -> None:
        if stop.wait(after):
            return
        msg = f"{self.name}: no answer within {self.seconds:g} s; giving up (hard deadline)\n"
        try:
            os.write(2, msg.encode())
        finally:
            os._exit(1)
