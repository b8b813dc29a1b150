"""Which launches the supervisor relaunches when the script writes no `start` events: those
whose ranks took an optimizer step (`first_step`, written by our torchrun workers), never
those that failed before (a script that fails at import), with the backoff of launches that
committed nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from hvd_resilient.event_names import FIRST_STEP
from hvd_resilient.launch.supervisor import Supervisor, trained_evidence
from tests.support.jobs import events
from tests.support.paths import ROOT

LAUNCHER = """
import sys
from hvd_resilient.events import EventLog
for rank in map(int, sys.argv[2:]):
    EventLog(sys.argv[1], rank=rank, size=2).emit("first_step")
sys.exit(1)
"""


def supervise(tmp_path: Path, *ranks: str) -> tuple[object, list[float]]:
    slept: list[float] = []
    cmd = [sys.executable, "-c", LAUNCHER, str(tmp_path / "events.jsonl"), *ranks]
    out = Supervisor(cmd, {"PYTHONPATH": str(ROOT)}, str(tmp_path), max_restarts=3,
                     sleep=slept.append).run()
    return out, slept


def test_ranks_that_stepped_are_relaunched_with_growing_backoff(tmp_path):
    out, slept = supervise(tmp_path, "0", "1")
    assert (out.exit_code, out.restarts, out.reason) == (1, 3, "gave up after 3 restarts")
    assert slept == [1.0, 2.0, 4.0]  # committed nothing: the crash-loop backoff still grows
    restarts = [e for e in events(tmp_path / "events.jsonl") if e["event"] == "restart"]
    assert [e["evidence"] for e in restarts] == [FIRST_STEP] * 3


def test_a_launch_that_never_stepped_is_not_relaunched(tmp_path):
    out, slept = supervise(tmp_path)
    assert (out.exit_code, out.restarts, slept) == (1, 0, [])
    assert out.reason.startswith("not restarting: no rank wrote a `start` event (nor "
                                 "`first_step`")


def test_only_ranks_count_never_the_supervisor():
    assert trained_evidence([{"event": FIRST_STEP, "rank": -1}]) is None
    assert trained_evidence([{"event": FIRST_STEP, "rank": 0}]) == FIRST_STEP
    assert trained_evidence([{"event": FIRST_STEP, "rank": 0},
                             {"event": "start", "rank": 1}]) == "start"
