"""Batches loaded ahead of the step in DataLoader workers, in the elastic sampler's order.

The sampler's position is the truth; the loader only predicts. For the (position, world size,
rank, batch size) the trainer is at, a *plan* lists the steps that follow if nothing changes
(the sampler simulated on a copy), and a real `torch.utils.data.DataLoader` loads the plan's
batches in worker processes ahead of the step. Every loaded batch carries the key of the step
it was planned for and the key of the step after it. When the trainer asks for a batch whose key
is not the one the plan produces next (a reset restored an older commit, the world grew or
shrank, a rank changed), the loader starts a new plan from there: batches prefetched for the
old plan are dropped uncounted (the sampler advances only for batches the step consumed), so
nothing is lost or trained twice.

Why not keep the DataLoader's own state (torchdata's StatefulDataLoader): it snapshots one
rank's iterator, valid for that rank at that world size; after a resize every rank needs a part
of an order the whole world agrees on, which the sampler already has in two integers (or the
shard cursors). Rebuilding the plan is cheap: the workers stay, and tasks of a dropped plan are
skipped in the workers (a shared generation number) instead of being loaded.

The DataLoader is iterated in a thread of its own, which matters for failures: torch installs
its SIGCHLD handler only for iterators made on the main thread, and that handler raises a
worker's death as an exception at whatever line the main thread is on (inside the optimizer
step, say). Here a dead worker (the OOM killer's SIGKILL) surfaces in the loader thread as the
DataLoader's "worker exited unexpectedly" error, is recorded (`loader_worker_lost`), and a new
DataLoader picks up at the first batch not yet delivered.

Each sample is loaded with every random generator seeded from (seed, epoch, sample id), so an
augmentation gives the same result whichever worker loads it and however often it is reloaded
after a reset. Workers close their copies of the training process's network sockets at start:
a forked worker holding a Gloo connection would keep it open after its rank died, and the peers'
hang-up watch would not see the death.

A worker dies with its rank, whatever kills the rank (SIGKILL, the OOM killer, a segfault):
it asks the kernel for a SIGKILL when its parent goes (`PR_SET_PDEATHSIG`), instead of finding
out at PyTorch's next check on its parent, up to 5 s later (`MP_STATUS_CHECK_INTERVAL`). And it
never holds its rank's stdout and stderr: when those are pipes (Horovod's launcher reads its
workers' output through pipes, and reports a worker's exit only at the end of its output), the
workers write into pipes of the rank's own, which a thread of the rank copies to its real
stdout and stderr. A killed rank's output then ends when the rank does, whatever its workers'
children still hold open; before, the survivors reset 4.8-5.0 s after a kill instead of 0.06 s
(examples/gpt.py with one loader worker; docs/architecture.md has the measurements).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import random
import selectors
import socket
import stat
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, default_collate

from hvd_resilient import event_names as ev
from hvd_resilient.config import DataOptions
from hvd_resilient.data.errors import DataError
from hvd_resilient.die_with_parent import die_with_parent
from hvd_resilient.events import EventLog

if TYPE_CHECKING:
    from hvd_resilient.state.sampler import StepSampler

logger = logging.getLogger(__name__)

MAX_BAD_IN_EVENT = 20
"""A bad_sample event lists at most this many samples (it always has the count)."""
WORKER_LOSSES_PER_BATCH = 3
"""Workers dying this many times before the same batch is delivered: a poison sample (one that
crashes the process), not bad luck; the loader stops instead of looping."""


@dataclass(frozen=True)
class BatchKey:
    """The step a batch was loaded for: equal keys, equal samples."""

    position: Hashable
    world: int
    rank: int
    batch_size: int


@dataclass
class BadSample:
    """A sample that raised while loading (or whose shard is unreadable)."""

    index: int
    error: str
    shard: str | None = None

    def describe(self) -> str:
        where = f" (shard {self.shard})" if self.shard else ""
        return f"sample {self.index}{where}: {self.error}"

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "shard": self.shard, "error": self.error}


@dataclass
class _Task:
    """One rank's samples of one step: what the loader thread hands a worker."""

    gen: int
    seq: int
    key: BatchKey
    next_key: BatchKey
    epoch: int
    indices: list[int]
    global_count: int
    filler: int
    """A sample to load, with weight 0, when none of `indices` can be (a rank without samples
    in an epoch's last step still takes part in the allreduce)."""


@dataclass
class LoadedBatch:
    """What the step trains on, and the step it was loaded for."""

    key: BatchKey
    next_key: BatchKey
    indices: list[int]
    """The sample ids the sampler gave this rank."""
    used: list[int]
    """The ids actually in `data`: `indices` less skipped bad samples (empty: `data` is a
    filler sample, to be weighted 0)."""
    global_count: int
    """Samples the whole world consumes in this step (what the sampler advances by)."""
    data: Any
    bad: list[BadSample] = field(default_factory=list)
    gen: int = 0
    seq: int = 0
    stale: bool = False
    """Planned under a dropped plan: not loaded (the worker skipped it)."""
    filler_error: str = ""

    @property
    def weight(self) -> float:
        """This rank's share of the global batch, as a factor on its mean loss: ranks may hold
        unequal shares (the epoch's last step), and weighting by share makes the averaged
        gradient the mean over the global batch (a skipped bad sample counts as zero)."""
        return len(self.used) * self.key.world / self.global_count if self.global_count else 0.0

    def pin_memory(self) -> LoadedBatch:
        """Called by the DataLoader's pinning thread (pin_memory=True)."""
        self.data = _pin(self.data)
        return self


def _pin(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pin(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _pin(v) for k, v in obj.items()}
    return obj


# -- worker side -------------------------------------------------------------------------------
def _sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * 1_000_003 + epoch) * 2_654_435_761 + index) & 0x7FFF_FFFF_FFFF


def _seed_everything(value: int) -> None:
    # The CPU generator only: torch.manual_seed also queues the seeding of every accelerator,
    # recording a stack trace each time (7 ms a sample here).
    torch.default_generator.manual_seed(value)
    random.seed(value)
    try:
        import numpy as np

        np.random.seed(value & 0xFFFF_FFFF)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass


class _Fetch:
    """Loads one task: every sample seeded, each failure recorded instead of raised, then
    collated. Runs in a loader worker (or inline with num_workers=0)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any], seed: int,
                 current_gen: Any | None) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.seed = seed
        self.current_gen = current_gen

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:  # pragma: no cover - DataLoader uses __getitems__
        raise TypeError("_Fetch loads whole tasks (__getitems__)")

    def _load(self, index: int, epoch: int) -> Any:
        _seed_everything(_sample_seed(self.seed, epoch, index))
        return self.dataset[index]

    def _bad(self, index: int, e: BaseException) -> BadSample:
        text = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        shard = getattr(e, "shard", None)
        if shard is None and hasattr(self.dataset, "shard_name"):
            with contextlib.suppress(Exception):
                shard = self.dataset.shard_name(index)
        return BadSample(index, text, shard)

    def __getitems__(self, task: _Task) -> LoadedBatch:
        out = LoadedBatch(task.key, task.next_key, task.indices, [], task.global_count, None,
                          gen=task.gen, seq=task.seq)
        if self.current_gen is not None and self.current_gen.value != task.gen:
            out.stale = True
            return out
        samples = []
        for i in task.indices:
            try:
                samples.append(self._load(i, task.epoch))
                out.used.append(i)
            except Exception as e:  # any error of the user's dataset or transform
                out.bad.append(self._bad(i, e))
        if not samples:  # weight 0; a filler that fails is no sample of this step: not counted
            try:
                samples.append(self._load(task.filler, task.epoch))
            except Exception as e:
                out.filler_error = self._bad(task.filler, e).describe()
                return out
        out.data = self.collate_fn(samples)
        return out


def _passthrough(batch: LoadedBatch) -> LoadedBatch:
    return batch


def close_inherited_sockets() -> int:
    """Closes this process's copies of inet sockets (TCP, UDP); returns how many.

    A forked loader worker inherits every socket of its rank: Gloo's connections, the
    heartbeats, S3 connections. If the rank is killed, its kernel closes the connections only
    when the last copy goes, so a worker still alive would hide the death from the peers'
    hang-up watch. Unix sockets (torch's tensor passing) are left alone, and closing a copy here
    sends nothing to the peer: the training process still holds its own."""
    closed = 0
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:  # not Linux: nothing to do that we can do safely
        return 0
    for fd in fds:
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=fd)
        except OSError:
            continue
        family = s.family
        s.detach()  # the object must not close it on its own terms
        if family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                os.close(fd)
                closed += 1
    return closed


@dataclass(frozen=True)
class _WorkerSetup:
    """What a loader worker does first (pickled into it under spawn: plain numbers only)."""

    parent_pid: int | None
    redirects: tuple[tuple[int, int], ...] = ()
    """(stdout or stderr, write end of the rank's pipe that replaces it): fork only, where the
    worker has the rank's file descriptors."""
    replaced: tuple[tuple[int, int], ...] = ()
    """(st_dev, st_ino) of the rank's own stdout and stderr pipes: every copy the worker holds
    is closed, so the worker never keeps them open."""


_forking = threading.local()
"""`parent_pid` is set on the loader thread, which forks the workers (fork start method)."""


def _die_with_the_forking_loader() -> None:
    """Runs in every child forked from this process, on the thread that forked it. A worker
    forked while another thread of the rank held a Python lock (an import's module lock, say)
    can block on that lock before torch runs `worker_init_fn`, and then never learns that its
    rank died: measured, 1 in 28 data_bench runs hung on such an orphan. Asking for the death
    signal here, before torch's worker code, covers that; `_worker_init` asks again (spawn)."""
    parent = getattr(_forking, "parent_pid", None)
    if parent is not None:
        die_with_parent(parent)


os.register_at_fork(after_in_child=_die_with_the_forking_loader)


def _worker_init(_worker_id: int, setup: _WorkerSetup | None = None) -> None:
    setup = setup or _WorkerSetup(None)
    die_with_parent(setup.parent_pid)
    close_inherited_sockets()
    if setup.redirects:
        _redirect_output(setup)


def _redirect_output(setup: _WorkerSetup) -> None:
    for target, write_end in setup.redirects:
        with contextlib.suppress(OSError):
            os.dup2(write_end, target)
    replaced = set(setup.replaced)
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in replaced:
            with contextlib.suppress(OSError):
                os.close(fd)


class _WorkerOutput:
    """The pipes loader workers write their stdout and stderr into, and the thread of the
    training process that copies them to its own stdout and stderr.

    Only streams that are pipes or sockets are replaced (a file or a terminal has no end that
    anyone waits for). The training process keeps the write ends for the workers it forks later
    and closes them in `close()`; the thread ends when every copy is closed."""

    def __init__(self) -> None:
        self.redirects: list[tuple[int, int]] = []
        self.replaced: list[tuple[int, int]] = []
        self._reads: list[tuple[int, int]] = []  # (read end, where its bytes go)
        for target in (1, 2):
            try:
                st = os.fstat(target)
            except OSError:
                continue
            if not (stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode)):
                continue
            r, w = os.pipe()
            self._reads.append((r, target))
            self.redirects.append((target, w))
            self.replaced.append((st.st_dev, st.st_ino))
        self._thread: threading.Thread | None = None
        if self._reads:
            self._thread = threading.Thread(target=self._forward, name="hvd-resilient-loader-out",
                                            daemon=True)
            self._thread.start()

    def setup(self, parent_pid: int | None) -> _WorkerSetup:
        return _WorkerSetup(parent_pid, tuple(self.redirects), tuple(self.replaced))

    def _forward(self) -> None:
        sel = selectors.DefaultSelector()
        for r, target in self._reads:
            sel.register(r, selectors.EVENT_READ, target)
        left = len(self._reads)
        while left:
            for key, _ in sel.select():
                try:
                    data = os.read(key.fd, 65536)
                except OSError:
                    data = b""
                if not data:  # every worker that had it, and the training process, closed it
                    sel.unregister(key.fd)
                    os.close(key.fd)
                    left -= 1
                    continue
                with contextlib.suppress(OSError):  # the reader of our output is gone: drop it
                    while data:
                        data = data[os.write(key.data, data):]
        sel.close()

    def close(self, timeout: float = 1.0) -> None:
        """After the workers were shut down. A helper process a worker started may still hold
        a write end; then the thread stays (a daemon) until that one ends."""
        redirects, self.redirects = self.redirects, []
        for _, w in redirects:
            with contextlib.suppress(OSError):
                os.close(w)
        if self._thread is not None:
            self._thread.join(timeout)


# -- the plan ------------------------------------------------------------------------------------
class _Plan:
    """The steps that follow a position if nothing changes: a copy of the sampler run ahead.

    `next_task` gives them in order; the lookahead (what streamed shards fetch ahead) runs
    further. Used in one thread at a time."""

    def __init__(self, sampler: StepSampler, key: BatchKey, gen: int, counter: Iterator[int],
                 dataset: Any, readahead: int) -> None:
        self.sampler = sampler
        if hasattr(sampler, "track_ids"):
            # A copy that runs ahead and is never committed: hashing the ids it passes (the
            # tally behind the `epoch_end` event) is the real sampler's work, not the plan's.
            sampler.track_ids = False
        self.key = key
        self.gen = gen
        self.counter = counter
        self.dataset = dataset
        self.readahead = readahead
        self._streams = hasattr(dataset, "prepare")
        self._ahead: deque[tuple[BatchKey, int, list[int], int]] = deque()
        self._filler: int | None = None

    def _generate(self) -> tuple[BatchKey, int, list[int], int]:
        s = self.sampler
        if s.epoch_done():
            s.set_epoch(s.epoch + 1)
        key = BatchKey(s.position(), self.key.world, self.key.rank, self.key.batch_size)
        sl = s.next_slice(self.key.rank, self.key.world, self.key.batch_size)
        epoch = s.epoch
        s.advance(sl.global_count)
        return key, epoch, sl.indices, sl.global_count

    def _fill(self, n: int) -> None:
        while len(self._ahead) < n:
            self._ahead.append(self._generate())

    def _look_ahead(self) -> None:
        """Asks a streamed data set to fetch the shards of the coming steps: as many steps as
        it takes to name `readahead` shards beyond the current one (at most 4096 steps)."""
        if not self._streams or self.readahead <= 0:
            self._fill(2)
            return
        shards: dict[int, None] = {}  # in order of first use
        wanted = min(self.readahead + 1, getattr(self.dataset, "num_shards", 1 << 30))
        n = 0
        while len(shards) < wanted and n < 4096:
            self._fill(n + 1)
            ids = self._ahead[n][2]
            for i in ids[:1] + ids[-1:]:
                shards.setdefault(self.dataset.shard_of(i))
            n += 1
        self._fill(2)
        self.dataset.request(list(shards))

    def next_task(self) -> _Task:
        self._look_ahead()
        key, epoch, indices, count = self._ahead.popleft()
        next_key = self._ahead[0][0]
        if indices:
            self._filler = indices[0]
        elif self._filler is None:  # first step without samples: borrow one from ahead
            self._filler = next((t[2][0] for t in self._ahead if t[2]), 0)
        seq = next(self.counter)
        task = _Task(self.gen, seq, key, next_key, epoch, indices, count, self._filler)
        if self._streams:  # the shards this task reads are local before a worker gets it
            self.dataset.prepare(indices + [self._filler], seq)
        return task


class _Feed:
    """The DataLoader's batch sampler: yields the tasks of the current plan, switching plans
    between tasks; re-issues undelivered tasks after a worker loss. Iterated in the loader
    thread only."""

    def __init__(self, loader: ElasticLoader) -> None:
        self.loader = loader
        self.plan: _Plan | None = None
        self.unacked: deque[_Task] = deque()
        self.replay: deque[_Task] = deque()
        self.stop_at_epoch_end = not loader.options.persistent_workers

    def __len__(self) -> int:  # pragma: no cover - never asked for (the plan has no end)
        return 2**62

    def __iter__(self) -> Iterator[_Task]:
        started_epoch: int | None = None
        while True:
            if self.replay:
                task = self.replay.popleft()
            else:
                plan = self.loader._wait_for_plan(self)
                if plan is None:
                    return
                if self.stop_at_epoch_end and started_epoch is not None \
                        and plan._ahead and plan._ahead[0][1] != started_epoch:
                    return  # a new DataLoader iterator (new workers) for the next epoch
                task = plan.next_task()
                if started_epoch is None:
                    started_epoch = task.epoch
            self.unacked.append(task)
            yield task

    def delivered(self, seq: int) -> None:
        while self.unacked and self.unacked[0].seq <= seq:
            self.unacked.popleft()

    def rewind(self) -> None:
        """After the workers were lost: what they had not delivered is issued again first."""
        self.replay.extendleft(reversed(self.unacked))
        self.unacked.clear()


# -- the loader ------------------------------------------------------------------------------------
class ElasticLoader:
    """Loads the batches of an elastic sampler's order ahead of the step.

    Args:
        dataset: map-style (`__getitem__` by sample id, `__len__`), or a streamed
            `hvd_resilient.data.shards.ShardedDataset`.
        sampler: the training state's sampler (`ElasticDataSampler` or `ElasticShardSampler`);
            read, never changed: the caller advances it by `batch.global_count` after the step.
        batch_size: samples per rank per step.
        options: the `data` config section (workers, prefetch, pinning, bad samples).
        collate_fn: turns a list of samples into the batch the model takes; runs in a worker.
        events: where `bad_sample` and `loader_worker_lost` are recorded.
        seed: seeds each sample's random generators with (seed, epoch, sample id).

    Use it from one thread: `next_batch(rank, world)` every step, `close()` at the end.
    """

    def __init__(self, dataset: Any, sampler: StepSampler, *, batch_size: int,
                 options: DataOptions | None = None,
                 collate_fn: Callable[[list[Any]], Any] = default_collate,
                 events: EventLog | None = None, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = batch_size
        self.options = options or DataOptions()
        self.collate_fn = collate_fn
        self.events = events or EventLog(None)
        self.seed = seed
        self._counter = itertools.count()
        self._gen = 0
        self._expect: BatchKey | None = None
        self.skipped = 0
        """Bad samples skipped so far by this process."""
        self.replans = 0
        """Plans dropped because the sampler's position was not the one predicted."""
        self.worker_losses = 0
        self._closed = False
        self._last_data: Any = None
        self._sync_plan: _Plan | None = None
        self._sync_fetch: _Fetch | None = None
        self._thread: threading.Thread | None = None
        if hasattr(dataset, "configure"):  # before any worker forks: where shards are cached
            dataset.configure(self.options, self.events.emit)
        if self.options.num_workers > 0:
            ctx = multiprocessing.get_context()
            self._shared_gen = ctx.RawValue("q", 0)
            method = ctx.get_start_method()
            # fork: the workers get the rank's file descriptors, the output pipes among them
            self._output = _WorkerOutput() if method == "fork" else None
            parent = os.getpid() if method in ("fork", "spawn") else None  # forkserver: not us
            self._worker_setup = (self._output.setup(parent) if self._output is not None
                                  else _WorkerSetup(parent))
            self._cond = threading.Condition()
            self._pending_plan: _Plan | None = None
            self._queue: queue.Queue[LoadedBatch] = queue.Queue(maxsize=2)
            self._error: BaseException | None = None
            self._thread = threading.Thread(target=self._run, name="hvd-resilient-loader",
                                            daemon=True)
            self._thread.start()

    # -- the training side ------------------------------------------------------------------
    def next_batch(self, rank: int, world: int) -> LoadedBatch:
        """The batch of the step the sampler is at, for `rank` in a world of `world`."""
        if self._closed:
            raise RuntimeError("the loader is closed")
        key = BatchKey(self.sampler.position(), world, rank, self.batch_size)
        if key != self._expect:
            self._new_plan(key)
        while True:
            batch = self._take()
            if batch.gen == self._gen and not batch.stale:
                break
        # The plan started at `key`, so anything else is a bug here. Planning the step on the
        # real sampler too checks the samples, and lets it `advance` by this step afterwards.
        planned = self.sampler.next_slice(rank, world, self.batch_size)
        if batch.key != key or batch.indices != planned.indices:
            raise RuntimeError(f"loader delivered the batch of {batch.key}, expected {key}")
        self._expect = batch.next_key
        if batch.bad:
            self._report_bad(batch)
        if batch.data is None and self._last_data is not None:
            # Nothing of this step loaded, not even the filler (a whole batch from one bad
            # shard): the last good batch stands in, weighted 0 like any filler.
            batch.data = self._last_data
        elif batch.data is None:
            raise DataError(f"data: no sample of the first step could be loaded: "
                            f"{batch.filler_error}")
        self._last_data = batch.data
        return batch

    def _new_plan(self, key: BatchKey) -> None:
        if self._expect is not None:
            self.replans += 1
            logger.debug("new plan at %s (expected %s)", key, self._expect)
        self._gen += 1
        plan = _Plan(copy.deepcopy(self.sampler), key, self._gen, self._counter, self.dataset,
                     self.options.readahead_shards)
        if self._thread is None:
            self._sync_plan = plan
            return
        with self._cond:
            self._shared_gen.value = self._gen
            self._pending_plan = plan
            self._cond.notify_all()

    def _take(self) -> LoadedBatch:
        if self._thread is None:
            assert self._sync_plan is not None
            if self._sync_fetch is None:
                self._sync_fetch = _Fetch(self.dataset, self.collate_fn, self.seed, None)
            task = self._sync_plan.next_task()
            with _rng_kept():  # the training process's own random streams stay untouched
                batch = self._sync_fetch.__getitems__(task)
            if hasattr(self.dataset, "release"):
                self.dataset.release(task.seq)
            return batch
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if self._error is not None:
                    raise self._error from None
                if not self._thread.is_alive():
                    raise DataError("data: the loader thread ended unexpectedly") from None

    def _report_bad(self, batch: LoadedBatch) -> None:
        fatal = self.options.on_bad_sample == "fatal"
        self.skipped += 0 if fatal else len(batch.bad)
        self.events.emit(ev.BAD_SAMPLE, count=len(batch.bad), action="fatal" if fatal else "skip",
                         skipped_total=self.skipped,
                         samples=[b.as_dict() for b in batch.bad[:MAX_BAD_IN_EVENT]])
        first = batch.bad[0]
        if fatal:
            more = f" (and {len(batch.bad) - 1} more in this batch)" if len(batch.bad) > 1 else ""
            raise DataError(f"data: {first.describe()}{more}; fix the data, or skip bad "
                            "samples with --data-on-bad-sample skip")
        logger.warning("skipped %d bad sample(s), %d so far; first: %s", len(batch.bad),
                       self.skipped, first.describe())

    def close(self) -> None:
        """Stops the loader thread and its workers; waits for them (bounded)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            with self._cond:
                self._cond.notify_all()
            with contextlib.suppress(queue.Empty):
                while True:  # unblock a put
                    self._queue.get_nowait()
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                logger.warning("the loader thread did not stop within 30 s")
            elif self._output is not None:  # its workers are gone with it
                self._output.close()
        if hasattr(self.dataset, "close"):
            self.dataset.close()

    def __enter__(self) -> ElasticLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the loader thread --------------------------------------------------------------------
    def _wait_for_plan(self, feed: _Feed) -> _Plan | None:
        """The feed's current plan, switched to a newer one when the trainer asked for it; None
        once the loader closes."""
        with self._cond:
            while self._pending_plan is None and feed.plan is None and not self._closed:
                self._cond.wait(timeout=1.0)
            if self._closed:
                return None
            if self._pending_plan is not None:
                feed.plan, self._pending_plan = self._pending_plan, None
                feed.replay.clear()  # tasks of the old plan: not worth re-issuing
            return feed.plan

    def _make_dataloader(self, feed: _Feed) -> DataLoader:
        o = self.options
        fetch = _Fetch(self.dataset, self.collate_fn, self.seed, self._shared_gen)
        return DataLoader(
            fetch, batch_sampler=feed, num_workers=o.num_workers,  # type: ignore[arg-type]
            prefetch_factor=o.prefetch_factor, pin_memory=o.pin_memory,
            # torch types collate_fn as taking a list of samples; with __getitems__ it gets
            # what that returns (a LoadedBatch)
            persistent_workers=False, collate_fn=_passthrough,  # type: ignore[arg-type]
            worker_init_fn=functools.partial(_worker_init, setup=self._worker_setup),
            # its own generator: creating the iterator must not draw from the global stream
            generator=torch.Generator().manual_seed(self.seed),
        )

    def _run(self) -> None:
        _forking.parent_pid = self._worker_setup.parent_pid
        feed = _Feed(self)
        losses_here = 0  # worker losses since the last delivered batch
        try:
            while not self._closed:
                it = iter(self._make_dataloader(feed))  # forks the workers
                try:
                    for batch in it:
                        losses_here = 0
                        feed.delivered(batch.seq)
                        if hasattr(self.dataset, "release"):
                            self.dataset.release(batch.seq)
                        if not self._deliver(batch):
                            return
                except (RuntimeError, ConnectionError, EOFError) as e:
                    # a dead worker shows as torch's "DataLoader worker ... exited", or, when
                    # it died after queueing a batch whose tensors travel as file descriptors
                    # (torch's file_descriptor sharing), as the reset of the connection that
                    # was to hand them over: a worker loss either way
                    if self._closed or (isinstance(e, RuntimeError)
                                        and "DataLoader worker" not in str(e)):
                        raise
                    losses_here += 1
                    self.worker_losses += 1
                    pending = [t.seq for t in feed.unacked]
                    error = " ".join(str(e).split())
                    gone = _dead_workers(getattr(it, "_workers", []))
                    if gone and not any(str(pid) in error for pid in gone):
                        # a reset connection names no worker: say which one(s) died
                        error += f" (worker pid {', '.join(map(str, gone))} gone)"
                    self.events.emit(ev.LOADER_WORKER_LOST, error=error,
                                     losses=self.worker_losses, redo_batches=len(pending))
                    logger.warning("a loader worker died (%s); new workers resume at the "
                                   "first batch not delivered", e)
                    if losses_here >= WORKER_LOSSES_PER_BATCH:
                        t = feed.unacked[0] if feed.unacked else None
                        what = f"samples {t.indices[:8]}" if t else "a batch"
                        raise DataError(f"data: loader workers died {losses_here} times while "
                                        f"loading {what}: a sample that kills the process?"
                                        ) from None
                    feed.rewind()
                finally:
                    del it  # its workers are shut down here, not whenever gc gets to it
        except BaseException as e:  # handed to the training thread, which raises it
            if not self._closed:
                self._error = e if isinstance(e, DataError) else DataError(
                    f"data: the loader failed: {' '.join(str(e).split())[:500]}")
                logger.error("loader failed: %s", e, exc_info=not isinstance(e, DataError))

    def _deliver(self, batch: LoadedBatch) -> bool:
        while not self._closed:
            if batch.stale or batch.gen != self._shared_gen.value:
                return True  # dropped: the trainer moved to a new plan
            try:
                self._queue.put(batch, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False


def _dead_workers(workers: list[Any], wait_s: float = 2.0) -> list[int]:
    """The pids of the loader workers that have ended. A killed worker's sockets close while
    it is still exiting, so the reset the loader sees can come before the process is reapable
    (`is_alive()` still True): wait on the workers' sentinels, which are ready once the
    process has closed its files, for up to `wait_s`."""
    ready = multiprocessing.connection.wait([w.sentinel for w in workers], timeout=wait_s)
    return [w.pid for w in workers if w.sentinel in ready]


@contextlib.contextmanager
def _rng_kept() -> Iterator[None]:
    """Loading in the training process seeds the generators per sample; put them back after,
    so dropout and the like draw the same numbers as they would without loading."""
    torch_state = torch.get_rng_state()
    py_state = random.getstate()
    try:
        import numpy as np

        np_state: Any = np.random.get_state()
    except ImportError:  # pragma: no cover
        np_state = None
    try:
        yield
    finally:
        torch.set_rng_state(torch_state)
        random.setstate(py_state)
        if np_state is not None:
            import numpy as np

            np.random.set_state(np_state)
