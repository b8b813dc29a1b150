"""Exact-once data order that survives resets and world-size changes.

Horovod's ElasticSampler pads the last shard (repeating samples) and tracks a set of every
processed index, which grows with the data set and is unioned by an allgather on every sync.
Here the whole state is two integers: the epoch and how many samples of that epoch's global
permutation have been consumed. Every rank derives the same permutation from (seed, epoch), and
each step takes the next `world_size * batch_size` samples, split as evenly as possible across
the ranks alive *at that step*. A reset just broadcasts the two integers, and no sample of an
epoch is skipped or repeated whatever the sizes were.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepSlice:
    """What one rank trains on in one step, and how big the step is globally."""

    indices: list[int]
    global_count: int


class ElasticDataSampler:
    """Deterministic, reshardable, exact-once sampler over `num_samples` items."""

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if num_samples <= 0:
            raise ValueError(f"the data set is empty (num_samples={num_samples})")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.consumed = 0
        self._perm: list[int] | None = None
        self._perm_epoch = -1

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed, "num_samples": self.num_samples}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if int(sd.get("num_samples", self.num_samples)) != self.num_samples:
            raise ValueError(
                f"sampler state is for {sd['num_samples']} samples but the data set has "
                f"{self.num_samples}; resume with the same data set"
            )
        self.epoch = int(sd["epoch"])
        self.consumed = int(sd["consumed"])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.consumed = 0

    # -- order --------------------------------------------------------------------------
    def permutation(self) -> list[int]:
        if self._perm is None or self._perm_epoch != self.epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed * 1_000_003 + self.epoch)
                self._perm = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                self._perm = list(range(self.num_samples))
            self._perm_epoch = self.epoch
        return self._perm

    def remaining(self) -> int:
        return self.num_samples - self.consumed

    def epoch_done(self) -> bool:
        return self.consumed >= self.num_samples

    def next_slice(self, rank: int, world_size: int, batch_size: int) -> StepSlice:
        """The indices `rank` trains on in the next step; does not advance (see `advance`)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        count = min(world_size * batch_size, self.remaining())
        base, extra = divmod(count, world_size)
        start = self.consumed + rank * base + min(rank, extra)
        n = base + (1 if rank < extra else 0)
        return StepSlice(self.permutation()[start : start + n], count)

    def advance(self, global_count: int) -> None:
        self.consumed = min(self.num_samples, self.consumed + global_count)

    def steps_left(self, world_size: int, batch_size: int) -> int:
        per = world_size * batch_size
        return -(-self.remaining() // per)
