"""The job `bench/goodput.py` runs: `examples/tiny_lm.py`'s model and text under two stacks.

`--stack ours` trains under `hvd_resilient.run` with `ElasticState` and `ElasticDataSampler`
(the product); `--stack vanilla` under Horovod's own `hvd.elastic.run` with
`hvd.elastic.TorchState` and `hvd.elastic.ElasticSampler`, as a user of plain Horovod Elastic
writes it (Horovod's MNIST elastic example). The model (`TinyLM`), the text, the optimizer
(AdamW, constant LR), the per-rank batch and the commit cadence are the same; neither stack
writes durable checkpoints (the benchmark measures in-process recovery only). Ours holds an
addition (a killed worker's slot back from its cooldown) until its standby is warm, as the
Trainer does (`hold_additions=True`; without it the others waited 2.5-2.7 s in every such join).

Both record one event format, so the benchmark and `hvd-resilient report` read either:
`start` (with the pid the fault injector kills by, and on rank 0 the config), rank 0's `commit`
and, for vanilla, the events Horovod does not write itself (`restore`, `hosts_changed`, `reset`,
`sync`), from a `TorchState` subclass that only adds logging. Every step trains a full global
batch (`batch_size` x world size): the tail of an epoch that cannot fill one is skipped by both
stacks, so committed samples = sum over commits of (steps since the last commit) x size x batch.

Trains until `--max-steps` (0: until the benchmark kills it at its deadline).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import horovod.torch as hvd
import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tiny_lm import BLOCK, TinyLM, make_data  # noqa: E402

import hvd_resilient  # noqa: E402
from hvd_resilient import log  # noqa: E402
from hvd_resilient.backends.horovod.state import ElasticState  # noqa: E402
from hvd_resilient.events import EventLog  # noqa: E402
from hvd_resilient.state.sampler import ElasticDataSampler  # noqa: E402

TrainStep = Callable[[list[int]], None]


class LoggedTorchState(hvd.elastic.TorchState):
    """Horovod's `TorchState`, unchanged in behaviour, writing the events the report needs."""

    def __init__(self, events: EventLog, **kwargs: object) -> None:
        self.events = events
        self.last_size = 0
        self.noticed_at = time.time()
        super().__init__(**kwargs)
        self.register_reset_callbacks([self._on_reset])

    def restore(self) -> None:
        self.noticed_at = time.time()
        before = self.step
        super().restore()
        self.events.emit("restore", from_step=before, to_step=self.step,
                         lost_steps=before - self.step)

    def check_host_updates(self) -> None:
        try:
            super().check_host_updates()
        except HostsUpdatedInterrupt as e:
            self.noticed_at = time.time()
            self.events.emit("hosts_changed", removed_only=bool(e.skip_sync))
            raise

    def _on_reset(self) -> None:
        self.events.emit("reset", old_size=self.last_size, new_size=hvd.size(),
                         seconds=round(time.time() - self.noticed_at, 6))


def run_ours(model: nn.Module, opt: torch.optim.Optimizer, n_windows: int, a: argparse.Namespace,
             events: EventLog, train_step: TrainStep) -> None:
    state = ElasticState(model, opt, sampler=ElasticDataSampler(n_windows, seed=a.seed),
                         seed=a.seed, events=events, host_check_every=a.host_check_every,
                         hold_additions=True)  # as the Trainer does: train through a warm-up

    @hvd_resilient.run
    def train(state: ElasticState) -> None:
        while not a.max_steps or state.step < a.max_steps:
            if state.sampler.remaining() < a.batch_size * hvd.size():
                state.sampler.set_epoch(state.sampler.epoch + 1)  # skip a partial tail
            sl = state.sampler.next_slice(hvd.rank(), hvd.size(), a.batch_size)
            train_step(sl.indices)
            state.sampler.advance(sl.global_count)
            state.step += 1
            if state.step % a.commit_every == 0 or state.host_change_pending():
                state.commit()

    train(state)


def run_vanilla(model: nn.Module, opt: torch.optim.Optimizer, n_windows: int,
                a: argparse.Namespace, events: EventLog, train_step: TrainStep) -> None:
    sampler = hvd.elastic.ElasticSampler(range(n_windows), shuffle=True, seed=a.seed)
    state = LoggedTorchState(events, model=model, optimizer=opt, sampler=sampler, step=0,
                             epoch=0)
    events.step_source = lambda: state.step

    @hvd.elastic.run
    def train(state: LoggedTorchState) -> None:
        events.emit("sync")  # Horovod synced (or skipped it) just before calling us
        state.last_size = hvd.size()
        while not a.max_steps or state.step < a.max_steps:
            mine = list(iter(state.sampler))  # this rank's share of what the epoch has left
            for i in range(len(mine) // a.batch_size):  # all ranks: the same count
                train_step(mine[i * a.batch_size : (i + 1) * a.batch_size])
                state.sampler.record_batch(i, a.batch_size)
                state.step += 1
                if state.step % a.commit_every == 0:
                    if hvd.rank() == 0:
                        events.emit("commit")  # ElasticState.commit says so itself
                    state.commit()
                if a.max_steps and state.step >= a.max_steps:
                    return
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)

    train(state)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--stack", choices=("ours", "vanilla"), required=True)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=0, help="0: train until killed")
    p.add_argument("--host-check-every", type=int, default=1,
                   help="ours: host_change_pending asks every N steps (0: never)")
    a = p.parse_args()

    hvd.init()
    torch.set_num_threads(1)  # several workers share two cores: one thread each, both stacks
    log.setup(rank_fn=hvd.rank)
    vocab, data = make_data()
    n_windows = (len(data) - 1) // BLOCK
    torch.manual_seed(a.seed)
    model = TinyLM(len(vocab))
    opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=a.lr),
                                   named_parameters=model.named_parameters())
    events = EventLog(os.path.join(a.run_dir, "events.jsonl"), rank=hvd.rank, size=hvd.size)
    config = {"batch_size": a.batch_size, "commit_every": a.commit_every, "stack": a.stack}
    events.emit("start", pid=os.getpid(), stack=a.stack,
                config=config if hvd.rank() == 0 else None)

    def train_step(windows: list[int]) -> None:
        starts = torch.tensor(windows) * BLOCK
        x = torch.stack([data[s : s + BLOCK] for s in starts])
        y = torch.stack([data[s + 1 : s + BLOCK + 1] for s in starts])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()

    (run_ours if a.stack == "ours" else run_vanilla)(model, opt, n_windows, a, events,
                                                     train_step)
    events.emit("done")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
