"""The run's fence in its checkpoint store: checkpoints of a job that was taken over are refused.

`hvd-resilient run` takes the run's lease (`run_lease.py`) with a new epoch and raises the fence
(`FENCE_KEY` at the checkpoint URL) to it before it starts its job; each worker checks it just
before it publishes a manifest, the write from which a checkpoint exists. An older epoch than
the fence's means another job now owns the run: the publish is refused (`CheckpointFencedError`)
and the worker stops itself. Kept in the store, not in the run folder, because the store is what
every writer on every host shares for certain.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from hvd_resilient.checkpoint.errors import CheckpointError
from hvd_resilient.checkpoint.stores import CheckpointStore
from hvd_resilient.checkpoint.stores.base import StoreNotFoundError

FENCE_KEY = "fence.json"


class CheckpointFencedError(CheckpointError):
    """A publish under an epoch older than the run's fence: a newer job owns the run."""

    def __init__(self, epoch: int, fence: int) -> None:
        super().__init__(f"this job's lease epoch {epoch} was taken over by epoch {fence}: "
                         "another launch owns the run now, so this job's checkpoints are refused")
        self.epoch, self.fence = epoch, fence


def read_fence(store: CheckpointStore) -> int:
    """The fence's epoch (0: none was set)."""
    try:
        raw = json.loads(bytes(store.get(FENCE_KEY)))
    except (StoreNotFoundError, ValueError):  # never set, or not ours to read
        return 0
    return int(raw.get("epoch", 0)) if isinstance(raw, dict) else 0


def raise_fence(store: CheckpointStore, epoch: int) -> None:
    """Sets the fence to `epoch` unless it is already there or higher. A read, then a write:
    not atomic. Two launches that took the run within milliseconds of each other could, in the
    worst interleaving, leave the older epoch; the older job still stops within a second
    (its lease watch or renewal sees the newer epoch), so this bounds, not prevents, what it
    could publish in that window. A store with conditional writes could close it."""
    if read_fence(store) < epoch:
        store.put(FENCE_KEY, json.dumps({"epoch": epoch}).encode())


def check_fence(store: CheckpointStore, epoch: int) -> None:
    """Raises `CheckpointFencedError` when a newer epoch owns the run."""
    fence = read_fence(store)
    if fence > epoch:
        raise CheckpointFencedError(epoch, fence)


def fenced(store_of: Callable[[], CheckpointStore], epoch: int,
           then: Callable[[int], None] | None) -> Callable[[int], None]:
    """A manager's `before_publish` that checks the fence first, then calls `then`."""
    def hook(step: int) -> None:
        check_fence(store_of(), epoch)
        if then is not None:
            then(step)
    return hook
