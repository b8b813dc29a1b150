"""The job `bench/recovery.py` runs: one small model, two recovery stacks, one event log.

`--stack ours` trains under `hvd_resilient.run` with `ElasticState` (the product); `--stack
vanilla` under Horovod's own `hvd.elastic.run` with `hvd.elastic.TorchState`, as a user of plain
Horovod Elastic writes it. Both record the same events through `EventLog` (`enter` each time the
training function starts, i.e. the first step of a new world; `commit` with the world size), so
the benchmark reads one format. Stops at --steps.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import horovod.torch as hvd
import torch
from torch import nn

import hvd_resilient
from hvd_resilient import log
from hvd_resilient.backends.horovod.state import ElasticState
from hvd_resilient.detect import progress
from hvd_resilient.detect.progress import ProgressWatchdog
from hvd_resilient.events import EventLog
from hvd_resilient.state.sampler import ElasticDataSampler
from hvd_resilient.training.faults import ENV, FaultPlan


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--stack", choices=("ours", "vanilla"), required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--step-time", type=float, default=0.02, help="simulated compute per step")
    p.add_argument("--progress-timeout", type=float, default=3.0,
                   help="ours: the progress watchdog's budget per step (seconds)")
    a = p.parse_args()

    hvd.init()
    log.setup(rank_fn=hvd.rank)
    faults = FaultPlan.parse(os.environ.get(ENV), a.run_dir)
    torch.manual_seed(0)
    x = torch.randn(4096, 64)
    y = (x.sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    events = EventLog(os.path.join(a.run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)
    events.emit("start", pid=os.getpid(), stack=a.stack)
    if a.stack == "ours":
        state = ElasticState(model, opt, sampler=ElasticDataSampler(len(x), seed=0),
                             events=events, hold_additions=True)  # as the Trainer does
        run = hvd_resilient.run
    else:
        state = hvd.elastic.TorchState(model, opt, step=0)
        events.step_source = lambda: state.step
        run = hvd.elastic.run
    state.register_reset_callbacks([lambda: events.emit("reset_callback")])
    dog = None
    if a.stack == "ours":  # a custom loop opts into the progress watchdog like this
        dog = ProgressWatchdog(run_dir=a.run_dir, rank=hvd.rank, emit=events.emit,
                               timeout_s=a.progress_timeout).start()
        progress.install(dog)
    waiting = dog.waiting_for_peers if dog else contextlib.nullcontext

    @run
    def train(state) -> None:
        events.emit("enter", at_step=state.step)
        while state.step < a.steps:
            faults.maybe_fire(hvd.rank(), state.step)
            idx = torch.randint(0, len(x), (32,))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            with waiting():  # Horovod's step() waits for the other ranks' gradients
                opt.step()
            time.sleep(a.step_time)
            state.step += 1
            if dog is not None:
                dog.step()
            if state.step % a.commit_every == 0 or (
                    a.stack == "ours" and state.host_change_pending()):
                if a.stack == "vanilla" and hvd.rank() == 0:
                    events.emit("commit")  # ElasticState.commit says so itself
                state.commit()

    train(state)
    events.emit("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
