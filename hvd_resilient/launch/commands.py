"""Launcher command lines other than elastic horovodrun: static horovodrun and mpirun."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hvd_resilient.errors import LaunchError


def require(exe: str, hint: str) -> str:
    """The launcher beside this Python first (a venv not activated), then PATH."""
    beside = Path(sys.executable).parent / exe
    path = str(beside) if os.access(beside, os.X_OK) else shutil.which(exe)
    if path is None:
        raise LaunchError(f"{exe} not found on PATH: {hint}")
    return path


def hosts_arg(hosts: list[tuple[str, int]]) -> str:
    return ",".join(f"{h}:{n}" for h, n in hosts)


def horovodrun_static(np: int, hosts: list[tuple[str, int]] | None,
                      network_interface: str | None, train_cmd: list[str]) -> list[str]:
    """horovodrun's arguments, run through `hvd_resilient.launch.horovod.driver` (Horovod's
    launcher in-process): a failed worker ends in one line instead of the launcher's
    traceback, and in none when the worker stopped on a fatal error it reported itself."""
    require("horovodrun", "run `make install` or activate .venv")  # Horovod is installed
    cmd = [sys.executable, "-m", "hvd_resilient.launch.horovod.driver", "-np", str(np), "--gloo"]
    if hosts:
        cmd += ["-H", hosts_arg(hosts)]
    if network_interface:
        cmd += ["--network-interface", network_interface]
    return cmd + train_cmd


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


def inplace_command(nproc: int, min_np: int, train_cmd: list[str], *,
                    replace: bool = False, standby: int = 0) -> list[str]:
    """The in-place agent (`launch/inplace_agent.py`) on this machine: ``nproc`` workers,
    the job ending (for a relaunch) below ``min_np``; ``replace``: a new worker for each one
    lost; ``standby``: that many more, set up and waiting to take a lost one's place."""
    return [sys.executable, "-m", "hvd_resilient.launch.inplace_agent", "--nproc", str(nproc),
            "--min-np", str(min_np), *(["--replace"] if replace else []),
            *(["--standby", str(standby)] if standby else []), "--", *train_cmd]


def torchrun_command(nproc_per_node: int, nnodes: str, rdzv_endpoint: str, max_restarts: int,
                     run_id: str, train_cmd: list[str]) -> list[str]:
    """torchrun with c10d rendezvous, through `torchrun_warm` (restarted workers are forked
    from the agent with torch imported). `last_call_timeout=1`: with --nnodes MIN:MAX torchrun
    otherwise waits 30 s for late nodes at every (re)start, even when all are there."""
    if train_cmd[:1] and Path(train_cmd[0]).name.startswith("python"):
        train_cmd = train_cmd[1:]  # torchrun runs the script with its own interpreter
    require("torchrun", "run `make install` or activate .venv")  # torch's launcher is there
    return [sys.executable, "-m", "hvd_resilient.launch.torchrun_warm",
            "--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", "last_call_timeout=1",
            "--max-restarts", str(max_restarts), *train_cmd]
