"""A worker that exits with FATAL_EXIT_CODE (78) stops the whole job at once.

It stopped on an error every restart would meet again (a bad config, a checkpoint that does
not fit the model); Horovod would blacklist its slot and reset the others into the same
error. Instead the driver stops (its shutdown event ends the other workers), and lets go the
threads that were already waiting at a reset's barrier. A worker killed while it waited for
its rendezvous answer then leaves the answer nowhere to go: that hang-up is logged at debug,
not printed as socketserver's BrokenPipeError traceback.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from hvd_resilient.backends.horovod import compat
from hvd_resilient.errors import FATAL_EXIT_CODE
from hvd_resilient.launch.horovod.patches.context import PatchContext

logger = logging.getLogger(__name__)


def stop_job(driver: Any, message: str) -> None:
    """Stops Horovod's driver: its shutdown event ends every worker, no reset follows, and
    the threads already waiting at a reset's barrier are let go instead of waiting forever."""
    driver.stop(error_message=message)
    barrier = driver._worker_registry._barrier  # None until the first reset
    if barrier is not None:
        barrier.abort()


def stop_on_fatal(ctx: PatchContext, handle_exit: Callable[..., None]) -> Callable[..., None]:
    """`ElasticDriver._handle_worker_exit` that stops the driver first on exit code 78."""

    def handle_worker_exit(self: Any, slot: Any, exit_code: int, timestamp: Any) -> None:
        if exit_code == FATAL_EXIT_CODE and not self.finished():
            name = f"{slot.hostname}[{slot.local_rank}]"
            ctx.fatal = ctx.fatal or name
            message = (f"worker {name} (rank {slot.rank}) stopped on an error no restart "
                       f"fixes (exit code {FATAL_EXIT_CODE}); stopping the job")
            logger.debug("%s", message)
            stop_job(self, message)
        handle_exit(self, slot, exit_code, timestamp)

    return handle_worker_exit


def wait_unless_stopped(wait: Callable[..., int]) -> Callable[..., int]:
    """`WorkerStateRegistry._wait`: threads waiting at a reset's barrier (a worker's exit, a
    survivor's rendezvous request) when the job is stopped are let go quietly, not left
    blocking the driver."""

    def registry_wait(self: Any, key: Any, state: Any, rendezvous_id: int) -> int:
        try:
            return wait(self, key, state, rendezvous_id)
        except threading.BrokenBarrierError:
            if self._driver.finished():
                return rendezvous_id
            raise

    return registry_wait


def quiet_hang_ups(handle_error: Callable[..., None]) -> Callable[..., None]:
    """`RendezvousHTTPServer.handle_error`, silent for a client that hung up."""

    def handle_error_quietly(self: Any, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            logger.debug("rendezvous client %s hung up before its answer", client_address)
            return
        handle_error(self, request, client_address)

    return handle_error_quietly


def install(ctx: PatchContext) -> None:
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.registration import WorkerStateRegistry
    from horovod.runner.http.http_server import RendezvousHTTPServer

    compat.replace(ElasticDriver, "_handle_worker_exit",
                   stop_on_fatal(ctx, ElasticDriver._handle_worker_exit))
    compat.replace(WorkerStateRegistry, "_wait", wait_unless_stopped(WorkerStateRegistry._wait))
    compat.replace(RendezvousHTTPServer, "handle_error",
                   quiet_hang_ups(RendezvousHTTPServer.handle_error))
