"""The `horovodrun` command lines, elastic and static, with the flags that matter made explicit.

Horovod's defaults are tuned for a cluster of many hosts; on one machine or a small cluster
they hang (no `--network-interface`: it waits forever for a second host to detect interfaces)
or give up (a failed host is blacklisted, so one dead worker on a single host ends the job:
hence slot hosts, on by default). Every flag we set is visible in `--dry-run` output.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.executables import require


@dataclass(kw_only=True)
class ElasticLaunch:
    np: int
    min_np: int
    max_np: int
    discovery_script: str | None = None
    hosts: str | None = None
    """Fixed hosts `h1:2,h2:2` instead of a discovery script (horovodrun -H, elastic)."""
    network_interface: str | None = None
    gloo_timeout_seconds: int = 30
    """How long a collective waits for a peer before the survivors give up on it."""
    blacklist_cooldown: tuple[int, int] | None = (10, 30)
    """A failed host is readmitted after a random wait in this range (None: never)."""
    reset_limit: int | None = None
    elastic_timeout: int = 600
    start_timeout: int = 120
    slot_hosts: bool = True
    """Blacklist and refill per slot, not per host (see `slot_hosts`)."""

    def __post_init__(self) -> None:
        if self.min_np < 1:
            raise ConfigError(f"launch: --min-np must be >= 1, got {self.min_np}")
        if self.max_np < self.min_np:
            raise ConfigError(
                f"launch: --min-np ({self.min_np}) is larger than --max-np ({self.max_np})"
            )
        if not self.min_np <= self.np <= self.max_np:
            raise ConfigError(
                f"launch: --np {self.np} must lie between --min-np {self.min_np} and "
                f"--max-np {self.max_np}"
            )
        if (self.discovery_script is None) == (self.hosts is None):
            raise ConfigError("launch: an elastic job needs a discovery script or fixed hosts "
                              "(one of the two)")
        path = self.discovery_script
        if path is not None and not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise ConfigError(
                f"launch: discovery script {path!r} is not an executable file "
                f"(chmod +x it, or pass the full path)"
            )
        if self.gloo_timeout_seconds < 1:
            raise ConfigError("launch: --gloo-timeout-seconds must be >= 1")
        if self.blacklist_cooldown is not None:
            lo, hi = self.blacklist_cooldown
            if not 0 < lo <= hi:
                raise ConfigError("launch: --blacklist-cooldown-range needs 0 < MIN <= MAX")


def horovodrun_command(launch: ElasticLaunch, train_cmd: list[str]) -> list[str]:
    if launch.slot_hosts:
        require("horovodrun", "run `make install` (or activate .venv)")  # Horovod is there
        exe = [sys.executable, "-m", "hvd_resilient.launch.horovod.driver"]
    else:
        exe = [require("horovodrun", "run `make install` (or activate .venv)")]
    cmd = [
        *exe, "-np", str(launch.np), "--min-np", str(launch.min_np),
        "--max-np", str(launch.max_np),
        *(["--host-discovery-script", os.path.abspath(launch.discovery_script)]
          if launch.discovery_script else ["-H", str(launch.hosts)]),
        "--gloo-timeout-seconds", str(launch.gloo_timeout_seconds),
        "--elastic-timeout", str(launch.elastic_timeout),
        "--start-timeout", str(launch.start_timeout),
    ]
    if launch.network_interface:
        cmd += ["--network-interface", launch.network_interface]
    if launch.blacklist_cooldown is not None:
        cmd += ["--blacklist-cooldown-range", *map(str, launch.blacklist_cooldown)]
    if launch.reset_limit is not None:
        cmd += ["--reset-limit", str(launch.reset_limit)]
    return cmd + list(train_cmd)


def horovodrun_static(np: int, hosts: str | None, network_interface: str | None,
                      train_cmd: list[str]) -> list[str]:
    """horovodrun's arguments for a static job (``hosts``: `h1:2,h2:2`, None: this machine),
    run through `hvd_resilient.launch.horovod.driver` (Horovod's launcher in-process): a failed
    worker ends in one line instead of the launcher's traceback, and in none when the worker
    stopped on a fatal error it reported itself."""
    require("horovodrun", "run `make install` or activate .venv")  # Horovod is installed
    cmd = [sys.executable, "-m", "hvd_resilient.launch.horovod.driver", "-np", str(np), "--gloo"]
    if hosts:
        cmd += ["-H", hosts]
    if network_interface:
        cmd += ["--network-interface", network_interface]
    return cmd + train_cmd
