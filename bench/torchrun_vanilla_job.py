"""Vanilla torchrun baseline for `bench/recovery.py`: DDP as the PyTorch docs write it.

`init_process_group("gloo")` from torchrun's environment, a small model, a checkpoint file
every 20 steps that a restarted round resumes from. The events (`start` once the process group
is up, `enter` with the step resumed from) go to the same event log as ours; each step's end
is a line of `samples.jsonl` ({t, step, size, pid}), as `tests/scripts/recipe_job.py` writes.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hvd_resilient.events import EventLog
from hvd_resilient.training.faults import ENV, FaultPlan


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-time", type=float, default=0.02)
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    step = 0
    events = EventLog(os.path.join(a.run_dir, "events.jsonl"), rank=lambda: rank,
                      size=lambda: size, step=lambda: step)
    events.emit("start", pid=os.getpid(), stack="vanilla")
    faults = FaultPlan.parse(os.environ.get(ENV), a.run_dir)
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(),
                                                  nn.Linear(256, 2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ckpt = os.path.join(a.run_dir, "ckpt.pt")
    if os.path.exists(ckpt):
        sd = torch.load(ckpt, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["opt"])
        step = sd["step"]
    events.emit("enter", at_step=step)
    steps_fd = os.open(os.path.join(a.run_dir, "samples.jsonl"),
                       os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while step < a.steps:
        faults.maybe_fire(rank, step)
        x = torch.randn(32, 64)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), (x.sum(1) > 0).long()).backward()
        opt.step()
        time.sleep(a.step_time)
        step += 1
        os.write(steps_fd, (json.dumps({"t": time.time(), "step": step - 1, "size": size,
                                        "pid": os.getpid()}) + "\n").encode())
        if step % 20 == 0 and rank == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
    events.emit("done")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
