"""`--launcher horovod`: horovodrun through our driver, elastic with --discovery (or on fixed
--hosts with --min-np/--max-np), else static.

Its section holds horovodrun's own options and the driver's switches
(`launch/horovod/options.DriverSwitches`, inherited: one declaration for the flag and for the
variable the driver reads). The driver ends its workers itself on a signal, and the
forkserver its middlemen come from must outlive that signal to report their exits (killed with
the group, every worker's exit read 255): a signal to `hvd-resilient run` goes to the driver
alone.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.horovod.command import (
    ElasticLaunch,
    horovodrun_command,
    horovodrun_static,
)
from hvd_resilient.launch.horovod.options import DriverSwitches, driver_env, interval_refusal
from hvd_resilient.launch.hosts import (
    check_hosts_reachable,
    first_discovered,
    hosts_arg,
    parse_hosts,
)
from hvd_resilient.launch.run_options import RunOptions
from hvd_resilient.launch.warm.standby import runnable_here
from hvd_resilient.settings import setting


@dataclass(kw_only=True)
class HorovodrunOptions:
    """horovodrun's own options, as `hvd-resilient run` passes them on."""

    network_interface: str | None = setting(None, metavar="NIC")
    """Horovod: the interface Gloo uses, e.g. eth0; lo on one machine (default: Horovod finds a
    common one across hosts)."""
    gloo_timeout_seconds: int = 30
    """Horovod: seconds a collective waits for a lost peer before the survivors reset."""
    reset_limit: int | None = None
    """Horovod: stop after this many resets (default: no limit)."""
    elastic_timeout: int = 600
    """Horovod: seconds to wait for --min-np slots."""
    blacklist_cooldown_range: tuple[int, int] = setting((10, 30), metavar=("MIN", "MAX"))
    """Horovod: a failed slot is readmitted after MIN..MAX s; 0 0: never (plain horovodrun's
    default)."""


@dataclass(kw_only=True)
class HorovodOptions(DriverSwitches, HorovodrunOptions):
    """Options of `--launcher horovod` only: horovodrun's own, then the driver's switches
    (one declaration for the flag and the variable the driver reads), in that order: a
    dataclass lists the fields of its last base first."""


class Horovod:
    name: ClassVar[str] = "horovod"
    options: ClassVar[type] = HorovodOptions
    shared: ClassVar[frozenset[str]] = frozenset({"hosts", "ssh_port", "min_np", "max_np",
                                                      "discovery"})
    stop_signal: ClassVar[signal.Signals | None] = None
    signal_group: ClassVar[bool] = False

    def __init__(self, own: HorovodOptions) -> None:
        self.own = own

    def elastic(self, opts: RunOptions) -> bool:
        """With --discovery, or --hosts with --min-np or --max-np: an elastic job on fixed hosts
        (horovodrun -H ... --min-np N: Horovod's own elastic mode without a discovery script),
        which recovers from failures in place but never grows beyond those hosts."""
        sized = opts.min_np is not None or opts.max_np is not None
        return bool(opts.discovery) or (bool(opts.hosts) and sized)

    def check(self, opts: RunOptions) -> None:
        own = self.own
        if opts.discovery and opts.hosts:
            raise ConfigError("run: give --hosts or --discovery, not both")
        watch = own.discovery_watch
        if watch and not opts.discovery:
            raise ConfigError("run: --discovery-watch needs --discovery (it runs that script "
                              "when the file changes)")
        if watch and not os.path.isfile(watch):
            raise ConfigError(f"run: --discovery-watch {watch} is not a file; name the hosts "
                              "file your discovery script reads")
        if own.discovery_interval is not None and not opts.discovery:
            raise ConfigError("run: --discovery-interval needs --discovery (it is how often "
                              "that script runs)")
        why = interval_refusal(own.discovery_interval)
        if why:
            raise ConfigError(f"run: --discovery-interval {why}, got {own.discovery_interval:g}")
        if (opts.min_np is not None or opts.max_np is not None) and not self.elastic(opts):
            raise ConfigError("run: --min-np/--max-np size an elastic job: they need --discovery "
                              "or --hosts (--launcher horovod); without them the job runs at "
                              "--np")
        for name, least in (("gloo_timeout_seconds", 1), ("reset_limit", 0),
                            ("elastic_timeout", 1)):
            value = getattr(own, name)
            if value is not None and value < least:
                raise ConfigError(f"run: --{name.replace('_', '-')} must be >= {least}, got "
                                  f"{value}")
        cooldown = own.blacklist_cooldown_range
        if list(cooldown) != [0, 0] and not 0 < cooldown[0] <= cooldown[1]:
            raise ConfigError(f"run: --blacklist-cooldown-range needs 0 < MIN <= MAX (or 0 0: a "
                              f"failed host never comes back), got {cooldown[0]} {cooldown[1]}")

    def probe(self, opts: RunOptions) -> None:
        if opts.discovery:
            # Horovod would retry a failing script for minutes, and die with a traceback on
            # output it cannot parse: one line now instead
            first_discovered(opts.discovery)
        if opts.hosts:
            check_hosts_reachable(parse_hosts(opts.hosts), opts.ssh_port)

    def command(self, opts: RunOptions, env_names: list[str]) -> list[str]:
        """The driver forwards the whole environment itself: ``env_names`` is not needed."""
        own = self.own
        hosts = hosts_arg(parse_hosts(opts.hosts)) if opts.hosts else None
        if not self.elastic(opts):
            return horovodrun_static(opts.np, hosts, own.network_interface, opts.command)
        cooldown = tuple(own.blacklist_cooldown_range)
        launch = ElasticLaunch(
            np=opts.np, min_np=opts.min_np or 1, max_np=opts.max_np or opts.np,
            discovery_script=opts.discovery, hosts=hosts,
            network_interface=own.network_interface,
            gloo_timeout_seconds=own.gloo_timeout_seconds, reset_limit=own.reset_limit,
            elastic_timeout=own.elastic_timeout,
            blacklist_cooldown=None if cooldown == (0, 0) else (cooldown[0], cooldown[1]),
        )
        return horovodrun_command(launch, opts.command)

    def environment(self, opts: RunOptions) -> dict[str, str]:
        """The driver's switches, as the variables it reads (the watched file as an absolute
        path: the driver may run in another folder)."""
        watch = self.own.discovery_watch
        switches = dataclasses.replace(
            self.own, discovery_watch=os.path.abspath(watch) if watch else None)
        return driver_env(switches)

    def wants_warm_pool(self, opts: RunOptions, env: Mapping[str, str]) -> bool:
        """--warm-pool, for an elastic job whose command the pool can run: held here across
        launches, a relaunched driver's workers fork warm too."""
        return self.own.warm_pool and self.elastic(opts) and runnable_here(opts.command)

    def lease_group(self, opts: RunOptions) -> str | None:
        return None
