"""A Trainer job with a real recipe, for the conformance tests: an optimizer with parameter
groups (no decay on biases and norms, a frozen layer, tied embedding/output weights), a warmup
schedule, and whatever `--recipe-*` flags the test gives (clipping, accumulation, precision,
EMA). Runs under horovodrun, mpirun and torchrun (the Trainer picks the backend).

With --stop-file the ranks agree (one collective at each commit step) to end at the first
commit step after the file appears, so a test ends a job after the scale changes it drove.

Rank 0 appends {step, size, digests} to <run_dir>/digests.jsonl at every commit step: what a
resume from that step must give back (the `resume` event carries the resumed digests).

With --samples every rank appends each step's sample ids to <run_dir>/samples.jsonl (all its
micro-batches, at the first one's sampler position) and the job ends with a `done` event
carrying the step count: what `tests.support.exactly_once.assert_exactly_once` reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hvd_resilient.cli_errors import exit_on_error  # noqa: E402
from hvd_resilient.config import TrainConfig  # noqa: E402
from tests.support import recipes  # noqa: E402

N_SAMPLES = 1536


def _groups(model: nn.Module, lr: float, wd: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() > 1]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() <= 1]
    return [{"params": decay, "weight_decay": wd, "lr": lr},
            {"params": rest, "weight_decay": 0.0, "lr": lr}]


def build(name: str, model: nn.Module, total_steps: int) -> tuple[torch.optim.Optimizer, object]:
    o, s = torch.optim, torch.optim.lr_scheduler
    if name == "adamw-warmup-cosine":
        opt = o.AdamW(_groups(model, 3e-3, 0.1), betas=(0.9, 0.95))
        warm = 10
        sched = s.SequentialLR(opt, [s.LinearLR(opt, 0.01, total_iters=warm),
                                     s.CosineAnnealingLR(opt, T_max=max(total_steps - warm, 1))],
                               milestones=[warm])
    elif name == "adam-onecycle":
        opt = o.Adam(_groups(model, 1e-3, 0.0))
        sched = s.OneCycleLR(opt, max_lr=3e-3, total_steps=total_steps + 50)
    elif name == "sgd-nesterov-lambda":
        opt = o.SGD(_groups(model, 0.05, 1e-3), momentum=0.9, nesterov=True)
        sched = s.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
    elif name == "rmsprop":
        opt = o.RMSprop(_groups(model, 1e-3, 1e-4), momentum=0.9)
        sched = None
    else:
        raise SystemExit(f"recipe_job: unknown recipe {name!r}")
    return opt, sched


@exit_on_error
def main() -> int:
    p = argparse.ArgumentParser()
    TrainConfig.add_arguments(p)
    p.add_argument("--recipe", required=True)
    p.add_argument("--step-time", type=float, default=0.0, help="simulated compute per step")
    p.add_argument("--samples", action="store_true", help="record every step's sample ids")
    p.add_argument("--stop-file", default="",
                   help="end at the first commit step after this file exists (all ranks agree)")
    args = p.parse_args()
    cfg = TrainConfig.from_sources(args)
    from hvd_resilient import Trainer

    torch.manual_seed(cfg.seed)
    model = recipes.RecipeModel()
    opt, sched = build(args.recipe, model, cfg.max_steps or 500)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, recipes.VOCAB, (N_SAMPLES, 4), generator=g)
    data = list(zip(x, (x[:, 0] + x[:, 1]) % recipes.VOCAB, strict=True))
    out = os.path.join(cfg.run_dir, "digests.jsonl")

    os.makedirs(cfg.run_dir, exist_ok=True)
    samples = os.open(os.path.join(cfg.run_dir, "samples.jsonl"),
                      os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if args.samples else None

    def record(state) -> None:
        """One write(2) of one line: a SIGKILL never leaves half a line."""
        first = trainer.batches[0].key
        line = json.dumps({"t": time.time(), "step": state.step - 1, "size": first.world,
                           "rank": first.rank, "epoch": first.position[0],
                           "pos": first.position[1], "pid": os.getpid(),
                           "ids": [i for b in trainer.batches for i in b.used]})
        os.write(samples, (line + "\n").encode())

    def on_step(state, _loss: float) -> None:
        if samples is not None:
            record(state)
        if args.step_time:
            time.sleep(args.step_time)  # stands in for compute: a longer run, nothing waits on it
        if state.step % cfg.commit_every:
            return
        if args.stop_file and trainer.backend.any_rank(os.path.exists(args.stop_file)):
            cfg.max_steps = state.step  # every rank at this same step: the loop ends here
        if trainer.backend.rank() == 0:
            line = {"step": state.step, "size": trainer.backend.size(),
                    "digests": state.state_digests()}
            with open(out, "a") as f:
                f.write(json.dumps(line) + "\n")

    trainer = Trainer(model, opt, nn.functional.cross_entropy, data, cfg, scheduler=sched,
                      on_step=on_step)
    result = trainer.fit()
    if samples is not None:  # the trainer's own `done` has no step count
        from hvd_resilient.events import EventLog

        EventLog(os.path.join(cfg.run_dir, "events.jsonl"), rank=result.rank,
                 size=result.world_size).emit("done", steps=result.step, samples=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
