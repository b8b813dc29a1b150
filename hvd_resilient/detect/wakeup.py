"""A stop flag that a thread blocked in `poll()` sees at once, so the thread needs no timeout.

A watcher that polls with a timeout wakes up for nothing ten times a second, and every wake-up
takes the GIL from the training thread: on busy cores that thread then waits for the watcher to
be scheduled again before it gets the GIL back (the detectors' wake-ups together cost 10-15%
of the step rate with three workers on two cores, bench/step_overhead.py). A watcher that
blocks on its file descriptors and this flag's pipe wakes only when there is news.
"""

from __future__ import annotations

import os
import threading


class Stop:
    """`threading.Event`'s set/is_set/wait, plus `fileno()` for a poller: readable once set.
    The thread that polls it closes it when it is done (`close`); `set` after that is harmless."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._closed = False

    def fileno(self) -> int:
        return self._read

    def set(self) -> None:
        with self._lock:
            self._event.set()
            if not self._closed:
                try:
                    os.write(self._write, b"x")
                except BlockingIOError:  # the pipe is full: readable already
                    pass

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read)
                os.close(self._write)
