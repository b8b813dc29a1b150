"""What real training recipes add to a step: gradient accumulation, mixed precision (bf16
autocast; fp16 with a GradScaler), clipping by global norm, an EMA of the weights.

The order inside a step is the one that keeps every rank identical:

    for each micro-batch: forward under autocast, backward of the (scaled) loss; the gradient
        allreduce happens once, on the last micro-batch (DDP `no_sync`, FSDP2
        `set_requires_gradient_sync`, Horovod `backward_passes_per_step`)
    Horovod: `synchronize()` so the gradients are the reduced ones
    unscale (fp16), clip by the global norm of the REDUCED gradients, optimizer step
        (Horovod inside `skip_synchronize()`), scaler update, EMA update

Every rank clips, unscales and checks for infs on the same reduced gradients, so the scaler's
scale and the EMA stay equal everywhere without a collective of their own. The scaler and the
EMA are state components: committed, restored, synced (and verified), checkpointed in both
tiers (`state.core.StateCore._stateful`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from hvd_resilient.config import RecipeOptions

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Recipe:
    """The recipe features of one run; the trainer calls it around each step."""

    def __init__(self, options: RecipeOptions, model: Any, optimizer: Any, *,
                 reduces_in_backward: bool, device: torch.device) -> None:
        self.options = options
        self.model = model
        """The wrapped model (DDP, FSDP2, or the plain one under Horovod)."""
        self.optimizer = optimizer
        self.reduces_in_backward = reduces_in_backward
        self.device = device
        self.scaler = (torch.amp.GradScaler(device.type) if options.precision == "fp16"
                       else None)
        self.ema = None
        if options.ema_decay:
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

            # torch leaves get_ema_multi_avg_fn unannotated (it returns the averaging function)
            avg = get_ema_multi_avg_fn(options.ema_decay)  # type: ignore[no-untyped-call]
            self.ema = AveragedModel(getattr(model, "module", model), use_buffers=True,
                                     multi_avg_fn=avg)

    def components(self) -> dict[str, Any]:
        """The state components this recipe adds (passed to the state as extras)."""
        out: dict[str, Any] = {}
        if self.scaler is not None:
            out["scaler"] = self.scaler
        if self.ema is not None:
            out["ema"] = self.ema
        return out

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = DTYPES.get(self.options.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    @contextlib.contextmanager
    def micro_batch(self, last: bool) -> Iterator[None]:
        """Around one micro-batch's forward and backward: the allreduce only on the last.
        Horovod counts backward passes itself (`backward_passes_per_step`)."""
        if last or not self.reduces_in_backward:
            yield
            return
        no_sync = getattr(self.model, "no_sync", None)
        if no_sync is not None:  # DDP
            with no_sync():
                yield
            return
        set_sync = getattr(self.model, "set_requires_gradient_sync", None)  # FSDP2
        if set_sync is None:
            yield
            return
        set_sync(False)
        try:
            yield
        finally:
            set_sync(True)

    def backward(self, loss: torch.Tensor) -> None:
        scaled = self.scaler.scale(loss) if self.scaler is not None else loss
        scaled.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward bare

    def step(self) -> float | None:
        """Unscale, clip, step, update; returns the pre-clip global gradient norm when
        clipping (the same on every rank)."""
        opt, clip = self.optimizer, self.options.clip_grad_norm
        horovod = not self.reduces_in_backward
        needs_reduced = bool(clip) or self.scaler is not None
        if horovod and needs_reduced:
            opt.synchronize()
        norm = None
        if self.scaler is not None:
            self.scaler.unscale_(opt)
        if clip:
            params = [p for g in opt.param_groups for p in g["params"]]
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        skip = opt.skip_synchronize() if horovod and needs_reduced else contextlib.nullcontext()
        with skip:
            if self.scaler is not None:
                self.scaler.step(opt)
            else:
                opt.step()
        if self.scaler is not None:
            self.scaler.update()
        if self.ema is not None:
            self.ema.update_parameters(getattr(self.model, "module", self.model))
        return norm
