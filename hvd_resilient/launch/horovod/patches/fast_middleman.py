"""Horovod's per-worker middleman, forked from a warm server instead of spawned.

Horovod launches every worker (and every ssh command) through `safe_shell_exec.execute`,
which starts a middleman process with multiprocessing's *spawn* method: a new interpreter
that re-imports the driver's main module (ours, Horovod's runner with it) before it runs the
worker's shell. That is 0.1-0.4 s of every launch here (a newcomer's, a readmitted slot's, a
standby's), and it is spent while the job waits for the newcomer.

Here `safe_shell_exec` sees a multiprocessing whose "spawn" context is a *forkserver*
context, whose server is started at install and has preloaded that module and the driver's
main module: each middleman is then forked from a single-threaded warm process in ~20 ms.
The middleman's own code and contract are Horovod's (it gets the same pipes, the same exit
event, still kills the worker's process tree when the driver dies), but for how it ends its
shell (`shell_exit.py`: a worker's exit code is no longer lost to a SIGTERM that reached
its shell a moment after the worker ended). Every other
context request passes through.
"""

from __future__ import annotations

import multiprocessing
import sys
from multiprocessing import forkserver as server
from typing import Any

from hvd_resilient.backends.horovod import compat
from hvd_resilient.launch.horovod.patches import shell_exit
from hvd_resilient.launch.horovod.patches.context import PatchContext

MIDDLEMAN_MODULE = "horovod.runner.common.util.safe_shell_exec"


class MiddlemanContext:
    """The forkserver context, whose middleman process runs `shell_exit.run_middleman`:
    Horovod's middleman, ending its shell without the race that turned a worker's exit code
    into the shell's SIGTERM (143)."""

    def __init__(self, forkserver: Any) -> None:
        self.forkserver = forkserver

    def Process(self, *, target: Any = None, args: tuple[Any, ...] = (), **kwargs: Any) -> Any:  # noqa: N802 - multiprocessing's name
        from horovod.runner.common.util import safe_shell_exec

        if target is safe_shell_exec._exec_middleman:
            target = shell_exit.run_middleman
        return self.forkserver.Process(target=target, args=args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.forkserver, name)


class ForkserverAsSpawn:
    """`multiprocessing` as `safe_shell_exec` uses it: get_context("spawn") answers the
    warm forkserver context; anything else is the real module's."""

    def __init__(self, forkserver: Any) -> None:
        self.forkserver = MiddlemanContext(forkserver)

    def get_context(self, method: str | None = None) -> Any:
        return self.forkserver if method == "spawn" else multiprocessing.get_context(method)

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)


def preload() -> list[str]:
    """What the server imports once: the middleman's module, and the main module every
    child re-runs as `__mp_main__` (so that its imports are already there)."""
    main = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    return [MIDDLEMAN_MODULE, shell_exit.__name__, *([main] if main and main != "__main__" else [])]


def install(ctx: PatchContext) -> None:
    from horovod.runner.common.util import safe_shell_exec

    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(preload())
    server.ensure_running()  # its imports overlap the driver's start, not the first launch
    compat.replace(safe_shell_exec, "multiprocessing", ForkserverAsSpawn(forkserver))
