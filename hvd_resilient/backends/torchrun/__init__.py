"""torch.distributed under torchrun: DDP or FSDP2 over NCCL/Gloo, and a state that survives only
through durable checkpoints (torchrun restarts every worker). What is not torchrun's own (the
collectives, the state's base, the world's base, the FSDP helpers) is the torch.distributed
base's, `backends.torchdist`."""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"TorchrunBackend": "hvd_resilient.backends.torchrun.backend",
         "TorchrunState": "hvd_resilient.backends.torchrun.state"}

def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
