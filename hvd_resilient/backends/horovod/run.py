"""The elastic run loop: Horovod's `hvd.elastic.run`, with every transition recorded.

Same semantics as Horovod's wrapper (restore on HorovodInternalError, sync unless only hosts
were removed, then reset), but each transition is an event with its timing, so an operator and
the recovery benchmark can see detection, reset and sync separately. The loop itself is the
backends' one (`backends/recovery.py`); this module fills its `World` with Horovod's calls.
Outside an elastic `horovodrun` (mpirun, a single process) there is nothing to recover
in-process: the world is formed once, the state synced once, and a failure ends the job, to be
resumed from a durable checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar, overload

import horovod.torch as hvd
import torch
from horovod.common.elastic import notification_manager
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvd_resilient import event_names as ev
from hvd_resilient.backends import recovery
from hvd_resilient.backends.horovod import (
    driver_watch,
    dropped_slot,
    lost_slots,
    pinned_handles,
    slots,
)
from hvd_resilient.backends.horovod.ported import PortedLoop, recovery_options
from hvd_resilient.backends.horovod.state import ElasticState, is_elastic
from hvd_resilient.backends.threads import share_cores
from hvd_resilient.detect import Detectors, progress
from hvd_resilient.detect.gloo_watch import GlooWatch
from hvd_resilient.detect.silent_peers import SilentPeers
from hvd_resilient.state.protocol import TrainingState

logger = logging.getLogger(__name__)
T = TypeVar("T")


HEARTBEAT_TIMEOUT_S = 1.5
"""Default of `recovery.heartbeat_timeout_seconds`: a peer silent this long is evicted."""


@overload
def run(func: Callable[..., T], *, heartbeat_timeout_s: float = ...,
        progress_timeout_s: float | None = ...) -> Callable[..., T]: ...


@overload
def run(func: None = None, *, heartbeat_timeout_s: float = ...,
        progress_timeout_s: float | None = ...,
        ) -> Callable[[Callable[..., T]], Callable[..., T]]: ...


def run(func: Callable[..., T] | None = None, *,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        progress_timeout_s: float | None = None,
        ) -> Callable[..., T] | Callable[[Callable[..., T]], Callable[..., T]]:
    """Decorates `train(state, ...)`; the function must not start with a collective.
    `@run`, or `@run(heartbeat_timeout_s=..., progress_timeout_s=...)`: heartbeats (0: none);
    the progress budget of a loop of your own (`ported.py`): seconds without an
    `optimizer.step()` or a commit before a rank is declared hung (0: adaptive; None: the
    `HVD_RESILIENT_RECOVERY_PROGRESS_TIMEOUT_SECONDS` setting, adaptive by default)."""
    if func is None:
        return functools.partial(run, heartbeat_timeout_s=heartbeat_timeout_s,
                                 progress_timeout_s=progress_timeout_s)
    if progress_timeout_s is not None and progress_timeout_s < 0:
        raise ValueError(f"hvd_resilient.run: progress_timeout_s must be >= 0 (0: adaptive), "
                         f"got {progress_timeout_s}")

    @functools.wraps(func)
    def wrapper(state: ElasticState, *args: Any, **kwargs: Any) -> T:
        train = functools.partial(func, state, *args, **kwargs)
        pinned_handles.install()  # the user's own hvd.init() made a plain map
        # A caller that installed a watchdog (the Trainer) writes start/done and counts steps
        # itself; a loop of the user's own gets ours (ported.py).
        loop = None
        if progress.installed() is None:
            loop = PortedLoop(state, recovery_options(
                progress_timeout_s=progress_timeout_s)).begin()
        elif getattr(state, "step_unit", "step") is None:
            state.step_unit = "step"
        try:
            if not is_elastic():  # mpirun, srun: a silent peer ends this worker, and the job
                result = _run_static(train, state, heartbeat_timeout_s)
            else:
                result = _run_elastic(train, state, heartbeat_timeout_s)
            if loop is not None:
                loop.done()
            return result
        finally:
            if loop is not None:
                loop.close()

    return wrapper


def _run_static(train: Callable[[], T], state: ElasticState, heartbeat_timeout_s: float) -> T:
    """One world, synced once; a failure ends the job, resumed from a durable checkpoint."""
    return recovery.run(_StaticWorld(state, heartbeat_timeout_s), state, train)


def _run_elastic(train: Callable[[], T], state: ElasticState, heartbeat_timeout_s: float) -> T:
    """Train; on a failed collective recover (restore the last commit), on a host change note
    it; either way reset into the new world and train again from the sync (`recovery.py`)."""
    notification_manager.init()
    notification_manager.register_listener(state)
    driver_watch.start(state.events)
    try:
        return recovery.run(_ElasticWorld(state, heartbeat_timeout_s), state, train)
    finally:
        notification_manager.remove_listener(state)


class _HorovodWorld:
    """What every Horovod world shares: hvd's rank and collectives, the last meeting."""

    detectors: Detectors

    def rank(self) -> int:
        return int(hvd.rank())

    def size(self) -> int:
        return int(hvd.size())

    def machine(self) -> str:
        return slots.machine()

    def allgather(self, obj: Any) -> list[Any]:
        return list(hvd.allgather_object(obj))

    def sync(self, state: TrainingState, rider: Any, arm: Callable[[list[Any]], None]) -> None:
        if isinstance(state, ElasticState) and type(state).sync is ElasticState.sync:
            # the offers ride in the sync's first allgather: armed before anything is sent
            state.sync_with(rider, arm)
        else:  # a subclass's own sync(): arm first, from an allgather of its own
            arm(self.allgather(rider))
            state.sync()

    def finish(self) -> None:
        with progress.waiting("the other ranks to finish (this rank's loop returned, theirs "
                              "did not: did the ranks' epochs have different lengths?)"):
            hvd.allreduce(torch.zeros(1), name="hvd_resilient.done")


class _StaticWorld(recovery.FormOnce, _HorovodWorld):
    """mpirun, srun: heartbeats only; a silent peer ends this worker, and the job."""

    def __init__(self, state: ElasticState, heartbeat_timeout_s: float) -> None:
        self.detectors = Detectors(SilentPeers(heartbeat_timeout_s, state.events,
                                               machine=slots.machine(), slot="",
                                               coordinator=None))

    def sync(self, state: TrainingState, rider: Any, arm: Callable[[list[Any]], None]) -> None:
        arm(self.allgather(rider))
        state.sync()


class _ElasticWorld(_HorovodWorld):
    """An elastic `horovodrun`: Horovod's driver re-forms the world (`hvd.shutdown()` then
    `hvd.init()`) after a failed collective (`HorovodInternalError`) or at a commit that
    found a host change (`HostsUpdatedInterrupt`)."""

    failure_budget = None  # Horovod's driver stops a job whose hosts keep failing
    may_skip_sync = True  # HostsUpdatedInterrupt.skip_sync: only hosts were removed

    def __init__(self, state: ElasticState, heartbeat_timeout_s: float) -> None:
        self.hangup = gloo = GlooWatch()
        self.driver = driver_watch.driver_address()  # the driver's rendezvous (None: unknown)
        self.slot = lost_slots.slot_key()
        self.state = state
        silent = SilentPeers(heartbeat_timeout_s, state.events, machine=slots.machine(),
                             slot=self.slot, coordinator=self.driver,
                             evict=lost_slots.DriverEvict(self.driver, self.slot, gloo.trip),
                             quiet_for=gloo.quiet_for)
        self.detectors = Detectors(gloo, silent)

    def generation(self) -> int | None:
        return None

    def armed(self, counts: dict[str, int], on_this_machine: int) -> int | None:
        if counts[GlooWatch.name] == 0 and hvd.size() > 1:
            logger.warning("no Gloo connections found to watch; failures are detected at the "
                           "Gloo timeout only")
        # With slot hosts every worker is alone on its "host" (hvd.local_size() == 1): count
        # the workers on this machine from what every rank just said, at every (re)start.
        return share_cores(on_this_machine)

    def classify(self, error: Exception) -> recovery.Fault | None:
        if isinstance(error, HorovodInternalError):
            return recovery.Fault(recovery.FaultKind.FAILURE)
        if isinstance(error, HostsUpdatedInterrupt):
            return recovery.Fault(recovery.FaultKind.CHANGE, skip_sync=bool(error.skip_sync))
        return None

    def evicted(self) -> str | None:
        if lost_slots.evicted_within(self.driver, self.slot, os.getpid(), lost_slots.ASK_S,
                                     until_answer=True):
            return ("the other workers evicted this one as silent (frozen or cut off) and went "
                    "on without it")
        return None

    def changed(self, fault: recovery.Fault) -> None:
        self.state.events.emit(ev.HOSTS_CHANGED, removed_only=fault.skip_sync)

    def leaving(self) -> str | None:
        """The slot the host change removed: this worker leaves, exit code 0, before the
        `hvd.init()` that would abort it (`dropped_slot.py`)."""
        return dropped_slot.slot_left()

    def leave(self, slot: str) -> int:
        hvd.shutdown()
        return dropped_slot.exit_code_of_leaving(slot)

    def tear_down(self, fault: recovery.Fault) -> None:
        hvd.shutdown()  # joins Horovod's background loop

    def form(self, fault: recovery.Fault) -> None:
        hvd.init()  # the driver's rendezvous, then the new world's Gloo connections
        pinned_handles.install()

    def rejoined(self, state: TrainingState) -> None:
        """Horovod's reset callbacks (TorchState's `on_reset`), on the state this world was
        built for: the loop's own, which `_run_elastic` hands it too."""
        self.state.on_reset()
