"""A drop-in for `torch.utils.data.DistributedSampler` that follows the live Horovod world.

Why: torch's sampler is built once with ``num_replicas=hvd.size(), rank=hvd.rank()`` and keeps
those numbers for good. After an elastic resize the ranks then disagree on the length of an
epoch (a newcomer built for 4 ranks has fewer batches than the old ranks built for 3), the
shortest finishes first, and every rank blocks in mismatched collectives for ever (Horovod's
own `pytorch_mnist_elastic.py` does exactly this after a host is added). Horovod's
`ElasticSampler` re-partitions, but only if the script calls `record_batch` and drops the
`DistributedSampler` arguments.

This one takes torch's constructor unchanged (``num_replicas`` and ``rank`` are read only when
Horovod is not running) and partitions the epoch's *remaining* samples over ``hvd.size()`` /
``hvd.rank()`` each time an epoch pass starts, so every rank's pass has the same number of
samples (padded at the end as torch pads) and, registered with the state
(``ElasticState(..., sampler=s)``), each sample of an epoch is used once across commits,
restores and resizes. In a fixed world and a fresh epoch it yields exactly what torch's
sampler yields (same permutation, same padding, same split), so porting changes no result.

The position is counted, not declared: each index handed out in the current pass counts as
consumed at the next commit. That is exact when the DataLoader asks for indices one batch at a
time (``num_workers=0``); loader workers prefetch, so with them call
``sampler.record_batch(batch_idx, batch_size)`` before each commit (Horovod's
`ElasticSampler` API), and the sampler counts what was recorded instead.

``len()`` is the samples this rank has taken in the epoch so far plus its share of the rest,
so a loop written as Horovod's example (``steps_remaining = len(loader) - state.batch``, then
``enumerate(loader)`` from the start) never stops before the partition runs out; the partition,
not the loop's arithmetic, decides which samples a pass sees.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler


def _live_world() -> tuple[int, int] | None:
    """(size, rank) of the running Horovod world; None before `hvd.init()` or without it."""
    try:
        import horovod.torch as hvd

        return int(hvd.size()), int(hvd.rank())
    except (ImportError, ValueError):  # Horovod absent, or not initialized
        return None


class DistributedSampler(Sampler[int]):
    """`torch.utils.data.DistributedSampler`'s constructor, `set_epoch` and `len`, over the
    live world (see the module doc). The state dict is ``epoch``, ``consumed`` (samples of the
    epoch's permutation used by all ranks) and ``taken`` (this pass's per-rank count before
    the commit, which keeps `len` stable for the loop that resumes)."""

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is not None and num_replicas < 1:
            raise ValueError(f"DistributedSampler: num_replicas must be >= 1, got {num_replicas}")
        if rank is not None and num_replicas is not None and not 0 <= rank < num_replicas:
            raise ValueError(f"DistributedSampler: rank must be in [0, {num_replicas - 1}], "
                             f"got {rank}")
        self.dataset = dataset
        self._given = (num_replicas or 1, rank or 0)
        """Used only where no Horovod world runs (a single process, a unit test)."""
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._base = 0  # samples of the epoch consumed before the current pass
        self._offset = 0  # this rank's samples taken in earlier passes of the epoch
        self._taken = 0  # this rank's samples handed out in the current pass
        self._recorded: int | None = None  # record_batch's count in this pass, when used
        self._pass_size = 1  # the world size the current pass was partitioned for
        self._pass = 0  # a stale iterator (from before a reset) must not count
        self._ran_out = False
        """The last pass of this epoch was iterated to its end (torch's StopIteration): only
        then does a new pass of a used-up epoch repeat it, as torch's sampler repeats an epoch
        when `set_epoch` is not called. A pass cut short by a reset or restore exactly at the
        epoch's last sample is empty instead: the epoch's samples were all used."""

    # -- torch's interface -----------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return self.world()[0]

    @property
    def rank(self) -> int:
        return self.world()[1]

    def world(self) -> tuple[int, int]:
        return _live_world() or self._given

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts from its first sample; the same epoch again (a loop that calls
        it after every reset, as Horovod's example does) keeps the position."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._start_epoch()

    def __len__(self) -> int:
        size, _ = self.world()
        return self._offset + self._taken_so_far() + self._share(self._remaining(), size)

    def __iter__(self) -> Iterator[int]:
        self.reset()
        size, rank = self.world()
        rest = self._order()[self._base:]
        if not rest and self._ran_out:  # used up, and no set_epoch came: torch repeats it
            self._start_epoch()
            rest = self._order()
        # (used up by a pass a reset cut short: an empty pass. Horovod's example then reenters
        # the epoch with `state.batch` at its last batch and would train a repeat of the
        # epoch's first batch, samples used twice.)
        share = self._share(len(rest), size)
        if self.drop_last:
            rest = rest[:share * size]
        else:
            rest += (rest * math.ceil(share * size / max(1, len(rest))))[:share * size - len(rest)]
        self._pass += 1
        self._pass_size = size
        return self._count(rest[rank::size], self._pass)

    # -- Horovod's ElasticSampler interface ------------------------------------------------
    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Declares ``batch_size`` more samples of this pass used (for loaders that prefetch);
        once called in a pass, only recorded samples count as consumed."""
        self._recorded = (self._recorded or 0) + batch_size

    def reset(self) -> None:
        """Closes the current pass: what it took becomes consumed, and the next pass is
        partitioned for the world as it is then (the state calls it after every sync)."""
        taken = self._taken_so_far()
        if taken:
            self._base = min(len(self.dataset), self._base + taken * self._pass_size)
            self._offset += taken
        self._taken, self._recorded = 0, None
        self._pass += 1

    def state_dict(self) -> dict[str, Any]:
        taken = self._taken_so_far()
        return {"epoch": self.epoch, "seed": self.seed,
                "consumed": min(len(self.dataset), self._base + taken * self._pass_size),
                "taken": self._offset + taken}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.seed = int(sd["epoch"]), int(sd.get("seed", self.seed))
        self._base, self._offset = int(sd["consumed"]), int(sd["taken"])
        self._taken, self._recorded = 0, None
        self._ran_out = False
        self._pass += 1

    # -- the parts ---------------------------------------------------------------------------
    def _start_epoch(self) -> None:
        self._base = self._offset = self._taken = 0
        self._recorded = None
        self._ran_out = False
        self._pass += 1

    def _taken_so_far(self) -> int:
        return self._taken if self._recorded is None else min(self._recorded, self._taken)

    def _remaining(self) -> int:
        return len(self.dataset) - min(len(self.dataset),
                                       self._base + self._taken_so_far() * self._pass_size)

    def _share(self, n: int, size: int) -> int:
        return n // size if self.drop_last else math.ceil(n / size)

    def _order(self) -> list[int]:
        """The epoch's permutation, as torch's DistributedSampler draws it."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _count(self, mine: list[int], pass_id: int) -> Iterator[int]:
        for i in mine:
            if pass_id == self._pass:
                self._taken += 1
            yield i
        if pass_id == self._pass:
            self._ran_out = True
