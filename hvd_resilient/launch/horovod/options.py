"""The driver's switches, read once where the driver starts.

The driver runs in its own process, started in horovodrun's place (by `hvd-resilient run`,
or by hand), so its switches cross that boundary in the environment, and the ssh settings in
horovodrun's own arguments. `DriverOptions.read` reads both, once, at the driver's entry;
the patch families are handed the result and read no environment themselves.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from hvd_resilient.backends.horovod import driver_kv
from hvd_resilient.errors import LaunchError
from hvd_resilient.launcher_env import RUN_DIR_ENV

SLOT_HOSTS_ENV = "HVD_RESILIENT_SLOT_HOSTS"
"""`0`: blacklist whole hosts on a failure, as plain horovodrun (`--no-slot-hosts` sets it)."""
STANDBY_ENV = "HVD_RESILIENT_STANDBY"
"""`0`: no standby workers; added hosts start cold at the reset."""
WARM_POOL_ENV = "HVD_RESILIENT_WARM_POOL"
"""`1`: a warm pool on the driver's machine forks its workers (`--warm-pool` sets it)."""
INTERVAL_ENV = "HVD_RESILIENT_DISCOVERY_INTERVAL"
"""Seconds between runs of the discovery script (unset: Horovod's 1 s)."""
WATCH_ENV = "HVD_RESILIENT_DISCOVERY_WATCH"
"""A file the discovery script reads: the script runs as soon as it changes
(`--discovery-watch` sets it)."""
"""The run folder `hvd-resilient run` gives the job: the driver's events go to its log."""

INTERVAL_RANGE_S = (0.05, 3600.0)


@dataclass(frozen=True, kw_only=True)
class DriverOptions:
    slot_hosts: bool = True
    """Every slot its own host (`backends/horovod/slots.py`)."""
    standby: bool = True
    """Newcomers started ahead of the reset (`patches/standby_slots.py`)."""
    warm_pool: bool = False
    """The standbys of this machine forked from a warm pool (`warm_pool_server.py`)."""
    discovery_interval_s: float | None = None
    """How often Horovod runs the discovery script; None keeps Horovod's 1 s."""
    discovery_watch: str | None = None
    """A file whose change runs the discovery script at once (`patches/discovery_watch.py`)."""
    run_dir: str = ""
    """The run folder ("" outside `hvd-resilient run`: no event log)."""
    ssh_port: str | None = None
    """horovodrun's -p/--ssh-port, for killing a frozen remote worker."""
    ssh_identity: str | None = None
    """horovodrun's -i/--ssh-identity-file, likewise."""
    standby_ready_timeout_s: float = driver_kv.READY_TIMEOUT_S
    """How long a reset waits for a standby's warm-up before releasing it anyway."""

    @classmethod
    def read(cls, env: Mapping[str, str] | None = None,
             argv: list[str] | None = None) -> DriverOptions:
        """The switches from `env` (default: this process's) and horovodrun's arguments;
        raises LaunchError (one line) on a value it cannot use."""
        env = os.environ if env is None else env
        port, identity = ssh_settings(argv or [])
        return cls(slot_hosts=env.get(SLOT_HOSTS_ENV, "1") != "0",
                   standby=env.get(STANDBY_ENV, "1") != "0",
                   warm_pool=env.get(WARM_POOL_ENV, "0") == "1",
                   discovery_interval_s=_interval(env.get(INTERVAL_ENV, "")),
                   discovery_watch=env.get(WATCH_ENV) or None,
                   run_dir=env.get(RUN_DIR_ENV, ""), ssh_port=port, ssh_identity=identity)


def _interval(raw: str) -> float | None:
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    lo, hi = INTERVAL_RANGE_S
    if not lo <= seconds <= hi:
        raise LaunchError(f"{INTERVAL_ENV}={raw!r} must be seconds between {lo:g} and {hi:g} "
                          "(unset it for Horovod's 1 s)")
    return seconds


def ssh_settings(argv: list[str]) -> tuple[str | None, str | None]:
    """horovodrun's -p/--ssh-port and -i/--ssh-identity-file from its arguments."""
    port = identity = None
    for i, a in enumerate(argv[:-1]):
        if a in ("-p", "--ssh-port"):
            port = argv[i + 1]
        elif a in ("-i", "--ssh-identity-file"):
            identity = argv[i + 1]
    return port, identity
