"""Errors a user or operator meets, each printed as one line by the CLI."""

from __future__ import annotations

from collections.abc import Mapping
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

RANK_ENVS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK", "SLURM_PROCID")
"""Where a process finds its launcher rank before (or without) a backend: horovodrun, Open
MPI, MPICH/Intel MPI, torchrun, srun."""


SIZE_ENVS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE", "SLURM_NTASKS")


def launcher_rank(env: Mapping[str, str] | None = None,
                  names: tuple[str, ...] = RANK_ENVS) -> int | None:
    """This process's rank as its launcher set it (None: not started by a known launcher)."""
    import os

    env = os.environ if env is None else env
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def error_exit_code(e: BaseException) -> int:
    """A store error a retry may cure (endpoint down, throttled) exits 1 so that a launcher
    restarts it; every other user error is fatal (no restart fixes a wrong URL)."""
    return int(getattr(e, "exit_code", FATAL_EXIT_CODE))


def _record_fatal(error: str, since: float) -> bool:
    """Appends a `fatal` event to $HVD_RESILIENT_RUN_DIR/events.jsonl unless one with this
    error was recorded since `since` (the trainer records its own); True once it is there."""
    import os

    run_dir = os.environ.get("HVD_RESILIENT_RUN_DIR", "")
    if not run_dir:
        return False
    try:
        from hvd_resilient.events import EventLog, read_recent_events

        path = os.path.join(run_dir, "events.jsonl")
        for ev in read_recent_events(path):
            if ev["event"] == "fatal" and ev["ts"] >= since and ev.get("error") == error:
                return True
        rank, size = launcher_rank(), launcher_rank(names=SIZE_ENVS)
        EventLog(path, rank=-1 if rank is None else rank, size=size or 0, step=-1).emit(
            "fatal", error=error, restartable=False, pid=os.getpid(),
            rank_source="launcher environment")
        return True
    except Exception:  # a full disk or a vanished run folder: print the line instead
        return False


def exit_on_error(main):  # type: ignore[no-untyped-def]
    """Wraps a main(): our own errors, and the checkpoint store's, become one line on stderr
    and their exit code; credentials are masked, there is no traceback.

    Under `hvd-resilient run` (HVD_RESILIENT_SUPERVISED=1) an error no restart fixes is
    recorded as a `fatal` event in the run's event log instead of being printed by every rank:
    the supervisor prints the first fatal error once, in its last line. It is printed here
    when it cannot be recorded, or for errors a restart may fix."""
    import functools
    import os
    import sys
    import time

    @functools.wraps(main)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        from hvd_resilient.masking import install_log_scrubber, mask_text

        install_log_scrubber()
        since = time.time()
        try:
            return main(*args, **kwargs)
        except HvdResilientError as e:
            error = mask_text(" ".join(str(e).split()) or type(e).__name__)
            code = error_exit_code(e)
            recorded = (code == FATAL_EXIT_CODE and os.environ.get(SUPERVISED_ENV) == "1"
                        and _record_fatal(error, since))
            if not recorded:
                print(f"hvd-resilient: error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(code) from None

    return wrapper

