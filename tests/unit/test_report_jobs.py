"""`hvd-resilient report` tells the jobs of one run apart by their lease epoch."""

from __future__ import annotations

from hvd_resilient.report.analysis import analyze
from hvd_resilient.report.text import render


def _run(second_starts: float) -> list[dict]:
    evs = [{"ts": 100.0, "event": "lease_taken", "rank": -1, "size": 0, "step": 0,
            "lease_epoch": 1}]
    evs += [{"ts": 101.0 + i, "event": "commit", "rank": 0, "size": 2, "step": 5 * i,
             "lease_epoch": 1} for i in range(5)]
    evs += [{"ts": second_starts + i, "event": "commit", "rank": 0, "size": 2,
             "step": 5 * i, "lease_epoch": 2} for i in range(5)]
    return evs


def test_jobs_one_at_a_time_are_one_line_and_no_problem():
    r = analyze(_run(110.0))
    assert [j["lease_epoch"] for j in r.jobs] == [1, 2] and not r.problems
    assert "2 (lease epochs 1, 2), one at a time" in render(r)


def test_two_jobs_training_at_once_are_a_problem():
    r = analyze(_run(103.0))  # epoch 1 trains until 105
    assert r.problems == ["jobs of lease epochs 1 and 2 trained on this run at the same time "
                          "for 2.00 s"]
    assert "PROBLEM" in render(r) and "some trained at the same time" in render(r)
