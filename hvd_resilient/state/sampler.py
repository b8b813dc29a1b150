"""Exact-once data order that survives resets and world-size changes.

Horovod's ElasticSampler pads the last shard (repeating samples) and tracks a set of every
processed index, which grows with the data set and is unioned by an allgather on every sync.
Here the whole state is two integers: the epoch and how many samples of that epoch's global
permutation have been consumed. Every rank derives the same permutation from (seed, epoch), and
each step takes the next `world_size * batch_size` samples, split as evenly as possible across
the ranks alive *at that step*. A reset just broadcasts the two integers, and no sample of an
epoch is skipped or repeated whatever the sizes were.

Beside the position, both samplers keep a tally of the epoch in progress: how many ids `advance`
has moved past and their order-independent digest (`ids_digest.py`). It is part of the state
dict, so a commit, a reset's broadcast and a durable checkpoint carry it with the position, and
after a restore it covers exactly what the restored position says was consumed. At the epoch's
end the trainer writes it in an `epoch_end` event (`epoch_record`), next to what the data set
expects, and `hvd-resilient report` checks that each id was used exactly once.

Streamed shards need another split (`ElasticShardSampler`): a rank should read whole shards,
not every shard's every W-th sample, or each rank downloads everything. Both samplers share one
interface (`next_slice`, `advance`, `epoch_done`, `set_epoch`, `position`, `state_dict`,
`epoch_record`), so the trainer, the state handlers and the loader (`hvd_resilient.data.loader`)
treat them alike.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from hvd_resilient.state.ids_digest import MASK, METHOD, digest_array, digest_range, to_hex


@dataclass
class StepSlice:
    """What one rank trains on in one step, and how big the step is globally."""

    indices: list[int]
    global_count: int


class StepSampler(Protocol):
    """The interface both samplers share (module doc): what the trainer's loop and the loader
    (`hvd_resilient.data.loader`) call on the training state's sampler, so that either one (or a
    data set's own, `make_sampler`) fits. The tally (`epoch_record`, `track_ids`) is left out:
    its callers look it up where it exists."""

    epoch: int

    def position(self) -> Hashable:
        """Equal on two samplers iff their next steps are equal."""

    def next_slice(self, rank: int, world_size: int, batch_size: int) -> StepSlice:
        """What ``rank`` trains on in the next step; does not advance."""

    def advance(self, global_count: int) -> None:
        """Moves past the step just planned, ``global_count`` samples of the whole world."""

    def epoch_done(self) -> bool: ...

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


class _IdsTally:
    """The consumed ids of the epoch in progress, as a count and a digest (`ids_digest`).

    Both None: unknown for the rest of this epoch (the state was restored from a checkpoint
    written before the tally existed, mid-epoch); the next epoch counts again. The loader's
    planning copies of a sampler turn `track_ids` off: they run ahead and are never committed.
    """

    epoch: int
    num_samples: int
    track_ids = True
    ids_count: int | None = 0
    ids_digest: int | None = 0
    _expected: tuple[int, int] | None = None

    def _reset_ids(self) -> None:
        self.ids_count, self.ids_digest = 0, 0

    def _count_ids(self, ids: Any) -> None:
        """Adds the ids (a list or a numpy array) the whole world consumed in one step."""
        if not self.track_ids or self.ids_count is None or self.ids_digest is None:
            return
        self.ids_count += len(ids)
        self.ids_digest = (self.ids_digest + digest_array(ids)) & MASK

    def _ids_state(self) -> dict[str, int | None]:
        return {"ids_count": self.ids_count, "ids_digest": self.ids_digest}

    def _load_ids_state(self, sd: dict[str, Any], consumed: int) -> None:
        count, digest = sd.get("ids_count"), sd.get("ids_digest")
        if count is not None and digest is not None:
            self.ids_count, self.ids_digest = int(count), int(digest)
        elif consumed == 0:  # an older state at an epoch's start: nothing consumed yet
            self._reset_ids()
        else:
            self.ids_count = self.ids_digest = None

    def expected_ids(self) -> tuple[int, int]:
        """(count, digest) of the ids a whole epoch consumes: every id 0 .. N-1 once (neither
        sampler drops or pads). Computed once (about 10 ms per million samples)."""
        if self._expected is None:
            self._expected = (self.num_samples, digest_range(0, self.num_samples))
        return self._expected

    def epoch_record(self) -> dict[str, Any]:
        """The fields of the `epoch_end` event for the epoch in progress (docs/data.md):
        `epoch`, `samples` and `ids_digest` (what it consumed, all ranks together, across every
        reset; None when unknown), `expected_samples` and `expected_ids_digest` (the data set),
        `digest` (the method, `ids_digest.METHOD`). Digests are 16 hex digits."""
        n, expected = self.expected_ids()
        return {"epoch": self.epoch, "samples": self.ids_count,
                "ids_digest": None if self.ids_digest is None else to_hex(self.ids_digest),
                "expected_samples": n, "expected_ids_digest": to_hex(expected),
                "digest": METHOD}


class ElasticDataSampler(_IdsTally):
    """Deterministic, reshardable, exact-once sampler over `num_samples` items."""

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if num_samples <= 0:
            raise ValueError(f"the data set is empty (num_samples={num_samples})")
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.consumed = 0
        self._reset_ids()
        self._perm: list[int] | None = None
        self._perm_epoch = -1

    # -- state --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "num_samples": self.num_samples,
                **self._ids_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if int(sd.get("num_samples", self.num_samples)) != self.num_samples:
            raise ValueError(
                f"sampler state is for {sd['num_samples']} samples but the data set has "
                f"{self.num_samples}; resume with the same data set"
            )
        self.epoch = int(sd["epoch"])
        self.consumed = int(sd["consumed"])
        self._load_ids_state(sd, self.consumed)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.consumed = 0
        self._reset_ids()

    def position(self) -> Hashable:
        """Where the data order stands: equal on two samplers iff their next steps are equal
        (the loader keys prefetched batches by it)."""
        return (self.epoch, self.consumed)

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
        end = min(self.num_samples, self.consumed + global_count)
        if self.track_ids:
            self._count_ids(self.permutation()[self.consumed:end])
        self.consumed = end


@dataclass
class _ShardStep:
    """One step of an `ElasticShardSampler` for every rank: the segments each rank reads and
    the state the sampler is in afterwards."""

    segments: list[list[tuple[int, int, int]]]
    """Per rank: (shard, first offset, end offset) ranges, in reading order."""
    global_count: int
    after: dict[str, Any]


class ElasticShardSampler(_IdsTally):
    """Exact-once order over samples stored in shards, each rank reading whole shards.

    Each rank owns a *slot*: a cursor (shard, offset) into the shard it is reading. A step gives
    slot r the next `batch_size` samples of its cursor; a cursor that runs out mid-batch is
    refilled from the supply: first the partly read shards that lost their slot when the world
    shrank (`parked`), then the next unopened shard of the epoch's shard order. Every rank knows
    every shard's size, so every rank computes every slot's cursor and they all agree on the
    state without exchanging a byte; a reset broadcasts rank 0's state like any other.

    When the world grows, the new slots start on unopened (or parked) shards; when it shrinks,
    the cursors of the slots that went away are parked and finished later by whoever needs
    more. No sample of an epoch is read twice or skipped, whatever the sizes were; the order
    depends on the sizes (unlike `ElasticDataSampler`), which exact-once does not need.

    A sample's id is `start[shard] + k` (k: its place in the shard), so ids run over 0..N-1
    like a map-style data set's indices; with `shuffle` the shard order and the order inside
    each shard are permuted per (seed, epoch).
    """

    def __init__(self, shard_sizes: Sequence[int], *, shuffle: bool = True,
                 seed: int = 0) -> None:
        sizes = [int(n) for n in shard_sizes]
        if not sizes or any(n < 0 for n in sizes) or sum(sizes) == 0:
            raise ValueError(f"the shards hold no samples (sizes {sizes[:8]}...)")
        self.shard_sizes = sizes
        self.num_samples = sum(sizes)
        self.starts = [0] * len(sizes)
        for i in range(1, len(sizes)):
            self.starts[i] = self.starts[i - 1] + sizes[i - 1]
        self.shuffle = shuffle
        self.seed = seed
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}
        # ((position, world_size, batch_size), the step planned there)
        self._step_cache: tuple[tuple[Hashable, int, int], _ShardStep] | None = None
        self.set_epoch(0)

    # -- state --------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.consumed = 0
        self.next_open = 0
        self.slots: list[tuple[int, int] | None] = []
        self.parked: list[tuple[int, int]] = []
        self._order: list[int] | None = None
        self._reset_ids()

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "next_open": self.next_open,
                "slots": [list(c) if c else None for c in self.slots],
                "parked": [list(c) for c in self.parked],
                "num_samples": self.num_samples, "num_shards": len(self.shard_sizes),
                **self._ids_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if "slots" not in sd:
            raise ValueError("sampler state is not a shard sampler's; resume with the same "
                             "kind of data set (streamed shards)")
        if (int(sd["num_samples"]), int(sd["num_shards"])) != (self.num_samples,
                                                               len(self.shard_sizes)):
            raise ValueError(
                f"sampler state is for {sd['num_samples']} samples in {sd['num_shards']} "
                f"shards but the data set has {self.num_samples} in {len(self.shard_sizes)}; "
                "resume with the same shards")
        self.set_epoch(int(sd["epoch"]))
        self.consumed = int(sd["consumed"])
        self.next_open = int(sd["next_open"])
        self.slots = [(int(c[0]), int(c[1])) if c else None for c in sd["slots"]]
        self.parked = [(int(c[0]), int(c[1])) for c in sd["parked"]]
        self._load_ids_state(sd, self.consumed)

    def position(self) -> Hashable:
        return (self.epoch, self.consumed, self.next_open, tuple(self.slots),
                tuple(self.parked))

    # -- order --------------------------------------------------------------------------
    def shard_order(self) -> list[int]:
        if self._order is None:
            n = len(self.shard_sizes)
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed * 1_000_003 + self.epoch)
                self._order = torch.randperm(n, generator=g).tolist()
            else:
                self._order = list(range(n))
        return self._order

    def _in_shard(self, shard: int) -> np.ndarray | None:
        """The order of samples inside `shard` this epoch (None: as stored), as int64.

        Every rank tallies every rank's ids (`_step_ids`), so a step reads the orders of all
        the slots' shards, not only its own: the cache keeps at least those (8 bytes a sample
        of each shard being read)."""
        if not self.shuffle:
            return None
        key = (self.epoch, shard)
        perm = self._perm_cache.get(key)
        if perm is None:
            if len(self._perm_cache) > max(64, 4 * (len(self.slots) + len(self.parked))):
                self._perm_cache.clear()
            g = torch.Generator()
            g.manual_seed((self.seed * 1_000_003 + self.epoch) * 65_537 + shard)
            perm = self._perm_cache[key] = torch.randperm(self.shard_sizes[shard],
                                                          generator=g).numpy()
        return perm

    def remaining(self) -> int:
        return self.num_samples - self.consumed

    def epoch_done(self) -> bool:
        return self.consumed >= self.num_samples

    def _step(self, world_size: int, batch_size: int) -> _ShardStep:
        key = (self.position(), world_size, batch_size)
        if self._step_cache is not None and self._step_cache[0] == key:
            return self._step_cache[1]
        order = self.shard_order()
        slots = list(self.slots)
        parked = list(self.parked)
        next_open = self.next_open
        if len(slots) > world_size:  # the world shrank: finish those shards later
            parked.extend(c for c in slots[world_size:] if c is not None)
            del slots[world_size:]
        slots.extend([None] * (world_size - len(slots)))
        segments: list[list[tuple[int, int, int]]] = []
        total = 0
        for r in range(world_size):
            mine: list[tuple[int, int, int]] = []
            want = batch_size
            while want > 0:
                cur = slots[r]
                if cur is None:
                    if parked:
                        cur = parked.pop(0)
                    elif next_open < len(order):
                        cur = (order[next_open], 0)
                        next_open += 1
                    else:
                        break
                shard, off = cur
                take = min(want, self.shard_sizes[shard] - off)
                if take > 0:
                    mine.append((shard, off, off + take))
                want -= take
                off += take
                slots[r] = (shard, off) if off < self.shard_sizes[shard] else None
            total += batch_size - want
            segments.append(mine)
        after = {"consumed": self.consumed + total, "next_open": next_open,
                 "slots": slots, "parked": parked}
        step = _ShardStep(segments, total, after)
        self._step_cache = (key, step)
        return step

    def next_slice(self, rank: int, world_size: int, batch_size: int) -> StepSlice:
        """The sample ids `rank` trains on in the next step; does not advance (`advance`)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        step = self._step(world_size, batch_size)
        ids: list[int] = []
        for shard, a, b in step.segments[rank]:
            perm = self._in_shard(shard)
            base = self.starts[shard]
            ids.extend((perm[a:b] + base).tolist() if perm is not None
                       else range(base + a, base + b))
        return StepSlice(ids, step.global_count)

    def advance(self, global_count: int) -> None:
        """Applies the step last planned by `next_slice` (every rank plans the same one)."""
        if self._step_cache is None or self._step_cache[0][0] != self.position():
            raise RuntimeError("advance() without next_slice() at this position")
        step = self._step_cache[1]
        if global_count != step.global_count:
            raise ValueError(f"advance({global_count}) but the planned step takes "
                             f"{step.global_count} samples")
        if self.track_ids:
            self._count_ids(self._step_ids(step))
        a = step.after
        self.consumed, self.next_open = a["consumed"], a["next_open"]
        self.slots, self.parked = list(a["slots"]), list(a["parked"])

    def _step_ids(self, step: _ShardStep) -> Any:
        """Every id the step gives any rank, as one numpy array (for the tally)."""
        parts = []
        for segments in step.segments:
            for shard, a, b in segments:
                perm = self._in_shard(shard)
                local = perm[a:b] if perm is not None else np.arange(a, b, dtype=np.int64)
                parts.append(local + self.starts[shard])
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
