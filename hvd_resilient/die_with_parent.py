"""A child that the kernel ends with its parent: no orphan holds what a dead process owned.

Used for a rank's loader workers (an orphan kept the dead rank's output pipes open, and the
launcher did not see the exit for 5 s), the in-place agent's workers and the warm pool.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from typing import Any

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _libc_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return None


_PRCTL = _libc_prctl()
"""Resolved at import, in the parent: a child just forked from a threaded process (an at-fork
hook) must not take the dynamic loader's lock, which another thread may have held at the fork."""


def die_with_parent(parent_pid: int | None) -> bool:
    """Asks the kernel to SIGKILL this process when its parent ends; returns whether it could.

    The signal comes when the parent *thread* that forked this process ends, so a worker must
    be forked by a thread that outlives it (the loader thread does: it shuts its workers down
    before it ends). If the parent is already gone before the request took effect, nothing
    would ever come: `parent_pid` (the pid that forked this process, None when unknown, as under
    forkserver) is checked after it, and this process ends at once if it was orphaned."""
    if _PRCTL is None:
        return False
    if _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        logger.debug("prctl(PR_SET_PDEATHSIG): errno %d", ctypes.get_errno())
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    return True
