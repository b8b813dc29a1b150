#!/usr/bin/env python3
"""A Trainer job with the long phases that are not failures: an evaluation of every rank
inside a declared watchdog section (`--eval-at STEP --eval-seconds S`, `--eval-ranks` to
leave some out), and a state big
enough that each commit and checkpoint copies it for a while (`--ballast-mb`: a random buffer
in the model, checkpointed like any other)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch import nn

from hvd_resilient.cli_errors import exit_on_error
from hvd_resilient.config import TrainConfig
from hvd_resilient.detect import progress
from hvd_resilient.training.trainer import Trainer


def data(n: int = 512) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 16, generator=g)
    return list(zip(x, (x.sum(1) > 0).long(), strict=True))


@exit_on_error
def main() -> int:
    parser = argparse.ArgumentParser()
    TrainConfig.add_arguments(parser)
    parser.add_argument("--eval-at", type=int, default=-1)
    parser.add_argument("--eval-seconds", type=float, default=30.0)
    parser.add_argument("--eval-ranks", default="",
                        help="comma-separated ranks that evaluate (default: every rank)")
    parser.add_argument("--ballast-mb", type=float, default=0.0)
    args = parser.parse_args()
    cfg = TrainConfig.from_sources(args)
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    if args.ballast_mb:
        n = int(args.ballast_mb * 2**20 / 4)
        model.register_buffer("ballast", torch.rand(n, generator=torch.Generator().manual_seed(1)))

    def on_step(state: Any, _loss: float) -> None:
        if state.step != args.eval_at or (
                args.eval_ranks and str(trainer.backend.rank()) not in args.eval_ranks.split(",")):
            return
        # every rank evaluates (no collective inside), busy in Python as a real eval loop is
        state.events.emit("evaluating", seconds=args.eval_seconds)
        with progress.section("evaluation", args.eval_seconds + 15):
            end = time.monotonic() + args.eval_seconds
            while time.monotonic() < end:
                model(torch.randn(64, 16)).sum().item()
        state.events.emit("evaluated", seconds=args.eval_seconds)

    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, optimizer, nn.functional.cross_entropy, data(), cfg, on_step=on_step)
    trainer.fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
