"""The driver's switches, declared once and read once where the driver starts.

The driver runs in its own process, started in horovodrun's place (by `hvd-resilient run`,
or by hand), so its switches cross that boundary in the environment, and the ssh settings in
horovodrun's own arguments. `DriverSwitches` declares each switch once, with the machinery of
every other setting (`hvd_resilient/settings.py`): `hvd-resilient run` takes it as a flag of
`--launcher horovod` (its section inherits these fields) and hands it on as the variable
`driver_env` writes; the driver reads the same variables back through the same schema
(`DRIVER`), whoever started it. `DriverOptions.read` does that once, at the driver's entry;
the patch families are handed the result and read no environment themselves.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from hvd_resilient.backends.horovod import driver_kv
from hvd_resilient.errors import ConfigError, LaunchError
from hvd_resilient.launcher_env import RUN_DIR_ENV
from hvd_resilient.settings import Schema, setting

ENV_PREFIX = "HVD_RESILIENT_"
INTERVAL_RANGE_S = (0.05, 3600.0)


@dataclass(kw_only=True)
class DriverSwitches:
    """What the Horovod driver is switched by: flags of `hvd-resilient run --launcher horovod`,
    variables of the driver's environment."""

    slot_hosts: bool = True
    """Horovod: blacklist per slot, so one dead worker never ends a one-host job
    (--no-slot-hosts: whole hosts, as plain horovodrun does)."""
    standby_workers: bool = setting(True, env="HVD_RESILIENT_STANDBY")
    """Horovod: start the workers of an added host (or of a slot back from its cooldown) ahead
    of the reset, as standby workers that import and set up while the old world trains
    (--no-standby-workers: they start cold at the reset)."""
    warm_pool: bool = False
    """Horovod: fork the workers of this machine from a warm pool that did their imports
    once, so a slot that comes back or joins here is ready in a tenth of a second instead of
    its cold start (default: each imports for itself; a joining host has a pool only if it
    starts one, docs/architecture.md)."""
    discovery_interval: float | None = setting(None, metavar="SECONDS")
    """Horovod with --discovery: seconds between runs of the script, 0.05 to 3600 (default:
    Horovod's 1 s)."""
    discovery_watch: str | None = setting(None, metavar="FILE")
    """Horovod with --discovery: a file the script reads (a hosts file); the script runs as soon
    as it changes, not at the next once-a-second poll (default: the poll only)."""


DRIVER = Schema("horovod driver", DriverSwitches, env_prefix=ENV_PREFIX)
"""The switches as the driver reads them: from its environment only."""


def interval_refusal(seconds: float | None) -> str:
    """Why a discovery interval cannot be used ("" when it can)."""
    lo, hi = INTERVAL_RANGE_S
    if seconds is None or lo <= seconds <= hi:
        return ""
    return f"must be seconds between {lo:g} and {hi:g}"


def driver_env(switches: DriverSwitches) -> dict[str, str]:
    """The variables that hand ``switches`` to a driver: one for each switch that is not at
    its default (a driver left alone reads the rest from the environment it inherits, as it
    always has)."""
    out = {}
    for st in DRIVER.settings:
        value = getattr(switches, st.field)
        if value != st.default and st.env is not None:
            out[st.env] = ("1" if value else "0") if isinstance(value, bool) else str(value)
    return out


@dataclass(frozen=True, kw_only=True)
class DriverOptions:
    """What the patch families are handed: the switches (`DriverSwitches`, under the names the
    patches use), the run folder and horovodrun's ssh settings."""

    slot_hosts: bool = True
    """Every slot its own host (`backends/horovod/slots.py`)."""
    standby: bool = True
    """Newcomers started ahead of the reset (`patches/standby_slots.py`)."""
    warm_pool: bool = False
    """The standbys of this machine forked from a warm pool (`launch/warm/pool_server.py`)."""
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
        try:
            switches: DriverSwitches = DRIVER.build(DRIVER.read(env=env))
        except ConfigError as e:
            raise LaunchError(str(e)) from None
        why = interval_refusal(switches.discovery_interval)
        if why:
            var = DRIVER.by_name()["discovery_interval"].env or ""
            raise LaunchError(f"{DRIVER.what}: discovery_interval {why}, got {env.get(var)!r} "
                              f"(from {var}; unset it for Horovod's 1 s)")
        port, identity = ssh_settings(argv or [])
        return cls(slot_hosts=switches.slot_hosts, standby=switches.standby_workers,
                   warm_pool=switches.warm_pool,
                   discovery_interval_s=switches.discovery_interval,
                   discovery_watch=switches.discovery_watch or None,
                   run_dir=env.get(RUN_DIR_ENV, ""), ssh_port=port, ssh_identity=identity)


def ssh_settings(argv: list[str]) -> tuple[str | None, str | None]:
    """horovodrun's -p/--ssh-port and -i/--ssh-identity-file from its arguments."""
    port = identity = None
    for i, a in enumerate(argv[:-1]):
        if a in ("-p", "--ssh-port"):
            port = argv[i + 1]
        elif a in ("-i", "--ssh-identity-file"):
            identity = argv[i + 1]
    return port, identity
