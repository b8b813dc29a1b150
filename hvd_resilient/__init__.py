"""Fault-tolerant distributed PyTorch training on Horovod Elastic, MPI and torchrun.

Heavy modules (torch, horovod, boto3) are imported on first use of the names below, so that
`hvd-resilient ckpt ...`, the discovery scripts and config validation start fast and work on
machines without Horovod.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "TrainConfig": "hvd_resilient.config",
    "ConfigError": "hvd_resilient.errors",
    "ElasticDataSampler": "hvd_resilient.state.sampler",
    "DistributedSampler": "hvd_resilient.backends.horovod.sampler",
    "ElasticState": "hvd_resilient.backends.horovod.state",
    "run": "hvd_resilient.training.ported",
    "Trainer": "hvd_resilient.training.trainer",
    "EventLog": "hvd_resilient.events",
    "local_rank": "hvd_resilient.backends.horovod.slots",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as e:
            if e.name not in ("horovod", "mpi4py"):
                raise
            raise ImportError(f"hvd_resilient.{name} needs Horovod, which is not installed: "
                              "pip install 'hvd_resilient[horovod]' (Horovod 0.28.1 needs a "
                              "C++17 patch on torch >= 2.1: `make install` builds it), or use "
                              "the torchrun backend") from None
        return getattr(module, name)
    raise AttributeError(f"module 'hvd_resilient' has no attribute {name!r}")
