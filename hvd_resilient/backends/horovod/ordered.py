"""--deterministic under Horovod: gradients averaged as one group, in parameter order.

Lives beside the other Horovod code (`backends/determinism.py` keeps what every backend
shares): it reads private fields of Horovod's optimizer, declared in `compat.py`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from hvd_resilient.backends.determinism import GRADIENTS_NAME
from hvd_resilient.errors import ConfigError

if TYPE_CHECKING:
    import torch


def ordered_optimizer(optimizer: torch.optim.Optimizer,
                      named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                      ) -> torch.optim.Optimizer:
    """`hvd.DistributedOptimizer` whose gradients are averaged in a fixed order: its
    per-gradient hooks only mark a gradient done, and `synchronize()` (called by `step()`)
    averages all of them at once with one grouped allreduce in parameter order (a gradient
    this rank did not compute counts as zeros, as in Horovod). With `horovod_env(ordered=True)`
    Horovod fuses the group alone and in that order, so an element's summation order is
    fixed. One fused allreduce per step, as Horovod's default usually does, after the backward
    pass instead of overlapping it. No collective at construction (Horovod's own `groups=`
    broadcasts the parameter names there, which a worker joining an elastic job would call
    alone). Written against Horovod 0.28.1's `_DistributedOptimizer`."""
    import horovod.torch as hvd
    import torch

    opt = hvd.DistributedOptimizer(optimizer, named_parameters=named_parameters)
    for attr in ("_allreduce_grad_async", "synchronize", "_handles", "_allreduce_delay",
                 "_synchronized", "backward_passes_per_step"):
        if not hasattr(opt, attr):
            raise ConfigError(f"deterministic: this Horovod's DistributedOptimizer lacks {attr}"
                              " (written against Horovod 0.28.1)")
    params = [p for group in opt.param_groups for p in group["params"] if p.requires_grad]

    def no_reduction(p: torch.Tensor) -> tuple[None, None]:
        return None, None  # the hook records (None, None): done, nothing in flight

    def synchronize() -> None:
        grads = []
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad.is_sparse:
                p.grad = p.grad.to_dense()
            grads.append(p.grad)
        hvd.grouped_allreduce_(grads, op=hvd.Average, name=GRADIENTS_NAME)
        for p in params:
            opt._allreduce_delay[p] = opt.backward_passes_per_step
        opt._handles.clear()
        opt._synchronized = True

    opt._allreduce_grad_async = no_reduction
    opt.synchronize = synchronize
    wrapped: torch.optim.Optimizer = opt  # Horovod's class of the optimizer's own class
    return wrapped
