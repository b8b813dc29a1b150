"""The elastic run loop: Horovod's `hvd.elastic.run`, with every transition recorded.

Same semantics as Horovod's wrapper (restore on HorovodInternalError, sync unless only hosts
were removed, then reset), but each transition is an event with its timing, so an operator and
the recovery benchmark can see detection, reset and sync separately. Outside an elastic
`horovodrun` (mpirun, a single process) there is nothing to recover in-process: the state is
synced once and a failure ends the job, to be resumed from a durable checkpoint.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import horovod.torch as hvd
from horovod.common.elastic import notification_manager
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvd_resilient.log import get
from hvd_resilient.state import ElasticState, is_elastic

log = get("elastic")
T = TypeVar("T")


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorates `train(state, ...)`; the function must not start with a collective."""

    @functools.wraps(func)
    def wrapper(state: ElasticState, *args: Any, **kwargs: Any) -> T:
        if not is_elastic():
            state.sync()
            return func(state, *args, **kwargs)
        notification_manager.init()
        notification_manager.register_listener(state)
        skip_sync = False
        try:
            while True:
                try:
                    if not skip_sync:
                        t0 = time.time()
                        state.sync()
                        state.events.emit("sync", seconds=round(time.time() - t0, 6))
                    return func(state, *args, **kwargs)
                except HorovodInternalError as e:
                    detected = time.time()
                    state.events.emit("failure_detected", error=_one_line(e))
                    log.warning("collective failed (%s); restoring the last commit", _one_line(e))
                    state.restore()
                    skip_sync = False
                except HostsUpdatedInterrupt as e:
                    detected = time.time()
                    state.events.emit("hosts_changed", removed_only=bool(e.skip_sync))
                    skip_sync = e.skip_sync
                old_size = hvd.size()
                hvd.shutdown()
                hvd.init()
                state.on_reset()
                state.events.emit(
                    "reset", old_size=old_size, new_size=hvd.size(),
                    seconds=round(time.time() - detected, 6),
                )
                if hvd.rank() == 0:
                    log.info("reset: world size %d -> %d", old_size, hvd.size())
        finally:
            notification_manager.remove_listener(state)

    return wrapper
