"""The exactly-once check the elastic tests rely on must itself catch lost and repeated work.

Synthetic samples.jsonl histories in the format of tests/scripts/elastic_job.py, built from the
real sampler: a clean run, a run with a rollback and a resize, and broken variants of it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hvd_resilient.state.sampler import ElasticDataSampler
from tests.support.exactly_once import assert_exactly_once

N = 64
BATCH = 4


class Recorder:
    """Plays elastic_job.py's loop: one line per rank before each step."""

    def __init__(self, run: Path) -> None:
        self.run, self.t, self.lines = run, 0.0, []
        self.sampler = ElasticDataSampler(N, seed=3)
        self.step = 0

    def steps(self, n: int, size: int, dead_rank: int | None = None) -> None:
        for _ in range(n):
            if self.sampler.epoch_done():
                self.sampler.set_epoch(self.sampler.epoch + 1)
            for r in range(size):
                if r == dead_rank:
                    continue
                self.t += 1
                sl = self.sampler.next_slice(r, size, BATCH)
                self.lines.append({"t": self.t, "step": self.step, "size": size, "rank": r,
                                   "epoch": self.sampler.epoch, "pos": self.sampler.consumed,
                                   "ids": sl.indices})
            self.sampler.advance(self.sampler.next_slice(0, size, BATCH).global_count)
            self.step += 1

    def snapshot(self) -> tuple[int, dict]:
        return self.step, self.sampler.state_dict()

    def restore(self, snap: tuple[int, dict]) -> None:
        self.step = snap[0]
        self.sampler.load_state_dict(snap[1])

    def write(self) -> Path:
        (self.run / "samples.jsonl").write_text("".join(json.dumps(x) + "\n" for x in self.lines))
        (self.run / "events.jsonl").write_text(
            json.dumps({"ts": self.t, "event": "done", "rank": 0, "size": 1,
                        "steps": self.step}) + "\n")
        return self.run


def rollback_run(tmp_path: Path, *, restore_sampler: bool = True) -> Recorder:
    rec = Recorder(tmp_path)
    rec.steps(5, size=4)
    commit = rec.snapshot()
    rec.steps(3, size=4)  # trained, then a rank died: undone
    if restore_sampler:
        rec.restore(commit)
    else:
        rec.step = commit[0]
    rec.steps(40, size=3)
    return rec


def test_a_rollback_and_a_resize_pass(tmp_path: Path) -> None:
    assert assert_exactly_once(rollback_run(tmp_path).write(), N) >= 2


def test_a_restore_that_forgets_the_sampler_fails(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="starts at epoch"):
        assert_exactly_once(rollback_run(tmp_path, restore_sampler=False).write(), N)


def test_a_rank_missing_from_a_kept_step_fails(tmp_path: Path) -> None:
    rec = Recorder(tmp_path)
    rec.steps(5, size=4)
    rec.steps(1, size=4, dead_rank=2)
    rec.steps(30, size=4)
    with pytest.raises(AssertionError, match="rank 2 has no record"):
        assert_exactly_once(rec.write(), N)


def test_a_repeated_sample_fails(tmp_path: Path) -> None:
    rec = Recorder(tmp_path)
    rec.steps(40, size=2)
    rec.lines[3]["ids"] = rec.lines[1]["ids"]
    with pytest.raises(AssertionError, match="exactly once"):
        assert_exactly_once(rec.write(), N)
