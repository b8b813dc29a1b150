"""The base of every backend over plain torch.distributed: torchrun's
(`backends.torchrun.backend`) and the in-place one (`backends.inplace.backend`).

Both hold one default process group at a time (torchrun's for the whole process, the in-place
backend's for one generation), so the trainer's own collectives (the gather, the any-rank flag)
and the release of the groups at the end are the same over either, written here once. Both
shard a model with FSDP2 (`fsdp`): the capability is declared here, for `backends.get` to ask.
"""

from __future__ import annotations

import datetime
import gc
from typing import Any

import torch
import torch.distributed as dist

from hvd_resilient.backends.base import Backend
from hvd_resilient.backends.torchdist.collectives import TorchDistCollectives


class TorchDistBackend(Backend):
    """A `Backend` over the current default torch.distributed group; a subclass says how the
    group is formed (`init`), who is a member (`rank`, `size`), how the model is wrapped and
    how its world recovers (`run`)."""

    supports_fsdp = True
    """FSDP2 needs torch.distributed's collectives and DTensors, which every subclass has."""

    def __init__(self, *, fsdp: bool, pg_timeout_seconds: float, heartbeat_timeout_s: float,
                 deterministic: bool) -> None:
        self.deterministic = deterministic
        self.fsdp = fsdp
        """Shard the model (FSDP2) instead of replicating it."""
        self.pg_timeout = datetime.timedelta(seconds=pg_timeout_seconds)
        """How long forming a process group (and its store) may take (config: recovery)."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        """A peer silent this long (frozen, cut off) is a fault (0: off); what follows is the
        subclass's (torchrun: this worker exits; in place: the agent ends the silent one)."""
        self.device = torch.device("cpu")
        """Where the collectives' tensors live: this worker's GPU under NCCL, else the CPU."""

    def allgather_object(self, obj: object) -> list[Any]:
        return TorchDistCollectives(self.device).allgather_object(obj)

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item() > 0)

    def shutdown(self) -> None:
        release_groups()


def release_groups() -> None:
    """Every process group of this process (the default one and the checkpoints' own), once;
    a no-op when the caller already destroyed them."""
    if dist.is_initialized():
        dist.destroy_process_group()
    # A group, or a Work holding tensors, that a reference cycle keeps (the state's hooks and
    # the tiers refer to each other) is freed by the collector, at teardown if not now.
    gc.collect()
