"""A custom-loop elastic job for tests, written the way a user with their own loop would.

Stops after --steps optimizer steps, or (with --expect-sizes) once the job has seen that
sequence of world sizes. At every commit each rank appends the sample ids it trained on since
its last commit to samples.jsonl; ids trained after the last commit are dropped by the reset
callback, so the file holds exactly what the committed model saw.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import horovod.torch as hvd
import torch
from torch import nn

import hvd_resilient
from hvd_resilient import log
from hvd_resilient.events import EventLog
from hvd_resilient.faults import ENV, FaultPlan
from hvd_resilient.sampler import ElasticDataSampler
from hvd_resilient.state import ElasticState

N_SAMPLES = 2048
BATCH = 16


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps")
    p.add_argument("--expect-sizes", default="", help="or stop once sizes went e.g. 2,4,2")
    p.add_argument("--steps-at-each", type=int, default=20)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.01, help="simulated compute per step")
    p.add_argument("--max-steps", type=int, default=20000)
    a = p.parse_args()
    expected = [int(x) for x in a.expect_sizes.split(",") if x]

    hvd.init()
    log.setup(rank_fn=hvd.rank)
    faults = FaultPlan.parse(os.environ.get(ENV), a.run_dir)
    torch.manual_seed(0)
    x = torch.randn(N_SAMPLES, 16)
    y = (x.sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    events = EventLog(os.path.join(a.run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)
    events.emit("start", pid=os.getpid())
    # (size, first step seen at) for every world size so far: a committed attribute, so every
    # rank (a worker that joins later too, through sync) decides to stop at the same step.
    state = ElasticState(model, opt, sampler=ElasticDataSampler(N_SAMPLES, seed=0),
                         events=events, sizes_seen=())
    pending: list[tuple[int, list[int]]] = []  # (epoch, ids) trained since the last commit
    state.register_reset_callbacks([pending.clear])
    samples_path = os.path.join(a.run_dir, "samples.jsonl")

    def finished() -> bool:
        if a.steps:
            return state.step >= a.steps
        seen = state.sizes_seen
        seq = [s for s, _ in seen]
        return seq[-len(expected):] == expected and state.step - seen[-1][1] >= a.steps_at_each

    def flush() -> None:
        if pending:
            line = json.dumps({"rank": hvd.rank(), "step": state.step, "ids": pending[:]})
            with open(samples_path, "a") as fh:
                fh.write(line + "\n")
            pending.clear()

    @hvd_resilient.run
    def train(state: ElasticState) -> None:
        while state.step < a.max_steps:
            if state.sampler.epoch_done():
                state.sampler.set_epoch(state.sampler.epoch + 1)
            faults.maybe_fire(hvd.rank(), state.step)
            sl = state.sampler.next_slice(hvd.rank(), hvd.size(), BATCH)
            opt.zero_grad()
            if sl.indices:
                idx = torch.tensor(sl.indices)
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                (loss * len(sl.indices) * hvd.size() / sl.global_count).backward()
            opt.step()
            time.sleep(a.step_time)
            pending.append((state.sampler.epoch, sl.indices))
            state.sampler.advance(sl.global_count)
            state.step += 1
            if state.step % a.commit_every == 0:
                if not state.sizes_seen or state.sizes_seen[-1][0] != hvd.size():
                    state.sizes_seen = (*state.sizes_seen, (hvd.size(), state.step))
                stop = finished()
                flush()  # before commit: it may raise HostsUpdatedInterrupt after saving
                state.commit()
                if stop:
                    return

    train(state)
    events.emit("done", params_sha256=state.params_sha256(),
                sizes=[s for s, _ in state.sizes_seen])
    return 0 if state.step < a.max_steps else 3


if __name__ == "__main__":
    raise SystemExit(main())
