"""A slot whose worker died is started again when a new world assigns it, even if the last
world had it too.

Horovod starts, at each reset, only the slots that the previous world did not assign
(`ElasticDriver._update_host_assignments`: "the slots that are already filled so we do not
respawn these processes"). A slot whose worker failed is normally left out of the next world
(blacklisted at the barrier), so it counts as new when it comes back. Not when the next world
must wait for it: two of three workers lost in one reset with `--min-np 2` (a survivor stuck
in its `hvd.shutdown()` exits 77 three seconds after the first death) leaves one slot, the
driver waits for a failed slot's cooldown, and the slot that comes back was in the previous
world: Horovod assigns it a rank and starts no process for it. The other worker then waits
30 s in the new world's Gloo rendezvous for a peer that does not exist, aborts, and the job
never recovers (2 of 40 random kills on 12-05; `bench/fault_in_reset.py` makes it happen).

Here every worker exit marks its slot, every worker start clears the mark, and a world that
assigns a marked slot starts it with the newcomers (through the standby worker where that is
on: `patches/standby_slots.py` starts any slot it is handed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.backends.horovod import compat
from hvd_resilient.launch.horovod.patches.context import (
    PatchContext,
    PerObject,
    driver_method,
    slot_key,
)

logger = logging.getLogger(__name__)


class OrphanSlots:
    """The replacements; each takes the driver first, as the method it wraps does."""

    def __init__(self, ctx: PatchContext, *, update: Callable[..., list[Any]],
                 start: Callable[..., None], handle_exit: Callable[..., None]) -> None:
        self.ctx = ctx
        self._update = update
        self._start = start
        self._handle_exit = handle_exit
        self.lock = threading.Lock()
        self._exited: PerObject[set[str]] = PerObject(set)

    def exited(self, driver: Any) -> set[str]:
        """Slots whose last worker exited and that were not started since."""
        return self._exited.of(driver)

    def handle_worker_exit(self, driver: Any, slot: Any, *args: Any) -> None:
        with self.lock:
            self.exited(driver).add(slot_key(slot))
        self._handle_exit(driver, slot, *args)

    def start_worker_process(self, driver: Any, slot: Any) -> None:
        with self.lock:
            self.exited(driver).discard(slot_key(slot))
        self._start(driver, slot)

    def update_host_assignments(self, driver: Any, current_hosts: Any) -> list[Any]:
        """Horovod's pending slots, and the assigned slots whose worker is gone."""
        pending = self._update(driver, current_hosts)
        keys = {slot_key(s) for s in pending}
        with self.lock:
            gone = set(self.exited(driver))
        orphans = [s for slots in driver._host_assignments.values() for s in slots
                   if slot_key(s) in gone and slot_key(s) not in keys]
        if orphans:
            names = [slot_key(s) for s in orphans]
            logger.warning("the new world assigns slot(s) %s, whose worker exited; starting "
                           "them again", ", ".join(names))
            self.ctx.emit(ev.ORPHAN_SLOTS_STARTED, slots=names)
        return [*pending, *orphans]


def install(ctx: PatchContext) -> None:
    from horovod.runner.elastic.driver import ElasticDriver

    patch = OrphanSlots(ctx, update=ElasticDriver._update_host_assignments,
                        start=ElasticDriver._start_worker_process,
                        handle_exit=ElasticDriver._handle_worker_exit)
    compat.replace(ElasticDriver, "_update_host_assignments",
                   driver_method(patch.update_host_assignments))
    compat.replace(ElasticDriver, "_start_worker_process",
                   driver_method(patch.start_worker_process))
    compat.replace(ElasticDriver, "_handle_worker_exit", driver_method(patch.handle_worker_exit))
