"""How our errors end a command: one line and an exit code, never a traceback.

Every entry point (the `hvd-resilient` command, the in-place agent, a training script's
main) wraps itself in `exit_on_error`. Under `hvd-resilient run` an error no restart fixes is
recorded as a `fatal` event instead of being printed by every rank: the supervisor prints the
first one, once.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from hvd_resilient.errors import (
    FATAL_EXIT_CODE,
    SUPERVISED_ENV,
    HvdResilientError,
    error_exit_code,
)
from hvd_resilient.fatal_events import record_fatal
from hvd_resilient.launcher_place import launcher_rank, launcher_size

T = TypeVar("T")


def exit_on_error(main: Callable[..., T]) -> Callable[..., T]:
    """Wraps a main(): our own errors, and the checkpoint store's, become one line on stderr
    and their exit code; credentials are masked, there is no traceback.

    Under `hvd-resilient run` (HVD_RESILIENT_SUPERVISED=1) an error no restart fixes is
    recorded as a `fatal` event in the run's event log instead of being printed by every rank:
    the supervisor prints the first fatal error once, in its last line. It is printed here
    when it cannot be recorded, or for errors a restart may fix."""

    @functools.wraps(main)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        from hvd_resilient.masking import install_log_scrubber, mask_text

        install_log_scrubber()
        since = time.time()
        try:
            return main(*args, **kwargs)
        except HvdResilientError as e:
            error = mask_text(" ".join(str(e).split()) or type(e).__name__)
            code = error_exit_code(e)
            recorded = (code == FATAL_EXIT_CODE and os.environ.get(SUPERVISED_ENV) == "1"
                        and record_fatal(os.environ.get("HVD_RESILIENT_RUN_DIR", ""), error,
                                         since, rank=launcher_rank(), size=launcher_size()))
            if not recorded:
                print(f"hvd-resilient: error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(code) from None

    return wrapper
