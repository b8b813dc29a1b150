"""A user's own DDP script in place (the backend side of `hvd_resilient.inplace`).

The Trainer never wraps its model in DistributedDataParallel here (`grads.GradientAverager`
follows the default group by itself). A torchrun script does, and DDP binds a process group
when it is built: after a generation changes, its reducer would keep the old one. On torch
2.13 that group is destroyed (its allreduce fails, and every generation after it); with torch's
own reconfigure (`reconfigure.py`) the group is the same object, but the reducer cached the old
world size as its divisor: the first step after a shrink 3 -> 2 averages over 3 (a gradient
1.0 instead of 1.5, field notes 2026-12-06). `DDPSession.bind` answers both before the script's
function runs in a new generation: `ddp._update_process_group(WORLD)` (rebinds the reducer,
resets its state after the failed backward, unsets the divisor, rebuilds the buckets), the
DistributedSamplers re-planned for the new rank and size, and torchrun's variables (RANK,
WORLD_SIZE, LOCAL_RANK, ...) set to the generation's, for code that reads them later.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

from hvd_resilient import event_names as ev
from hvd_resilient.backends.inplace.backend import InPlaceBackend
from hvd_resilient.backends.inplace.state import InPlaceState
from hvd_resilient.backends.torchdist.collectives import TorchDistCollectives
from hvd_resilient.events import EventLog

logger = logging.getLogger(__name__)

TORCHRUN_ENVS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
"""What torchrun sets and a DDP script reads; the agent sets none (ranks change inside the
running workers), the session sets them at every generation."""


def replan(sampler: DistributedSampler[Any], rank: int, size: int) -> None:
    """``sampler`` as `DistributedSampler(dataset)` would be built in this generation: its
    rank, its number of replicas and its share (`__init__`'s arithmetic, torch 2.13). Its
    epoch and seed are kept: the ranks' orders stay one permutation, split anew."""
    sampler.rank, sampler.num_replicas = rank, size
    n = len(sampler.dataset)  # type: ignore[arg-type]
    if sampler.drop_last and n % size != 0:
        sampler.num_samples = math.ceil((n - size) / size)
    else:
        sampler.num_samples = math.ceil(n / size)
    sampler.total_size = sampler.num_samples * size


def set_torchrun_env(rank: int, size: int, env: MutableMapping[str, str] | None = None) -> None:
    """torchrun's variables for this generation (one machine: local = global)."""
    env = os.environ if env is None else env
    for name, value in zip(TORCHRUN_ENVS, (rank, size, rank, size, 0), strict=True):
        env[name] = str(value)


class DDPSession:
    """One worker's in-place run as a DDP script sees it: the backend, and the generation its
    DDP wrappers and samplers are bound to."""

    def __init__(self, backend: InPlaceBackend, events: EventLog) -> None:
        self.backend, self.events = backend, events
        self.solo = False
        """A latecomer (a replacement, a standby) holds a group of its own until it is taken
        in, so that the script's `DDP(model)` and `DistributedSampler(data)` can be built
        before `run`: both want a default group. Dropped at `run`; `bind` then moves both to
        the generation that takes it in, and the sync sends it the state."""

    @property
    def generation(self) -> int:
        m = self.backend.membership
        return -1 if m is None or self.solo else m.generation

    def leave_solo(self) -> None:
        if self.solo:
            dist.destroy_process_group()
            self.solo = False

    def bind(self, state: DDPState) -> None:
        """Before the script's function runs: if the generation changed since the last bind
        (a fault, a join), every DDP wrapper and sampler moves to it (see the module doc)."""
        g = self.generation
        if g == state.bound_generation:
            return
        world = dist.group.WORLD
        rank, size = dist.get_rank(), dist.get_world_size()
        for ddp in state.ddp_models:
            ddp._update_process_group(world)  # type: ignore[no-untyped-call]  # torch's own
        for sampler in state.samplers:
            replan(sampler, rank, size)
        set_torchrun_env(rank, size)
        if state.bound_generation >= 0:
            state.first_step_pending = True
            self.events.emit(ev.DDP_REBOUND, generation=g, models=len(state.ddp_models),
                             samplers=len(state.samplers))
        state.bound_generation = g


class DDPState(InPlaceState):
    """What a DDP script commits: its (DDP-wrapped) model, its optimizer, its own counters
    (``**attributes``: an epoch, a best loss), restored by the survivors of a fault and sent to
    a newcomer by the verified sync. ``sampler``: a `DistributedSampler` is re-planned at every
    generation (it has no state to commit: its epoch is what the script's loop sets); this
    library's `ElasticDataSampler` is committed as in the Trainer.

    Without a session (not under the in-place agent: plain torchrun, one process) nothing is
    kept: `commit()` only counts, and a failure ends the job as it always did."""

    _synced_once = True
    """The script's random streams are its own: the first sync does not re-seed them, as the
    Trainer's does (each rank's streams are still committed and restored with the state)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 session: DDPSession | None, sampler: Any | None = None,
                 **attributes: Any) -> None:
        self.session = session
        self.samplers = [sampler] if isinstance(sampler, DistributedSampler) else []
        self.ddp_models = [m for m in (model, *attributes.values())
                           if isinstance(m, DistributedDataParallel)]
        self.bound_generation = session.generation if session is not None else -1
        """The generation the DDP wrappers were built on (the script built them before the
        state), then the one `DDPSession.bind` last moved them to."""
        self.first_step_pending = False
        backend = session.backend if session is not None else None
        kwargs: dict[str, Any] = dict(
            sampler=None if self.samplers else sampler,
            rank=backend.rank if backend else _dist_rank,
            size=backend.size if backend else _dist_size,
            collectives=backend.collectives if backend else TorchDistCollectives(),
            events=session.events if session is not None else None)
        if backend is not None:
            kwargs["generation_changed"] = backend._generation_changed
        super().__init__(model, optimizer, **kwargs, **attributes)
        optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        """Counts optimizer steps (the events' `step`, and what tells a commit from none);
        the first step after a rebind is recorded (`first_step`: what recovery is timed to)."""
        self.step += 1
        if self.first_step_pending:
            self.first_step_pending = False
            self.events.emit(ev.FIRST_STEP, generation=self.bound_generation, pid=os.getpid())

    def commit(self) -> None:
        """The commit point (in this process's memory), every rank at the same place in its
        loop: a collective-free copy, plus one broadcast when a worker may join (it joins
        here, at the commit)."""
        if self.session is None:
            self.last_commit_step = self.step
            return
        self.host_change_pending()
        super().commit()


def _dist_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _dist_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def run_in_place(session: DDPSession, state: DDPState, fn: Callable[[], Any]) -> Any:
    """``fn`` trained in generations: on a fault the survivors restore ``state``'s last
    commit, form the next generation, sync from its rank 0, rebind, and call ``fn`` again
    (`InPlaceBackend.run`)."""
    result: list[Any] = []

    def attempt(_state: Any) -> None:
        session.bind(state)
        result[:] = [fn()]

    session.leave_solo()
    t0 = time.time()
    session.backend.run(attempt, state)
    state.events.emit(ev.DONE, seconds=round(time.time() - t0, 6),
                      params_sha256=state.params_sha256(), digests=state.state_digests())
    return result[0]
