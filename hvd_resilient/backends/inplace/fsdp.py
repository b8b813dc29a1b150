"""FSDP2 on the in-place backend: the model re-sharded onto every new generation.

`fully_shard` binds a module to the group it was sharded over and cannot be applied to a module
twice, while every generation is a new group. So what the trainer, the recipe and the state
hold is a `Resharded` holder whose ``module`` is the current generation's sharded model. At a
new generation a fresh copy of the model's structure (kept on the meta device: no memory) is
materialized, sharded over the new group, and the optimizer's param groups are pointed at its
parameters by name: the optimizer object stays, with its hyper-parameters and the scheduler
bound to it. The values come afterwards from the last commit (`training.durable_sharded`: the
memory tier's segments hold every old rank's shards, the lost rank's too, since they live in the
host's memory and not in the dead process; else the durable checkpoint).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, cast

import torch
from torch import nn

from hvd_resilient.backends.torchdist import fsdp


def _meta_copy(model: nn.Module) -> nn.Module:
    """The model's structure on the meta device, without ever copying its values (tied
    parameters stay tied: a deepcopy memo keyed by the originals)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) \
            if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _release(module: nn.Module) -> None:
    """Frees the memory of an old generation's shards and gradients now. FSDP's hooks keep the
    module in reference cycles, which only a full collection breaks (0.1-0.15 s here, inside
    the recovery); until then its parameters would hold their memory beside the new ones (on a
    GPU, twice the shards for a moment). The empty objects go with the next collection."""
    with torch.no_grad():
        for p in module.parameters():
            p.grad = None
            local = p.to_local() if hasattr(p, "to_local") else p
            local.untyped_storage().resize_(0)


class Resharded(fsdp.ShardedHolder):
    """The trainer's model under the in-place backend with ``--fsdp``; forwards to ``module``
    (the `fsdp.ShardedHolder` interface: what the tiers and the state ask for).

    Its state dict is the sharded module's (no ``module.`` prefix), so checkpoints are the ones
    torchrun's FSDP writes and either backend resumes the other's.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 device: torch.device) -> None:
        super().__init__()
        names = fsdp.param_names(model, optimizer)
        # plain attributes, not submodules: the template holds no state of the model's
        self.__dict__.update(_template=_meta_copy(model), _optimizer=optimizer, _names=names,
                             _device=device)
        self.module = fsdp.shard(model, optimizer, device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def set_requires_gradient_sync(self, requires: bool, **kwargs: Any) -> None:
        """FSDP2's switch for gradient accumulation (`training.recipe`)."""
        from torch.distributed.fsdp import FSDPModule

        cast(FSDPModule, self.module).set_requires_gradient_sync(requires, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.load_state_dict(*args, **kwargs)

    def reshard(self) -> None:
        """A fresh copy of the model sharded over the current group, the optimizer pointed at
        it with no state. Its parameters hold no values yet: the caller loads a commit.
        Collective (every member of the generation)."""
        old = self.module
        fresh = copy.deepcopy(self.__dict__["_template"])
        fresh.to_empty(device=self.__dict__["_device"])
        # FSDP2 leaves buffers whole on every rank, and a state dict lacks the non-persistent
        # ones: every buffer comes from the previous generation's module
        with torch.no_grad():
            before = dict(old.named_buffers())
            for name, b in fresh.named_buffers():
                b.copy_(before[name])
        fsdp.shard_module(fresh)
        optimizer = self.__dict__["_optimizer"]
        optimizer.state.clear()  # keyed by the old generation's parameters
        fsdp.point_optimizer(optimizer, fresh, self.__dict__["_names"])
        self.module = fresh
        _release(old)
