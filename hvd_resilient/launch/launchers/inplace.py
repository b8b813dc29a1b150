"""`--launcher inplace`: the in-place agent (`launch/inplace_agent.py`) on this machine; the
survivors of a fault keep their processes and go on in the next generation, and below
--min-np the agent ends the job for `hvd-resilient run` to relaunch.

The agent passes a signal on to every worker itself, and its workers are in its process group:
a signal to `hvd-resilient run` goes to the group, as it came. It runs on this machine only
for now: --hosts is not among the options it takes.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.run_options import RunOptions


@dataclass(kw_only=True)
class InplaceOptions:
    """Options of `--launcher inplace` only."""

    replace: bool = False
    """Inplace: start a new worker for each one lost; it joins the others at their next commit
    once it is up (default: train on without it)."""
    standby: int = 0
    """Inplace: K more workers started at launch that set up and wait; a lost worker's place
    goes to one of them in the generation that answers the fault, without an import."""


def inplace_command(nproc: int, min_np: int, train_cmd: list[str], *,
                    replace: bool = False, standby: int = 0) -> list[str]:
    """The in-place agent on this machine: ``nproc`` workers, the job ending (for a relaunch)
    below ``min_np``; ``replace``: a new worker for each one lost; ``standby``: that many more,
    set up and waiting to take a lost one's place."""
    return [sys.executable, "-m", "hvd_resilient.launch.inplace_agent", "--nproc", str(nproc),
            "--min-np", str(min_np), *(["--replace"] if replace else []),
            *(["--standby", str(standby)] if standby else []), "--", *train_cmd]


class Inplace:
    name: ClassVar[str] = "inplace"
    options: ClassVar[type] = InplaceOptions
    shared: ClassVar[frozenset[str]] = frozenset({"min_np"})
    stop_signal: ClassVar[signal.Signals | None] = None
    signal_group: ClassVar[bool] = True

    def __init__(self, own: InplaceOptions) -> None:
        self.own = own

    def check(self, opts: RunOptions) -> None:
        if self.own.standby < 0:
            raise ConfigError(f"run: --standby must be >= 0, got {self.own.standby}")

    def probe(self, opts: RunOptions) -> None:
        """Nothing to reach ahead: every worker runs on this machine."""

    def command(self, opts: RunOptions, env_names: list[str]) -> list[str]:
        """The agent passes its whole environment on: ``env_names`` is not needed."""
        return inplace_command(opts.np, opts.min_np or 1, opts.command,
                               replace=self.own.replace, standby=self.own.standby)

    def environment(self, opts: RunOptions) -> dict[str, str]:
        return {}

    def wants_warm_pool(self, opts: RunOptions, env: Mapping[str, str]) -> bool:
        """Its standbys (--standby) are started at launch and wait: no pool."""
        return False

    def lease_group(self, opts: RunOptions) -> str | None:
        return None
