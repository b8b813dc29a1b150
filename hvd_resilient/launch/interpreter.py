"""Which Python runs the workers: the training command's `python` is this environment's.

`hvd-resilient run -- python train.py` used to start whatever `python` came first on PATH. With
the project installed in a virtual environment that is not activated (a cron job, a Slurm
script, `.venv/bin/hvd-resilient run ...`), that is the system's Python: every worker then
failed at its first import (`ModuleNotFoundError`), once per rank and once per restart, long
after the launch looked fine. A bare `python`, `python3` or `python3.X` therefore means the
interpreter `hvd-resilient` itself runs in (`sys.executable`), on every host (hosts share the
environment's path, as they share the code's). A command that names an interpreter by its path
is the user's choice and is kept, but checked before the launch: if it cannot import torch and
this project, the run stops with one line instead of a crash loop.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from hvd_resilient.errors import LaunchError

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
PROBE_TIMEOUT_S = 120.0
"""Importing torch takes seconds, and more on a loaded machine or a cold page cache."""
NEEDED = ("torch", "hvd_resilient")


def is_python(arg: str) -> bool:
    """True for a Python interpreter named bare or by path (`python`, `/opt/py/bin/python3.11`)."""
    return bool(_PYTHON.fullmatch(os.path.basename(arg)))


def workers_command(cmd: list[str], this: str = sys.executable) -> list[str]:
    """``cmd`` with a bare Python name replaced by ``this`` interpreter (see the module doc);
    anything else unchanged."""
    if cmd and is_python(cmd[0]) and os.sep not in cmd[0]:
        return [this, *cmd[1:]]
    return cmd


def check_interpreter(cmd: list[str], this: str = sys.executable) -> None:
    """Raises LaunchError (one line) when ``cmd`` names another interpreter by its path and
    that one cannot import what every worker imports. Nothing to check for this environment's
    interpreter or for a command that is not Python (a shell script decides for itself)."""
    if not cmd or not is_python(cmd[0]) or os.path.abspath(cmd[0]) == os.path.abspath(this):
        return
    probe = "; ".join(f"import {m}" for m in NEEDED)
    try:
        r = subprocess.run([cmd[0], "-c", probe], capture_output=True, text=True,
                           timeout=PROBE_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise LaunchError(f"run: the training command's interpreter {cmd[0]} does not exist; "
                          f"write `python` for this environment's ({this})") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"run: the training command's interpreter {cmd[0]} took over "
                          f"{PROBE_TIMEOUT_S:.0f} s to import {', '.join(NEEDED)}") from None
    if r.returncode != 0:
        lines = (r.stderr or r.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit code {r.returncode}"
        raise LaunchError(f"run: the training command's interpreter {cmd[0]} cannot import "
                          f"{' and '.join(NEEDED)} ({why}); write `python` for this "
                          f"environment's ({this}), or install hvd_resilient there")
