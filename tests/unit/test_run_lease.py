"""The run's lease and the checkpoint store's fence (`run_lease.py`, `checkpoint/fence.py`)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from hvd_resilient.checkpoint.fence import (
    CheckpointFencedError,
    fenced,
    raise_fence,
    read_fence,
    read_mark,
)
from hvd_resilient.checkpoint.manager import CheckpointManager
from hvd_resilient.run_lease import TTL_S, LeaseHeldError, LeaseLostError, RunLease


def test_epochs_rise_and_a_live_holder_is_waited_for_or_taken_over(tmp_path):
    first = RunLease(tmp_path, "a")
    assert first.acquire(wait_s=0, take_over=False) is None and first.epoch == 1
    second = RunLease(tmp_path, "b")
    told = []
    with pytest.raises(LeaseHeldError, match="held by a live job"):
        second.acquire(wait_s=0.3, take_over=False, on_wait=told.append)
    assert len(told) == 1 and told[0].epoch == 1
    old = second.acquire(wait_s=0, take_over=True)
    assert old is not None and old.token == "a" and second.epoch == 2
    with pytest.raises(LeaseLostError, match="taken over"):
        first.renew()
    second.renew()


def test_a_lapsed_released_or_dead_holders_lease_is_free_at_once(tmp_path):
    now = [1000.0]
    lapsed = RunLease(tmp_path, "a", clock=lambda: now[0])
    lapsed.acquire(wait_s=0, take_over=False)
    now[0] += TTL_S + 0.1
    assert RunLease(tmp_path, "b", clock=lambda: now[0]).acquire(wait_s=0, take_over=False)
    released = RunLease(tmp_path / "r", "a")
    released.acquire(wait_s=0, take_over=False)
    released.release()
    assert RunLease(tmp_path / "r", "b").acquire(wait_s=0, take_over=False).released
    # a supervisor of this machine that died: its pid no longer names it, whatever the time
    code = ("import sys; from hvd_resilient.run_lease import RunLease; "
            "RunLease(sys.argv[1], 'dead').acquire(wait_s=0, take_over=False)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "d")], check=True, timeout=60)
    t0 = time.monotonic()
    old = RunLease(tmp_path / "d", "b").acquire(wait_s=30, take_over=False)
    assert old is not None and old.token == "dead" and time.monotonic() - t0 < 1.0


def test_the_store_refuses_a_checkpoint_of_a_displaced_epoch(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    mgr = CheckpointManager(url)
    mgr.before_publish = fenced(lambda: mgr.store, 1, None)
    raise_fence(mgr.store, 1)
    mgr.save(10, 0, 1, {"state.pt": b"x"})
    raise_fence(mgr.store, 2)
    raise_fence(mgr.store, 1)  # never lowered
    assert read_fence(mgr.store) == 2
    with pytest.raises(CheckpointFencedError, match="taken over by epoch 2"):
        mgr.save(20, 0, 1, {"state.pt": b"y"})
    assert [c.step for c in CheckpointManager(url).scan().checkpoints] == [10]


def test_the_processes_of_one_job_share_its_epoch_and_a_dead_jobs_name_is_not_joined(tmp_path):
    now = [1000.0]
    first = RunLease(tmp_path, "torchrun:r:h:29400", clock=lambda: now[0])
    assert first.join_or_take(wait_s=0) is None and first.epoch == 1
    node = RunLease(tmp_path, "torchrun:r:h:29400", clock=lambda: now[0])
    assert node.join_or_take(wait_s=0) is None and node.epoch == 1
    with pytest.raises(LeaseHeldError):  # another job waits, as it would for any live holder
        RunLease(tmp_path, "torchrun:other", clock=lambda: now[0]).join_or_take(wait_s=0)
    now[0] += TTL_S + 0.1  # the job died: the same name relaunched is a new epoch
    again = RunLease(tmp_path, "torchrun:r:h:29400", clock=lambda: now[0])
    assert again.join_or_take(wait_s=0) is not None and again.epoch == 2


def test_a_writer_of_an_older_generation_is_refused_once_a_newer_one_published(tmp_path):
    """In place: a rank 0 cut off from the others (generation 3) must not publish after the
    others' rank 0 published in the generation that went on without it (4); a relaunch (a
    higher epoch, its generations from 0 again) is not held back by them."""
    url = f"file://{tmp_path}/ckpt"

    def writer(epoch: int, generation: int) -> CheckpointManager:
        mgr = CheckpointManager(url)
        mgr.before_publish = fenced(lambda: mgr.store, epoch, None, generation=lambda: generation)
        return mgr

    old, new = writer(0, 3), writer(0, 4)
    old.save(10, 0, 3, {"state.pt": b"a"})
    assert read_mark(old.store) == (0, 3)
    new.save(20, 0, 2, {"state.pt": b"b"})
    with pytest.raises(CheckpointFencedError, match="generation 3 is older than generation 4"):
        old.save(30, 0, 3, {"state.pt": b"c"})
    writer(1, 0).save(40, 0, 2, {"state.pt": b"d"})
    assert read_mark(new.store) == (1, 0)
    assert [c.step for c in CheckpointManager(url).scan().checkpoints] == [10, 20, 40]
