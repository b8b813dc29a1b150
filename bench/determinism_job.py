#!/usr/bin/env python3
"""The job `bench/determinism_bench.py` runs: a model trained by `Trainer` (so every backend
and `HVD_RESILIENT_DETERMINISTIC` work as in a user's job); rank 0 writes the model's shape and
the time between consecutive steps (`on_step`) to `<run_dir>/model.json`.

- `--model digits`: `examples/digits.py`'s MLP (4 parameter tensors) at `--hidden` width;
- `--model tinylm`: `examples/tiny_lm.py`'s transformer (`--dim`, `--layers`; 28 parameter
  tensors at 2 layers), on its generated text, next-character loss.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from hvd_resilient.config import TrainConfig  # noqa: E402


def build(args: argparse.Namespace) -> tuple[nn.Module, list, object]:
    if args.model == "digits":
        from digits import build_model, load_digits_split

        train, _, _ = load_digits_split()
        return build_model(args.hidden), train, nn.functional.cross_entropy
    from tiny_lm import BLOCK, TinyLM, make_data

    vocab, data = make_data()
    windows = [(data[s:s + BLOCK], data[s + 1:s + BLOCK + 1])
               for s in range(0, len(data) - BLOCK - 1, BLOCK)]

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())

    return TinyLM(len(vocab), dim=args.dim, layers=args.layers), windows, loss_fn


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    TrainConfig.add_arguments(parser)
    parser.add_argument("--model", choices=("digits", "tinylm"), default="digits")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    cfg = TrainConfig.from_sources(args)

    from hvd_resilient.training.trainer import Trainer

    torch.manual_seed(cfg.seed)
    model, data, loss_fn = build(args)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    stamps: list[float] = []
    result = Trainer(model, optimizer, loss_fn, data, cfg,
                     on_step=lambda state, loss: stamps.append(time.perf_counter())).fit()
    if result.rank == 0:
        out = {"tensors": len(list(model.parameters())),
               "params": sum(p.numel() for p in model.parameters()),
               "world_size": result.world_size, "batch_size": cfg.batch_size,
               "step_seconds": [b - a for a, b in zip(stamps, stamps[1:], strict=False)]}
        with open(os.path.join(cfg.run_dir, "model.json"), "w") as fh:
            json.dump(out, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
