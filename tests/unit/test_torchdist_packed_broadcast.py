"""The state's bytes packed into few broadcasts (`torchdist.collectives.broadcast_bytes_`, the
sync of the in-place and torchrun backends): one broadcast per tensor was dozens of round trips
at every newcomer's sync."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hvd_resilient.backends.torchdist import collectives
from hvd_resilient.backends.torchdist.collectives import TorchDistCollectives


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bytes(*sizes: int) -> list[torch.Tensor]:
    return [torch.zeros(n, dtype=torch.uint8) for n in sizes]


def test_buckets_keep_order_skip_empty_and_cut_at_the_limit(monkeypatch):
    monkeypatch.setattr(collectives, "BUCKET_BYTES", 10)
    got = collectives._buckets(_bytes(4, 0, 5, 3, 12, 1))
    assert [[b.numel() for b in bucket] for bucket in got] == [[4, 5], [3], [12], [1]]


def _broadcast_worker(rank: int, port: int, bucket_bytes: int) -> None:
    collectives.BUCKET_BYTES = bucket_bytes
    store = dist.TCPStore("127.0.0.1", port, 3, rank == 0,
                          timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    try:
        gen = torch.Generator().manual_seed(7)
        truth = [torch.randn(5, 3, generator=gen), torch.empty(0),
                 torch.arange(6, dtype=torch.int64), torch.randn(40, generator=gen).half()]
        mine = [t.clone() if rank == 0 else torch.full_like(t, -1) for t in truth]
        kept = [t.data_ptr() for t in mine]
        views = [t.reshape(-1).view(torch.uint8) for t in mine]
        TorchDistCollectives().broadcast_bytes_(views, "components")
        assert all(torch.equal(a, b) for a, b in zip(mine, truth, strict=True))
        assert [t.data_ptr() for t in mine] == kept, "received in place"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("bucket_bytes", [64 * 2**20, 50])
def test_packed_broadcast_gives_every_rank_rank_0s_bytes_in_place(bucket_bytes):
    """One bucket, and buckets cut small enough that a tensor travels alone."""
    mp.spawn(_broadcast_worker, args=(_free_port(), bucket_bytes), nprocs=3)
