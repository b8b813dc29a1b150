"""The in-place backend: torch.distributed (Gloo) in generations; survivors keep their process.

A fault is anything that fails a collective: a peer that died (its kernel hangs up, and the
Gloo hang-up watch spreads that to every rank at once), a peer its heartbeats found silent
(the agent ends it), a collective error. Each survivor then: hangs up on its peers (so none
waits out its timeout on this rank), restores its last in-memory commit, drops the
generation's group locally (its sockets are shut: nothing left to wait for, measured 0.1 ms),
asks the agent for the next generation, forms the new group and syncs (`state.agreement`, rank
0 a survivor). The step loop goes on; the sampler re-plans the rest of the epoch for the new
size. That order is the backends' one recovery loop (`backends/recovery.py`); `_Generations`
says how a generation is left and entered.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hvd_resilient import event_names as ev
from hvd_resilient.backends import determinism, recovery
from hvd_resilient.backends.base import StateT
from hvd_resilient.backends.inplace.busy import BusyReporter
from hvd_resilient.backends.inplace.grads import GradientAverager
from hvd_resilient.backends.inplace.membership import Fenced, Membership, host_of
from hvd_resilient.backends.inplace.state import GenerationChanged, InPlaceState
from hvd_resilient.backends.torchdist.backend import TorchDistBackend
from hvd_resilient.backends.torchdist.collectives import TorchDistCollectives
from hvd_resilient.backends.torchdist.world import TorchDistWorld
from hvd_resilient.detect import Detectors, progress
from hvd_resilient.detect.gloo_watch import GlooWatch
from hvd_resilient.detect.heartbeat import Peer
from hvd_resilient.detect.silent_peers import SilentPeers
from hvd_resilient.errors import ConfigError
from hvd_resilient.state.protocol import TrainingState

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


class _Generations(TorchDistWorld):
    """The in-place world (`recovery.World`): a generation of torch.distributed groups that
    the agent publishes; a fault or a join moves every member to the next one."""

    failure_budget = MAX_FAILED_GENERATIONS
    may_skip_sync = False  # its moves never skip the sync
    backend: InPlaceBackend

    def __init__(self, backend: InPlaceBackend, m: Membership, state: InPlaceState) -> None:
        self.backend, self.m, self.state = backend, m, state
        self._moving = False
        """The fault being answered is a move at a commit (a join, a host removed)."""
        self.reset_pending = False
        """A new generation's state hooks (`reset_done`) are still to run: at the sync, where
        the detectors watch their collectives."""
        self.hangup = watch = GlooWatch()
        self.detectors = Detectors(watch, SilentPeers(
            backend.heartbeat_timeout_s, state.events, machine=socket.gethostname(),
            slot=str(m.me), coordinator=m.address, evict=_AgentEvict(m, watch.trip),
            quiet_for=watch.quiet_for))

    def generation(self) -> int | None:
        return self.m.generation

    def sync(self, state: TrainingState, rider: object,
             arm: Callable[[list[Any]], None]) -> None:
        arm(self.allgather(rider))
        if self.reset_pending:  # watched: the hooks' collectives (fsdp's reload) fail fast
            self.state.reset_done()  # on a lost peer (the state the loop syncs)
            self.reset_pending = False
        state.sync()

    def armed(self, counts: dict[str, int], on_this_machine: int) -> int | None:
        return None  # the agent starts every worker with its share of the cores

    def classify(self, error: Exception) -> recovery.Fault | None:
        if isinstance(error, GenerationChanged):
            return recovery.Fault(recovery.FaultKind.CHANGE, joined=True)
        if collective_failure(error):
            return recovery.Fault(recovery.FaultKind.FAILURE)
        return None

    def evicted(self) -> str | None:
        return None  # the agent's store says so when the next generation is entered (form)

    def changed(self, fault: recovery.Fault) -> None:
        dist.barrier()  # every rank stopped watching before anyone hangs up
        self._moving = fault.kind is recovery.FaultKind.CHANGE

    def leaving(self) -> str | None:
        """At a commit's move only: the newest generation goes on without this worker (its
        host was removed, `HostAgent.leave`), which leaves with exit code 0 and writes
        nothing more. After a fault, `form` tells the same leave (`recovery.Left`) from an
        eviction (a worker found silent, which its agent ends)."""
        if not self._moving or not self.m.left_out():
            return None
        return str(self.m.me)

    def leave(self, slot: str) -> int:
        dist.destroy_process_group()
        return 0

    def tear_down(self, fault: recovery.Fault) -> None:
        if not self.m.reconfigure:  # (a reconfigured group is kept: `inplace.reconfigure`)
            dist.destroy_process_group()  # local: its sockets are shut, nothing to wait for

    def form(self, fault: recovery.Fault) -> None:
        """The next generation that holds this worker: after a fault reported and asked for,
        after a join already published."""
        m = self.m
        old_gen = m.generation
        if fault.kind is recovery.FaultKind.FAILURE:
            m.report_fault(old_gen)
        try:
            m.enter(old_gen, self.backend.pg_timeout)
        except Fenced as e:
            if m.host_leaving():  # a fault came before the commit this host would leave at
                raise recovery.Left(str(m.me)) from e
            raise recovery.Evicted(str(e)) from e

    def rejoined(self, state: TrainingState) -> None:
        self.reset_pending = True  # the after-reset hooks run watched, at the next sync

    def finish(self) -> None:
        dist.barrier()


class InPlaceBackend(TorchDistBackend):
    name = "inplace"
    numbers_generations = True
    resume_on_every_rank = False  # rank 0 reads the durable checkpoint, the sync spreads it
    reduces_in_backward = False  # the gradients are averaged at optimizer.step() (grads.py)

    def __init__(self, pg_timeout_seconds: float = 300.0, heartbeat_timeout_s: float = 1.5,
                 generation_timeout_s: float = 120.0, *, deterministic: bool = False,
                 fsdp: bool = False, pg_backend: str = "gloo",
                 reconfigure: bool = False) -> None:
        super().__init__(fsdp=fsdp, pg_timeout_seconds=pg_timeout_seconds,
                         heartbeat_timeout_s=heartbeat_timeout_s, deterministic=deterministic)
        self.pg_backend, self.reconfigure = pg_backend, reconfigure
        """The groups' torch backend, and whether one group is reconfigured per generation
        (`inplace.reconfigure`) instead of a new one formed: the DDP adapter
        (`inplace.ddp`) asks for the latter where torch has it."""
        # fsdp: the model is re-sharded at every generation (`inplace.fsdp`); FSDP reduces in
        # backward, and every rank loads its shards at a (re)start, as on torchrun
        if fsdp:
            self.reduces_in_backward = self.resume_on_every_rank = True
        self.generation_timeout_s = generation_timeout_s
        self.membership: Membership | None = None
        self.collectives = TorchDistCollectives()

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

    def generation(self) -> int:
        """The generation this worker trains in (its checkpoints carry it: `fenced`)."""
        return max(self.membership.generation, 0) if self.membership is not None else 0

    def local_size(self) -> int:
        """The members its host's agent started (they share this machine's cores)."""
        assert self.membership is not None, "init() first"
        me = host_of(self.membership.me)
        return sum(host_of(m) == me for m in self.membership.members)

    @property
    def joining(self) -> bool:
        """A latecomer set up before it has a group: it takes no host role (the memory tier's
        writer) until it is a member."""
        return self.membership is not None and not dist.is_initialized()

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
             accumulation: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
        """The model as it is (its parameters are made equal by every sync), the optimizer
        averaging gradients at each step; with fsdp, the model sharded in its holder."""
        if self.fsdp:
            from hvd_resilient.backends.inplace.fsdp import Resharded

            return Resharded(model, optimizer, self.device), optimizer
        GradientAverager(optimizer)
        return model, optimizer

    def make_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   **kwargs: Any) -> InPlaceState:
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

    def run(self, fn: Callable[[StateT], None], state: StateT) -> None:
        m = self.membership
        assert m is not None, "init() first"
        if not isinstance(state, InPlaceState):  # its generations run the state's reset hooks
            raise TypeError(f"the inplace backend runs the state its make_state() builds, not "
                            f"{type(state).__name__}")
        if self.joining:  # a latecomer, set up: up and waiting now, so the
            m.announce()  # members' stall at its join is the formation and the sync only
            with progress.section("standing by", None):  # a standby: the whole run, maybe
                self._take_place(m)
        busy = BusyReporter(m.me).start()  # the agent's last call waits for a busy member
        if m.generation > 0 and m.announced_at is not None:  # a replacement, taken in now
            state.events.emit(ev.JOINED, member=m.me, generation=m.generation,
                              ready_at=round(m.announced_at, 6),
                              waited_s=round(time.time() - m.announced_at, 6))
        try:
            recovery.run(_Generations(self, m, state), state, lambda: fn(state))
        finally:
            busy.stop()
