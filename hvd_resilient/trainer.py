"""The common case in a few lines: `Trainer(model, optimizer, loss_fn, data, config).fit()`.

The trainer is deliberately thin: the state knows what survives, the sampler knows the data
order, `durable` knows the store, `elastic.run` knows how to recover. This file only runs the
step loop and decides when to commit, checkpoint and stop.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import horovod.torch as hvd
import torch
from torch.utils.data import default_collate

from hvd_resilient import elastic, hvd_init, log
from hvd_resilient.checkpoint.store import StoreError
from hvd_resilient.config import TrainConfig
from hvd_resilient.durable import DurableCheckpoints
from hvd_resilient.errors import HvdResilientError
from hvd_resilient.events import EventLog
from hvd_resilient.faults import ENV as FAULT_ENV
from hvd_resilient.faults import FaultPlan
from hvd_resilient.sampler import ElasticDataSampler, StepSlice
from hvd_resilient.state import ElasticState

logger = log.get("trainer")

PREEMPTED_EXIT_CODE = 75
"""Exit status after a graceful stop on SIGTERM/SIGUSR1 with a final checkpoint (EX_TEMPFAIL):
a supervisor or `sbatch --requeue` restarts the job, which then resumes from that checkpoint."""


class Preempted(SystemExit):
    def __init__(self) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)


@dataclass
class FitResult:
    step: int
    epoch: int
    loss: float
    world_size: int


def _flag_preemption() -> list[int]:
    """Installs SIGTERM/SIGUSR1 handlers that only set a flag: the ranks agree on when to
    stop at the next commit, so the final checkpoint is consistent."""
    received: list[int] = []

    def handler(signum: int, _frame: Any) -> None:
        received.append(signum)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread (embedded use): leave signals alone
            pass
    return received


def share_cores() -> None:
    """Several workers per host each running torch's default thread pool oversubscribe the
    cores and slow every step; give each its share unless the user set OMP_NUM_THREADS."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, hvd.local_size())))


class Trainer:
    """Runs the training loop for a model whose forward takes the collated inputs."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        train_data: Sequence[Any],
        config: TrainConfig,
        *,
        scheduler: Any | None = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        on_step: Callable[[ElasticState, float], None] | None = None,
        comm: Any | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.data = train_data
        self.config = config
        self.scheduler = scheduler
        self.collate_fn = collate_fn
        self.on_step = on_step
        self.comm = comm
        """An mpi4py communicator to train on (default: COMM_WORLD under mpirun)."""

    def fit(self) -> FitResult:
        cfg = self.config
        hvd_init.init(self.comm)
        log.setup(rank_fn=hvd.rank)
        share_cores()
        events = EventLog(f"{cfg.run_dir}/events.jsonl", rank=hvd.rank, size=hvd.size)
        optimizer = hvd.DistributedOptimizer(
            self.optimizer, named_parameters=self.model.named_parameters()
        )
        sampler = ElasticDataSampler(len(self.data), shuffle=cfg.shuffle, seed=cfg.seed)
        state = ElasticState(
            self.model, optimizer, sampler=sampler, scheduler=self.scheduler, seed=cfg.seed,
            lr_scaling=cfg.lr_scaling, events=events, last_loss=math.nan,
        )
        durable = DurableCheckpoints(cfg, state, events)
        events.emit("start", pid=os.getpid(), host=socket.gethostname(),
                    run_id=cfg.run_id, config=cfg.to_dict() if hvd.rank() == 0 else None)
        if hvd.rank() == 0 and cfg.resume:
            try:
                durable.resume()
            except (HvdResilientError, StoreError) as e:
                # A restart would meet the same checkpoint or store: tell the supervisor.
                events.emit("fatal", error=str(e), restartable=False)
                raise
        preempt = _flag_preemption()
        self._faults = FaultPlan.parse(os.environ.get(FAULT_ENV), cfg.run_dir)

        @elastic.run
        def train(state: ElasticState) -> None:
            self._loop(state, durable, preempt)
            if durable.last_saved_step != state.step:
                durable.save()

        try:
            train(state)
        finally:
            durable.close(timeout=cfg.grace_seconds)
        events.emit("done", epoch=state.epoch, loss=state.last_loss,
                    params_sha256=state.params_sha256())
        if hvd.rank() == 0:
            logger.info("done: step %d, epoch %d, loss %.4f", state.step, state.epoch,
                        state.last_loss)
        return FitResult(state.step, state.epoch, float(state.last_loss), hvd.size())

    # -- the loop ------------------------------------------------------------------------
    def _finished(self, state: ElasticState) -> bool:
        cfg = self.config
        if cfg.max_steps and state.step >= cfg.max_steps:
            return True
        return state.epoch >= cfg.epochs

    def _loop(self, state: ElasticState, durable: DurableCheckpoints, preempt: list[int]) -> None:
        cfg = self.config
        sampler = state.sampler
        t_log, steps_since_log = time.time(), 0
        while not self._finished(state):
            if sampler.epoch_done():
                sampler.set_epoch(sampler.epoch + 1)
                state.commit()
                if cfg.checkpoint_every == 0 or self._finished(state):
                    durable.save()
                continue
            rank, size = hvd.rank(), hvd.size()
            sl = sampler.next_slice(rank, size, cfg.batch_size)
            self._faults.maybe_fire(rank, state.step)
            loss = self._step(state.optimizer, sl, size)
            sampler.advance(sl.global_count)
            state.step += 1
            state.samples += sl.global_count
            if loss is not None:
                state.last_loss = loss
            if self.scheduler is not None:
                self.scheduler.step()
            if self.on_step is not None:
                self.on_step(state, state.last_loss)
            steps_since_log += 1
            if rank == 0 and state.step % cfg.log_every == 0:
                now = time.time()
                logger.info(
                    "epoch %d step %d loss %.4f | %.1f samples/s | world %d",
                    state.epoch, state.step, state.last_loss,
                    steps_since_log * size * cfg.batch_size / max(now - t_log, 1e-9), size,
                )
                t_log, steps_since_log = now, 0
            if state.step % cfg.commit_every == 0:
                if self._agree_to_stop(preempt):
                    self._stop_for_preemption(state, durable)
                state.commit()
            if durable.due():
                durable.save()

    def _step(self, optimizer: torch.optim.Optimizer, sl: StepSlice, size: int) -> float | None:
        self.model.train()
        optimizer.zero_grad()
        loss_value = None
        if sl.indices:
            inputs, targets = self.collate_fn([self.data[i] for i in sl.indices])
            loss = self.loss_fn(self.model(inputs), targets)
            # Ranks may hold unequal shares of the last batch of an epoch; weighting by share
            # makes the averaged gradient the exact mean over the global batch.
            (loss * (len(sl.indices) * size / sl.global_count)).backward()
            loss_value = float(loss.detach())
        # A rank with no samples still joins the allreduce: Horovod submits zero gradients.
        optimizer.step()
        return loss_value

    def _agree_to_stop(self, preempt: list[int]) -> bool:
        flag = torch.tensor([1.0 if preempt else 0.0])
        return bool(hvd.allreduce(flag, op=hvd.Max, name="hvd_resilient.preempt").item() > 0)

    def _stop_for_preemption(self, state: ElasticState, durable: DurableCheckpoints) -> None:
        t0 = time.time()
        state.commit()
        durable.save(blocking=True)
        durable.close(timeout=self.config.grace_seconds)
        state.events.emit("preempted", seconds=round(time.time() - t0, 3),
                          exit_code=PREEMPTED_EXIT_CODE)
        if hvd.rank() == 0:
            logger.warning("stopping on a termination signal after a final checkpoint at step %d",
                           state.step)
        raise Preempted()
