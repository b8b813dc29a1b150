"""The collectives a verified sync needs (`state.agreement.Collectives`), over
torch.distributed (Gloo or NCCL: tensors travel on the group's device)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


class TorchDistCollectives:
    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")

    def rank(self) -> int:
        return dist.get_rank()

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def broadcast_bytes_(self, buffers: Sequence[torch.Tensor], tag: str) -> None:
        works = []
        for b in buffers:
            t = b if b.device == self.device else b.to(self.device)
            works.append((dist.broadcast(t, src=0, async_op=True), b, t))
        for work, b, t in works:
            work.wait()
            if t is not b:
                b.copy_(t)
