"""The common case in a few lines: `Trainer(model, optimizer, loss_fn, data, config).fit()`.

The trainer is deliberately thin: the state knows what survives, the sampler knows the data
order, `durable` knows the store, the backend's `run` (the one recovery loop,
`backends/recovery.py`) knows how to recover. This file only runs the step loop and decides
when to commit, checkpoint and stop.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch.utils.data import default_collate

from hvd_resilient import backends, log
from hvd_resilient import event_names as ev
from hvd_resilient.backends.threads import share_cores
from hvd_resilient.checkpoint.host_buffers import pool as snapshot_pool
from hvd_resilient.config import TrainConfig
from hvd_resilient.data.loader import ElasticLoader, LoadedBatch
from hvd_resilient.detect import progress
from hvd_resilient.detect.progress import ProgressWatchdog
from hvd_resilient.errors import PREEMPTED_EXIT_CODE
from hvd_resilient.events import EventLog
from hvd_resilient.launcher_env import FORKED_ENV
from hvd_resilient.observability import Observer
from hvd_resilient.state.protocol import TrainingState
from hvd_resilient.state.sampler import ElasticDataSampler, StepSampler
from hvd_resilient.training import lease, rss
from hvd_resilient.training.durable import DurableCheckpoints
from hvd_resilient.training.faults import FaultPlan
from hvd_resilient.training.memory_tier import MemoryCommits
from hvd_resilient.training.recipe import Recipe

logger = logging.getLogger(__name__)


class TrainerState(TrainingState, Protocol):
    """The state the trainer makes: a `TrainingState` with the trainer's own extra
    ``last_loss`` (passed to `make_state`, so committed, restored and checkpointed with the
    rest). Not a protocol member: a state made elsewhere (a ported script's) has no such
    attribute."""

    last_loss: float


class Preempted(SystemExit):
    def __init__(self) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)


@dataclass
class FitResult:
    step: int
    epoch: int
    loss: float
    world_size: int
    rank: int


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
        on_step: Callable[[TrainingState, float], None] | None = None,
        comm: Any | None = None,
        backend: str | backends.Backend | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.data = train_data
        self.config = config
        self.scheduler = scheduler
        self.collate_fn = collate_fn
        """Turns a list of samples into (inputs, targets); runs in the loader workers when
        `config.data.num_workers` > 0."""
        self.on_step = on_step
        self.batch: LoadedBatch | None = None
        """The batch of the step in progress (or the last one): its sample ids, the step it
        was loaded for; what `on_step` callbacks may record. With gradient accumulation the
        last micro-batch; `batches` holds them all."""
        self.batches: list[LoadedBatch] = []
        """Every micro-batch of the step in progress (one without accumulation)."""
        self.comm = comm
        """An mpi4py communicator to train on (default: COMM_WORLD under mpirun)."""
        self.backend_name = backend
        """A registered backend's name (horovod, torchrun) or a `Backend` instance; default:
        whichever launcher started this process."""

    def fit(self) -> FitResult:
        cfg = self.config
        backend = self.backend = backends.get(
            self.backend_name, fsdp=cfg.fsdp, recovery=cfg.recovery,
            deterministic=cfg.deterministic)
        backend.init(self.comm)  # deterministic settings first: Horovod reads them at init
        log.setup(rank_fn=backend.rank, level=cfg.observability.log_level)
        snapshot_pool().enabled = snapshot_pool().enabled and cfg.checkpoint.snapshot_reuse
        share_cores(backend.local_size())
        renewal = lease.take_plain(cfg, backend.rank())  # one job per run
        events = EventLog(f"{cfg.run_dir}/events.jsonl", rank=backend.rank, size=backend.size,
                          lease_epoch=cfg.checkpoint.lease_epoch)
        lease.stop_when_taken_over(cfg, events, renewal)
        model, optimizer = backend.wrap(self.model, self.optimizer,
                                        accumulation=cfg.recipe.grad_accum)
        self._wrapped = model
        self.recipe = Recipe(cfg.recipe, model, optimizer,
                             reduces_in_backward=backend.reduces_in_backward,
                             device=next(model.parameters()).device)
        sampler = _make_sampler(self.data, cfg)
        # A TrainingState, and a TrainerState since `last_loss` is among its extras
        state = cast(TrainerState, backend.make_state(
            model, optimizer, sampler=sampler, scheduler=self.scheduler, seed=cfg.seed,
            lr_scaling=cfg.lr_scaling, events=events, last_loss=math.nan,
            **self.recipe.components(),
        ))
        self._faults = FaultPlan.parse(cfg.fault, cfg.run_dir)
        commits = _memory_class(cfg.fsdp)(cfg, state, events, backend)
        durable = _durable_class(cfg.fsdp)(cfg, state, events, backend, faults=self._faults,
                                           memory_tier=commits)
        rank0 = backend.rank() == 0
        events.emit(ev.START, pid=os.getpid(), host=socket.gethostname(), backend=backend.name,
                    run_id=cfg.run_id, warm=os.environ.get(FORKED_ENV) == str(os.getpid()),
                    config=cfg.to_dict() if rank0 else None)
        # Resume (or refuse to start); a failure stops every rank at the first sync, never
        # just rank 0 while the others train from scratch over the run's checkpoints.
        durable.start()
        preempt = _flag_preemption()
        self._watch_memory(state, events, backend)

        dog = self._dog = ProgressWatchdog(
            run_dir=cfg.run_dir, rank=backend.rank, emit=events.emit,
            timeout_s=cfg.recovery.progress_timeout_seconds,
            floor_s=cfg.recovery.progress_floor_seconds, factor=cfg.recovery.progress_factor,
            first_step_s=cfg.recovery.first_step_seconds)
        progress.install(dog.start())
        # Batches are loaded ahead of the step, in the sampler's order (hvd_resilient.data).
        self._loader = ElasticLoader(self.data, sampler, batch_size=cfg.batch_size,
                                     options=cfg.data, collate_fn=self.collate_fn,
                                     events=events, seed=cfg.seed)
        # Step timing, stragglers and the metrics endpoint (docs/observability.md).
        obs = self._obs = Observer(cfg.observability, backend=backend, emit=events.emit,
                                   events_path=events.path, run_id=cfg.run_id,
                                   waiting=dog.waiting_for_peers)

        def train(state: TrainerState) -> None:
            self._loop(state, durable, preempt)
            with dog.section("final checkpoint", None):  # an upload takes what it takes
                durable.finish()

        try:
            backend.run(train, state)
            commits.discard()  # the run is over: nothing will resume from its commits
        except Preempted:
            commits.discard()  # the final durable checkpoint holds the same step
            raise
        finally:
            dog.stop()
            progress.install(None)
            obs.close()
            self._loader.close()
            durable.close(timeout=cfg.checkpoint.grace_seconds)
            commits.close()
        events.emit(ev.DONE, epoch=state.epoch, loss=state.last_loss,
                    params_sha256=state.params_sha256(),
                    digests=None if state.sharded() else state.state_digests())
        if rank0:
            logger.info("done: step %d, epoch %d, loss %.4f", state.step, state.epoch,
                        state.last_loss)
        return FitResult(state.step, state.epoch, float(state.last_loss), backend.size(),
                         backend.rank())

    def _watch_memory(self, state: TrainingState, events: EventLog,
                      backend: backends.Backend) -> None:
        watch = rss.GrowthWatch()

        def after_reset() -> None:
            m = rss.sample()
            warning = watch.at_reset(m["rss_bytes"])
            events.emit(ev.MEMORY, at="reset", **m)
            if warning:
                events.emit(ev.MEMORY_GROWTH, warning=warning)
                logger.warning("rank %d: %s", backend.rank(), warning)

        state.after_reset(after_reset)  # never under torchrun: a restart is a new process

    def _report_progress(self, state: TrainerState, durable: DurableCheckpoints,
                         rate: float) -> None:
        """Every rank records its memory; rank 0 records and shows progress."""
        m = rss.sample()
        state.events.emit(ev.MEMORY, **m)
        if self.backend.rank() != 0:
            return
        since = durable.seconds_since_save()
        state.events.emit(ev.PROGRESS, epoch=state.epoch, loss=state.last_loss,
                          samples_per_s=round(rate, 3), **m)
        line = (f"epoch {state.epoch} step {state.step} loss {state.last_loss:.4f} | "
                f"{rate:.1f} samples/s | world {self.backend.size()} | last checkpoint "
                + (f"{since:.0f}s ago" if since is not None else "none yet"))
        if sys.stderr.isatty():
            print("\r" + line.ljust(100), end="", file=sys.stderr, flush=True)
        else:
            logger.info(line)

    # -- the loop ------------------------------------------------------------------------
    def _finished(self, state: TrainingState) -> bool:
        cfg = self.config
        if cfg.max_steps and state.step >= cfg.max_steps:
            return True
        return state.epoch >= cfg.epochs

    def _loop(self, state: TrainerState, durable: DurableCheckpoints,
              preempt: list[int]) -> None:
        cfg = self.config
        sampler: StepSampler = state.sampler  # the one `fit` made
        t_log, steps_since_log = time.time(), 0
        while not self._finished(state):
            if sampler.epoch_done():
                self._epoch_end(state)
                sampler.set_epoch(sampler.epoch + 1)
                state.commit()
                if cfg.checkpoint.every == 0 or self._finished(state):
                    durable.save()
                continue
            rank, size = self.backend.rank(), self.backend.size()
            t_step = time.perf_counter()  # waiting for the batch is this rank's compute too
            batches = self.batches = self._micro_batches(sampler, rank, size)
            self.batch = batches[-1]
            self._faults.maybe_fire(rank, state.step)
            loss = self._step(batches)
            state.step += 1
            state.samples += sum(b.global_count for b in batches)
            if loss is not None:
                state.last_loss = loss
            if self.scheduler is not None:
                self.scheduler.step()
            if self.on_step is not None:
                self.on_step(state, state.last_loss)
            self._dog.step()
            self._obs.step_end(state.step, t_step, state.samples, size)
            steps_since_log += 1
            if state.step % cfg.log_every == 0:
                now = time.time()
                rate = (steps_since_log * size * cfg.batch_size * cfg.recipe.grad_accum
                        / max(now - t_log, 1e-9))
                self._report_progress(state, durable, rate)
                t_log, steps_since_log = now, 0
            if state.step % cfg.commit_every == 0 or state.host_change_pending():
                if self.backend.any_rank(bool(preempt)):
                    self._stop_for_preemption(state, durable)
                state.commit()
            if durable.due():
                durable.save()
        if sampler.epoch_done():  # max_steps reached at an epoch's last step
            self._epoch_end(state)

    def _epoch_end(self, state: TrainingState) -> None:
        """Rank 0 records what the epoch consumed, all ranks and every reset together, beside
        what the data set expects (`epoch_end`; `hvd-resilient report` checks it). Every rank
        holds the same tally (it is committed and synced with the sampler), so one writes it.
        A rollback past this point makes the epoch end again: a second event, equal to this
        one when nothing is wrong."""
        record = getattr(state.sampler, "epoch_record", None)
        if record is not None and self.backend.rank() == 0:
            state.events.emit(ev.EPOCH_END, **record())

    def _micro_batches(self, sampler: StepSampler, rank: int, size: int) -> list[LoadedBatch]:
        """The step's micro-batches, each advancing the sampler (so the loader plans the next
        one and a commit after the step covers them all); fewer at the epoch's end."""
        out = []
        for _ in range(self.config.recipe.grad_accum):
            batch = self._loader.next_batch(rank, size)
            sampler.advance(batch.global_count)
            out.append(batch)
            if sampler.epoch_done():
                break
        return out

    def _step(self, batches: list[LoadedBatch]) -> float | None:
        self._wrapped.train()
        recipe = self.recipe
        recipe.optimizer.zero_grad()
        device = next(self._wrapped.parameters()).device
        total = sum(b.global_count for b in batches)
        losses: list[tuple[float, int]] = []
        t_wait = time.perf_counter()
        for i, batch in enumerate(batches):
            # A rank with no samples in the epoch's last step (or only bad ones, skipped)
            # still runs forward and backward (DDP and Horovod both need every rank in the
            # allreduce), on a filler sample the loader loaded, weighted 0. Weighting by the
            # rank's share of the micro-batch, and each micro-batch by its share of the step,
            # makes the averaged gradient the exact mean over the step's samples.
            weight = batch.weight * (batch.global_count / total if total else 0.0)
            inputs, targets = batch.data
            if device.type != "cpu":
                inputs, targets = _to(inputs, device), _to(targets, device)
            last = i == len(batches) - 1
            with recipe.micro_batch(last):
                with recipe.autocast():
                    loss = self.loss_fn(self._wrapped(inputs), targets)
                if last and self.backend.reduces_in_backward:  # DDP: backward waits for peers
                    t_wait = time.perf_counter()
                    with self._dog.waiting_for_peers():
                        recipe.backward(loss * weight)
                else:
                    recipe.backward(loss * weight)
            if batch.used:
                losses.append((float(loss.detach()), len(batch.used)))
        if not self.backend.reduces_in_backward:  # Horovod: step() waits for the allreduce
            t_wait = time.perf_counter()
        with self._dog.waiting_for_peers():
            recipe.step()
        self._obs.waited(time.perf_counter() - t_wait)  # the rest of the step is compute
        if len(losses) <= 1:
            return losses[0][0] if losses else None
        return sum(v * n for v, n in losses) / sum(n for _, n in losses)

    def _stop_for_preemption(self, state: TrainingState, durable: DurableCheckpoints) -> None:
        t0 = time.time()
        state.commit()
        grace = self.config.checkpoint.grace_seconds
        with self._dog.section("preemption checkpoint", grace + 5):
            durable.save(blocking=True)
            durable.close(timeout=grace)
            # Nobody leaves before the writers are done: a launcher that ends a job at its
            # first exit (mpirun) would kill rank 0 in the middle of the final checkpoint.
            self.backend.any_rank(False)
        state.events.emit(ev.PREEMPTED, seconds=round(time.time() - t0, 3),
                          exit_code=PREEMPTED_EXIT_CODE)
        if self.backend.rank() == 0:
            logger.warning("stopping on a termination signal after a final checkpoint at step %d",
                           state.step)
        raise Preempted()


def _make_sampler(data: Any, cfg: TrainConfig) -> StepSampler:
    """Streamed shards bring their own sampler (whole shards per rank); anything else with a
    length gets the map-style one."""
    if hasattr(data, "make_sampler"):
        made: StepSampler = data.make_sampler(shuffle=cfg.shuffle, seed=cfg.seed)
        return made
    return ElasticDataSampler(len(data), shuffle=cfg.shuffle, seed=cfg.seed)


def _durable_class(sharded: bool) -> type[DurableCheckpoints]:
    """Sharded (FSDP) models save every rank's shards; replicated ones save rank 0's copy."""
    if not sharded:
        return DurableCheckpoints
    from hvd_resilient.training.durable_sharded import ShardedDurableCheckpoints

    return ShardedDurableCheckpoints


def _memory_class(sharded: bool) -> type[MemoryCommits]:
    """Each rank keeps its own shards (FSDP), or one rank per host the whole state."""
    if not sharded:
        return MemoryCommits
    from hvd_resilient.training.memory_tier_sharded import ShardedMemoryCommits

    return ShardedMemoryCommits


def _to(batch: Any, device: torch.device) -> Any:
    """Moves tensors (also inside lists, tuples and dicts) to the model's device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch
