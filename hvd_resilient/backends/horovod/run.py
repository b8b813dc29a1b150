"""The elastic run loop: Horovod's `hvd.elastic.run`, with every transition recorded.

Same semantics as Horovod's wrapper (restore on HorovodInternalError, sync unless only hosts
were removed, then reset), but each transition is an event with its timing, so an operator and
the recovery benchmark can see detection, reset and sync separately. Outside an elastic
`horovodrun` (mpirun, a single process) there is nothing to recover in-process: the state is
synced once and a failure ends the job, to be resumed from a durable checkpoint.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import horovod.torch as hvd
import torch
from horovod.common.elastic import notification_manager
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from hvd_resilient.backends.horovod import (
    driver_watch,
    leaving,
    lost_slots,
    pinned_handles,
    slots,
)
from hvd_resilient.backends.horovod.ported import PortedLoop, recovery_options
from hvd_resilient.backends.horovod.state import ElasticState, is_elastic
from hvd_resilient.backends.threads import share_cores
from hvd_resilient.detect import Detectors, gloo_watch, hangup, progress
from hvd_resilient.detect.gloo_watch import GlooWatch
from hvd_resilient.detect.silent_peers import SilentPeers
from hvd_resilient.errors import HUNG_EXIT_CODE, exit_now, one_line

logger = logging.getLogger(__name__)
T = TypeVar("T")


HEARTBEAT_TIMEOUT_S = 1.5
"""Default of `recovery.heartbeat_timeout_seconds`: a peer silent this long is evicted."""


def run(func: Callable[..., T] | None = None, *,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        progress_timeout_s: float | None = None) -> Any:
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
    detectors = Detectors(SilentPeers(heartbeat_timeout_s, state.events,
                                      machine=slots.machine(), slot="", coordinator=None))
    detectors.arm_with(hvd.rank(), hvd.allgather_object)
    state.sync()
    result = train()
    _finish(detectors)
    return result


def _run_elastic(train: Callable[[], T], state: ElasticState, heartbeat_timeout_s: float) -> T:
    """Train; on a failed collective recover (restore the last commit), on a host change note
    it; either way reset into the new world and train again from the sync."""
    notification_manager.init()
    notification_manager.register_listener(state)
    driver_watch.start(state.events)
    w = _Watch.start(state, heartbeat_timeout_s)
    skip_sync = False
    try:
        while True:
            try:
                return _attempt(train, state, w.detectors, skip_sync)
            except HorovodInternalError as e:
                detected, skip_sync = _recover(e, state, w), False
            except HostsUpdatedInterrupt as e:
                detected, skip_sync = _hosts_changed(e, state, w), e.skip_sync
                _leave_if_removed(state)
            _reset(state, detected)
    finally:
        w.detectors.disarm()
        notification_manager.remove_listener(state)


@dataclass
class _Watch:
    """This worker's failure detectors in an elastic job, and what they report to."""

    gloo: GlooWatch
    driver: tuple[str, int] | None  # the driver's rendezvous address (None: unknown)
    slot: str
    detectors: Detectors

    @classmethod
    def start(cls, state: ElasticState, heartbeat_timeout_s: float) -> _Watch:
        gloo = GlooWatch()
        driver = driver_watch.driver_address()
        slot = lost_slots.slot_key()
        silent = SilentPeers(heartbeat_timeout_s, state.events, machine=slots.machine(),
                             slot=slot, coordinator=driver,
                             evict=lost_slots.DriverEvict(driver, slot, gloo.trip),
                             quiet_for=gloo.quiet_for)
        return cls(gloo, driver, slot, Detectors(gloo, silent))


def _attempt(train: Callable[[], T], state: ElasticState, detectors: Detectors,
             skip_sync: bool) -> T:
    """Sync (unless only hosts were removed), then train to the end."""
    with progress.section("sync", None):  # waits for joiners, as long as it takes
        offer = (detectors.offers(hvd.rank()), slots.machine())
        if skip_sync:
            _arm(detectors, state, hvd.allgather_object(offer))
        else:
            t0 = time.time()
            if type(state).sync is ElasticState.sync:  # the offers ride in the sync's first
                # allgather: armed before anything is sent
                state.sync_with(offer, lambda everyone: _arm(detectors, state, everyone))
            else:  # a subclass's own sync(): arm first, from an allgather of its own
                _arm(detectors, state, hvd.allgather_object(offer))
                state.sync()
            state.events.emit("sync", seconds=round(time.time() - t0, 6))
    result = train()
    _finish(detectors)
    return result


def _finish(detectors: Detectors) -> None:
    """Nobody may leave (and hang up on a still-watching peer) before everyone stopped
    watching: disarm, then meet once more."""
    detectors.disarm()
    with progress.waiting("the other ranks to finish (this rank's loop returned, theirs did "
                          "not: did the ranks' epochs have different lengths?)"):
        hvd.allreduce(torch.zeros(1), name="hvd_resilient.done")


def _recover(e: HorovodInternalError, state: ElasticState, w: _Watch) -> float:
    """A collective failed: peers blocked on this worker are let go, a worker its peers
    evicted exits, the others restore the last commit. Returns when the failure was detected
    (the first hang-up, when the watch saw one)."""
    detected = time.time()
    hangup.hang_up(w.gloo.stand_down())  # peers blocked on us fail now
    if lost_slots.evicted_within(w.driver, w.slot, os.getpid(), lost_slots.ASK_S,
                                 until_answer=True):
        logger.error("the other workers evicted this one as silent (frozen or cut off) and went "
                  "on without it; exiting (code %d) without writing", HUNG_EXIT_CODE)
        exit_now(HUNG_EXIT_CODE)
    with progress.section("recovery", None):  # until the next sync, unbounded
        w.detectors.disarm()
        hung_up = w.gloo.detected_at
        state.events.emit(
            "failure_detected", error=one_line(e, typed=True),
            peer_hangup=w.gloo.detail or None,
            detect_seconds=round(detected - hung_up, 6) if hung_up else None,
        )
        if hung_up:
            detected = hung_up
        logger.warning("collective failed (%s); restoring the last commit", one_line(e, typed=True))
        state.restore()
    return detected


def _hosts_changed(e: HostsUpdatedInterrupt, state: ElasticState, w: _Watch) -> float:
    """The driver announced a host change at a commit: nothing to restore. Returns when it was
    seen."""
    detected = time.time()
    with progress.section("recovery", None):
        w.detectors.disarm()
        state.events.emit("hosts_changed", removed_only=bool(e.skip_sync))
    return detected


def _leave_if_removed(state: ElasticState) -> None:
    """Ends this worker, exit code 0, when the host change removed its slot: before the
    `hvd.init()` that would abort it (`leaving.py`)."""
    slot = leaving.slot_left()
    if slot is None:
        return
    state.events.emit("left_job", slot=slot)
    logger.info("slot %s left the job (discovery no longer lists it); this worker exits", slot)
    with progress.section("leaving", None):  # the rendezvous waits as long as a reset's
        hvd.shutdown()
        code = leaving.exit_code_of_leaving(slot)
    raise SystemExit(code)


def _reset(state: ElasticState, detected: float) -> None:
    """Horovod re-formed: this worker joins the new world."""
    old_size = hvd.size()
    with progress.section("reset", None):  # the driver may wait minutes for hosts
        t0 = time.time()
        with gloo_watch.exit_if_stuck("reset:"):  # a loop stuck in Gloo holds shutdown
            hvd.shutdown()
        t1 = time.time()
        hvd.init()  # the driver's rendezvous, then the new world's Gloo connections
        pinned_handles.install()
        t2 = time.time()
        state.on_reset()
    # where a reset's time goes: shutdown (the old loop joined), init, the state's own reset
    state.events.emit("reset", old_size=old_size, new_size=hvd.size(),
                      seconds=round(time.time() - detected, 6), shutdown_s=round(t1 - t0, 4),
                      init_s=round(t2 - t1, 4), state_s=round(time.time() - t2, 4))
    if hvd.rank() == 0:
        logger.info("reset: world size %d -> %d", old_size, hvd.size())


def _arm(detectors: Detectors, state: ElasticState, everyone: list[Any]) -> None:
    """Arms from every rank's offers (its connections, its heartbeat address) and machine, as
    the (re)start's first allgather brought them (a failure there is caught like any
    other)."""
    machine = slots.machine()
    counts = detectors.arm(hvd.rank(), [offers for offers, _ in everyone])
    watched, beats = counts[GlooWatch.name], counts[SilentPeers.name]
    if watched == 0 and hvd.size() > 1:
        logger.warning("no Gloo connections found to watch; failures are detected at the Gloo "
                    "timeout only")
    # With slot hosts every worker is alone on its "host" (hvd.local_size() == 1): count the
    # workers on this machine from what every rank just said, at every (re)start.
    threads = share_cores(sum(m == machine for _, m in everyone))
    state.events.emit("watch", connections=watched, heartbeats=beats, threads=threads)
