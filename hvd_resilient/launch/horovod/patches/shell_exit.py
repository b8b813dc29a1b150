"""A worker's own exit code, not the SIGTERM its shell got a moment after the worker ended.

Horovod's middleman runs each worker through a shell (`sh -c COMMAND`) and ends it with
`terminate_executor_shell_and_children`: SIGTERM to the shell's children, up to 5 s for them
to go, then SIGSTOP and SIGTERM to the shell itself. Once a child is gone, its shell needs a
moment more to exit with the child's code; on a busy machine the middleman's SIGTERM can land
in that moment, and the slot reports 143 for a worker that stopped at its final checkpoint
and exited 75 (seen in CI: `test_sigterm_to_run_stops_horovod_workers_at_a_final_checkpoint`,
one rank 75, the other 143, so the driver could not say the job stopped cleanly).

Here, when every child ended within the grace, the shell is given a second more to exit on
its own (it needs milliseconds); only a shell still there after that, or one whose children
outlived the grace, is stopped and killed as Horovod does. The wait never reaps the shell
(a pidfd is polled): the middleman's own `wait()` must still see its exit code.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from typing import Any

import psutil

GRACE_S = 5.0
"""Horovod's GRACEFUL_TERMINATION_TIME_S: SIGTERM to SIGKILL, for the children as for the
shell; the workers' final checkpoint is sized to it (`patches/stop_signal.py`)."""
SHELL_EXIT_S = 1.0
"""What a shell whose children are gone gets to exit with their code. Bounded, and short: a
shell that runs the worker with `exec` has no children, and is signalled only after it."""


def exited_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` (a child of this process) exits within `timeout_s`, left
    unreaped: its parent's `wait()` still gets its status."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], max(timeout_s, 0.0))[0])
    finally:
        os.close(fd)


def terminate_shell_and_children(pid: int, grace_s: float = GRACE_S) -> None:
    """Ends the worker's shell `pid` and its process tree: SIGTERM to the children, then the
    shell's own exit when they are gone, else SIGSTOP, SIGKILL to what is left and SIGTERM
    (SIGKILL after the grace) to the shell."""
    try:
        shell = psutil.Process(pid)
        children = shell.children()
    except psutil.NoSuchProcess:
        return
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    if not alive and exited_within(pid, SHELL_EXIT_S):
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        shell.send_signal(signal.SIGSTOP)  # it starts nothing more while its tree is killed
    for child in alive:
        _kill_tree(child)
    with contextlib.suppress(psutil.NoSuchProcess):
        shell.terminate()
    if not exited_within(pid, grace_s):
        with contextlib.suppress(psutil.NoSuchProcess):
            shell.kill()


def _kill_tree(proc: psutil.Process) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        for p in [*proc.children(recursive=True), proc]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def run_middleman(*args: Any) -> None:
    """Horovod's middleman (`safe_shell_exec._exec_middleman`), unchanged but for how it ends
    its shell; the target `fast_middleman` gives the forked middleman process."""
    from horovod.runner.common.util import safe_shell_exec

    from hvd_resilient.backends.horovod import compat

    compat.replace(safe_shell_exec, "terminate_executor_shell_and_children",
                   terminate_shell_and_children)
    safe_shell_exec._exec_middleman(*args)
