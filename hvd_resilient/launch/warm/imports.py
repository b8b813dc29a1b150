"""What a training script will import, imported ahead: by a process that forks its workers.

A worker's cold start is mostly imports (torch, torch._dynamo, the script's own libraries:
sklearn took 2-17 s under load). The launchers that fork workers from a warm process (torchrun
with `warm/torchrun.py`, the warm pool) import the script's modules first, read from its
syntax tree without running it.
"""

from __future__ import annotations

import ast
import gc
import importlib
import os
import sys


def script_imports(path: str) -> list[str]:
    """Every absolute module the training script imports, anywhere in it (a function's
    `from sklearn.datasets import load_digits` too), read from its syntax tree, never run."""
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return list(dict.fromkeys(n for n in names if n != "__future__"))


NEVER_AHEAD = ("mpi4py",)
"""Modules a forking process must not import for its children: `mpi4py.MPI` initializes MPI
on import, and a forked child of an initialized MPI process cannot initialize its own."""


def import_script_modules(path: str) -> None:
    """Imports what `path` imports, its own folder's modules too (as `python path` would find
    them). A module that fails here is left to the worker, which imports it again and says
    why."""
    folder = os.path.dirname(os.path.abspath(path))
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        for name in script_imports(path):
            if name.split(".")[0] in NEVER_AHEAD:
                continue
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001, S110 - see the docstring
                pass
    finally:
        if added:
            sys.path.remove(folder)


def settle_heap() -> None:
    """Collects once and moves every object alive now (the imports: 290 k objects after
    torch and Horovod) out of the collector's sight (`gc.freeze`). Called where a process
    waits anyway (a standby before it says READY, a warm process before it forks): otherwise
    the first full collection after the imports comes at a random moment later, 100-200 ms
    here, and for a newcomer that moment is the reset the whole world waits in; and in a
    forked child it also copies every page the collector touches."""
    gc.collect()
    gc.freeze()
