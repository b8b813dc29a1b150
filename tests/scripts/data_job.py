"""An elastic custom-loop job whose batches come from `ElasticLoader` with loader workers: over
a map-style data set (--data map) or over webdataset shards streamed from --shards-url
(--data shards). Written like tests/scripts/elastic_job.py, and its samples.jsonl has the same
lines, so `tests.support.exactly_once.assert_exactly_once` checks it; the difference is where
the ids come from: decoded by a loader worker from the sample itself (the map data set returns
its id inside the tensor; a shard sample carries it in its `cls` member), so a batch that
belonged to another step, rank or plan would show up as a wrong id, not only as a wrong plan.

Stops after --steps optimizer steps, or (with --expect-sizes) once the job has seen that
sequence of world sizes and --steps-at-each more steps. With --checkpoint-url it writes durable
checkpoints every --checkpoint-every steps and resumes from the newest on start (full restarts).
--transform-ms adds CPU work per sample in the workers (a stand-in for decoding/augmentation).

--api trainer runs the same data through `Trainer.fit()` instead (config from the flags:
`--data-num-workers`, ...; stops at --steps), recording each step's line from `trainer.batch`
in an `on_step` callback, which runs before the step's commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from typing import Any

import horovod.torch as hvd
import torch
from torch import nn

import hvd_resilient
from hvd_resilient import log
from hvd_resilient.backends.horovod.backend import HorovodBackend
from hvd_resilient.backends.horovod.state import ElasticState
from hvd_resilient.config import DataOptions, TrainConfig
from hvd_resilient.data.loader import ElasticLoader
from hvd_resilient.data.shards import ShardedDataset
from hvd_resilient.events import EventLog
from hvd_resilient.state.sampler import ElasticDataSampler
from hvd_resilient.training.durable import DurableCheckpoints
from hvd_resilient.training.faults import ENV, FaultPlan

N_SAMPLES = 2048
BATCH = 16


def spin(ms: float) -> None:
    """CPU work, not a sleep: it competes for the cores like a real transform."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


class MapData:
    """Sample i: 16 features drawn from a generator seeded by i, its label, and i itself."""

    def __init__(self, transform_ms: float) -> None:
        self.transform_ms = transform_ms

    def __len__(self) -> int:
        return N_SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        spin(self.transform_ms)
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return x, (x.sum() > 0).long(), i


def decode_shard_sample(transform_ms: float):  # noqa: ANN201 - a closure for the data set
    def decode(s: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
        spin(transform_ms)
        x = torch.frombuffer(bytearray(s["x"]), dtype=torch.float32)
        return x, torch.tensor(int(s["y"])), int(s["cls"])

    return decode


def trainer_main(argv: list[str]) -> int:
    """The `Trainer` path: loader settings come from the config's `data` section."""
    from hvd_resilient.training.trainer import Trainer

    p = argparse.ArgumentParser()
    TrainConfig.add_arguments(p)
    p.add_argument("--api")
    p.add_argument("--data", choices=("map", "shards"), default="map")
    p.add_argument("--shards-url", default="")
    p.add_argument("--transform-ms", type=float, default=0.0)
    a = p.parse_args(argv)
    cfg = TrainConfig.from_sources(a)
    data: Any = MapData(a.transform_ms) if a.data == "map" else ShardedDataset(
        a.shards_url, decode=decode_shard_sample(a.transform_ms))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    fd = os.open(os.path.join(cfg.run_dir, "samples.jsonl"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def collate(samples: list) -> tuple:
        x, y, ids = torch.utils.data.default_collate(samples)
        return x, (y, ids)

    def loss_fn(out: torch.Tensor, target: tuple) -> torch.Tensor:
        return nn.functional.cross_entropy(out, target[0])

    trainer: Trainer

    def on_step(state: Any, _loss: float) -> None:
        b = trainer.batch
        assert b is not None
        line = json.dumps({"t": time.time(), "step": state.step - 1, "size": b.key.world,
                           "rank": b.key.rank, "epoch": b.key.position[0],
                           "pos": b.key.position[1],
                           "ids": b.data[1][1].tolist() if b.used else []})
        os.write(fd, (line + "\n").encode())

    trainer = Trainer(model, opt, loss_fn, data, cfg, collate_fn=collate, on_step=on_step)
    result = trainer.fit()
    # The trainer's own `done` has no step count; exactly_once reads the last `done` per rank.
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    EventLog(os.path.join(cfg.run_dir, "events.jsonl"), rank=result.rank,
             size=result.world_size).emit("done", steps=result.step, params_sha256=h.hexdigest())
    return 0


def main() -> int:
    if sys.argv[1:3] == ["--api", "trainer"]:
        return trainer_main(sys.argv[1:])
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--data", choices=("map", "shards"), default="map")
    p.add_argument("--shards-url", default="")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--transform-ms", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps")
    p.add_argument("--expect-sizes", default="", help="or stop once sizes went e.g. 2,3,2")
    p.add_argument("--steps-at-each", type=int, default=20)
    p.add_argument("--commit-every", type=int, default=5)
    p.add_argument("--max-steps", type=int, default=20000)
    p.add_argument("--checkpoint-url", default="")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--heartbeat-timeout", type=float, default=1.5,
                   help="seconds; longer on a machine so loaded that a live worker starves")
    a = p.parse_args()
    expected = [int(x) for x in a.expect_sizes.split(",") if x]

    hvd.init()
    log.setup(rank_fn=hvd.rank)
    faults = FaultPlan.parse(os.environ.get(ENV), a.run_dir)
    torch.manual_seed(0)
    if a.data == "map":
        data = MapData(a.transform_ms)
        sampler = ElasticDataSampler(N_SAMPLES, seed=0)
    else:
        data = ShardedDataset(a.shards_url, decode=decode_shard_sample(a.transform_ms))
        sampler = data.make_sampler(seed=0)
    n_samples = len(data)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    events = EventLog(os.path.join(a.run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)
    events.emit("start", pid=os.getpid(), host=os.environ.get("HOROVOD_HOSTNAME"),
                n_samples=n_samples)
    state = ElasticState(model, opt, sampler=sampler, events=events, sizes_seen=())
    loader = ElasticLoader(data, sampler, batch_size=BATCH, events=events,
                           options=DataOptions(num_workers=a.num_workers))
    samples_fd = os.open(os.path.join(a.run_dir, "samples.jsonl"),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    durable = None
    if a.checkpoint_url:
        durable = DurableCheckpoints(
            TrainConfig.from_sources(env={}, run_id="data", run_dir=a.run_dir,
                                     checkpoint_url=a.checkpoint_url,
                                     checkpoint_every=a.checkpoint_every, checkpoint_keep_last=100),
            state, events, HorovodBackend())
        if hvd.rank() == 0:
            durable.resume()

    def finished() -> bool:
        if a.steps:
            return state.step >= a.steps
        seen = state.sizes_seen
        seq = [s for s, _ in seen]
        return seq[-len(expected):] == expected and state.step - seen[-1][1] >= a.steps_at_each

    def record(ids: list[int], pos: int) -> None:
        """One write(2) of one line: a SIGKILL never leaves half a line."""
        line = json.dumps({"t": time.time(), "step": state.step, "size": hvd.size(),
                           "rank": hvd.rank(), "epoch": state.sampler.epoch, "pos": pos,
                           "ids": ids})
        os.write(samples_fd, (line + "\n").encode())

    @hvd_resilient.run(heartbeat_timeout_s=a.heartbeat_timeout)
    def train(state: ElasticState) -> None:
        while state.step < a.max_steps:
            if state.sampler.epoch_done():
                state.sampler.set_epoch(state.sampler.epoch + 1)
            faults.maybe_fire(hvd.rank(), state.step)
            batch = loader.next_batch(hvd.rank(), hvd.size())
            x, y, ids = batch.data
            record(ids.tolist() if batch.used else [], state.sampler.consumed)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            (loss * batch.weight).backward()
            opt.step()
            state.sampler.advance(batch.global_count)
            state.step += 1
            if not state.sizes_seen or state.sizes_seen[-1][0] != hvd.size():
                state.sizes_seen = (*state.sizes_seen, (hvd.size(), state.step))
            stop = finished()
            if stop or state.step % a.commit_every == 0 or state.host_change_pending():
                state.commit()
                if durable is not None and durable.due():
                    durable.save()
                if stop:
                    return

    try:
        train(state)
    finally:
        loader.close()
    if durable is not None:
        durable.close(timeout=120)
    events.emit("done", params_sha256=state.params_sha256(), steps=state.step,
                sizes=[s for s, _ in state.sizes_seen], replans=loader.replans,
                worker_losses=loader.worker_losses)
    return 0 if state.step < a.max_steps else 3


if __name__ == "__main__":
    raise SystemExit(main())
