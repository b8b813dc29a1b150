"""The collectives a verified sync needs (`state.agreement.Collectives`), over Horovod."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import horovod.torch as hvd
import torch


class HorovodCollectives:
    def rank(self) -> int:
        return int(hvd.rank())

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(hvd.allgather_object(obj, name="hvd_resilient.sync.digests"))

    def broadcast_object(self, obj: Any) -> Any:
        return hvd.broadcast_object(obj, root_rank=0, name="hvd_resilient.sync.tree")

    def broadcast_bytes_(self, buffers: Sequence[torch.Tensor], tag: str) -> None:
        # All in flight at once: Horovod fuses them into few Gloo broadcasts.
        handles = [hvd.broadcast_async_(b, root_rank=0, name=f"hvd_resilient.sync.{tag}.{i}")
                   for i, b in enumerate(buffers)]
        for h in handles:
            hvd.synchronize(h)
