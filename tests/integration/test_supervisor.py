"""The supervisor's decisions from the event log, with real child processes standing in for
the launcher (fast: no training)."""

from __future__ import annotations

import sys
from pathlib import Path

from hvd_resilient.errors import FATAL_EXIT_CODE
from hvd_resilient.events import read_events
from hvd_resilient.launch.supervisor import Supervisor
from tests.support.paths import ROOT

LAUNCHER = """
import sys
from hvd_resilient.events import EventLog
log = EventLog(sys.argv[1] + "/events.jsonl", rank=int(sys.argv[2]), size=2, step=0)
log.emit("start")
if sys.argv[3]:
    log.emit("fatal", error=sys.argv[3], restartable=False)
sys.exit(int(sys.argv[4]))
"""


def supervise(tmp_path: Path, rank: int, fatal: str, code: int) -> tuple[int, str, int]:
    cmd = [sys.executable, "-c", LAUNCHER, str(tmp_path), str(rank), fatal, str(code)]
    env = {"PYTHONPATH": str(ROOT)}
    out = Supervisor(cmd, env, str(tmp_path), max_restarts=2, sleep=lambda s: None).run()
    launches = sum(e["event"] == "launch" for e in read_events(tmp_path / "events.jsonl"))
    return out.exit_code, out.reason, launches


def test_a_fatal_error_is_never_reported_as_success(tmp_path):
    """The other ranks trained on and the launcher exited 0: still a failure, not restarted."""
    code, reason, launches = supervise(tmp_path, 1, "checkpoint does not fit", 0)
    assert code == FATAL_EXIT_CODE and launches == 1
    assert reason == "not restarting: checkpoint does not fit"


def test_a_fatal_error_with_a_failed_launcher_exits_with_the_fatal_code(tmp_path):
    """One exit code means "do not restart" to whatever runs the supervisor (Slurm, k8s)."""
    assert supervise(tmp_path, 0, "bad config", 1)[:2] == (FATAL_EXIT_CODE,
                                                            "not restarting: bad config")


def test_a_plain_failure_is_restarted_and_success_is_success(tmp_path):
    assert supervise(tmp_path, 0, "", 0) == (0, "finished", 1)
    sub = tmp_path / "failing"
    sub.mkdir()
    code, reason, launches = supervise(sub, 0, "", 1)
    assert (code, launches) == (1, 3) and reason == "gave up after 2 restarts"


TRAINS = """
import sys
from hvd_resilient.events import EventLog
log = EventLog(sys.argv[1] + "/events.jsonl", rank=0, size=2, step=0)
log.emit("start")
log.emit("resume", from_step=40)
if sys.argv[2] == "trains":
    log.step_source = 50
    log.emit("commit")
sys.exit(1)
"""


def test_a_launch_that_trained_is_relaunched_at_once_and_a_crash_loop_backs_off(tmp_path):
    """A dead rank under mpirun ends a launch that was training: its relaunch waits for
    nothing. Launches that fail before they commit past their resume back off, 1 s, 2 s ..."""
    for case, expected in (("trains", [0.0, 0.0]), ("crashes", [1.0, 2.0])):
        folder = tmp_path / case
        folder.mkdir()
        slept: list[float] = []
        cmd = [sys.executable, "-c", TRAINS, str(folder), case]
        Supervisor(cmd, {"PYTHONPATH": str(ROOT)}, str(folder), max_restarts=2,
                   sleep=slept.append).run()
        assert slept == expected, case
        delays = [e["delay"] for e in read_events(folder / "events.jsonl")
                  if e["event"] == "restart"]
        assert delays == expected, case
