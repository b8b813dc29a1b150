"""When the state's durable checkpoint counts as owed after a sync (`DurableCheckpoints._owed`):
a save lost with rank 0 must be redone by the next rank 0, whichever commit the survivors
restored, and never twice by the rank 0 that is still uploading it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hvd_resilient.training.durable import DurableCheckpoints


class Backend:
    def __init__(self, rank: int, root_holds: bool) -> None:
        self._rank, self.root_holds, self.gathers = rank, root_holds, 0

    def rank(self) -> int:
        return self._rank

    def allgather_object(self, obj: bool) -> list[bool]:
        self.gathers += 1
        return [obj if self._rank == 0 else self.root_holds]  # rank 0's answer first


class Writer:
    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def holds(self, step: int) -> bool:
        return step in self.steps


def owed(step: int, published: int, requested: int, *, rank: int = 1,
         root_holds: bool = False, every: int = 10) -> tuple[bool, int]:
    backend = Backend(rank, root_holds)
    me = SimpleNamespace(
        config=SimpleNamespace(checkpoint=SimpleNamespace(every=every)),
        state=SimpleNamespace(step=step, ckpt_published=published, ckpt_requested=requested),
        backend=backend,
        _writer=Writer({step} if root_holds else set()) if rank == 0 else None,
    )
    return DurableCheckpoints._owed(me), backend.gathers


def test_a_commit_taken_after_the_lost_save_was_requested_still_owes_it():
    """The epoch's end commits right after a checkpoint step: that commit says "requested",
    and the rank 0 that was uploading it died. The CI failure: step 30 never redone."""
    assert owed(30, 20, 30, rank=0) == (True, 1)
    assert owed(30, 20, 30, rank=1, root_holds=False) == (True, 1)


def test_the_rank_0_still_uploading_it_is_not_asked_to_save_it_again():
    assert owed(30, 20, 30, rank=0, root_holds=True) == (False, 1)
    assert owed(30, 20, 30, rank=1, root_holds=True) == (False, 1)


@pytest.mark.parametrize("step,published,requested,expected", [
    (30, 20, 20, True),   # the survivors restored the commit before the save
    (35, 20, 20, True),   # a save skipped (a host change interrupted its commit)
    (30, 30, 30, False),  # published
    (25, 20, 20, False),  # less than an interval behind
    (0, -1, -1, False),   # a fresh start
])
def test_no_collective_where_the_synced_state_decides(step, published, requested, expected):
    assert owed(step, published, requested) == (expected, 0)


def test_no_interval_nothing_is_owed():
    assert owed(30, -1, -1, every=0) == (False, 0)
