"""The collective layer under the trainer: Horovod (elastic or MPI), torch.distributed under
torchrun, or torch.distributed in place (generations under the in-place agent); the last two
build on the torch.distributed base in `torchdist/`.

`detect()` reads which launcher started this process; the trainer and the durable checkpoints
talk to whichever backend through the small interface in `base.py`, and ask a backend's class
what it can do (`Backend.supports_fsdp`), never its name. Every backend's `run` goes through
the one recovery loop in `recovery.py`, filling its `World`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping

from hvd_resilient.backends.base import Backend
from hvd_resilient.config import RecoveryOptions
from hvd_resilient.errors import ConfigError

Factory = Callable[..., Backend]
"""Builds a backend from ``fsdp=``, ``recovery=`` (a `RecoveryOptions`) and
``deterministic=``."""


def _horovod(*, fsdp: bool, recovery: RecoveryOptions, deterministic: bool) -> Backend:
    from hvd_resilient.backends.horovod.backend import HorovodBackend

    return HorovodBackend(heartbeat_timeout_s=recovery.heartbeat_timeout_seconds,
                          deterministic=deterministic,
                          host_check_every=recovery.host_check_every)


def _torchrun(*, fsdp: bool, recovery: RecoveryOptions, deterministic: bool) -> Backend:
    from hvd_resilient.backends.torchrun.backend import TorchrunBackend

    return TorchrunBackend(fsdp=fsdp, pg_timeout_seconds=recovery.pg_timeout_seconds,
                           heartbeat_timeout_s=recovery.heartbeat_timeout_seconds,
                           deterministic=deterministic)


def _inplace(*, fsdp: bool, recovery: RecoveryOptions, deterministic: bool) -> Backend:
    from hvd_resilient.backends.inplace.backend import InPlaceBackend

    return InPlaceBackend(pg_timeout_seconds=recovery.pg_timeout_seconds,
                          heartbeat_timeout_s=recovery.heartbeat_timeout_seconds,
                          generation_timeout_s=recovery.generation_timeout_seconds,
                          deterministic=deterministic, fsdp=fsdp)


_REGISTRY: dict[str, Factory] = {"horovod": _horovod, "torchrun": _torchrun,
                                 "inplace": _inplace}
"""name -> factory; a factory imports its backend only when called (Horovod is optional)."""
NAMES = tuple(_REGISTRY)


def register(name: str, factory: Factory) -> None:
    """Adds a backend under ``name`` (docs/extending.md); a second one of a name is refused."""
    if name in _REGISTRY:
        raise ValueError(f"a backend named {name!r} is registered already")
    _REGISTRY[name] = factory


def names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


INPLACE_AGENT_ENV = "HVD_RESILIENT_AGENT"
"""Set by the in-place agent for its workers (`backends.inplace.membership.AGENT_ENV`)."""


def detect(env: Mapping[str, str] = os.environ) -> str:
    """The in-place agent and torchrun (TORCHELASTIC_RUN_ID) say so; everything else
    (horovodrun, mpirun, srun, a plain single process) runs on Horovod."""
    if INPLACE_AGENT_ENV in env:
        return "inplace"
    return "torchrun" if "TORCHELASTIC_RUN_ID" in env else "horovod"


def get(name: str | Backend | None = None, *, fsdp: bool = False,
        recovery: RecoveryOptions | None = None, deterministic: bool = False) -> Backend:
    """The backend called ``name`` (default: the launcher's), or ``name`` itself when it is a
    backend instance. ``fsdp`` shards the model (a backend whose class declares
    `Backend.supports_fsdp`: asking for it on Horovod is a ConfigError, before anything
    starts); ``recovery`` carries the detection settings (timeouts, heartbeats) from the
    config; ``deterministic`` reduces gradients in a fixed order (a backend instance must have
    been built with it: it is never switched on later)."""
    if isinstance(name, Backend):
        if deterministic and not name.deterministic:
            raise ConfigError(f"--deterministic: the {name.name} backend passed in was built "
                              "without deterministic=True")
        return name
    recovery = recovery or RecoveryOptions()
    name = name or detect()
    if name not in _REGISTRY:
        raise ConfigError(f"backend must be one of {', '.join(_REGISTRY)}, got {name!r}")
    try:
        backend = _REGISTRY[name](fsdp=fsdp, recovery=recovery, deterministic=deterministic)
    except ModuleNotFoundError:
        if fsdp:  # Horovod not installed: the class cannot be asked, and FSDP is the mistake
            raise ConfigError(_no_fsdp(name)) from None
        raise
    if fsdp and not backend.supports_fsdp:
        raise ConfigError(_no_fsdp(backend.name))
    return backend


def _no_fsdp(backend: str) -> str:
    """FSDP needs torch.distributed's collectives and DTensors; Horovod (horovodrun, mpirun)
    only averages replicated gradients, so the combination is refused in one line, after the
    backend is built (nothing joined yet) and before anything starts."""
    return (f"config: fsdp needs the torchrun or inplace backend, this job runs on {backend} "
            "(launch it with torchrun or `hvd-resilient run --launcher torchrun|inplace`, or "
            "drop --fsdp / HVD_RESILIENT_FSDP)")


__all__ = ["Backend", "NAMES", "detect", "get", "names", "register"]
