"""A torchrun script that has not adopted `hvd_resilient.inplace`, told apart by the agent.

Such a script calls torch's `init_process_group()` with env://, which wants the RANK that
torchrun sets and the in-place agent does not (ranks change inside the running workers): every
worker would print torch's traceback and exit 1, and the job would end on a raw
``ValueError: ... environment variable RANK expected, but not set``. Nothing of ours runs in
such a worker (it never imports the library, and a sitecustomize would reach into every Python
the agent starts), so the agent tells it from the worker's own exception: it copies each
worker's stderr through, line by line, holds a Python traceback back until its last line, and
drops it when that line is torch's (or a ``KeyError: 'RANK'`` from reading the variable
directly). The agent then ends the job with `REFUSAL`, one line, exit 78: no restart would
change the script.
"""

from __future__ import annotations

import os
import re
import threading
from typing import IO

DOCS = "docs/inplace-ddp.md"
REFUSAL = (
    "--launcher inplace: the script initialises torch.distributed itself (torch's env:// "
    "rendezvous wants RANK, which the in-place agent does not set: ranks change inside the "
    "running workers); add `from hvd_resilient import inplace`, call "
    "`inplace.init_process_group(backend=\"gloo\")` instead of torch's, and wrap the "
    "training loop in `@inplace.run` with an `inplace.State(model, optimizer, ...)` that it "
    f"commits ({DOCS}); or run it with --launcher torchrun")
_RANK_PREFIX = re.compile(rb"^(\[rank\d+\]:\s?)+")
"""torch prefixes a worker's traceback lines with its rank once a group existed."""
_UNADOPTED = re.compile(
    rb"^(ValueError: Error initializing torch\.distributed using env:// rendezvous: "
    rb"environment variable (RANK|WORLD_SIZE|MASTER_ADDR|MASTER_PORT) expected, but not set"
    rb"|KeyError: '(RANK|WORLD_SIZE|LOCAL_RANK)')\s*$")
_TRACEBACK = b"Traceback (most recent call last):"


def bare(line: bytes) -> bytes:
    return _RANK_PREFIX.sub(b"", line)


def is_unadopted(last_line: bytes) -> bool:
    """True for the last line of the traceback an unadopted DDP script dies with."""
    return bool(_UNADOPTED.match(bare(last_line)))


class StderrWatch:
    """Copies one worker's stderr to ``out_fd`` as it comes, but for the traceback of an
    unadopted script (see the module doc), which it keeps back and records."""

    def __init__(self, pipe: IO[bytes], out_fd: int) -> None:
        self.pipe, self.out_fd = pipe, out_fd
        self.unadopted = False
        self.ending = False
        """Set when the agent ends this worker because another one was found unadopted: it
        is killed while it prints the same traceback, and the part it got out is dropped."""
        self._thread = threading.Thread(target=self._copy, daemon=True,
                                        name="inplace-stderr")
        self._thread.start()

    def _write(self, data: bytes) -> None:
        try:
            os.write(self.out_fd, data)
        except OSError:  # the agent's own stderr is gone: the worker's output with it
            pass

    def _copy(self) -> None:
        held: list[bytes] = []
        for line in iter(self.pipe.readline, b""):
            if held:
                held.append(line)
                # a traceback's frames are indented; its first unindented line is the error
                if bare(line)[:1] not in (b" ", b"\t", b"\n", b""):
                    if is_unadopted(line):
                        self.unadopted = True
                    else:
                        self._write(b"".join(held))
                    held = []
            elif bare(line).startswith(_TRACEBACK):
                held = [line]
            else:
                self._write(line)
        if held and not self.ending:  # the worker died in the middle of its traceback
            self._write(b"".join(held))
        self.pipe.close()

    def join(self, timeout_s: float) -> None:
        """Waits for the worker's last line (a child of it may hold the pipe a little longer:
        then what it writes later still passes, only unawaited)."""
        self._thread.join(timeout_s)
