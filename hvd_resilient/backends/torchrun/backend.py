"""torch.distributed under torchrun: DDP (or FSDP2 with `fsdp=True`) over NCCL on GPUs, Gloo
on CPUs.

torchrun restarts every worker after a failure; the restarted workers resume from the newest
durable checkpoint. A plain `init_process_group` hangs after such a restart: the workers share
the agent's store with the dead round, and Gloo reads the dead processes' addresses from it.
Keys of each round live under their own prefix here, so a restarted round never sees them.

DDP lays its gradient buckets out in parameter order for a process's first step and rebuilds
them in gradient-ready order after it, so with 3 or more ranks the first step after a restart
rounds differently from the same step of a run never restarted. With ``deterministic=True``
(`--deterministic`) a communication hook reduces all gradients as one buffer laid out in
parameter order, whatever their buckets (`determinism`).
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore, TCPStore

from hvd_resilient.backends import determinism, recovery
from hvd_resilient.backends.base import StateT
from hvd_resilient.backends.torchdist.backend import TorchDistBackend, release_groups
from hvd_resilient.backends.torchdist.collectives import TorchDistCollectives
from hvd_resilient.backends.torchdist.world import TorchDistWorld
from hvd_resilient.backends.torchrun.state import TorchrunState
from hvd_resilient.detect import Detectors
from hvd_resilient.detect.silent_peers import SilentPeers
from hvd_resilient.state.protocol import TrainingState

logger = logging.getLogger(__name__)


class TorchrunBackend(TorchDistBackend):
    """A worker that torchrun started: its place comes from torchrun's variables, its group is
    formed once, and a peer its heartbeats find silent (frozen, cut off) makes this worker
    exit, so that torchrun restarts every worker now instead of after the process-group
    timeout."""

    name = "torchrun"
    resume_on_every_rank = True
    reduces_in_backward = True

    def __init__(self, fsdp: bool = False, pg_timeout_seconds: float = 300.0,
                 heartbeat_timeout_s: float = 1.5, *, deterministic: bool = False) -> None:
        super().__init__(fsdp=fsdp, pg_timeout_seconds=pg_timeout_seconds,
                         heartbeat_timeout_s=heartbeat_timeout_s, deterministic=deterministic)

    def init(self, comm: Any | None = None) -> None:
        env = os.environ  # torchrun's agent hands its workers their place here
        determinism.apply(self.deterministic)  # local math; the DDP hook comes in wrap()
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        self.coordinator = (env["MASTER_ADDR"], int(env["MASTER_PORT"]))
        use_cuda = torch.cuda.is_available()
        if use_cuda:
            self.device = torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        # the rendezvous round (every node agrees; launch/warm/torchrun.py exports it), else
        # this agent's restart count (right while no node joins later)
        restart = env.get("HVD_RESILIENT_RDZV_ROUND") or env.get("TORCHELASTIC_RESTART_COUNT",
                                                                  "0")
        base = TCPStore(*self.coordinator, world_size=world, is_master=False,
                        timeout=self.pg_timeout)
        store = PrefixStore(f"hvd_resilient/round{restart}/", base)
        dist.init_process_group("nccl" if use_cuda else "gloo", store=store, rank=rank,
                                world_size=world, timeout=self.pg_timeout)

    def rank(self) -> int:
        return dist.get_rank()

    def size(self) -> int:
        return dist.get_world_size()

    def local_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer, *,
             accumulation: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
        """DDP or FSDP2; accumulation needs nothing here (`training.recipe` skips the
        reduction of all but the last micro-batch)."""
        if self.fsdp:
            from hvd_resilient.backends.torchdist import fsdp

            if self.deterministic and self.rank() == 0:
                logger.warning("--deterministic does not cover FSDP's reductions "
                               "(docs/determinism.md)")
            return fsdp.shard(model, optimizer, self.device), optimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        model.to(self.device)
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DDP(model, device_ids=ids)
        if self.deterministic:
            determinism.register_ddp_hook(ddp)
        return ddp, optimizer

    def make_state(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   **kwargs: Any) -> TorchrunState:
        return TorchrunState(model, optimizer, rank=self.rank, size=self.size,
                             collectives=TorchDistCollectives(self.device), **kwargs)

    def run(self, fn: Callable[[StateT], None], state: StateT) -> None:
        env = os.environ
        silent = SilentPeers(self.heartbeat_timeout_s, state.events, machine=socket.gethostname(),
                             slot=f"local rank {env.get('LOCAL_RANK', '?')}",
                             coordinator=self.coordinator)
        # No Gloo hang-up watch: torchrun's agent sees a dead worker and restarts every one.
        recovery.run(_TorchrunWorld(self, Detectors(silent)), state, lambda: fn(state))
        # Past this barrier no collective of ours is in flight, so releasing the groups cannot
        # wait on a peer. Left to interpreter teardown, Gloo's worker threads still hold
        # tensors whose release needs the GIL, and the process can abort with "terminate
        # called without an active exception" after a finished run (seen in CI). At exit, not
        # here: the caller may still run collectives after fit().
        atexit.register(release_groups)


class _TorchrunWorld(TorchDistWorld, recovery.FormOnce):
    """torchrun's world is formed once: its agent restarts every worker after a failure."""

    def __init__(self, backend: TorchrunBackend, detectors: Detectors) -> None:
        self.backend, self.detectors = backend, detectors

    def sync(self, state: TrainingState, rider: object,
             arm: Callable[[list[Any]], None]) -> None:
        arm(self.allgather(rider))
        state.sync()

    def finish(self) -> None:
        dist.barrier()  # detectors disarmed: nobody leaves while a peer still judges
