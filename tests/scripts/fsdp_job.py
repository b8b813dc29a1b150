#!/usr/bin/env python3
"""The job tests/integration/test_fsdp.py launches under torchrun: the Trainer with `--fsdp`,
AdamW and a scheduler on a small MLP whose layer sizes do not divide by 2 or 4 (uneven shards,
padding).

It writes the full (gathered) model and optimizer state to `--dump-dir` at every checkpoint
or commit step (`saved-<step>-w<world>.pt`, the state the checkpoint holds) and right after a resume
(`resumed-<step>-w<world>.pt`, the state the checkpoint gave back), so the test can compare
them across world sizes.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hvd_resilient.backends.torchdist import fsdp
from hvd_resilient.cli_errors import exit_on_error
from hvd_resilient.config import TrainConfig
from hvd_resilient.training.durable_sharded import ShardedDurableCheckpoints
from hvd_resilient.training.trainer import Trainer


def data(n: int = 640) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 12, generator=g)
    y = (x @ torch.randn(12, 5, generator=g)).argmax(1)
    return list(zip(x, y, strict=True))


def dump(state: Any, tag: str, folder: str) -> None:
    """Collective (gathers the shards); rank 0 writes."""
    model_sd, optim_sd = fsdp.full_state(state.model, state.optimizer)
    if dist.get_rank() != 0:
        return
    out = {"step": state.step, "samples": state.samples, "sampler": state.sampler.state_dict(),
           "scheduler": state.scheduler.state_dict(), "model": model_sd, "optim": optim_sd}
    path = Path(folder, f"{tag}-{state.step}-w{dist.get_world_size()}.pt")
    torch.save(out, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


@exit_on_error
def main() -> int:
    parser = argparse.ArgumentParser()
    TrainConfig.add_arguments(parser)
    parser.add_argument("--dump-dir", required=True)
    args = parser.parse_args()
    cfg = TrainConfig.from_sources(args)
    os.makedirs(args.dump_dir, exist_ok=True)

    resume = ShardedDurableCheckpoints.resume

    def resume_and_dump(self: ShardedDurableCheckpoints, **kwargs: Any) -> int | None:
        step = resume(self, **kwargs)
        if step is not None:
            dump(self.state, "resumed", args.dump_dir)
        return step

    ShardedDurableCheckpoints.resume = resume_and_dump  # type: ignore[method-assign]

    def on_step(state: Any, _loss: float) -> None:
        # the checkpoint or commit of this step follows
        if state.step % min(cfg.checkpoint.every, cfg.commit_every) == 0:
            dump(state, "saved", args.dump_dir)

    torch.manual_seed(cfg.seed)
    model = nn.Sequential(nn.Linear(12, 37), nn.Tanh(), nn.Linear(37, 29), nn.Tanh(),
                          nn.Linear(29, 5))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    Trainer(model, optimizer, nn.functional.cross_entropy, data(), cfg, scheduler=scheduler,
            on_step=on_step).fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
