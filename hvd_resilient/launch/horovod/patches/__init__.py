"""What the driver teaches Horovod's launcher: one module per patch family, installed in the
one order below.

Each family only wraps (or replaces) methods of Horovod's launcher, through
`backends/horovod/compat.replace`, which refuses a target `check_compatible` does not check;
the protocol between driver and workers stays Horovod's own. Each is handed the
`PatchContext` (the switches read once at the driver's entry, the event log, what it saw)
and reads no environment; what a family keeps about one of Horovod's objects it keeps in a
`PerObject` of its own, never in that object.

The order matters where two families touch the same method: the later one wraps what the
earlier one left, and a family that replaces a method outright must come before any that
wraps it. The reasons are told beside each entry of `ORDER`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from hvd_resilient.launch.horovod.options import DriverOptions
from hvd_resilient.launch.horovod.patches import (
    discovery_check,
    discovery_interval,
    discovery_watch,
    evict,
    fast_middleman,
    fatal_stop,
    gloo_check,
    next_slots,
    orphan_slots,
    slot_hosts,
    standby_slots,
    stop_signal,
)
from hvd_resilient.launch.horovod.patches.context import PatchContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    install: Callable[[PatchContext], object]
    """Installs the family (what it returns, the installed patch where it has one, is not
    used here)."""
    wanted: Callable[[DriverOptions], bool] = lambda options: True
    """Whether this launch wants it (its switch)."""


ORDER: tuple[Patch, ...] = (
    # HVD_RESILIENT_DISCOVERY_INTERVAL: a constant, touched by nothing else.
    Patch("discovery_interval", discovery_interval.install,
          lambda o: o.discovery_interval_s is not None),
    # Replaces HostDiscoveryScript.find_available_hosts_and_slots outright: before the
    # slot split, which wraps the checked answer.
    Patch("discovery_check", discovery_check.install),
    # HVD_RESILIENT_DISCOVERY_WATCH: wraps the script's run that discovery_check put in place,
    # and sets the loop's period after discovery_interval (it reads that interval).
    Patch("discovery_watch", discovery_watch.install, lambda o: o.discovery_watch is not None),
    # HVD_RESILIENT_SLOT_HOSTS: splits what discovery answers (checked, above).
    Patch("slot_hosts", slot_hosts.install, lambda o: o.slot_hosts),
    # Wraps _handle_worker_exit: before standby_slots, which wraps it again, so that a standby
    # exiting before its release is only logged (it never stops the job).
    Patch("fatal_stop", fatal_stop.install),
    # Replaces gloo_run.register_shutdown_event and ElasticDriver.start (touched by nothing
    # else) and wraps _handle_worker_exit before standby_slots, so that the exit of a standby
    # not yet released (it holds no state) is not counted among the workers' at a stop.
    Patch("stop_signal", stop_signal.install),
    # HVD_RESILIENT_STANDBY: replaces _start_worker_processes outright (it starts or releases
    # each slot itself), so the eviction watch, which wraps it, comes after.
    Patch("standby_slots", standby_slots.install, lambda o: o.standby),
    # Wraps _start_worker_processes: the watch starts with the first workers.
    Patch("evict", evict.install),
    # Wraps _handle_worker_exit after standby_slots (every exit marks its slot, a standby's
    # too) and _start_worker_process, which standby_slots calls for every start; the only one to
    # touch _update_host_assignments.
    Patch("orphan_slots", orphan_slots.install),
    # Replaces launch.gloo_built (a module-level name): touched by nothing else.
    Patch("gloo_check", gloo_check.install),
    # Replaces safe_shell_exec's view of multiprocessing: touched by nothing else; first
    # launch after it.
    Patch("fast_middleman", fast_middleman.install),
    # Wraps _notify_workers_host_changes, which standby_slots replaced by its own wrapper
    # (either order works: the next world's slots are written before anything is told).
    Patch("next_slots", next_slots.install),
)


def install(ctx: PatchContext, order: tuple[Patch, ...] = ORDER) -> list[str]:
    """Installs the families this launch wants, in `order`; returns their names."""
    names = []
    for patch in order:
        if patch.wanted(ctx.options):
            patch.install(ctx)
            names.append(patch.name)
    logger.debug("Horovod launcher patched: %s", ", ".join(names))
    return names
