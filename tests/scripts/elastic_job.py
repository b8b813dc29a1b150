"""A custom-loop elastic job for tests, written the way a user with their own loop would.

Stops after --steps optimizer steps, or (with --expect-sizes) once the job has seen that
sequence of world sizes. Before each step's forward pass every rank appends one line to
samples.jsonl: wall time, step, world size, rank, epoch, sampler position and the ids it is
about to train on. Steps undone by a restore (in memory or from a durable checkpoint) are run
again later with the same step number, so the step's last line in time is the one the final
model holds; the tests rebuild that history from the file (`assert_exactly_once`). Writing at
the step rather than at the commit matters: a rank killed between its peers' save and its own
would otherwise leave committed work unrecorded.

With --checkpoint-url the job also writes durable checkpoints (hvd_resilient.training.durable,
as the Trainer does) every --checkpoint-every steps and resumes from the newest verified one on
start.
--ballast-mb adds a buffer of that size to the model: a checkpoint big enough to take a while to
upload.
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
from hvd_resilient.backends.horovod.backend import HorovodBackend
from hvd_resilient.backends.horovod.state import ElasticState
from hvd_resilient.config import TrainConfig
from hvd_resilient.events import EventLog
from hvd_resilient.state.sampler import ElasticDataSampler
from hvd_resilient.training.durable import DurableCheckpoints
from hvd_resilient.training.faults import ENV, FaultPlan
from hvd_resilient.training.memory_tier import MemoryCommits

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
    p.add_argument("--checkpoint-url", default="", help="file:// or s3:// (default: none)")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--ballast-mb", type=float, default=0.0)
    p.add_argument("--allreduce-mb", type=float, default=0.0,
                   help="also allreduce a tensor this big every --allreduce-every steps")
    p.add_argument("--allreduce-every", type=int, default=10)
    p.add_argument("--heartbeat-timeout", type=float, default=1.5,
                   help="seconds of silence before a peer is evicted (0: heartbeats off)")
    p.add_argument("--memory-tier", action="store_true",
                   help="with --checkpoint-url: commits also go to the memory tier")
    a = p.parse_args()
    expected = [int(x) for x in a.expect_sizes.split(",") if x]

    hvd.init()
    log.setup(rank_fn=hvd.rank)
    faults = FaultPlan.parse(os.environ.get(ENV), a.run_dir)
    torch.manual_seed(0)
    x = torch.randn(N_SAMPLES, 16)
    y = (x.sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    if a.ballast_mb:  # random, so that no layer of the stack can compress it away
        n = int(a.ballast_mb * 2**20 / 4)
        model.register_buffer("ballast", torch.rand(n, generator=torch.Generator().manual_seed(1)))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    events = EventLog(os.path.join(a.run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)
    events.emit("start", pid=os.getpid(), host=os.environ.get("HOROVOD_HOSTNAME"))
    # (size, first step seen at) for every world size so far: a committed attribute, so every
    # rank (a worker that joins later too, through sync) decides to stop at the same step.
    state = ElasticState(model, opt, sampler=ElasticDataSampler(N_SAMPLES, seed=0),
                         events=events, sizes_seen=(), hold_additions=True)
    samples_fd = os.open(os.path.join(a.run_dir, "samples.jsonl"),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    durable = commits = None
    if a.checkpoint_url:
        # settings from the environment too (the memory tier's folder, as a test sets it)
        env = {"HVD_RESILIENT_RUN_ID": "chaos", **os.environ,
               "HVD_RESILIENT_RUN_DIR": a.run_dir, "HVD_RESILIENT_CHECKPOINT_URL": a.checkpoint_url}
        cfg = TrainConfig.from_sources(env=env, checkpoint_every=a.checkpoint_every,
                                       checkpoint_keep_last=100)
        if a.memory_tier:  # every commit also in this host's memory, for a full restart
            commits = MemoryCommits(cfg, state, events, HorovodBackend())
        durable = DurableCheckpoints(cfg, state, events, HorovodBackend(), memory_tier=commits)
        # Rank 0 of a fresh start (new workers join at the end, so never a late joiner): the
        # others wait in the first sync, which spreads what it loaded.
        if hvd.rank() == 0:
            durable.resume()

    def finished() -> bool:
        if a.steps:
            return state.step >= a.steps
        seen = state.sizes_seen
        seq = [s for s, _ in seen]
        return seq[-len(expected):] == expected and state.step - seen[-1][1] >= a.steps_at_each

    def record(ids: list[int]) -> None:
        """One write(2) of one line: a SIGKILL never leaves half a line."""
        line = json.dumps({"t": time.time(), "step": state.step, "size": hvd.size(),
                           "rank": hvd.rank(), "epoch": state.sampler.epoch,
                           "pos": state.sampler.consumed, "ids": ids})
        os.write(samples_fd, (line + "\n").encode())

    @hvd_resilient.run(heartbeat_timeout_s=a.heartbeat_timeout)
    def train(state: ElasticState) -> None:
        while state.step < a.max_steps:
            if state.sampler.epoch_done():
                state.sampler.set_epoch(state.sampler.epoch + 1)
            faults.maybe_fire(hvd.rank(), state.step)
            sl = state.sampler.next_slice(hvd.rank(), hvd.size(), BATCH)
            record(sl.indices)
            opt.zero_grad()
            if sl.indices:
                idx = torch.tensor(sl.indices)
                loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
                (loss * len(sl.indices) * hvd.size() / sl.global_count).backward()
            opt.step()
            if a.allreduce_mb and state.step % a.allreduce_every == 0:
                t0 = time.perf_counter()
                hvd.allreduce(torch.ones(int(a.allreduce_mb * 2**20 / 4)), name="big")
                if hvd.rank() == 0:
                    events.emit("big_allreduce", seconds=round(time.perf_counter() - t0, 3))
            time.sleep(a.step_time)
            state.sampler.advance(sl.global_count)
            state.step += 1
            if not state.sizes_seen or state.sizes_seen[-1][0] != hvd.size():
                state.sizes_seen = (*state.sizes_seen, (hvd.size(), state.step))
            stop = finished()
            if stop or state.step % a.commit_every == 0 or state.host_change_pending():
                state.commit()
                if durable is not None and durable.due():
                    durable.save()
                    if hvd.rank() == 0:  # the upload runs in the background from here on
                        events.emit("checkpoint_submitted", ckpt_step=state.step)
                if stop:
                    return

    train(state)
    if durable is not None:
        durable.close(timeout=120)
    if commits is not None:
        commits.discard()  # the run is over
        commits.close()
    events.emit("done", params_sha256=state.params_sha256(), steps=state.step,
                sizes=[s for s, _ in state.sizes_seen])
    return 0 if state.step < a.max_steps else 3


if __name__ == "__main__":
    raise SystemExit(main())
