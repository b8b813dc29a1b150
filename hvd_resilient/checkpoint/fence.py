"""The run's fence in its checkpoint store: checkpoints of a job that was taken over are refused.

`hvd-resilient run` takes the run's lease (`run_lease.py`) with a new epoch and raises the fence
(`FENCE_KEY` at the checkpoint URL) to it before it starts its job; each worker checks it just
before it publishes a manifest, the write from which a checkpoint exists. An older epoch than
the fence's means another job now owns the run: the publish is refused (`CheckpointFencedError`)
and the worker stops itself. Kept in the store, not in the run folder, because the store is what
every writer on every host shares for certain.

Within one job the in-place backend numbers its worlds (generations: a fault or a join makes the
next one, `backends/inplace`). The fence also holds the newest generation that published: a
writer whose generation is older (a rank 0 cut off from the others, publishing after they went
on without it) is refused the same way. The mark is (epoch, generation), compared in that
order: a relaunch starts its generations again under a higher epoch.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hvd_resilient.checkpoint.errors import CheckpointError
from hvd_resilient.checkpoint.stores import CheckpointStore
from hvd_resilient.checkpoint.stores.base import StoreNotFoundError

FENCE_KEY = "fence.json"


class CheckpointFencedError(CheckpointError):
    """A publish under an epoch older than the run's fence (a newer job owns the run), or
    under a generation older than one that already published (the others went on without this
    writer)."""

    def __init__(self, epoch: int, fence: int, generation: int = 0,
                 fence_generation: int = 0) -> None:
        if fence > epoch:
            why = (f"this job's lease epoch {epoch} was taken over by epoch {fence}: another "
                   "launch owns the run now, so this job's checkpoints are refused")
        else:
            why = (f"this writer's generation {generation} is older than generation "
                   f"{fence_generation}, which published already: the others went on without "
                   "it, so its checkpoints are refused")
        super().__init__(why)
        self.epoch, self.fence = epoch, fence


def read_mark(store: CheckpointStore) -> tuple[int, int]:
    """The fence's (epoch, generation) ((0, 0): none was set)."""
    try:
        raw = json.loads(bytes(store.get(FENCE_KEY)))
    except (StoreNotFoundError, ValueError):  # never set, or not ours to read
        return 0, 0
    if not isinstance(raw, dict):
        return 0, 0
    return int(raw.get("epoch", 0)), int(raw.get("generation", 0))


def read_fence(store: CheckpointStore) -> int:
    """The fence's epoch (0: none was set)."""
    return read_mark(store)[0]


def raise_fence(store: CheckpointStore, epoch: int) -> None:
    """Sets the fence to `epoch` unless it is already there or higher. A read, then a write:
    not atomic. Two launches that took the run within milliseconds of each other could, in the
    worst interleaving, leave the older epoch; the older job still stops within a second
    (its lease watch or renewal sees the newer epoch), so this bounds, not prevents, what it
    could publish in that window. A store with conditional writes could close it."""
    if read_fence(store) < epoch:
        store.put(FENCE_KEY, json.dumps({"epoch": epoch, "generation": 0}).encode())


def check_fence(store: CheckpointStore, epoch: int) -> None:
    """Raises `CheckpointFencedError` when a newer epoch owns the run."""
    fence = read_fence(store)
    if fence > epoch:
        raise CheckpointFencedError(epoch, fence)


def fenced(store_of: Callable[[], CheckpointStore], epoch: int,
           then: Callable[[int], None] | None,
           generation: Callable[[], int] | None = None) -> Callable[[int], None]:
    """A manager's `before_publish` that checks the fence first, then calls `then`.

    ``epoch`` 0 (a launch without a lease) checks no epoch; ``generation`` (the backend's
    world number, where it numbers them) is checked too, and the first publish of a newer
    generation raises the mark to it, from which on the older generations' writers are
    refused. A read, then a write, as `raise_fence`: the window it leaves is the one between
    two publishes of different generations within milliseconds."""
    def hook(step: int) -> None:
        store = store_of()
        g = generation() if generation is not None else 0
        mark_epoch, mark_generation = read_mark(store)
        mine = epoch or mark_epoch
        if (mark_epoch, mark_generation) > (mine, g):
            raise CheckpointFencedError(mine, mark_epoch, g, mark_generation)
        if g > mark_generation or mine > mark_epoch:
            store.put(FENCE_KEY, json.dumps({"epoch": mine, "generation": g}).encode())
        if then is not None:
            then(step)
    return hook
