"""Horovod: elastic under horovodrun (Gloo), static under mpirun/srun (MPI controller)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import horovod.torch as hvd
import torch

from hvd_resilient.backends.base import Backend, StateT
from hvd_resilient.backends.horovod import init as hvd_init
from hvd_resilient.backends.horovod import ordered, slots
from hvd_resilient.backends.horovod.run import HEARTBEAT_TIMEOUT_S
from hvd_resilient.backends.horovod.run import run as run_elastic
from hvd_resilient.backends.horovod.state import ElasticState


class HorovodBackend(Backend):
    name = "horovod"
    resume_on_every_rank = False

    def __init__(self, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S, *,
                 deterministic: bool = False, host_check_every: int = 1) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        """A peer silent this long is evicted (0: heartbeats off)."""
        self.deterministic = deterministic
        self.host_check_every = host_check_every
        """Steps between the ranks' questions whether discovery changed the hosts."""

    def init(self, comm: Any | None = None) -> None:
        # wrap() builds the ordered optimizer when asked
        hvd_init.init(comm, ordered=True, deterministic=self.deterministic)

    def rank(self) -> int:
        return int(hvd.rank())

    def size(self) -> int:
        return int(hvd.size())

    def local_size(self) -> int:
        return int(hvd.local_size())

    def wrap(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
             accumulation: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        if torch.cuda.is_available():  # one GPU per worker, by its rank on the host
            slot = slots.local_rank()  # with slot hosts hvd.local_rank() is always 0
            torch.cuda.set_device(hvd.local_rank() if slot is None else slot)
            model.cuda()
        opt: Any  # Horovod's DistributedOptimizer, whose class (and its methods) has no types
        if self.deterministic:  # gradients averaged in one fixed order (docs/determinism.md)
            opt = ordered.ordered_optimizer(optimizer, model.named_parameters())
        else:
            opt = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
        # Accumulated micro-batches: the allreduce fires on the last backward pass; a step
        # with fewer (the epoch's end) reduces the rest in step()'s synchronize().
        opt.set_backward_passes_per_step(accumulation)
        return model, opt

    def make_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   **kwargs: Any) -> ElasticState:
        kwargs.setdefault("host_check_every", self.host_check_every)
        kwargs.setdefault("hold_additions", True)  # the Trainer's loop has no Horovod timing
        return ElasticState(model, optimizer, **kwargs)

    def run(self, fn: Callable[[StateT], None], state: StateT) -> None:
        run_elastic(fn, heartbeat_timeout_s=self.heartbeat_timeout_s)(state)

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(hvd.allgather_object(obj))

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0])
        return bool(hvd.allreduce(t, op=hvd.Max, name="hvd_resilient.any_rank").item() > 0)

    def shutdown(self) -> None:
        """Horovod stays up: the user may still run collectives after fit()."""
