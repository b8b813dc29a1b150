"""`horovodrun` with slot hosts: `python -m hvd_resilient.launch.horovod_driver ARGS`.

Takes exactly `horovodrun`'s arguments and runs Horovod's own launcher in this process, after
teaching it slot hosts (see `slot_hosts`): the discovery output is split per slot, and address
lookups and ssh commands get the real host back. Horovod is otherwise untouched; with
`HVD_RESILIENT_SLOT_HOSTS=0` this is plain `horovodrun`.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

from hvd_resilient import slot_hosts

ENV = "HVD_RESILIENT_SLOT_HOSTS"


def _real_host_arg(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "host" in kwargs and kwargs["host"]:
            kwargs["host"] = slot_hosts.real_host(kwargs["host"])
        return fn(*args, **kwargs)

    return wrapper


def install() -> None:
    """Patches the few places where Horovod's launcher turns a host name into a connection."""
    from horovod.runner import gloo_run, launch
    from horovod.runner.driver import driver_service
    from horovod.runner.elastic import discovery
    from horovod.runner.util import network, remote

    resolve = network.resolve_host_address
    network.resolve_host_address = lambda name: resolve(slot_hosts.real_host(name))
    for mod in (remote, gloo_run, launch, driver_service):
        if hasattr(mod, "get_remote_command"):
            mod.get_remote_command = _real_host_arg(mod.get_remote_command)
    for cls in (discovery.HostDiscoveryScript, discovery.FixedHosts):
        find = cls.find_available_hosts_and_slots
        cls.find_available_hosts_and_slots = (
            lambda self, _find=find: slot_hosts.split(_find(self))
        )


def main(argv: list[str] | None = None) -> None:
    if os.environ.get(ENV, "1") != "0":
        install()
    from horovod.runner.launch import run_commandline

    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    run_commandline()


if __name__ == "__main__":
    main()
