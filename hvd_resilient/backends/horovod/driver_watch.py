"""A worker exits when its horovodrun driver is gone, so no orphan trains on beside a relaunch.

When the driver (horovodrun) is killed, Horovod ends its ssh clients, but a worker in a non-tty
remote session receives no signal: it trains on, and its rank 0 keeps writing checkpoints while
`hvd-resilient run` (or the scheduler) has already started the job again. Every elastic worker
therefore probes the driver's rendezvous server (the address Horovod gives it) once a second; five
failed connections in a row (a refused connection is immediate when the driver's host is up)
mean the driver is gone, and the worker exits with DRIVER_LOST_EXIT_CODE after saying so. A
partitioned host is treated the same way: it cannot rejoin its job anyway.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

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

_started = False
_lock = threading.Lock()


def driver_address(env: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, int] | None:
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        return None
    return addr, int(port)


def watch(address: tuple[str, int], on_lost: Callable[[], None], stop: threading.Event,
          every: float = PROBE_EVERY_S, lost_after: int = LOST_AFTER) -> None:
    failures = 0
    while not stop.wait(every):
        failures = 0 if reachable(address, timeout=PROBE_TIMEOUT_S) else failures + 1
        if failures >= lost_after:
            on_lost()
            return


def start(events: EventLog) -> bool:
    """Once per process; False outside an elastic horovodrun job."""
    global _started
    address = driver_address()
    with _lock:
        if address is None or _started:
            return False
        _started = True

    def lost() -> None:
        events.emit("driver_lost", driver=f"{address[0]}:{address[1]}")
        logger.error("the horovodrun driver at %s:%d is gone; exiting (code %d) so that no "
                  "orphaned worker trains on beside a relaunch", *address, DRIVER_LOST_EXIT_CODE)
        exit_now(DRIVER_LOST_EXIT_CODE)

    threading.Thread(target=watch, args=(address, lost, threading.Event()), daemon=True,
                     name="hvd-resilient-driver-watch").start()
    return True
