"""A worker exits when its horovodrun driver is gone, so no orphan trains on beside a relaunch.

When the driver (horovodrun) is killed, Horovod ends its ssh clients, but a worker in a non-tty
remote session receives no signal: it trains on, and its rank 0 keeps writing checkpoints while
`hvd-resilient run` (or the scheduler) has already started the job again. Every elastic worker
therefore probes the driver's rendezvous server (the address Horovod gives it) once a second; five
failed connections in a row (a refused connection is immediate when the driver's host is up)
mean the driver is gone, and the worker exits with DRIVER_LOST_EXIT_CODE after saying so. A
partitioned host is treated the same way: it cannot rejoin its job anyway.

Five seconds is the price of telling a dead driver from a slow link over the network. A worker
that shares the driver's kernel, process table and network (`heartbeat.this_view`; the driver
started by `hvd-resilient run` says who it is in DRIVER_ENV) needs no such margin: it waits for
the driver's process to end (its pidfd; /proc five times a second where there is none), and an
ended driver is known at once. The supervisor relaunches only when the old workers are gone
(they hold the launch's output), so those 5 s were the relaunch's delay.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections.abc import Callable

from hvd_resilient import event_names as ev
from hvd_resilient.detect import heartbeat
from hvd_resilient.detect.heartbeat import ENDED, this_view
from hvd_resilient.detect.heartbeat import probe as reachable
from hvd_resilient.errors import DRIVER_LOST_EXIT_CODE, exit_now
from hvd_resilient.events import EventLog

logger = logging.getLogger(__name__)
PROBE_EVERY_S = 1.0
LOST_AFTER = 5  # consecutive failed probes
PROBE_TIMEOUT_S = 2.0
"""A probe's connect may wait this long: on a saturated or throttled link a SYN can be dropped
and resent after 1 s, which must not read as a lost driver (seen with a 256 kbit tbf link).
A killed driver refuses at once, so it is still found in about LOST_AFTER seconds; a cut-off
host is found sooner by the heartbeats (`detect/heartbeat.py`)."""
LOOK_EVERY_S = 0.2
"""How often a worker on the driver's machine without pidfds looks the driver up in /proc."""
DRIVER_ENV = "HVD_RESILIENT_DRIVER_PROCESS"
"""`identity()` of the driver process, set by `launch/horovod/driver.py` for its workers."""

_started = False
_lock = threading.Lock()


def driver_address(env: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, int] | None:
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        return None
    return addr, int(port)


def identity(pid: int | None = None) -> str:
    """Who a process is, for a process of the same view to look up: its view, pid and start
    time (a pid reused by a later process is not the driver). "" when /proc cannot say."""
    pid = os.getpid() if pid is None else pid
    view, (_, start) = this_view(), _stat(pid)
    return f"{view}|{pid}|{start}" if view and start else ""


Driver = tuple[int, str]
"""A driver process as this machine's /proc names it: pid and start time."""


def local_driver(env: dict[str, str] | os._Environ[str] = os.environ) -> Driver | None:
    """The driver when this process can look it up in /proc (same kernel, process table and
    network), else None: another machine, a driver that did not say who it is, or a /proc that
    hides it (then the probes alone decide)."""
    view, _, rest = env.get(DRIVER_ENV, "").partition("|")
    pid, _, start = rest.partition("|")
    if not view or view != this_view() or not pid.isdigit() or not start:
        return None
    _, now = _stat(int(pid))
    if not now and os.path.isdir(f"/proc/{pid}"):
        return None  # there but unreadable
    return int(pid), start


def ended(driver: Driver) -> bool:
    """Gone, a zombie, or its pid taken by a later process."""
    state, start = _stat(driver[0])
    return state in ENDED or start != driver[1]


def watch(address: tuple[str, int], on_lost: Callable[[], None], stop: threading.Event,
          every: float = PROBE_EVERY_S, lost_after: int = LOST_AFTER,
          local: Driver | None = None) -> None:
    """Probes `address` every `every` s; with `local`, also waits for that process to end in
    between: either way of finding the driver gone ends it."""
    exited = _ExitWaiter(local, stop)
    try:
        failures = 0
        while not stop.is_set():
            if exited(every):
                on_lost()
                return
            if stop.is_set():
                return
            failures = 0 if reachable(address, timeout=PROBE_TIMEOUT_S) else failures + 1
            if failures >= lost_after:
                on_lost()
                return
    finally:
        exited.close()


class _ExitWaiter:
    """`waiter(timeout)`: True once the driver's process has ended, else False after `timeout`
    s (or when `stop` is set). Woken by the kernel where it can be: a pidfd is readable once its
    process has ended, so the thread sleeps until then instead of waking five times a second
    to look in /proc (each wake-up takes the GIL from training, `detect/wakeup.py`). Without a
    pidfd (Linux < 5.3, or a /proc that hides it) /proc is read every LOOK_EVERY_S."""

    def __init__(self, driver: Driver | None, stop: threading.Event) -> None:
        self.driver, self.stop = driver, stop
        self.pidfd: int | None = None
        if driver is not None:
            try:
                self.pidfd = os.pidfd_open(driver[0])
            except (AttributeError, OSError):
                pass
        self.gone = driver is not None and ended(driver)  # after the open: a pid reused
        # before it would leave the pidfd naming a later process

    def __call__(self, timeout: float) -> bool:
        if self.driver is None:
            self.stop.wait(timeout)
            return False
        if self.gone:
            return True
        if self.pidfd is not None:
            poller = select.poll()
            poller.register(self.pidfd, select.POLLIN)
            self.gone = bool(poller.poll(int(timeout * 1000)))
            return self.gone
        deadline = time.monotonic() + timeout
        while not self.stop.wait(max(0.0, min(LOOK_EVERY_S, deadline - time.monotonic()))):
            if ended(self.driver):
                self.gone = True
                return True
            if time.monotonic() >= deadline:
                return False
        return False

    def close(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def _stat(pid: int) -> tuple[str, str]:
    """State letter and start time (field 22: clock ticks since boot); ("", "") when /proc
    cannot say."""
    fields = heartbeat.process_stat(pid)
    return (fields[0], fields[19]) if len(fields) > 19 else ("", "")


def start(events: EventLog) -> bool:
    """Once per process; False outside an elastic horovodrun job."""
    global _started
    address = driver_address()
    with _lock:
        if address is None or _started:
            return False
        _started = True

    local = local_driver()

    def lost() -> None:
        events.emit(ev.DRIVER_LOST, driver=f"{address[0]}:{address[1]}",
                    found_by="process" if local is not None and ended(local) else "probes")
        logger.error("the horovodrun driver at %s:%d is gone; exiting (code %d) so that no "
                  "orphaned worker trains on beside a relaunch", *address, DRIVER_LOST_EXIT_CODE)
        exit_now(DRIVER_LOST_EXIT_CODE)

    threading.Thread(target=watch, args=(address, lost, threading.Event()),
                     kwargs={"local": local}, daemon=True,
                     name="hvd-resilient-driver-watch").start()
    return True
