"""FSDP2 (`torch.distributed.fsdp.fully_shard`) over torch.distributed (the torchrun backend,
and the in-place one through its holder, `backends.inplace.fsdp`): each rank holds a shard of
every parameter, gradient and optimizer state instead of a replica.

Why the extra steps around `fully_shard`:

- it replaces every parameter with a new sharded one, so an optimizer built before wrapping
  (the Trainer's API takes one) would step tensors the model no longer uses: `shard` points
  the optimizer's param groups at the new parameters;
- it shards each rank's own initial values and, unlike DDP, never broadcasts them: ranks that
  built the model from different seeds would train a model no single rank ever had, so rank 0's
  values are broadcast first;
- a sharded state dict holds DTensors that no rank can `torch.save` alone: `full_state`
  gathers them (a collective), to export the whole model or compare it in tests;
- a module stays bound to the group it was sharded over, so where the group changes (the
  in-place backend's generations) the trainer holds a `ShardedHolder` instead, and every helper
  here works on the sharded module inside it (`root`).
"""

from __future__ import annotations

import logging
from typing import Any, TypeGuard

import torch
from torch import nn

from hvd_resilient.errors import ConfigError

logger = logging.getLogger(__name__)

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


class ShardedHolder(nn.Module):
    """A model that holds its sharded module in ``module`` instead of being it, and shards a
    fresh copy over the current group at `reshard`: `fully_shard` binds a module to the group
    it was sharded over and cannot be applied twice, while the in-place backend forms a new
    group at every generation (its `backends.inplace.fsdp.Resharded` declares this interface).

    What it changes for the readers (each asks `holds_sharded_module`): the helpers here work
    on ``module`` (`root`); the in-place state's commit holds no model, since the memory tier's
    copy of every rank's shards is the commit; and the durable tier re-shards and reloads the
    last commit at every new generation (`training.durable_sharded`).
    """

    module: nn.Module

    def reshard(self) -> None:
        """A fresh copy of the model sharded over the current group, the optimizer pointed at
        it with no state; its values come from the commit the caller loads next. Collective
        (every member of the group)."""
        raise NotImplementedError


def holds_sharded_module(model: object) -> TypeGuard[ShardedHolder]:
    """True when ``model`` is a `ShardedHolder` (not the sharded module itself)."""
    return isinstance(model, ShardedHolder)


def root(model: nn.Module) -> nn.Module:
    """The sharded module itself: ``model``'s ``module`` where it is a `ShardedHolder`."""
    return model.module if holds_sharded_module(model) else model


def _units(model: nn.Module) -> list[nn.Module]:
    """The submodules that get their own FSDP unit (all-gathered just before they run, freed
    after): the root's children that hold parameters, one level into plain containers so a
    stack of transformer blocks becomes one unit per block."""
    out: list[nn.Module] = []
    for child in model.children():
        inner = list(child.children()) if isinstance(child, _CONTAINERS) else [child]
        out += [m for m in inner if any(True for _ in m.parameters())]
    return out


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each param group's parameters by name: what survives `fully_shard` replacing them.

    Raises:
        ConfigError: the optimizer holds tensors that are not parameters of ``model``.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise ConfigError("fsdp: the optimizer holds tensors that are not parameters of "
                          "the model; build it from model.parameters()") from None


def shard_module(model: nn.Module) -> int:
    """``fully_shard`` over the current default group: one unit per block, plus the root.
    Returns the number of units. Collective."""
    from torch.distributed.fsdp import fully_shard

    units = _tied_together(_units(model))
    for unit in units:
        fully_shard(unit if len(unit) > 1 else unit[0])
    fully_shard(model)
    return len(units) + 1


def _tied_together(units: list[nn.Module]) -> list[list[nn.Module]]:
    """The units, those that share a parameter (an embedding tied to the output layer) in one
    group: FSDP2 refuses a parameter managed by two units, and gathers one group at once."""
    groups: list[tuple[set[int], list[nn.Module]]] = []
    for unit in units:
        ids, members = {id(p) for p in unit.parameters()}, [unit]
        rest = []
        for other_ids, others in groups:
            if other_ids & ids:
                ids |= other_ids
                members = others + members
            else:
                rest.append((other_ids, others))
        groups = [*rest, (ids, members)]
    return [members for _, members in groups]


def point_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module,
                    names: list[list[str]]) -> None:
    """The optimizer's param groups hold ``model``'s (sharded) parameters of these names."""
    sharded = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, names, strict=True):
        group["params"] = [sharded[n] for n in group_names]


def shard(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> nn.Module:
    """Moves ``model`` to ``device``, makes every rank start from rank 0's values, wraps it with
    ``fully_shard`` (one unit per block, plus the root) and re-points ``optimizer`` at the
    sharded parameters. Collective: every rank calls it.

    Raises:
        ConfigError: ``optimizer`` already has state (it must not have stepped yet), or it
            holds tensors that are not parameters of ``model``.
    """
    import torch.distributed as dist

    if optimizer.state:
        raise ConfigError("fsdp: the optimizer has already stepped; hand the Trainer a fresh "
                          "one (its state must be created on the sharded parameters)")
    names = param_names(model, optimizer)
    model.to(device)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)
    units = shard_module(model)
    point_optimizer(optimizer, model, names)
    logger.info("model sharded with FSDP2 over %d ranks (%d units)", dist.get_world_size(),
                units)
    return model


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The gathered (unsharded) model and optimizer state dicts, keyed by parameter name, on
    every rank. Collective; memory for the whole model on each rank: for exporting a model or
    comparing states in tests, never for checkpoints (those stay sharded)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    model = root(model)
    if optimizer is None:
        return get_model_state_dict(model, options=opts), {}
    return get_state_dict(model, optimizer, options=opts)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer
                  ) -> dict[str, dict[str, Any]]:
    """``{"model": ..., "optim": ...}`` of DTensor shards, keyed by parameter name so that
    `torch.distributed.checkpoint` can reshard it onto any world size. An optimizer that has
    not stepped gets its (zero) state created first, or a load would have nowhere to go."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(root(model), optimizer)
    return {"model": model_sd, "optim": optim_sd}


def apply_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                        sd: dict[str, dict[str, Any]]) -> None:
    """Puts a loaded :func:`sharded_state` back into the model and optimizer."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(root(model), optimizer, model_state_dict=sd["model"],
                   optim_state_dict=sd["optim"])


def apply_full_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                     full: dict[str, Any]) -> None:
    """Puts a whole (unsharded) ``{"model": ..., "optim": ...}`` onto this world size: every
    rank holds all of it and keeps its own shards (the memory tier's restart, which assembles
    the full tensors from every old rank's shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(root(model), optimizer, model_state_dict=full["model"],
                   optim_state_dict=full["optim"],
                   options=StateDictOptions(full_state_dict=True))
