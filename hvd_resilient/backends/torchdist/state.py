"""What a training state on plain torch.distributed holds, whoever launched the processes:
the base of torchrun's state (`backends.torchrun.state`, which survives only through the tiers)
and of the in-place one (`backends.inplace.state`, which commits in process memory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hvd_resilient.events import EventLog
from hvd_resilient.state.agreement import Collectives
from hvd_resilient.state.core import StateCore


class TorchDistState(StateCore):
    """What a state on plain torch.distributed holds (torchrun's and the inplace backend's):
    the components, the counters as plain attributes, rank and size from the backend."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        rank: Callable[[], int],
        size: Callable[[], int],
        sampler: Any | None = None,
        collectives: Collectives | None = None,
        scheduler: Any | None = None,
        seed: int = 0,
        lr_scaling: str = "none",
        events: EventLog | None = None,
        **extras: Any,
    ) -> None:
        self._init_core(seed=seed, lr_scaling=lr_scaling, events=events, extras=extras)
        self.model, self.optimizer = model, optimizer
        self.sampler, self.scheduler = sampler, scheduler
        self._rank_fn, self._size_fn = rank, size
        self._collectives = collectives
        for k, v in extras.items():
            setattr(self, k, v)
        self.step = self.samples = 0
        self.lr_scale = 1.0
        self.resume_rng: dict[str, Any] | None = None
        self.ckpt_requested = self.ckpt_published = -1
        self.fatal = ""

    def _rank(self) -> int:
        return self._rank_fn()

    def _size(self) -> int:
        return self._size_fn()
