"""Errors a user or operator meets, each printed as one line by the CLI."""

from __future__ import annotations


FATAL_EXIT_CODE = 78
"""EX_CONFIG: a worker stopped on an error no restart can fix (a bad config, a checkpoint that
does not fit the model). The Horovod driver stops the whole job when a worker exits with it,
and the supervisor does not relaunch."""


class HvdResilientError(Exception):
    """Base class: the CLI prints `str(err)` as one line and exits non-zero, no traceback."""

    exit_code = FATAL_EXIT_CODE


class ConfigError(HvdResilientError):
    """A configuration value is wrong; raised before any worker trains."""


class LaunchError(HvdResilientError):
    """A launcher is missing or cannot start the job (a restart would not help)."""


class ResumeError(HvdResilientError):
    """A durable checkpoint cannot be applied to this model (a restart would not help)."""


def exit_on_error(main):  # type: ignore[no-untyped-def]
    """Wraps a main(): our own errors become one line on stderr and their exit code."""
    import functools
    import sys

    @functools.wraps(main)
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return main(*args, **kwargs)
        except HvdResilientError as e:
            print(f"hvd-resilient: error: {e}", file=sys.stderr)
            raise SystemExit(e.exit_code) from None

    return wrapper


DRIVER_LOST_EXIT_CODE = 76
"""A worker whose horovodrun driver died exits with this; the relaunch takes over."""
