"""The environment variables a launcher and `hvd-resilient run` give a worker, named once,
and the job id a launch's processes share.

Imported from every layer (the backends, the tiers, the launcher), so it imports nothing of
the package: what a process's rank and size are under each launcher is `launcher_place`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

INPLACE_MEMBER_ENV = "HVD_RESILIENT_MEMBER"
"""Set by the in-place agent in each worker it starts: the worker's member id (never reused),
which is not its rank (`backends.inplace.membership.MEMBER_ENV` is this name)."""

FORKED_ENV = "HVD_RESILIENT_FORKED_PID"
"""Set by a warm pool in each worker it forks, to that worker's pid: a process that finds its
own pid there started warm (its `start` event says so); a child it starts inherits a pid that
is not its own."""

RUN_DIR_ENV = "HVD_RESILIENT_RUN_DIR"
"""The run folder `hvd-resilient run` gives every process of its job (events, hangs, lease)."""
RUN_ID_ENV = "HVD_RESILIENT_RUN_ID"
"""The run's id, likewise: set only under `hvd-resilient run`."""


JOB_ID_ENVS = (("torchrun", ("TORCHELASTIC_RUN_ID",)),
               ("horovod", ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT")),
               ("slurm", ("SLURM_JOB_ID", "SLURM_STEP_ID")),
               ("mpi", ("PMIX_NAMESPACE",)),
               ("mpi", ("OMPI_MCA_orte_ess_jobid",)))
"""Where the processes of one launch find a name they share and no other launch has: torchrun's
run id, Horovod's rendezvous server (its driver's address and port), Slurm's job and step,
Open MPI's PMIx namespace or job id."""


def launcher_job_id(env: Mapping[str, str] | None = None) -> str | None:
    """A name every process of this launch shares and no other launch has (None: not started
    by a known launcher, or by one that names none)."""
    env = os.environ if env is None else env
    for kind, names in JOB_ID_ENVS:
        values = [env.get(n, "") for n in names]
        if all(values):
            return f"{kind}:{':'.join(values)}"
    return None
