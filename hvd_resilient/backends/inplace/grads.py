"""Gradient averaging that follows the generations: at `optimizer.step()`, over whatever the
default process group is then.

DDP binds its process group when it is built, and a new generation has a new group, so the
in-place backend does not use it: a step pre-hook on the user's optimizer (the same object: a
scheduler built on it keeps steering it) allreduces every gradient as one flat buffer per
dtype, in parameter order, once per optimizer step (so accumulation reduces once). The
optimizer gets Horovod's two methods, which `training.recipe` calls to clip or unscale the
reduced gradients: `synchronize()` and `skip_synchronize()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._C._nn import flatten_dense_tensors, unflatten_dense_tensors

from hvd_resilient.errors import ConfigError


class GradientAverager:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._skip = False
        optimizer.register_step_pre_hook(self._before_step)
        optimizer.synchronize = self.synchronize  # type: ignore[attr-defined]
        optimizer.skip_synchronize = self.skip_synchronize  # type: ignore[attr-defined]

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]

    def synchronize(self) -> None:
        """Every rank's gradients replaced by their mean (a collective); a parameter without
        a gradient on a rank counts as zero there."""
        size = dist.get_world_size()
        params = self._params()
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad.is_sparse:
                raise ConfigError("the inplace backend averages dense gradients only; use "
                                  "torchrun or Horovod for sparse embeddings")
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        if size > 1:
            for grads in by_dtype.values():
                flat = flatten_dense_tensors(grads)
                dist.all_reduce(flat)
                flat.div_(size)
                for g, reduced in zip(grads, unflatten_dense_tensors(flat, grads),
                                      strict=True):
                    g.copy_(reduced)

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """The step inside uses the gradients `synchronize()` reduced already."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def _before_step(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        if not self._skip:  # (reducing reduced gradients again gives the same mean)
            self.synchronize()
