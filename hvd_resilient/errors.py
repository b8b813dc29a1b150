"""Errors a user or operator meets, and the exit codes they end a process with.

Printed as one line by the entry points (`cli_errors.exit_on_error`); what a launcher sets in
the environment is read in `launcher_env`, the `fatal` event in `fatal_events`."""

from __future__ import annotations

from typing import NoReturn

# Every exit code the project gives a meaning to, in one place: launchers, the supervisor and
# the Horovod driver decide from them whether a restart can help.
RESTARTABLE_EXIT_CODE = 1
"""A failure a restart may cure (a store endpoint down or throttled, a lost peer)."""
PREEMPTED_EXIT_CODE = 75
"""EX_TEMPFAIL: stopped by SIGTERM/SIGUSR1 (preemption) after the final checkpoint; the
supervisor relaunches."""
DRIVER_LOST_EXIT_CODE = 76
"""A worker whose horovodrun driver died exits with this; the relaunch takes over."""
HUNG_EXIT_CODE = 77
"""A rank ended by the progress watchdog (alive, no step ended within its budget) or by its
heartbeat (it was frozen, or cut off from its peers); restartable."""
FATAL_EXIT_CODE = 78
"""EX_CONFIG: a worker stopped on an error no restart can fix (a bad config, a checkpoint that
does not fit the model). The Horovod driver stops the whole job when a worker exits with it,
and the supervisor does not relaunch."""

CUT_OFF_EXIT_CODE = 79
"""An in-place host agent that stopped its own workers because it is cut off from the job's
majority (or cannot reach the coordinator that follows the one it lost): the other hosts go
on without it; when none does, the supervisor relaunches."""


def one_line(e: BaseException | str, *, typed: bool = False, limit: int = 300) -> str:
    """What went wrong as one bounded line, for a log line or an event: the message's
    whitespace (newlines too) collapsed, the type when the message is empty; ``typed``: the
    type, then the message's first line only (a collective's error carries a traceback)."""
    if typed and isinstance(e, BaseException):
        lines = str(e).strip().splitlines()
        text = f"{type(e).__name__}: {lines[0].strip() if lines else ''}"
    else:
        text = " ".join(str(e).split()) or (type(e).__name__ if isinstance(e, BaseException)
                                            else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def exit_now(code: int) -> NoReturn:
    """Ends this process at once with `code`, logs flushed: from a watcher thread, where
    SystemExit would end only the thread, and where the main thread may be stuck in a
    collective that never returns. A dead process is what every launcher already handles."""
    import logging
    import os

    logging.shutdown()
    os._exit(code)


class HvdResilientError(Exception):
    """The one root the CLI knows: it prints `str(err)` as one line and exits `exit_code`, no
    traceback. Each package's own root derives from it (the checkpoint store's `StoreError`,
    the checkpoint manager's `CheckpointError`); discovery scripts are separate programs
    with exit codes Horovod reads, and keep theirs (`discovery/errors.py`)."""

    exit_code = FATAL_EXIT_CODE


class ConfigError(HvdResilientError):
    """A configuration value is wrong; raised before any worker trains."""


class LaunchError(HvdResilientError):
    """A launcher is missing or cannot start the job (a restart would not help)."""


class ResumeError(HvdResilientError):
    """A durable checkpoint cannot be applied to this model (a restart would not help)."""


SUPERVISED_ENV = "HVD_RESILIENT_SUPERVISED"
"""Set to 1 by `hvd-resilient run` for the processes it launches: their fatal errors are
recorded in the run's event log, and the supervisor prints the first one, once."""


def error_exit_code(e: BaseException) -> int:
    """A store error a retry may cure (endpoint down, throttled) exits 1 so that a launcher
    restarts it; every other user error is fatal (no restart fixes a wrong URL)."""
    return int(getattr(e, "exit_code", FATAL_EXIT_CODE))
