"""`--launcher torchrun`: torchrun with c10d rendezvous, its workers forked from the agent with
their imports done (`launch/warm/torchrun.py`); torchrun restarts the round in the job, and
`hvd-resilient run` relaunches once its restarts are spent.

torchrun's workers are in its process group, and torchrun answers SIGTERM by stopping them: a
signal to `hvd-resilient run` goes to the whole group, as it came. A job of several nodes runs
one `hvd-resilient run` per node, all on one run: they share its lease under the job's name.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.executables import require
from hvd_resilient.launch.run_options import RunOptions
from hvd_resilient.settings import setting


@dataclass(kw_only=True)
class TorchrunOptions:
    """Options of `--launcher torchrun` only."""

    nnodes: str = "1"
    """Torchrun: N or MIN:MAX nodes."""
    rdzv_endpoint: str = setting("127.0.0.1:29400", metavar="HOST:PORT")
    """Torchrun: where the c10d rendezvous listens."""
    torchrun_restarts: int = 3
    """Torchrun: in-job restarts before the supervisor relaunches."""


def torchrun_command(nproc_per_node: int, nnodes: str, rdzv_endpoint: str, max_restarts: int,
                     run_id: str, train_cmd: list[str]) -> list[str]:
    """torchrun with c10d rendezvous, through `launch/warm/torchrun.py` (restarted workers are
    forked from the agent with torch imported). `last_call_timeout=1`: with --nnodes MIN:MAX
    torchrun otherwise waits 30 s for late nodes at every (re)start, even when all are
    there."""
    if train_cmd[:1] and Path(train_cmd[0]).name.startswith("python"):
        train_cmd = train_cmd[1:]  # torchrun runs the script with its own interpreter
    require("torchrun", "run `make install` or activate .venv")  # torch's launcher is there
    return [sys.executable, "-m", "hvd_resilient.launch.warm.torchrun",
            "--nnodes", nnodes, "--nproc-per-node", str(nproc_per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", "last_call_timeout=1",
            "--max-restarts", str(max_restarts), *train_cmd]


class Torchrun:
    name: ClassVar[str] = "torchrun"
    options: ClassVar[type] = TorchrunOptions
    shared: ClassVar[frozenset[str]] = frozenset()
    stop_signal: ClassVar[signal.Signals | None] = None
    signal_group: ClassVar[bool] = True

    def __init__(self, own: TorchrunOptions) -> None:
        self.own = own

    def nodes(self) -> list[str]:
        return str(self.own.nnodes or "1").split(":")

    def check(self, opts: RunOptions) -> None:
        if self.own.torchrun_restarts < 0:
            raise ConfigError(f"run: --torchrun-restarts must be >= 0, got "
                              f"{self.own.torchrun_restarts}")
        nodes = self.nodes()
        if (len(nodes) > 2 or not all(n.isdigit() and int(n) >= 1 for n in nodes)
                or int(nodes[0]) > int(nodes[-1])):
            raise ConfigError(f"run: --nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got "
                              f"{self.own.nnodes!r}")

    def probe(self, opts: RunOptions) -> None:
        """Nothing to reach ahead: torchrun finds its nodes at the rendezvous."""

    def command(self, opts: RunOptions, env_names: list[str]) -> list[str]:
        """torchrun passes its whole environment on: ``env_names`` is not needed."""
        own = self.own
        return torchrun_command(opts.np, own.nnodes, own.rdzv_endpoint, own.torchrun_restarts,
                                opts.run_id, opts.command)

    def environment(self, opts: RunOptions) -> dict[str, str]:
        return {}

    def wants_warm_pool(self, opts: RunOptions, env: Mapping[str, str]) -> bool:
        """Its workers fork from its own agent (`launch/warm/torchrun.py`), not from a pool."""
        return False

    def lease_group(self, opts: RunOptions) -> str | None:
        """Several nodes (--nnodes up to more than 1): the supervisors of the job, one per node,
        share the run's lease under the job's name (its run id and rendezvous endpoint), with
        one epoch."""
        if int(self.nodes()[-1]) > 1:
            return f"torchrun:{opts.run_id}:{self.own.rdzv_endpoint}"
        return None
