"""What a launcher's console output says, read as it passes through to the supervisor's own.

The supervisor decides from the run's event log. A script that writes none (a plain Horovod
script, or one that failed before its first event) leaves it only the launcher's exit code and
what the launcher printed; this reads that text for the few facts a message may state: which
process the launcher says exited first, and how far the training's own progress lines got. It
never guesses beyond them.

Every launcher names the first process to fail in its own words:
- Horovod (`horovodrun`, our driver's one line): "... The first process to do so was: Process
  name: localhost[0] Exit code: 1";
- Open MPI's mpirun: "Process name: [[4242,1],0]" and, on a later line, "Exit code: 1";
- torchrun: "Root Cause (first observed failure):", then "rank : 0 (local_rank: 0)" and
  "exitcode : 1 (pid: 1234)".
Progress lines are those that name a step, a batch or an iteration followed by its number
("step 120", "epoch 2 batch 9", "iteration=40").
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field

_PROGRESS = re.compile(r"\b(?:step|batch|iteration|iter)\b\s*[=:#]?\s*(\d+)", re.IGNORECASE)
_PROCESS = re.compile(r"Process name:\s*(\S+)")
_EXIT_CODE = re.compile(r"Exit code:\s*(-?\d+)")
_TORCHRUN_ROOT = re.compile(r"Root Cause \(first observed failure\)")
_TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_TORCHRUN_CODE = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")
_MAX_LINE = 4096  # a line longer than this is scanned in pieces (a progress bar without \n)


@dataclass
class OutputFacts:
    """What the launcher's output showed, nothing inferred."""

    progress_lines: int = 0
    last_progress: str = ""
    highest_number: int | None = None  # the largest step/batch number in a progress line
    first_exit: str = ""  # the process the launcher says exited first, e.g. "localhost[0]"
    first_exit_code: int | None = None
    _torchrun: bool = field(default=False, repr=False)

    def feed_line(self, line: str) -> None:
        line = line.rstrip("\r\n")
        found = [int(n) for n in _PROGRESS.findall(line)]
        if found:
            self.progress_lines += 1
            self.last_progress = line.strip()[:200]
            top = max(found)
            self.highest_number = top if self.highest_number is None else max(
                self.highest_number, top)
        if _TORCHRUN_ROOT.search(line):
            self._torchrun = True
            self.first_exit, self.first_exit_code = "", None
            return
        if self._torchrun:  # torchrun's root-cause block: rank and exitcode on their own lines
            if (m := _TORCHRUN_RANK.search(line)) and not self.first_exit:
                self.first_exit = f"rank {m.group(1)}"
            if (m := _TORCHRUN_CODE.search(line)) and self.first_exit_code is None:
                self.first_exit_code = int(m.group(1))
            return
        if (m := _PROCESS.search(line)) and not self.first_exit:
            self.first_exit = m.group(1)
            self.first_exit_code = None
        if (m := _EXIT_CODE.search(line)) and self.first_exit and self.first_exit_code is None:
            self.first_exit_code = int(m.group(1))

    def describe(self) -> str:
        """The facts, one clause each; what the output did not show is said to be missing."""
        if self.first_exit:
            code = "" if self.first_exit_code is None else f" (exit code {self.first_exit_code})"
            first = f"the launcher names {self.first_exit}{code} as the first process to exit"
        else:
            first = "the launcher's output names no first process to exit"
        if self.progress_lines:
            progress = (f"{self.progress_lines} line(s) of its output name a step or batch, "
                        f"the highest number {self.highest_number} (last: "
                        f"{self.last_progress!r})")
        else:
            progress = "no line of its output names a step or batch"
        return f"{first}; {progress}"


class Tee:
    """Copies a child's stream to one of our file descriptors as it comes, byte for byte, and
    feeds its lines to `facts`. A failed write (our stdout closed) stops the copying, never the
    reading: the child must not block on a full pipe."""

    def __init__(self, source: int, sink_fd: int, facts: OutputFacts,
                 lock: threading.Lock) -> None:
        self._source, self._sink, self._facts, self._lock = source, sink_fd, facts, lock
        self._sink_ok = True
        self._partial = b""
        self.thread = threading.Thread(target=self._pump, daemon=True,
                                       name=f"hvd-resilient-tee-{sink_fd}")
        self.thread.start()

    def _pump(self) -> None:
        try:
            while chunk := os.read(self._source, 65536):
                if self._sink_ok:
                    try:
                        os.write(self._sink, chunk)
                    except OSError:
                        self._sink_ok = False
                self._scan(chunk)
            if self._partial:
                self._line(self._partial)
        finally:
            os.close(self._source)

    def _scan(self, chunk: bytes) -> None:
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        for raw in lines:
            self._line(raw)
        while len(self._partial) > _MAX_LINE:
            self._line(self._partial[:_MAX_LINE])
            self._partial = self._partial[_MAX_LINE:]

    def _line(self, raw: bytes) -> None:
        with self._lock:
            self._facts.feed_line(raw.decode(errors="replace"))
