"""The launchers `hvd-resilient run` can start a job with, one module each, found by name.

Each module declares its own section of the options (the options only it takes), its checks,
its command line, its environment, its warm pool, its stop signal and its group signalling
(the `Launcher` protocol, `base.py`). Adding a launcher is a module here and its line below
(and its section in `launch/run_settings.py`); nothing else branches on a launcher's name.
"""

from __future__ import annotations

from hvd_resilient.launch.launchers.base import Launcher
from hvd_resilient.launch.launchers.horovod import Horovod
from hvd_resilient.launch.launchers.inplace import Inplace
from hvd_resilient.launch.launchers.mpi import Mpi
from hvd_resilient.launch.launchers.torchrun import Torchrun

__all__ = ["LAUNCHERS", "Launcher", "owners"]

LAUNCHERS: dict[str, type[Launcher]] = {
    cls.name: cls for cls in (Horovod, Mpi, Torchrun, Inplace)}
"""`--launcher` name -> the launcher; the first is the default."""


def owners(option: str) -> tuple[str, ...]:
    """The launchers that take ``option`` (a flat option name), in registry order; () when
    every launcher takes it."""
    from dataclasses import fields

    own = tuple(n for n, cls in LAUNCHERS.items()
                if option in {f.name for f in fields(cls.options)} or option in cls.shared)
    return () if len(own) == len(LAUNCHERS) else own
