"""Slot hosts in Horovod's launcher: the discovery output split per slot, and the real host
given back wherever a name reaches the network.

Why every slot is its own host (one dead worker costs one slot, not the whole host) is told
in `backends/horovod/slots.py`; these are the few places where Horovod's launcher turns a host
name into a connection: address lookups, and the ssh commands of four modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from hvd_resilient.backends.horovod import compat, slots
from hvd_resilient.launch.horovod.patches.context import PatchContext


def real_host_arg(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with its `host=` keyword mapped back to the machine (`h+1` -> `h`)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "host" in kwargs and kwargs["host"]:
            kwargs["host"] = slots.real_host(kwargs["host"])
        return fn(*args, **kwargs)

    return wrapper


def split_hosts(find: Callable[[Any], dict[str, int]]) -> Callable[[Any], dict[str, int]]:
    """A discovery's `find_available_hosts_and_slots`, answering one-slot hosts."""
    @functools.wraps(find)
    def find_available_hosts_and_slots(self: Any) -> dict[str, int]:
        return slots.split(find(self))

    return find_available_hosts_and_slots


def install(ctx: PatchContext) -> None:
    from horovod.runner import gloo_run, launch
    from horovod.runner.driver import driver_service
    from horovod.runner.elastic import discovery
    from horovod.runner.util import network, remote

    resolve = network.resolve_host_address
    compat.replace(network, "resolve_host_address",
                   lambda name: resolve(slots.real_host(name)))
    for mod in (remote, gloo_run, launch, driver_service):  # each checked by check_compatible
        compat.replace(mod, "get_remote_command", real_host_arg(mod.get_remote_command))
    for cls in (discovery.HostDiscoveryScript, discovery.FixedHosts):
        compat.replace(cls, "find_available_hosts_and_slots",
                       split_hosts(cls.find_available_hosts_and_slots))
