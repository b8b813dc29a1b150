"""An mpirun rank forked from a warm process: a relaunch without the cold start.

    mpirun ... python -m hvd_resilient.launch.warm.mpirun python train.py ARGS

mpirun cannot lose a rank: one dead rank ends the job, and `hvd-resilient run` relaunches it
from the last commit. Measured here (2 ranks, examples/digits.py), 2.8 s of the 5.3 s from a
kill to the first step went to the relaunched ranks importing torch, Horovod and the script's
libraries. `hvd-resilient run --launcher mpi` therefore starts a warm pool on its machine
(`warm/pool_server.py`, asked in "script" mode: the script runs at once,
with no standby wait) before the first launch, and mpirun starts each rank through this module: a
stdlib-only stand-in that hands the pool its command, environment, folder and standard
streams, and then stands in for the forked rank until it ends (signals passed on, its exit
code or signal taken on). mpirun and its daemons see the stand-in; MPI itself is initialized
in the forked rank from the environment mpirun gave (the pool never initializes MPI: it does
not import mpi4py, and refuses to fork if something did).

A rank on a machine without a pool, a command that is not `python script.py` with this very
Python, or `HVD_RESILIENT_MPI_WARM=0` run exactly as given (exec).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from hvd_resilient.launch.warm import pool as warm_pool
from hvd_resilient.launch.warm.standby import runnable_here

ENV = "HVD_RESILIENT_MPI_WARM"
"""`0`: `hvd-resilient run --launcher mpi` starts no pool, and every rank starts cold."""


def enabled(env: Mapping[str, str]) -> bool:
    return env.get(ENV, "1") != "0"


def wrap(train_cmd: list[str]) -> list[str]:
    """The rank's command under mpirun: through this module when the pool can serve it."""
    if not runnable_here(train_cmd) or train_cmd[1] == "-m":
        return train_cmd
    return [sys.executable, "-m", "hvd_resilient.launch.warm.mpirun", *train_cmd]


def main() -> None:
    cmd = sys.argv[1:]
    if not cmd:
        sys.exit("usage: python -m hvd_resilient.launch.warm.mpirun python train.py [ARGS]")
    if enabled(os.environ):
        warm_pool.run_in_pool(cmd, "script")  # exits as the forked rank did, when a pool served it
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
