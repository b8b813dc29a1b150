"""The recovery loop: one for every backend; a backend says how its world forms, not when.

    sync (arm the detectors from the sync's first allgather) -> train -> disarm, meet, return
    a collective failed:  hang up -> evicted? exit -> disarm -> budget -> failure_detected ->
                          restore -> tear down -> form -> reset -> sync again
    the world changed:    disarm -> (the backend's hand-over) -> leaving? exit -> tear down ->
                          form -> reset -> sync again (nothing restored)

Every backend used to spell this out by hand, and each grew guards the others lacked (the
stuck-shutdown exit only on Horovod, the failures-in-a-row budget only in place) and event
fields the others did not write. Here the order, the guards and the `watch`, `sync`,
`failure_detected` and `reset` events live once, each event with one field set (a field a
world cannot tell is None), so a report reads every backend the same way and a fix to the
order reaches every backend.

A backend fills a `World`: how to gather, sync, classify an exception, tear down and form the
next world, whether this worker was evicted or leaves. A world that cannot re-form (mpirun,
torchrun: a failure ends the job, the launcher restarts it) classifies nothing, and is the
same loop run once. The loop is tested in process with worlds that fail on purpose
(tests/unit/test_recovery_loop.py).
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import psutil

from hvd_resilient import event_names as ev
from hvd_resilient.detect import Detectors, gloo_watch, hangup, progress
from hvd_resilient.detect.gloo_watch import GlooWatch
from hvd_resilient.detect.silent_peers import SilentPeers
from hvd_resilient.errors import HUNG_EXIT_CODE, HvdResilientError, exit_now, one_line
from hvd_resilient.state.protocol import TrainingState

logger = logging.getLogger(__name__)
T = TypeVar("T")


class FaultKind(enum.Enum):
    FAILURE = "failure"
    """A collective failed (a peer died, froze, or was cut off): the last commit is restored."""
    CHANGE = "change"
    """The world changes at a commit every rank reached (a host added or removed, a worker
    joins): nothing is lost, nothing restored."""


@dataclass(frozen=True)
class Fault:
    """What an exception out of training means to the loop (`World.classify`)."""

    kind: FaultKind
    skip_sync: bool = False
    """Only hosts were removed: the survivors hold the same commit, the next start arms
    without a sync (Horovod's `HostsUpdatedInterrupt.skip_sync`)."""
    joined: bool = False
    """A worker joins (the `reset` event's `joined`): the report tells a join from a loss."""


class Evicted(HvdResilientError):
    """Raised by `World.form`: the others went on without this worker (it was found silent).
    The loop exits it as a hung worker, without writing anything beside the survivors."""


class Left(HvdResilientError):
    """Raised by `World.form`: the next world leaves this worker out because its host was
    removed from the job (a fault came first, so no commit's move said so). The loop lets it
    leave as at a move: `left_job`, exit code 0. The message is the slot."""


class GenerationsFailed(HvdResilientError):
    """Worlds keep failing before their first commit: the fault is not a peer's, and a restart
    would fail the same way, so the job stops with one line (exit 78, not relaunched)."""


class World(Protocol):
    """How one backend's world is gathered, synced and re-formed; the loop says when.

    `detectors` are armed at every start from one allgather; `hangup` (the Gloo hang-up
    watch, None where there is none) is hung up on at a failure so that no peer waits out its
    timeout on this worker. `failure_budget`: failures in a row without a commit before the
    job stops (`GenerationsFailed`); None: no limit.
    """

    @property
    def detectors(self) -> Detectors: ...

    @property
    def hangup(self) -> GlooWatch | None: ...

    @property
    def failure_budget(self) -> int | None: ...

    @property
    def may_skip_sync(self) -> bool:
        """Whether a change may come with `Fault.skip_sync`: then every start agrees first
        whether all ranks skip (a newcomer never does)."""

    def rank(self) -> int: ...

    def size(self) -> int: ...

    def generation(self) -> int | None:
        """The world's number where the backend counts them (the `generation` fields)."""

    def machine(self) -> str:
        """This worker's machine, riding with its detector offers (`armed` counts by it)."""

    def allgather(self, obj: object) -> list[Any]:
        """Every rank's `obj`, by rank (a collective)."""

    def sync(self, state: TrainingState, rider: object,
             arm: Callable[[list[Any]], None]) -> None:
        """Makes every rank's state rank 0's; `arm` gets every rank's `rider` before any state
        is sent, so the detectors watch the sync itself (a world may let the rider travel in
        the sync's own first allgather)."""

    def armed(self, counts: dict[str, int], on_this_machine: int) -> int | None:
        """After arming: the backend's own reaction (a warning, sharing the cores among the
        workers on this machine); returns the threads each got (None: not shared)."""

    def classify(self, error: Exception) -> Fault | None:
        """What an exception out of sync or training means; None: not a fault of the world
        (a bug of the script), raised on. Exception types first, messages only where the
        library gives none."""

    def evicted(self) -> str | None:
        """After a failure, before restoring: why the others went on without this worker
        (None: they did not)."""

    def changed(self, fault: Fault) -> None:
        """After a change, detectors disarmed: the hand-over every rank makes first (an event,
        a barrier so that nobody hangs up on a peer still watching)."""

    def leaving(self) -> str | None:
        """After a change: the slot this worker held when the change removed it (None: it
        stays)."""

    def leave(self, slot: str) -> int:
        """Leaves the job on purpose; returns the exit code."""

    def tear_down(self, fault: Fault) -> None:
        """Drops the old world locally (its peers were hung up on, or met at the change)."""

    def form(self, fault: Fault) -> None:
        """Joins the next world that holds this worker; raises `Evicted` when none does
        (`Left` when its host was removed)."""

    def rejoined(self, state: TrainingState) -> None:
        """The state's own reset into the new world (or a note to run it at the next sync)."""

    def finish(self) -> None:
        """After training, detectors disarmed: meets every rank once more, so that nobody
        leaves (and hangs up on a peer still watching) before everyone stopped watching."""


class FormOnce:
    """The re-forming half of a `World` for a world formed once (mpirun, torchrun): nothing is
    a fault it could recover from, so a failure ends the job and the launcher restarts it
    from a durable checkpoint."""

    hangup: GlooWatch | None = None
    failure_budget: int | None = None
    may_skip_sync = False

    def generation(self) -> int | None:
        return None

    def armed(self, counts: dict[str, int], on_this_machine: int) -> int | None:
        return None

    def classify(self, error: Exception) -> Fault | None:
        return None

    def evicted(self) -> str | None:
        return None

    def changed(self, fault: Fault) -> None:
        raise AssertionError("a world formed once does not change")

    def leaving(self) -> str | None:
        return None

    def leave(self, slot: str) -> int:
        raise AssertionError("a world formed once does not change")

    def tear_down(self, fault: Fault) -> None:
        raise AssertionError("a world formed once is not re-formed")

    def form(self, fault: Fault) -> None:
        raise AssertionError("a world formed once is not re-formed")

    def rejoined(self, state: TrainingState) -> None:
        raise AssertionError("a world formed once is not re-formed")


def run(world: World, state: TrainingState, train: Callable[[], T]) -> T:
    """Trains in `world` until `train` returns; recovers from every fault `world.classify`
    recognises, raises anything else. The detectors are disarmed however it ends."""
    return _Loop(world, state).run(train)


def _armed_already(everyone: list[Any]) -> None:
    """The sync's `arm` where the start's own allgather armed the detectors."""


def resources() -> dict[str, int]:
    """What a world could leak, counted at every reset (50 in a row must stay flat)."""
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "rss_bytes": psutil.Process().memory_info().rss}


class _Loop:
    def __init__(self, world: World, state: TrainingState) -> None:
        self.world, self.state = world, state
        self.failed_in_a_row = 0
        self.last_commit = getattr(state, "last_commit_step", None)

    def run(self, train: Callable[[], T]) -> T:
        world, skip_sync = self.world, False
        try:
            while True:
                try:
                    self._start(skip_sync)
                    result = train()
                    world.detectors.disarm()
                    world.finish()
                    return result
                except Exception as e:
                    fault = world.classify(e)
                    if fault is None:
                        raise
                    if fault.kind is FaultKind.FAILURE:
                        since = self._failed(e)
                    else:
                        since = self._changed(fault)
                    skip_sync = fault.skip_sync
                    self._reset(fault, since)
        finally:
            world.detectors.disarm()

    def _start(self, skip_sync: bool) -> None:
        """Arms the detectors and syncs, unless only hosts were removed: then every survivor
        holds the same commit and one allgather arms them. Skipping is agreed: the world
        formed after a removal may also hold a newcomer (Horovod's driver readmits a host
        whose cooldown ended at that rendezvous), which syncs; survivors that skipped would
        train into its sync's broadcasts and both sides wait for good (Horovod #3494). So
        where a world may skip, every start's first allgather also says who would, and all
        skip or all sync: one allgather more where some sync."""
        world = self.world
        with progress.section("sync", None):  # waits for joiners, as long as it takes
            rider: Any = (world.detectors.offers(world.rank()), world.machine())
            if world.may_skip_sync:
                everyone = world.allgather((rider, skip_sync))
                self._arm([r for r, _ in everyone])
                if all(skips for _, skips in everyone):
                    return
                rider, arm = None, _armed_already
            else:  # a world that never skips: the rider travels in the sync's first allgather
                arm = self._arm
            t0 = time.time()
            world.sync(self.state, rider, arm)
            self.state.events.emit(ev.SYNC, seconds=round(time.time() - t0, 6))

    def _arm(self, everyone: list[Any]) -> None:
        """Arms from every rank's offers and machine, as the start's first allgather brought
        them (a failure there is caught like any other)."""
        world = self.world
        counts = world.detectors.arm(world.rank(), [offers for offers, _ in everyone])
        machine = world.machine()
        threads = world.armed(counts, sum(m == machine for _, m in everyone))
        self.state.events.emit(ev.WATCH, connections=counts.get(GlooWatch.name),
                               heartbeats=counts.get(SilentPeers.name), threads=threads,
                               generation=world.generation())

    def _failed(self, error: Exception) -> float:
        """A collective failed: peers blocked on this worker are let go, a worker its peers
        evicted exits, the others restore the last commit. Returns when the failure was
        detected (the first hang-up, when the watch saw one)."""
        world, state = self.world, self.state
        detected = time.time()
        if world.hangup is not None:
            hangup.hang_up(world.hangup.stand_down())  # peers blocked on us fail now
        reason = world.evicted()
        if reason is not None:
            _exit_evicted(reason)
        with progress.section("recovery", None):  # until the next sync, unbounded
            world.detectors.disarm()
            self._count_failure(error)
            hung_up = world.hangup.detected_at if world.hangup is not None else None
            state.events.emit(
                ev.FAILURE_DETECTED, error=one_line(error, typed=True),
                peer_hangup=(world.hangup.detail if world.hangup is not None else "") or None,
                generation=world.generation(),
                detect_seconds=round(detected - hung_up, 6) if hung_up else None)
            logger.warning("collective failed (%s); restoring the last commit",
                           one_line(error, typed=True))
            state.restore()
        return hung_up or detected

    def _count_failure(self, error: Exception) -> None:
        """A fault that fails every world before its first commit is not a peer's: stop."""
        budget = self.world.failure_budget
        if budget is None:
            return
        commit = getattr(self.state, "last_commit_step", None)
        if commit != self.last_commit:
            self.failed_in_a_row, self.last_commit = 0, commit
        self.failed_in_a_row += 1
        if self.failed_in_a_row > budget:
            raise GenerationsFailed(
                f"{self.failed_in_a_row} generations in a row failed before a commit; "
                f"last: {one_line(error, typed=True)}") from error

    def _changed(self, fault: Fault) -> float:
        """The world changes at a commit: nothing to restore; a worker whose slot the change
        removed leaves (exit code from `World.leave`) before the next world would abort it.
        Returns when the change was seen."""
        world = self.world
        detected = time.time()
        with progress.section("recovery", None):
            world.detectors.disarm()
        world.changed(fault)  # a collective hand-over keeps the step budget
        slot = world.leaving()
        if slot is not None:
            self._left(slot)
            with progress.section("leaving", None):  # the rendezvous waits as long as a reset's
                code = world.leave(slot)
            raise SystemExit(code)
        return detected

    def _left(self, slot: str) -> None:
        self.state.events.emit(ev.LEFT_JOB, slot=slot)
        logger.info("slot %s left the job (discovery no longer lists it); this worker exits",
                    slot)

    def _reset(self, fault: Fault, since: float) -> None:
        """Leaves the old world for the next one. Where a reset's time goes: the teardown
        (Horovod joins its background loop), forming the next world, the state's own reset."""
        world, state = self.world, self.state
        old_size = world.size()
        with progress.section("reset", None):  # the driver may wait minutes for hosts
            t0 = time.time()
            with gloo_watch.exit_if_stuck("reset:"):  # a loop stuck in Gloo holds a shutdown
                world.tear_down(fault)
            t1 = time.time()
            try:
                world.form(fault)
            except Evicted as e:
                _exit_evicted(str(e))
            except Left as e:  # the old world is torn down already: nothing more to leave
                self._left(str(e))
                raise SystemExit(0) from None
            t2 = time.time()
            world.rejoined(state)
        gen = world.generation()
        state.events.emit(ev.RESET, old_size=old_size, new_size=world.size(), generation=gen,
                          seconds=round(time.time() - since, 6), shutdown_s=round(t1 - t0, 4),
                          init_s=round(t2 - t1, 4), state_s=round(time.time() - t2, 4),
                          joined=fault.joined, **resources())
        if world.rank() == 0:
            logger.info("%s: world size %d -> %d%s",
                        "reset" if gen is None else f"generation {gen}", old_size, world.size(),
                        " (a worker joined)" if fault.joined else "")


def _exit_evicted(reason: str) -> None:
    """The others went on without this worker: it exits as a hung one (the launcher's dead
    worker), before it writes a checkpoint or an event beside the survivors'."""
    logger.error("%s; exiting (code %d) without writing", reason, HUNG_EXIT_CODE)
    exit_now(HUNG_EXIT_CODE)
