"""SIGTERM or SIGINT to the driver stops the job, not just its current workers.

Horovod's elastic launcher answers the signal by setting the event that ends every worker's
process (each gets SIGTERM, and SIGKILL 5 s later), and nothing else: the driver takes those
exits for failures. When every worker of the world fails in the same round, Horovod stops
("failure count == N -> stop running") and exits 1 blaming "processes exited with non-zero
status ... Exit code: 143"; when the exits straddle a reset (a worker that ignores SIGTERM
until its SIGKILL, a reset already under way), it blacklists, resets and starts new workers
that the same event ends at once, until no host is left and its elastic timeout (600 s)
passes: a driver that `timeout 30` signalled once ran on for 10 minutes (session 29, a job
with a stuck worker). Here the signal stops the driver itself, as a worker's fatal stop does:
no reset follows, no worker starts, and the driver exits once its workers have, with one line
saying why and 75 when every worker stopped at a final checkpoint (the Trainer's answer to
SIGTERM: exit 75, as the ranks under mpirun), else 128 + the signal's number. The workers get
Horovod's middleman grace, 5 s from SIGTERM to SIGKILL, for that checkpoint.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.backends.horovod import compat
from hvd_resilient.launch.horovod.patches.context import PatchContext, driver_method
from hvd_resilient.launch.horovod.patches.fatal_stop import stop_job

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopOnSignal:
    """The replacements: `gloo_run.register_shutdown_event` (Horovod's signal handlers),
    `ElasticDriver.start`, where the driver to stop is seen, and `_handle_worker_exit`, where
    the workers' exits after the signal are."""

    def __init__(self, ctx: PatchContext, *, register: Callable[[], threading.Event],
                 start: Callable[..., Any], handle_exit: Callable[..., None]) -> None:
        self.ctx = ctx
        self._register = register
        self._start = start
        self._handle_exit = handle_exit
        self._driver: Any = None
        self._seen = threading.Event()  # the driver is known

    def handle_worker_exit(self, driver: Any, slot: Any, exit_code: int,
                           timestamp: Any) -> None:
        """Notes each exit after the signal: workers that all stopped at a final checkpoint
        (exit 75, the preemption path) make the driver's own exit 75, as under mpirun."""
        if self.ctx.stopped_by:
            self.ctx.exits_after_stop.append(exit_code)
        self._handle_exit(driver, slot, exit_code, timestamp)

    def start(self, driver: Any, *args: Any) -> Any:
        self._driver = driver
        self._seen.set()
        return self._start(driver, *args)

    def register_shutdown_event(self) -> threading.Event:
        """Horovod's event (set on the signal: its workers end), with the driver stopped too."""
        event = self._register()

        def on_signal(signum: int, _frame: object) -> None:
            event.set()
            if not self.ctx.stopped_by:  # a second signal changes nothing
                self.ctx.stopped_by = signal.Signals(signum).name
                # not in the handler: the main thread may hold a lock stop() needs
                threading.Thread(target=self._stop, name="hvd-resilient-stop-signal",
                                 daemon=True).start()

        for sig in SIGNALS:
            signal.signal(sig, on_signal)
        return event

    def _stop(self) -> None:
        name = self.ctx.stopped_by
        logger.warning("%s: stopping the job (every worker gets SIGTERM, then SIGKILL after "
                       "5 s; none is started again)", name)
        self.ctx.emit(ev.STOP_SIGNAL, signal=name)
        self._seen.wait()  # set just after the handlers are installed; never on a static run,
        if not self._driver.finished():  # whose workers the event alone ends
            stop_job(self._driver, f"stopped by {name}")


def install(ctx: PatchContext) -> None:
    from horovod.runner import gloo_run
    from horovod.runner.elastic.driver import ElasticDriver

    patch = StopOnSignal(ctx, register=gloo_run.register_shutdown_event,
                         start=ElasticDriver.start, handle_exit=ElasticDriver._handle_worker_exit)
    compat.replace(gloo_run, "register_shutdown_event", patch.register_shutdown_event)
    compat.replace(ElasticDriver, "start", driver_method(patch.start))
    compat.replace(ElasticDriver, "_handle_worker_exit", driver_method(patch.handle_worker_exit))
