"""The collective layer under the trainer: Horovod (elastic or MPI) or torch.distributed.

`detect()` reads which launcher started this process; the trainer and the durable checkpoints
talk to whichever backend through the small interface in `base.py`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hvd_resilient.backends.base import Backend
from hvd_resilient.config import RecoveryOptions
from hvd_resilient.errors import ConfigError

NAMES = ("horovod", "torchrun")


def detect(env: Mapping[str, str] = os.environ) -> str:
    """torchrun sets TORCHELASTIC_RUN_ID; everything else (horovodrun, mpirun, srun, a plain
    single process) runs on Horovod."""
    return "torchrun" if "TORCHELASTIC_RUN_ID" in env else "horovod"


def get(name: str | None = None, *, fsdp: bool = False,
        recovery: RecoveryOptions | None = None) -> Backend:
    """The backend called ``name`` (default: the launcher's). ``fsdp`` shards the model
    (torchrun only: asking for it on Horovod is a ConfigError, before anything starts);
    ``recovery`` carries the detection settings (timeouts, heartbeats) from the config."""
    recovery = recovery or RecoveryOptions()
    name = name or detect()
    if fsdp and name in NAMES:
        from hvd_resilient.backends.torchrun.fsdp import require_torchrun

        require_torchrun(name)
    if name == "horovod":
        from hvd_resilient.backends.horovod.backend import HorovodBackend

        return HorovodBackend(heartbeat_timeout_s=recovery.heartbeat_timeout_seconds)
    if name == "torchrun":
        from hvd_resilient.backends.torchrun.backend import TorchDistBackend

        return TorchDistBackend(fsdp=fsdp, pg_timeout_seconds=recovery.pg_timeout_seconds,
                                heartbeat_timeout_s=recovery.heartbeat_timeout_seconds)
    raise ConfigError(f"backend must be one of {', '.join(NAMES)}, got {name!r}")


__all__ = ["Backend", "NAMES", "detect", "get"]
