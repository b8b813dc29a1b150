"""The agents a launch across hosts started (`fanout.py`, `fanout_discovery.py`): each agent's
process (or the ssh running it) with the write end of its stdin, the lines it prints, and how a
launch ends them. Below both, so that neither imports the other."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from hvd_resilient.errors import CUT_OFF_EXIT_CODE

COORDINATOR_LINE = "hvd-resilient-coordinator"
"""What host 0's agent prints, followed by ``HOST:PORT``, once its store listens."""
AGENT_LINE = "hvd-resilient-agent"
"""What every other agent prints, followed by its store's ``HOST:PORT``: where a host added
later looks for the agent that coordinates by then."""
SSH_FAILED = 255
SSH_ALIVE = ("-o", "ServerAliveInterval=3", "-o", "ServerAliveCountMax=3")
"""A host whose link is down (its agent's exit cannot arrive) ends its ssh with 255 within about
10 s, instead of after TCP's own timeouts (many minutes), so the job's code is known."""
END_WAIT_S = 10.0
"""How long an agent whose stdin was closed has to end its workers before it is killed."""


def exit_code(returncode: int) -> int:
    """A process killed by signal N exits 128 + N, as a shell says."""
    return returncode if returncode >= 0 else 128 - returncode


def own_code(code: int) -> bool:
    """An agent's exit code that is the job's own: neither a signal's (or ssh's 255) nor "cut
    off, the others go on"."""
    return code < 128 and code != CUT_OFF_EXIT_CODE


def job_code(codes: list[int]) -> int:
    """The job's code from the agents' own (those told to leave left out): 0 when any says the
    job finished, else the first that is the job's own (not a signal's, not "cut off, the
    others go on"), else cut off (restartable), else 1."""
    if 0 in codes:
        return 0
    own = [c for c in codes if own_code(c)]
    if own:
        return own[0]
    return CUT_OFF_EXIT_CODE if CUT_OFF_EXIT_CODE in codes else (codes[0] if codes else 1)


def say(line: str) -> None:
    print(f"hvd-resilient: {line}", file=sys.stderr, flush=True)


class LaunchedAgent:
    """One host's agent as this process started it (or the ssh running it), and the write
    end of its stdin (the agent itself: `inplace.host_agent.HostAgent`)."""

    def __init__(self, index: int, host: str, cmd: list[str], *, local: bool,
                 capture: bool, slots: int = 0) -> None:
        self.index, self.host, self.local, self.slots = index, host, local, slots
        self.address = ""
        """Its store's ``HOST:PORT``, once its line was read (captured output only)."""
        self.removed = False
        """The discovery script dropped its host: told to leave (its exit is no job's end)."""
        # a session of its own: a signal to our group must reach it as a line, not as a signal
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, start_new_session=True,
                                     stdout=subprocess.PIPE if capture else None)
        assert self.proc.stdin is not None
        self._stdin: IO[bytes] = self.proc.stdin
        self._open = True
        self.ready = False
        """Its environment line is written: signal words may follow."""
        self.told = 0
        """How many of the fan-out's signal words it was sent."""

    @property
    def name(self) -> str:
        return f"host {self.index} ({self.host})"

    def send(self, data: bytes) -> None:
        """Unbuffered (a signal handler writes here too); an agent already gone is not an
        error here: its exit code says what happened."""
        if not self._open:
            return
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._stdin.fileno(), view):]
        except OSError:
            pass

    def catch_up(self, words: Sequence[str]) -> None:
        """Every signal word not yet sent to it, each once, in order; safe to call again from
        the signal handler at any point of a call here (it runs in the main thread, between
        two lines of this one), so no signal is lost or doubled while an agent starts."""
        while self.ready and self.told < len(words):
            word = words[self.told]
            self.told += 1
            self.send(f"{word}\n".encode())

    def hang_up(self) -> None:
        """EOF on its stdin: it ends its workers and exits."""
        self._open = False  # first: a signal handler running now must not write to it
        with contextlib.suppress(OSError):
            self._stdin.close()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            return None


def end(agents: Sequence[LaunchedAgent]) -> None:
    """Every agent's stdin closed (it ends its workers), then, after END_WAIT_S, whatever is
    left killed with its session (ssh with it: the remote agent sees EOF)."""
    for agent in agents:
        agent.hang_up()
    deadline = time.monotonic() + END_WAIT_S
    for agent in agents:
        if agent.wait(deadline - time.monotonic()) is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.proc.pid, signal.SIGKILL)
            agent.proc.wait()


class Passthrough:
    """An agent's stdout: its store's address taken from it, once (host 0's: the coordinator's);
    every other line is the job's output, passed on to ours."""

    def __init__(self, stream: IO[bytes], agent: LaunchedAgent | None = None) -> None:
        self.address: queue.Queue[str | None] = queue.Queue(maxsize=1)
        self.agent = agent
        self.thread = threading.Thread(target=self._run, args=(stream,), daemon=True,
                                       name=f"host{agent.index if agent else 0}-stdout")
        self.thread.start()

    def _run(self, stream: IO[bytes]) -> None:
        prefixes = (f"{COORDINATOR_LINE} ".encode(), f"{AGENT_LINE} ".encode())
        found = False
        for line in iter(stream.readline, b""):
            prefix = next((p for p in prefixes if line.startswith(p)), None)
            if not found and prefix is not None:
                found = True
                address = line[len(prefix):].strip().decode(errors="replace")
                if self.agent is not None:
                    self.agent.address = address
                self.address.put(address)
                continue
            with contextlib.suppress(OSError):  # our reader gone: keep draining the agent
                sys.stdout.buffer.write(line)
                sys.stdout.buffer.flush()
        if not found:
            self.address.put(None)  # its stdout closed before the line: it has ended
        stream.close()
