"""Where this process stands, as its launcher says: its rank and world size, before (or
without) a backend.

horovodrun, Open MPI, MPICH/Intel MPI, torchrun and srun each name them differently; the
in-place agent names no rank at all (see `launcher_rank`). Read where no backend is up yet, or
where none ever will be: the `fatal` event of an error at startup carries the rank that hit it,
a script prints its banner on one rank only, and one rank writes what all of them then read.
A module of its own above the backends (the in-place answer is read from the agent's store
through `backends.inplace.membership`); the variables' names are `launcher_env`'s, which
every layer may import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hvd_resilient.launcher_env import INPLACE_MEMBER_ENV

RANK_ENVS = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK", "SLURM_PROCID")
"""Where a process finds its rank: horovodrun, Open MPI, MPICH/Intel MPI, torchrun, srun."""

SIZE_ENVS = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE", "SLURM_NTASKS")
"""Where it finds the world size, in the same order."""


INPLACE_LOOKUP_TIMEOUT_S = 10.0
"""How long an in-place worker's `launcher_rank`/`launcher_size` wait for the agent's store
(to connect, and for the first generation to be published) before they answer None."""


def _first_number(env: Mapping[str, str] | None, names: tuple[str, ...]) -> int | None:
    env = os.environ if env is None else env
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def _inplace(env: Mapping[str, str]) -> tuple[int | None, int | None] | None:
    """(rank, size) of an in-place worker as the agent's newest generation has them; None for
    a process the agent did not start."""
    if INPLACE_MEMBER_ENV not in env:
        return None
    # Only in-place workers get here, and they import torch.distributed anyway.
    from hvd_resilient.backends.inplace.membership import newest_place

    try:
        return newest_place(env, INPLACE_LOOKUP_TIMEOUT_S)
    except (RuntimeError, OSError, KeyError, ValueError):  # the agent is gone, or no address
        return None, None



def launcher_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher set it (None: not started by a known launcher).

    Under the in-place agent it is the worker's position in the newest generation's member
    list, read from the agent's store at each call (None while the worker is in none: a
    standby or replacement not taken in yet, or a member the others went on without). No
    variable can hold it: the agent starts each worker once, naming it by a member id
    (`INPLACE_MEMBER_ENV`), and the ranks change inside the running workers whenever a
    generation loses or takes in a member. A RANK set at the start would go on saying 2 in the
    worker that is rank 1 of the next generation, and would name no rank at all in a
    replacement, whose id lies beyond the world size; so the agent sets none, and this reads
    the agent's own names. It is looked at first: an agent started under srun or mpirun passes
    their (per-machine) variables on to every worker it starts.
    """
    env = os.environ if env is None else env
    inplace = _inplace(env)
    return inplace[0] if inplace is not None else _first_number(env, RANK_ENVS)


def launcher_size(env: Mapping[str, str] | None = None) -> int | None:
    """The world size as the launcher set it (None: not started by a known launcher); under
    the in-place agent, how many members its newest generation has (see `launcher_rank`)."""
    env = os.environ if env is None else env
    inplace = _inplace(env)
    return inplace[1] if inplace is not None else _first_number(env, SIZE_ENVS)
