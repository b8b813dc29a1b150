#!/usr/bin/env python3
"""Elastic training of a small classifier on scikit-learn's digits (ships with the package).

    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh \
        --network-interface lo python examples/digits.py --run-id digits --epochs 20

Every flag of TrainConfig works here (see --help); `--lr` and `--hidden` are the example's own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_resilient.cli_errors import exit_on_error  # noqa: E402
from hvd_resilient.config import TrainConfig  # noqa: E402


def load_digits_split(seed: int = 0) -> tuple[list, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    g = torch.Generator().manual_seed(1234)  # a fixed split, independent of the run's seed
    perm = torch.randperm(len(x), generator=g)
    test, train = perm[:360], perm[360:]
    return list(zip(x[train], y[train], strict=True)), x[test], y[test]


def build_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 10))


@exit_on_error
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    TrainConfig.add_arguments(parser)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64)
    args = parser.parse_args(argv)
    cfg = TrainConfig.from_sources(args)

    from hvd_resilient.training.trainer import Trainer

    torch.manual_seed(cfg.seed)
    train, x_test, y_test = load_digits_split()
    model = build_model(args.hidden)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = Trainer(model, optimizer, nn.functional.cross_entropy, train, cfg)
    result = trainer.fit()
    # Every rank evaluates: with --fsdp each forward is a collective (it gathers the shards).
    model.eval()
    with torch.no_grad():
        acc = (model(x_test).argmax(1) == y_test).float().mean().item()
    if result.rank == 0:
        out = {"accuracy": acc, "step": result.step, "epoch": result.epoch, "loss": result.loss}
        with open(os.path.join(cfg.run_dir, "result.json"), "w") as fh:
            json.dump(out, fh)
        print(f"accuracy {acc:.4f} after {result.step} steps; run folder {cfg.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
