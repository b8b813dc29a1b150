"""What the supervisor says of a launch whose script wrote no `start` event: the exit code, the
process the launcher names as the first to exit, how far the output's progress lines got, and
nothing it does not know (it used to say that no rank had started training, also after the
ranks of a plain Horovod script had trained a whole epoch)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hvd_resilient.launch.launcher_output import OutputFacts
from hvd_resilient.launch.supervisor import Supervisor
from tests.support.paths import ROOT

HOROVOD = [
    "[0]<stderr>:epoch 0 batch 0",
    "[1]<stderr>:epoch 1 batch 7",
    "hvd-resilient: launcher: Horovod detected that one or more processes exited with non-zero "
    "status, thus causing the job to be terminated. The first process to do so was: Process "
    "name: 127.0.0.1[0] Exit code: 1",
]
MPIRUN = [
    "[1,0]<stdout>:step 12 loss 0.4",
    "mpirun detected that one or more processes exited with non-zero status, thus causing",
    "the job to be terminated. The first process to do so was:",
    "",
    "  Process name: [[4242,1],1]",
    "  Exit code:    9",
]
TORCHRUN = [
    "iteration=40 loss=1.2",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-12-01_10:00:00",
    "  host      : node1",
    "  rank      : 3 (local_rank: 1)",
    "  exitcode  : -9 (pid: 1234)",
]


def facts_of(lines: list[str]) -> OutputFacts:
    facts = OutputFacts()
    for line in lines:
        facts.feed_line(line + "\n")
    return facts


@pytest.mark.parametrize("lines,first,code,progress,highest", [
    (HOROVOD, "127.0.0.1[0]", 1, 2, 7),
    (MPIRUN, "[[4242,1],1]", 9, 1, 12),
    (TORCHRUN, "rank 3", -9, 1, 40),
    (["Traceback (most recent call last):", "ImportError: no module named foo"], "", None, 0,
     None),
])
def test_the_launchers_own_words_are_read_for_the_first_exit_and_progress(
        lines, first, code, progress, highest):
    facts = facts_of(lines)
    assert (facts.first_exit, facts.first_exit_code) == (first, code)
    assert (facts.progress_lines, facts.highest_number) == (progress, highest)


def test_an_output_without_those_facts_says_they_are_missing():
    text = facts_of(["ImportError: no module named foo"]).describe()
    assert text == ("the launcher's output names no first process to exit; no line of its "
                    "output names a step or batch")


LAUNCHER = """
import sys
for line in sys.argv[1:]:
    print(line, file=sys.stderr if "Process name" in line else sys.stdout, flush=True)
sys.exit(3)
"""


def test_a_launch_without_start_events_is_described_not_guessed(tmp_path: Path, capfd):
    cmd = [sys.executable, "-c", LAUNCHER, *HOROVOD]
    out = Supervisor(cmd, {"PYTHONPATH": str(ROOT)}, str(tmp_path), max_restarts=2,
                     sleep=lambda s: None).run()
    assert out.exit_code == 3 and out.restarts == 0
    assert "before any rank started training" not in out.reason
    assert out.reason.startswith("not restarting: no rank wrote a `start` event")
    assert "the launcher exited with code 3" in out.reason
    assert "names 127.0.0.1[0] (exit code 1) as the first process to exit" in out.reason
    assert "2 line(s) of its output name a step or batch, the highest number 7" in out.reason
    # The launcher's output still reaches the supervisor's own, each stream to its own.
    seen = capfd.readouterr()
    assert "[1]<stderr>:epoch 1 batch 7" in seen.out
    assert "Process name: 127.0.0.1[0]" in seen.err
