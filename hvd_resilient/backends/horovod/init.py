"""Starting Horovod the right way for the launcher that started this process.

Under `mpirun`/`srun` (a static MPI world) Horovod runs on its MPI controller over mpi4py's
COMM_WORLD, or a sub-communicator the user passes; under `horovodrun` elastic it must be Gloo
(MPI cannot change its world). Horovod would pick by itself in most cases; being explicit makes
the mpi4py communicator the one Horovod uses, so user code can mix mpi4py calls safely.

With ``deterministic=True`` (the backend's, from `TrainConfig.deterministic`) the gradient
reductions get a fixed order before Horovod starts (`determinism.horovod_env`): for the
Horovod backend, whose optimizer reduces all gradients as one group in parameter order
(`ordered=True`), groups are fused alone and in their order; for anyone else's optimizer
tensor fusion is off. Horovod reads those settings from the process environment, so the
re-inits after elastic resets keep them.
"""

from __future__ import annotations

import os
from typing import Any

import horovod.torch as hvd

from hvd_resilient.backends import determinism
from hvd_resilient.backends.horovod import pinned_handles
from hvd_resilient.backends.horovod.compat import check_compatible


def launched_by_mpi(env: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    gloo = "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env
    mpi = any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
    return mpi and not gloo


def init(comm: Any | None = None, *, ordered: bool = False, deterministic: bool = False) -> None:
    """``ordered``: the caller reduces its gradients with `ordered.ordered_optimizer`;
    ``deterministic``: reduce them in a fixed order (docs/determinism.md)."""
    check_compatible(driver=False)
    if determinism.apply(deterministic):  # before hvd.init: Horovod reads it there
        determinism.horovod_env(ordered)
    if comm is None and launched_by_mpi():
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    if comm is None:
        hvd.init()
    else:
        hvd.init(comm=comm)
    pinned_handles.install()
