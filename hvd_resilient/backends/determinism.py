"""Bit-identical training at a fixed world size: every gradient is reduced in an order that
does not depend on timing (`TrainConfig.deterministic`: `--deterministic`,
`HVD_RESILIENT_DETERMINISTIC=1` or `deterministic: true`, read once by the config and handed
to the backend as an argument, `backends.get(..., deterministic=)`).

Why runs differ without it (measured, docs/determinism.md): a ring allreduce over N ranks
splits its buffer into N segments, and the order in which the N contributions to an element
are added depends on the segment the element lands in. With 2 ranks that order does not
matter (a + b == b + a in floating point); with 3 or more it does ((a + b) + c != a + (b + c)).
What decides where a gradient element lands:

- Horovod packs whichever tensors all ranks have ready in one background cycle into one fused
  buffer (tensor fusion), in an order that depends on when they became ready: the layout, so
  the rounding, changes from step to step and from run to run. With fusion off
  (`HOROVOD_FUSION_THRESHOLD=0`) every tensor is reduced alone, so an element's summation order
  depends only on the tensor's size, the element's offset in it and the world size.
- DDP reduces fixed buckets, but it lays them out in parameter order for the first step of a
  process and rebuilds them in gradient-ready order after it: the first step after every
  (re)start of a torchrun job reduces with another layout than the same step of a run that was
  never restarted. Here a DDP communication hook (`ordered_ddp_hook`) collects the buckets and
  reduces all gradients as one flat buffer in parameter order once the last bucket is ready.
  (Reducing each gradient alone, as Horovod does with fusion off, is deterministic too but cost
  DDP 2.5x the step time of the tiny transformer here; the flat buffer costs about nothing.)

Local math: `torch.use_deterministic_algorithms(True, warn_only=True)` (no-op for the usual CPU
kernels; on GPUs it picks deterministic kernels and warns where none exists), cuDNN autotuning
off, and the cuBLAS workspace setting that its deterministic mode needs.

What this does not give: equality across world sizes (the data each rank sees and the
reduction order both change with the world size), across machines with other CPUs/GPUs or
library builds, or with a different number of threads per worker on CPUs whose kernels split
work by thread count.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

logger = logging.getLogger(__name__)

FUSION = "HOROVOD_FUSION_THRESHOLD"
GROUP_FUSION_OFF = "HOROVOD_DISABLE_GROUP_FUSION"
HOROVOD_DEFAULT_FUSION = str(128 * 1024 * 1024)
"""Horovod 0.28's fusion threshold when none is set."""
CUBLAS_ENV = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
GRADIENTS_NAME = "hvd_resilient.gradients"


def apply(on: bool = True, env: MutableMapping[str, str] | None = None) -> bool:
    """Deterministic local math for this process: torch's deterministic algorithms, cuDNN
    autotuning off, and the cuBLAS workspace setting its deterministic mode needs (in the
    environment, where unset: cuBLAS reads it there, also in processes started later). Each
    backend calls it at init when it was built with ``deterministic=True``; off does nothing
    (it never undoes a setting). Returns ``on``."""
    if not on:
        return False
    env = os.environ if env is None else env
    env.setdefault(*CUBLAS_ENV)
    _deterministic_local_math()
    return True


def horovod_env(ordered: bool, env: MutableMapping[str, str] | None = None) -> None:
    """Sets what the next `hvd.init()` reads (and every elastic re-init after it: Horovod
    reads these from the environment), for deterministic mode; call it once, before
    `hvd.init()` (`backends.horovod.init.init(deterministic=True)` does).

    ``ordered=False`` (any optimizer, e.g. a plain `hvd.DistributedOptimizer`): tensor fusion
    off, every tensor reduced alone; a user's other HOROVOD_FUSION_THRESHOLD is overridden,
    with a warning. ``ordered=True`` (the gradients are reduced by
    `backends.horovod.ordered.ordered_optimizer`, as one group in parameter order): groups
    fused alone and in their own order (HOROVOD_DISABLE_GROUP_FUSION=1), at a threshold set
    in the environment, the user's or Horovod's default, so that HOROVOD_AUTOTUNE cannot move
    the split points."""
    env = os.environ if env is None else env
    user = env.get(FUSION, "")
    if ordered:
        env[FUSION] = user or HOROVOD_DEFAULT_FUSION
        env[GROUP_FUSION_OFF] = "1"
        return
    if user not in ("", "0"):
        logger.warning(
            "%s=%s overridden with 0: deterministic reductions need tensor fusion off",
            FUSION, user)
    env[FUSION] = "0"


def _deterministic_local_math() -> None:
    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False


CHUNK_ELEMENTS = 16 * 1024 * 1024
"""The flat gradient is reduced in pieces of this many elements (64 MB of float32): fixed
boundaries, so a fixed order, and a bounded size per collective."""


class OrderedReduction:
    """The state of `ordered_ddp_hook` for one DDP model: every gradient's place in one flat
    buffer in the order of `module.parameters()`, whatever bucket DDP puts it in."""

    def __init__(self, module: Any, group: Any = None) -> None:
        self.index = {id(p): i for i, p in enumerate(module.parameters())}
        self.group = group
        self.pending: list[tuple[Any, list[tuple[int, Any]], Any]] = []

    def add(self, bucket: Any) -> Any:
        import torch

        if bucket.index() == 0:
            self.pending.clear()  # a new backward pass (an aborted one left nothing to keep)
        views = [(self.index[id(p)], v)
                 for p, v in zip(bucket.parameters(), bucket_views(bucket), strict=True)]
        fut: Any = torch.futures.Future()
        self.pending.append((bucket.buffer(), views, fut))
        if bucket.is_last():
            self._reduce_all()
        return fut

    def _reduce_all(self) -> None:
        import torch
        import torch.distributed as dist

        group = self.group if self.group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        pending, self.pending = self.pending, []
        views = sorted((iv for _, vs, _ in pending for iv in vs), key=lambda iv: iv[0])
        by_dtype: dict[Any, list[Any]] = {}
        for _, v in views:
            by_dtype.setdefault(v.dtype, []).append(v)
        flats = [torch.cat(vs) for vs in by_dtype.values()]
        works = []
        for flat in flats:
            flat.div_(world)
            for piece in torch.split(flat, CHUNK_ELEMENTS):
                works.append(dist.all_reduce(piece, group=group, async_op=True).get_future())

        def done(all_done: Any) -> None:
            try:
                for work in all_done.value():
                    work.value()  # raises what the collective raised
            except Exception as e:  # DDP waits on every bucket's future: fail them all
                for _, _, fut in pending:
                    fut.set_exception(e)
                return
            for flat, vs in zip(flats, by_dtype.values(), strict=True):
                offset = 0
                for v in vs:
                    v.copy_(flat[offset:offset + v.numel()])
                    offset += v.numel()
            for buffer, _, fut in pending:
                fut.set_result(buffer)

        torch.futures.collect_all(works).then(done)


def ordered_ddp_hook(state, bucket):  # type: ignore[no-untyped-def]  # see the docstring
    """A DDP communication hook: DDP's buckets are only collected; when the last one of a
    backward pass comes, all gradients are averaged as one flat buffer laid out in parameter
    order (in fixed pieces of CHUNK_ELEMENTS), so an element's summation order never depends
    on the bucket layout, which DDP rebuilds after the first step of every process. One
    allreduce per step like DDP's own (plus a copy in and out), after the backward pass
    instead of overlapping it. `state` is an `OrderedReduction`. (No annotations: DDP checks
    them against its own types, which string annotations never equal.)"""
    return state.add(bucket)


def register_ddp_hook(ddp: Any, group: Any = None) -> None:
    """Makes a DistributedDataParallel model reduce in a fixed order (`ordered_ddp_hook`)."""
    ddp.register_comm_hook(OrderedReduction(ddp.module, group), ordered_ddp_hook)


def bucket_views(bucket: Any) -> list[Any]:
    """One flat view of the bucket's buffer per gradient. DDP's `bucket.gradients()` are such
    views (torch 2.13); where one is not, the buffer is cut by the gradients' sizes, the
    layout DDP's reducer uses (contiguous, in the bucket's parameter order)."""
    buffer = bucket.buffer()
    grads = bucket.gradients()
    base = buffer.untyped_storage().data_ptr()
    if all(g.untyped_storage().data_ptr() == base and g.is_contiguous() for g in grads):
        return [g.view(-1) for g in grads]
    views, offset = [], 0
    for g in grads:
        views.append(buffer.narrow(0, offset, g.numel()))
        offset += g.numel()
    return views
