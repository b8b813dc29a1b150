"""torch.distributed under torchrun: DDP or FSDP2 over NCCL/Gloo, a state that survives only
through durable checkpoints (torchrun restarts every worker), and the FSDP helpers."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"TorchDistBackend": "hvd_resilient.backends.torchrun.backend",
         "TorchrunState": "hvd_resilient.backends.torchrun.state"}

def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
