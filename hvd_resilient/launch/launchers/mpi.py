"""`--launcher mpi`: Open MPI's mpirun, a static world that `hvd-resilient run` relaunches
whole when a rank dies.

It takes no option of its own: its ranks' warm start is on unless `HVD_RESILIENT_MPI_WARM=0`
(`launch/warm/mpirun.py`). A SIGTERM or SIGINT to `hvd-resilient run` reaches mpirun as
SIGUSR1, which mpirun passes on to every rank on every host: the preemption path, a final
checkpoint. mpirun's own answer to SIGTERM is to kill its ranks, with no time for that
checkpoint.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from hvd_resilient.errors import LaunchError
from hvd_resilient.launch.executables import require
from hvd_resilient.launch.hosts import check_hosts_reachable, hosts_arg, parse_hosts
from hvd_resilient.launch.run_options import RunOptions
from hvd_resilient.launch.warm import mpirun as mpi_warm


@dataclass(kw_only=True)
class MpiOptions:
    """Options of `--launcher mpi` only: none (--hosts and --ssh-port it shares with horovod)."""


def mpirun_command(np: int, hosts: list[tuple[str, int]] | None, env_names: list[str],
                   train_cmd: list[str]) -> list[str]:
    """Open MPI's mpirun; every HVD_RESILIENT_/AWS_ variable is forwarded with -x."""
    cmd = [require("mpirun", "install Open MPI (apt-get install openmpi-bin)"), "-np", str(np),
           "--bind-to", "none", "--tag-output",
           # When a rank dies, mpirun ends the others with SIGTERM and then sleeps this long
           # (1 s by default, whether they are gone or not) before SIGKILL. Their state is in
           # the memory tier, and a preemption reaches them as SIGUSR1 (the supervisor's
           # graceful signal), not through this: the second is pure delay.
           "--mca", "odls_base_sigkill_timeout", "0"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    if hosts:
        cmd += ["-H", hosts_arg(hosts)]
        if sum(n for _, n in hosts) < np:
            raise LaunchError(f"--np {np} is more than the {sum(n for _, n in hosts)} slots "
                              f"in --hosts {hosts_arg(hosts)}")
    else:
        cmd.append("--oversubscribe")  # one machine: as many ranks as asked, whatever its cores
    for name in sorted(env_names):
        cmd += ["-x", name]
    return cmd + train_cmd


class Mpi:
    name: ClassVar[str] = "mpi"
    options: ClassVar[type] = MpiOptions
    shared: ClassVar[frozenset[str]] = frozenset({"hosts", "ssh_port"})
    stop_signal: ClassVar[signal.Signals | None] = signal.SIGUSR1
    signal_group: ClassVar[bool] = True

    def __init__(self, own: MpiOptions) -> None:
        self.own = own

    def check(self, opts: RunOptions) -> None:
        """Nothing beyond what every launcher's options are checked for."""

    def probe(self, opts: RunOptions) -> None:
        if opts.hosts:
            check_hosts_reachable(parse_hosts(opts.hosts), opts.ssh_port)

    def command(self, opts: RunOptions, env_names: list[str]) -> list[str]:
        """Each rank through the warm pool's stand-in where the pool can run its command."""
        train = opts.command
        if mpi_warm.enabled(os.environ):
            train = mpi_warm.wrap(train)
        hosts = parse_hosts(opts.hosts) if opts.hosts else None
        return mpirun_command(opts.np, hosts, env_names, train)

    def environment(self, opts: RunOptions) -> dict[str, str]:
        return {}

    def wants_warm_pool(self, opts: RunOptions, env: Mapping[str, str]) -> bool:
        """mpirun relaunches every rank after a failure: a pool held across launches forks
        this machine's ranks of each with their imports done, unless turned off
        (`HVD_RESILIENT_MPI_WARM=0`) or the command is not one it can run."""
        return mpi_warm.enabled(env) and mpi_warm.wrap(opts.command) != opts.command

    def lease_group(self, opts: RunOptions) -> str | None:
        return None
