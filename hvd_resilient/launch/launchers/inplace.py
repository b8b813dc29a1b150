"""`--launcher inplace`: the in-place agent (`launch/inplace_agent.py`); the survivors of a
fault keep their processes and go on in the next generation, and below --min-np the agent ends
the job for `hvd-resilient run` to relaunch.

Without --hosts, one agent on this machine starts --np workers. The agent passes a signal on to
every worker itself, and its workers are in its process group: a signal to `hvd-resilient run`
goes to the group, as it came.

With --hosts h1:2,h2:2 the fan-out (`launch/inplace/fanout.py`) starts one agent per host (its
slots are that host's workers, --np only may not exceed their sum): host 0's coordinates, the
others over ssh (--ssh-port) unless they are this machine. The agents run in sessions of their
own, so the same signal to the group reaches the fan-out alone, which passes it on to every
agent through its stdin; the forwarded variables go to them that way too, never on a command
line.

With --discovery SCRIPT the hosts follow a host-discovery script's answers as the job trains
(`launch/inplace/fanout_discovery.py`): its first answer names the hosts the job starts on, a
host it drops leaves at the others' next commit, a host it adds joins there; --max-np caps the
slots run.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.hosts import check_hosts_reachable, hosts_arg, is_loopback, parse_hosts
from hvd_resilient.launch.inplace.fanout_discovery import first_hosts
from hvd_resilient.launch.run_options import RunOptions
from hvd_resilient.settings import setting


@dataclass(kw_only=True)
class InplaceOptions:
    """Options of `--launcher inplace` only."""

    replace: bool = False
    """Inplace: start a new worker for each one lost; it joins the others at their next commit
    once it is up (default: train on without it)."""
    standby: int = 0
    """Inplace: K more workers started at launch that set up and wait; a lost worker's place
    goes to one of them in the generation that answers the fault, without an import."""
    etcd: str = setting("", metavar="URL,...")
    """Inplace with --hosts: agree on the generations in etcd (its client URLs, e.g.
    http://h1:2379,http://h2:2379,http://h3:2379), which rests on no clock margin (default: the
    first host's agent coordinates, and when it is lost or cut off a majority of the hosts goes
    on under the next one)."""


def inplace_command(nproc: int, min_np: int, train_cmd: list[str], *,
                    replace: bool = False, standby: int = 0) -> list[str]:
    """The in-place agent on this machine: ``nproc`` workers, the job ending (for a relaunch)
    below ``min_np``; ``replace``: a new worker for each one lost; ``standby``: that many more,
    set up and waiting to take a lost one's place."""
    return [sys.executable, "-m", "hvd_resilient.launch.inplace_agent", "--nproc", str(nproc),
            "--min-np", str(min_np), *(["--replace"] if replace else []),
            *(["--standby", str(standby)] if standby else []), "--", *train_cmd]


def fanout_command(hosts: list[tuple[str, int]] | str, ssh_port: int, min_np: int | None,
                   env_names: list[str], train_cmd: list[str], *, replace: bool = False,
                   standby: int = 0, etcd: str = "", max_np: int | None = None) -> list[str]:
    """One agent per host (`launch/inplace/fanout.py`), each with its host's slots; ``hosts``
    a discovery script's path: the hosts it lists, as they change (``max_np``: their slots'
    cap); ``min_np`` for the whole job (None: the agent's default). ``env_names`` are names
    only: their values reach the agents on their stdin, never on a command line."""
    where = (["--discovery", hosts, *(["--max-np", str(max_np)] if max_np else [])]
             if isinstance(hosts, str) else ["--hosts", hosts_arg(hosts)])
    return [sys.executable, "-m", "hvd_resilient.launch.inplace.fanout",
            *where, "--ssh-port", str(ssh_port),
            *(["--min-np", str(min_np)] if min_np is not None else []),
            *(["--replace"] if replace else []),
            *(["--standby", str(standby)] if standby else []),
            *(["--etcd", etcd] if etcd else []),
            "--env-names", ",".join(sorted(env_names)), "--die-with-parent", "--", *train_cmd]


class Inplace:
    name: ClassVar[str] = "inplace"
    options: ClassVar[type] = InplaceOptions
    shared: ClassVar[frozenset[str]] = frozenset({"min_np", "hosts", "ssh_port", "discovery",
                                                  "max_np"})
    stop_signal: ClassVar[signal.Signals | None] = None
    signal_group: ClassVar[bool] = True

    def __init__(self, own: InplaceOptions) -> None:
        self.own = own

    def check(self, opts: RunOptions) -> None:
        """With --hosts, each host's slots are its workers: --np (2 when not given) may be
        fewer than their sum, never more."""
        if self.own.standby < 0:
            raise ConfigError(f"run: --standby must be >= 0, got {self.own.standby}")
        if opts.discovery and opts.hosts:
            raise ConfigError("run: give --hosts or --discovery, not both")
        if opts.max_np is not None and not opts.discovery:
            raise ConfigError("run: --max-np caps the hosts a discovery script adds: it needs "
                              "--discovery (with --hosts the job's size is their slots)")
        if opts.max_np is not None and opts.max_np < max(opts.min_np or 1, 1):
            raise ConfigError(f"run: --max-np {opts.max_np} is less than --min-np "
                              f"{opts.min_np or 1}")
        if opts.hosts:
            hosts = parse_hosts(opts.hosts)
            slots = sum(n for _, n in hosts)
            loopback = [h for h, _ in hosts if is_loopback(h)] if len(hosts) > 1 else []
            if loopback:  # every agent tells the others where its store is by this name
                raise ConfigError(f"run: --hosts {opts.hosts}: {', '.join(loopback)} means "
                                  "each host itself; name this machine by an address the "
                                  "other hosts reach")
            if opts.np > slots:
                raise ConfigError(f"run: --np {opts.np} is more than the {slots} slots in "
                                  f"--hosts {opts.hosts}")
        if self.own.etcd and not (opts.hosts or opts.discovery):
            raise ConfigError("run: --etcd applies with --hosts or --discovery (one machine "
                              "needs no service)")
        for url in filter(None, self.own.etcd.split(",")):
            if not url.strip().startswith(("http://", "https://")) or url.count(":") < 2:
                raise ConfigError(f"run: --etcd entry {url!r} must look like "
                                  f"http://host:2379")

    def probe(self, opts: RunOptions) -> None:
        """With --hosts, the remote ones reachable over ssh; with --discovery, the script
        answers with a host (one line, else); without, nothing to reach."""
        if opts.hosts:
            check_hosts_reachable(parse_hosts(opts.hosts), opts.ssh_port)
        if opts.discovery:
            first_hosts(opts.discovery, opts.max_np)

    def command(self, opts: RunOptions, env_names: list[str]) -> list[str]:
        """With --hosts, the fan-out sends ``env_names``' values to every agent; without, the
        one agent passes its whole environment on, and ``env_names`` is not needed."""
        if opts.hosts or opts.discovery:
            return fanout_command(opts.discovery or parse_hosts(opts.hosts or ""),
                                  opts.ssh_port, opts.min_np, env_names, opts.command,
                                  replace=self.own.replace, standby=self.own.standby,
                                  etcd=self.own.etcd, max_np=opts.max_np)
        return inplace_command(opts.np, opts.min_np or 1, opts.command,
                               replace=self.own.replace, standby=self.own.standby)

    def environment(self, opts: RunOptions) -> dict[str, str]:
        return {}

    def wants_warm_pool(self, opts: RunOptions, env: Mapping[str, str]) -> bool:
        """Its standbys (--standby) are started at launch and wait: no pool."""
        return False

    def lease_group(self, opts: RunOptions) -> str | None:
        return None
