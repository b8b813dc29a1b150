"""A process's rank and world size as its launcher set them, before (or without) a backend.

horovodrun, Open MPI, MPICH/Intel MPI, torchrun and srun each name them differently. Read where
no backend is up yet, or where none ever will be: the `fatal` event of an error at startup
carries the rank that hit it, and a script prints its banner on one rank only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RANK_ENVS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK", "SLURM_PROCID")
"""Where a process finds its rank: horovodrun, Open MPI, MPICH/Intel MPI, torchrun, srun."""

SIZE_ENVS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE", "SLURM_NTASKS")
"""Where it finds the world size, in the same order."""

FORKED_ENV = "HVD_RESILIENT_FORKED_PID"
"""Set by a warm pool in each worker it forks, to that worker's pid: a process that finds its
own pid there started warm (its `start` event says so); a child it starts inherits a pid that
is not its own."""


def _first_number(env: Mapping[str, str] | None, names: tuple[str, ...]) -> int | None:
    env = os.environ if env is None else env
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def launcher_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher set it (None: not started by a known launcher)."""
    return _first_number(env, RANK_ENVS)


def launcher_size(env: Mapping[str, str] | None = None) -> int | None:
    """The world size as the launcher set it (None: not started by a known launcher)."""
    return _first_number(env, SIZE_ENVS)
