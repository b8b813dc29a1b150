"""Horovod's "was it built with Gloo?" asked once per installation, not once per launch.

Before an elastic launch horovodrun asks each framework extension whether it was built with
Gloo, in a forked child that imports it: tensorflow (absent here), then `horovod.torch`, and
with it torch. Measured 1.9 s of the driver's start on an idle 2-core machine, in the path of
every launch and of every relaunch after the driver died (the relaunch's whole budget is a
second). The answer only changes when Horovod, torch or Python is reinstalled, so a yes is kept
in a small file keyed by what would change it (the interpreter, Horovod's version and the
files of its extensions and of torch, by inode, size and modification time). A no, or anything
odd, is asked again each time, as Horovod does.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from hvd_resilient.backends.horovod import compat
from hvd_resilient.launch.horovod.patches.context import PatchContext


def installation_key() -> str:
    """What the answer depends on, hashed; found without importing a framework."""
    import horovod

    root = os.path.dirname(os.path.abspath(horovod.__file__))
    files = sorted(glob.glob(os.path.join(root, "*", "mpi_lib*.so")))
    torch = importlib.util.find_spec("torch")  # a top-level spec: torch is not imported
    if torch is not None and torch.origin:
        files.append(torch.origin)
    parts: list[Any] = [os.path.realpath(sys.executable), str(horovod.__version__)]
    for path in files:
        st = os.stat(path)
        parts.append([path, st.st_ino, st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def cache_file(key: str, folder: str | None = None) -> str:
    folder = folder or os.path.join(tempfile.gettempdir(), f"hvd-resilient-{os.getuid()}")
    return os.path.join(folder, f"gloo-built-{key}")


def remembered(ask: Callable[..., Any], folder: str | None = None) -> Callable[..., Any]:
    """`gloo_built(verbose=False)` answering a remembered yes at once."""

    def gloo_built(verbose: bool = False) -> Any:
        try:
            path = cache_file(installation_key(), folder)
        except (OSError, ImportError, ValueError):
            return ask(verbose=verbose)
        if os.path.exists(path):
            return True
        answer = ask(verbose=verbose)
        if answer is True:
            with contextlib.suppress(OSError):  # an unwritable temp dir: ask again next time
                os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
                with open(path, "w") as f:
                    f.write("yes\n")
        return answer

    return gloo_built


def install(ctx: PatchContext) -> None:
    from horovod.runner import launch

    compat.replace(launch, "gloo_built", remembered(launch.gloo_built))
