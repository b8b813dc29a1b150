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
        """Rank 0's bytes in every buffer, packed into as few broadcasts as `BUCKET_BYTES`
        allows: a state is dozens of small tensors (a parameter, its two Adam moments, its
        step count), and one broadcast each cost a round trip each; on 4 workers of a 2-core
        machine that was most of a newcomer's sync (12-07). The packing is one copy of the
        bytes on each side."""
        root = dist.get_rank() == 0
        for bucket in _buckets(buffers):
            total = sum(b.numel() for b in bucket)
            if root:
                flat = torch.cat([b.reshape(-1).to(self.device) for b in bucket])
            else:
                flat = torch.empty(total, dtype=torch.uint8, device=self.device)
            dist.broadcast(flat, src=0)
            if not root:
                offset = 0
                for b in bucket:
                    n = b.numel()
                    b.reshape(-1).copy_(flat[offset:offset + n])
                    offset += n


BUCKET_BYTES = 64 * 2**20
"""The most bytes packed into one broadcast: a packed copy of a large model's state would
double its memory at a sync; 64 MiB of packing is already far past any round trip's cost."""


def _buckets(buffers: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``buffers`` (flat uint8 tensors) in order, cut where a bucket would pass
    `BUCKET_BYTES` (a larger buffer travels alone)."""
    out: list[list[torch.Tensor]] = []
    size = BUCKET_BYTES
    for b in buffers:
        if not b.numel():
            continue
        if not out or size + b.numel() > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(b)
        size += b.numel()
    return out
