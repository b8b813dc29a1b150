"""Horovod: elastic under horovodrun (Gloo), static under mpirun/srun (MPI controller).

Everything that knows Horovod lives in this folder: joining the world (init), the elastic and
static worlds of the recovery loop (run), the state that commits/restores/syncs (state),
per-slot host names (slots), fast failure detection (detect/), and the one module that touches
Horovod's private internals (compat). Names resolve lazily so that the launcher side can import
``slots`` without importing ``horovod.torch``.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"HorovodBackend": "hvd_resilient.backends.horovod.backend",
         "ElasticState": "hvd_resilient.backends.horovod.state",
         "run": "hvd_resilient.backends.horovod.run"}

def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
