"""What survives a failure, whatever the backend: the shared core of a training state (the
checkpoint dict, hooks, the parameter digest), the exact-once sampler, every rank's random
streams. The backend-specific states live with their backend (backends/horovod/state.py,
backends/torchrun/state.py).

``from hvd_resilient.state import ElasticState`` is the path the first versions documented; it
still works (resolved lazily, so importing this package never imports Horovod).
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"ElasticState": "hvd_resilient.backends.horovod.state",
         "is_elastic": "hvd_resilient.backends.horovod.state"}

def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
