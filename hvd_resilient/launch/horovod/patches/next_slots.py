"""The next world's slots, written before the workers hear of a host change: a worker whose
slot left the job learns so, and leaves cleanly.

When discovery drops a host (or slots of one), Horovod tells every worker "hosts changed";
each resets, and a worker whose slot is gone learns it only inside `hvd.init()`: Horovod's
background thread gets rank -1 from the rendezvous and throws "has been removed from elastic
job" where nothing catches it, so the process dies by SIGABRT (exit 134, "terminate
called ... Aborted" in the job's output at every planned scale-down).

Here the driver writes, before it tells the workers, the slots of the world it will form
(`driver_kv.NEXT_SLOTS`); a worker resetting for a host change reads it first and, when its
slot is not there, answers the rendezvous as `hvd.init()` would and exits 0 without calling
it (`backends/horovod/dropped_slot.py`). Horovod ignores the exit of a slot without a rank, as
it ignored the abort. The list is only written where Horovod would form a world at once (at
least --min-np slots), and Horovod's rendezvous clears it: a worker that finds none initializes
as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hvd_resilient.backends.horovod import compat, driver_kv
from hvd_resilient.launch.horovod.patches.context import PatchContext


def next_slots(driver: Any, current_hosts: Any) -> list[str] | None:
    """The slots (`host:local_rank`) of the world the driver forms next for `current_hosts`;
    None when it would not form one now (no world yet, or fewer than --min-np slots)."""
    if not driver._host_assignments or (
        current_hosts.count_available_slots() < driver._min_num_proc
    ):
        return None
    nxt, _ = driver._get_host_assignments(current_hosts)
    return sorted(f"{h}:{s.local_rank}" for h, slots in nxt.items() for s in slots)


def publishing(notify: Callable[..., None]) -> Callable[..., None]:
    """`_notify_workers_host_changes` that writes the next world's slots before telling."""
    def _notify_workers_host_changes(driver: Any, current_hosts: Any, update_res: Any) -> None:
        if driver._host_assignments:  # else no world yet, nor the store it would go in
            listed = next_slots(driver, current_hosts)
            compat.kv_set(driver, driver_kv.NEXT_SLOTS, driver_kv.NEXT_SLOTS_KEY,
                          None if listed is None else ",".join(listed).encode())
        notify(driver, current_hosts, update_res)

    return _notify_workers_host_changes


def install(ctx: PatchContext) -> None:
    from horovod.runner.elastic.driver import ElasticDriver

    compat.replace(ElasticDriver, "_notify_workers_host_changes",
                   publishing(ElasticDriver._notify_workers_host_changes))
