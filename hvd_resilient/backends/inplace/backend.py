"""The in-place backend: torch.distributed (Gloo) in generations; survivors keep their process.

A fault is anything that fails a collective: a peer that died (its kernel hangs up, and the
Gloo hang-up watch spreads that to every rank at once), a peer its heartbeats found silent
(the agent ends it), a collective error. Each survivor then: hangs up on its peers (so none
waits out its timeout on this rank), drops the generation's group locally (its sockets are
shut: nothing left to wait for, measured 0.1 ms), asks the agent for the next generation,
restores its last in-memory commit, forms the new group and syncs (`state.agreement`, rank 0 a
survivor). The step loop goes on; the sampler re-plans the rest of the epoch for the new size.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil
import torch
import torch.distributed as dist

from hvd_resilient.backends import determinism
from hvd_resilient.backends.base import Backend
from hvd_resilient.backends.inplace.busy import BusyReporter
from hvd_resilient.backends.inplace.grads import GradientAverager
from hvd_resilient.backends.inplace.membership import Fenced, Membership
from hvd_resilient.backends.inplace.state import GenerationChanged, InPlaceState
from hvd_resilient.backends.torchrun.collectives import TorchDistCollectives
from hvd_resilient.detect import Detectors, hangup, progress
from hvd_resilient.detect.gloo_watch import GlooWatch
from hvd_resilient.detect.heartbeat import Peer
from hvd_resilient.detect.silent_peers import SilentPeers
from hvd_resilient.errors import (
    HUNG_EXIT_CODE,
    ConfigError,
    HvdResilientError,
    exit_now,
    one_line,
)

logger = logging.getLogger(__name__)
MAX_FAILED_GENERATIONS = 5
"""Generations in a row that fail before their first commit: then the fault is not a peer's
(a bug that fails a collective every time), and the job stops instead of looping."""
_GLOO_MARKERS = ("gloo", "Connection closed", "Connection reset", "Broken pipe", "Read error",
                 "Timed out", "NCCL")


def collective_failure(e: BaseException) -> bool:
    """A failed collective (raised as a plain RuntimeError by Gloo), not a bug of the script."""
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _GLOO_MARKERS)


def _resources() -> dict[str, int]:
    """What a generation could leak, counted at every reset (50 in a row must stay flat)."""
    return {"threads": threading.active_count(), "fds": len(os.listdir("/proc/self/fd")),
            "rss_bytes": psutil.Process().memory_info().rss}


class GenerationsFailed(HvdResilientError):
    """Generations keep failing before their first commit: the fault is not a peer's, and a
    restart would fail the same way, so the job stops with one line (exit 78, not relaunched)."""


class _AgentEvict:
    """Silent peers are ended by the agent (`launch/inplace_agent.py`), which sees every
    worker; this rank's collectives fail now (the watch trips)."""

    def __init__(self, membership: Membership, trip: Callable[[str], None]) -> None:
        self.membership, self.trip = membership, trip

    def evicted_first(self, peers: list[Peer], alone: bool) -> bool:
        return self.membership.evicted()

    def __call__(self, peers: list[Peer], detail: str) -> None:
        self.membership.evict([int(p.slot) for p in peers if p.slot.isdigit()], detail)
        self.trip(detail)


class InPlaceBackend(Backend):
    name = "inplace"
    resume_on_every_rank = False  # rank 0 reads the durable checkpoint, the sync spreads it
    reduces_in_backward = False  # the gradients are averaged at optimizer.step() (grads.py)

    def __init__(self, pg_timeout_seconds: float = 300.0, heartbeat_timeout_s: float = 1.5,
                 generation_timeout_s: float = 120.0, *, deterministic: bool = False,
                 fsdp: bool = False, pg_backend: str = "gloo",
                 reconfigure: bool = False) -> None:
        self.deterministic = deterministic
        self.pg_backend, self.reconfigure = pg_backend, reconfigure
        """The groups' torch backend, and whether one group is reconfigured per generation
        (`inplace.reconfigure`) instead of a new one formed: the DDP adapter
        (`inplace.ddp`) asks for the latter where torch has it."""
        self.fsdp = fsdp
        """Shard the model (FSDP2), re-sharded at every generation (`inplace.fsdp`): FSDP
        reduces in backward, and every rank loads its shards at a (re)start, as on torchrun."""
        if fsdp:
            self.reduces_in_backward = self.resume_on_every_rank = True
        self.pg_timeout = datetime.timedelta(seconds=pg_timeout_seconds)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.generation_timeout_s = generation_timeout_s
        self.membership: Membership | None = None
        self.collectives = TorchDistCollectives()
        self._reset_pending = False

    def init(self, comm: Any | None = None) -> None:
        determinism.apply(self.deterministic)
        m = self.membership = Membership(self.generation_timeout_s, backend=self.pg_backend,
                                         reconfigure=self.reconfigure)
        self.coordinator = m.address  # where the memory tier's segment server is reached from
        if self.fsdp and m.joins:
            raise ConfigError("fsdp on the inplace backend takes no replacement or standby "
                              "workers yet (a newcomer would need every shard); drop --replace "
                              "and --standby")
        if m.expect_to_join():
            return  # a latecomer: set up first, announce at run() (the others train on)
        self._take_place(m)

    def _take_place(self, m: Membership) -> None:
        """The first generation that holds this worker, and its group."""
        m.enter(-1, self.pg_timeout, joining=True)

    # Rank and size come from the generation's member list (equal to the group's once it is
    # formed): a latecomer sets up with the place it will most likely take, before it has a
    # group, and every component re-plans at the sync anyway.
    def rank(self) -> int:
        assert self.membership is not None, "init() first"
        return self.membership.rank

    def size(self) -> int:
        assert self.membership is not None, "init() first"
        return len(self.membership.members)

    def local_size(self) -> int:
        return self.size()  # the agent starts every worker on its machine

    @property
    def joining(self) -> bool:
        """A latecomer set up before it has a group: it takes no host role (the memory tier's
        writer) until it is a member."""
        return self.membership is not None and not dist.is_initialized()

    def wrap(self, model: Any, optimizer: Any, *, accumulation: int = 1) -> tuple[Any, Any]:
        """The model as it is (its parameters are made equal by every sync), the optimizer
        averaging gradients at each step; with fsdp, the model sharded in its holder."""
        if self.fsdp:
            from hvd_resilient.backends.inplace.fsdp import Resharded

            return Resharded(model, optimizer, torch.device("cpu")), optimizer
        GradientAverager(optimizer)
        return model, optimizer

    def make_state(self, model: Any, optimizer: Any, **kwargs: Any) -> Any:
        return InPlaceState(model, optimizer, rank=self.rank, size=self.size,
                            collectives=self.collectives,
                            generation_changed=self._generation_changed, **kwargs)

    def _generation_changed(self) -> bool:
        """Rank 0's look at the store, the same on every rank (a collective); nothing at all,
        on any rank, when the agent starts no worker that could join."""
        m = self.membership
        if m is not None and not m.joins:
            return False
        flag = torch.tensor([1 if self.rank() == 0 and m is not None and m.changed() else 0],
                            dtype=torch.int32)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def run(self, fn: Callable[[Any], None], state: Any) -> None:
        m = self.membership
        assert m is not None, "init() first"
        if self.joining:  # a latecomer, set up: up and waiting now, so the
            m.announce()  # members' stall at its join is the formation and the sync only
            with progress.section("standing by", None):  # a standby: the whole run, maybe
                self._take_place(m)
        watch = GlooWatch()
        detectors = Detectors(watch, SilentPeers(
            self.heartbeat_timeout_s, state.events, machine=socket.gethostname(),
            slot=str(m.me), coordinator=None, evict=_AgentEvict(m, watch.trip),
            quiet_for=watch.quiet_for))
        busy = BusyReporter(m.me).start()  # the agent's last call waits for a busy member
        failed_in_a_row, last_commit = 0, state.last_commit_step
        if m.generation > 0 and m.announced_at is not None:  # a replacement, taken in now
            state.events.emit("joined", member=m.me, generation=m.generation,
                              ready_at=round(m.announced_at, 6),
                              waited_s=round(time.time() - m.announced_at, 6))
        try:
            while True:
                try:
                    with progress.section("sync", None):
                        counts = detectors.arm_with(self.rank(), self.allgather_object)
                        state.events.emit("watch", generation=m.generation, **counts)
                        if self._reset_pending:  # watched: the hooks' collectives (fsdp's
                            state.reset_done()  # reload) fail fast on a lost peer
                            self._reset_pending = False
                        t0 = time.time()
                        state.sync()
                        state.events.emit("sync", seconds=round(time.time() - t0, 6))
                    fn(state)
                    detectors.disarm()  # nobody leaves while a peer still watches
                    dist.barrier()
                    return
                except GenerationChanged:
                    detectors.disarm()
                    dist.barrier()  # every rank stopped watching before anyone hangs up
                    self._move_to_newest(state)
                except Exception as e:
                    if not collective_failure(e):
                        raise
                    detected = time.time()
                    hangup.hang_up(watch.stand_down())  # peers blocked on this rank fail now
                    detectors.disarm()
                    if state.last_commit_step != last_commit:
                        failed_in_a_row, last_commit = 0, state.last_commit_step
                    failed_in_a_row += 1
                    if failed_in_a_row > MAX_FAILED_GENERATIONS:
                        raise GenerationsFailed(
                            f"{failed_in_a_row} generations in a row failed before a commit; "
                            f"last: {one_line(e, typed=True)}") from e
                    self._next_generation(state, e, detected, watch)
        finally:
            busy.stop()
            detectors.disarm()

    def _next_generation(self, state: Any, error: BaseException, detected: float,
                         watch: GlooWatch) -> None:
        m = self.membership
        assert m is not None  # run() checked it
        hung_up = watch.detected_at
        state.events.emit("failure_detected", error=one_line(error, typed=True),
                          peer_hangup=watch.detail or None, generation=m.generation,
                          detect_seconds=round(detected - hung_up, 6) if hung_up else None)
        self._reform(state, detected, after_fault=True)

    def _move_to_newest(self, state: Any) -> None:
        """A worker joins: the members leave their generation at the same commit (no fault,
        nothing restored) for the newest one, and the sync sends the newcomer the state."""
        self._reform(state, time.time(), after_fault=False)

    def _reform(self, state: Any, since: float, *, after_fault: bool) -> None:
        """Leaves this generation for the next one that holds this worker: after a fault
        restored and asked for, after a join already published."""
        m = self.membership
        assert m is not None
        old_gen, old_size = m.generation, self.size()
        with progress.section("reset", None):
            if after_fault:
                state.restore()
            if not m.reconfigure:  # (a reconfigured group is kept: `inplace.reconfigure`)
                dist.destroy_process_group()  # local: its sockets are shut, nothing to wait for
            if after_fault:
                m.report_fault(old_gen)
            try:
                m.enter(old_gen, self.pg_timeout)
            except Fenced as e:
                logger.error("%s; exiting (code %d)", e, HUNG_EXIT_CODE)
                exit_now(HUNG_EXIT_CODE)
        self._reset_pending = True  # the after-reset hooks run in the loop (run())
        joined = {} if after_fault else {"joined": True}
        state.events.emit("reset", old_size=old_size, new_size=self.size(),
                          generation=m.generation, seconds=round(time.time() - since, 6),
                          **joined, **_resources())
        if self.rank() == 0:
            logger.info("generation %d: world size %d -> %d%s", m.generation, old_size,
                     self.size(), "" if after_fault else " (a worker joined)")

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.collectives.allgather_object(obj)

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

