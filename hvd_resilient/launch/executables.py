"""Where a launcher's executable is: beside this Python first, then PATH.

`hvd-resilient` is often run from a virtual environment that is not activated (a cron job, a
Slurm script, `.venv/bin/hvd-resilient run ...`): horovodrun and torchrun are installed beside
its interpreter, not on PATH, and a PATH lookup alone would find another installation's, or
none.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hvd_resilient.errors import LaunchError


def require(exe: str, hint: str) -> str:
    """The launcher beside this Python first (a venv not activated), then PATH; LaunchError
    (one line, with ``hint``) when neither has it."""
    beside = Path(sys.executable).parent / exe
    path = str(beside) if os.access(beside, os.X_OK) else shutil.which(exe)
    if path is None:
        raise LaunchError(f"{exe} not found on PATH: {hint}")
    return path
