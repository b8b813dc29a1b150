"""Standby workers: newcomers started at once, rank 0 told at once, the new world formed once
they are warm.

Horovod starts the workers of an added host (or a slot back from its cooldown) only at the
reset, so the whole world waits for their cold start (Python, torch, Horovod: 5-20 s). Here
they are started as soon as discovery sees them, through the standby worker
(`launch/horovod/standby.py`), which does its imports while the old world trains.

Rank 0 is told of every discovery change as it is seen, warm-up or not: Horovod's contract is
that rank 0 hears of a change within one discovery interval, and a script may wait for that
(Horovod's own elastic test worker gives up after 3 s, "Timed out waiting for notifications
from driver."). Holding the notice back until the newcomers were warm (the first design) kept
the old world training through the warm-up, but left rank 0 blind for 5-20 s, and with it
every script that acts on the notice.

The reset that follows (at the next commit) waits for the newcomers' warm-up, and where it
waits matters: inside Horovod's rendezvous barrier (the old workers' request for their new
rank, which the driver answers when it likes), not in the new world's Gloo connect, which
gives up after the Gloo timeout and aborts every old worker with it (seen here: a newcomer
still importing 30 s later, on 2 cores at load 8, cost the whole job). So the release of a
standby into the new world waits until it said it is ready (imports done), it died (its slot
then starts afresh), the ready timeout passed, or the job stopped; only then is the new world
formed, and its Gloo connect waits for warm processes only. A slot that joins at a reset
without having been started ahead (back from its cooldown, or replacing a standby that died)
is started as a standby at that moment and waited for the same way.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from hvd_resilient.backends.horovod import compat
from hvd_resilient.launch.horovod import standby as standby_worker
from hvd_resilient.launch.horovod.patches.context import PatchContext

logger = logging.getLogger("hvd_resilient.launch")


def slot_key(slot: Any) -> str:
    return f"{slot.hostname}:{slot.local_rank}"


def standby_table(driver: Any) -> dict[str, Any]:
    """The driver's standby workers: started, not yet released (slot key -> SlotInfo)."""
    return driver.__dict__.setdefault("_hvdr_standby", {})


class Standby:
    """The replacements of the driver's methods; each takes the driver first, as the method
    it replaces does. ``notify``, ``handle_exit`` and ``run_elastic``: Horovod's originals."""

    def __init__(self, ctx: PatchContext, *, notify: Callable[..., None],
                 handle_exit: Callable[..., None], run_elastic: Callable[[Any], Any]) -> None:
        self.ctx = ctx
        self.ready_timeout_s = ctx.options.standby_ready_timeout_s
        self._notify = notify
        self._handle_exit = handle_exit
        self._run_elastic = run_elastic
        self.lock = threading.Lock()  # the standby table: started, not yet released
        self.wrapped = False
        """Every worker runs through the standby module (same Python), speaking its protocol
        (ready, go); set when the job's command is seen."""

    def notify_host_changes(self, driver: Any, current_hosts: Any, update_res: Any) -> None:
        """`_notify_workers_host_changes`: the newcomers of the world to be formed start now,
        as standbys; rank 0 is told at once, as plain Horovod does."""
        standby = standby_table(driver)
        if driver._host_assignments and (
            current_hosts.count_available_slots() >= driver._min_num_proc
        ):
            nxt, _ = driver._get_host_assignments(current_hosts)
            active = {(h, s.local_rank) for h, slots in driver._host_assignments.items()
                      for s in slots}
            new = [s for h, slots in nxt.items() for s in slots
                   if (h, s.local_rank) not in active and slot_key(s) not in standby]
            for s in new:
                self.start_standby(driver, s)
            if new:
                logger.info("hosts changed: started %d standby worker(s) (%s); telling rank 0 "
                            "now", len(new), ", ".join(slot_key(s) for s in new))
                self.ctx.emit("standby_started", slots=[slot_key(s) for s in new])
        self._notify(driver, current_hosts, update_res)

    def start_standby(self, driver: Any, s: Any) -> None:
        compat.kv_set(driver, standby_worker.READY, slot_key(s), None)
        compat.kv_set(driver, standby_worker.GO, slot_key(s), None)
        with self.lock:
            standby_table(driver)[slot_key(s)] = s
        driver._start_worker_process(s)

    def wait_until_warm(self, driver: Any, slots: dict[str, Any]) -> None:
        """Runs in the reset's barrier action: the old workers wait in their rendezvous
        request meanwhile, which has no timeout (Horovod waits there for --min-np slots too).
        A standby that dies meanwhile is replaced by a new one, once; after that its slot is
        no longer waited for (it starts cold, and a failure there is Horovod's to handle)."""
        standby = standby_table(driver)
        deadline = time.monotonic() + self.ready_timeout_s
        t0 = time.monotonic()
        replaced: set[str] = set()
        keys = list(slots)
        while not driver.finished():
            ready = compat.kv_get(driver, standby_worker.READY)
            with self.lock:
                died = [k for k in keys if k not in standby and k not in replaced]
            for k in died if self.wrapped else ():
                replaced.add(k)
                self.start_standby(driver, slots[k])
            with self.lock:
                waiting = [k for k in keys if k in standby and k not in ready]
            if not waiting:
                break
            if time.monotonic() > deadline:
                logger.warning("standby worker(s) %s not ready after %.0f s; releasing them "
                               "anyway", ", ".join(waiting), self.ready_timeout_s)
                break
            time.sleep(0.05)
        if keys:
            waited = time.monotonic() - t0
            logger.info("released %d standby worker(s) after %.2f s of warm-up wait",
                        len(keys), waited)
            self.ctx.emit("standby_released", slots=keys, waited_s=round(waited, 3),
                          replaced=sorted(replaced) or None)

    def start_or_release(self, driver: Any, pending_slots: list[Any]) -> None:
        """`_start_worker_processes`: a slot with a standby is released into the new world
        once it is warm; any other slot starts its worker as Horovod would."""
        standby = standby_table(driver)
        if self.wrapped and driver.__dict__.get("_hvdr_formed"):
            # A reset: a slot nobody started ahead (back from its cooldown, or a standby that
            # died) starts as a standby now, so that its cold start is waited for here too.
            for s in pending_slots:
                if slot_key(s) not in standby:
                    self.start_standby(driver, s)
        driver.__dict__["_hvdr_formed"] = True
        with self.lock:
            warming = {slot_key(s): s for s in pending_slots if slot_key(s) in standby}
        self.wait_until_warm(driver, warming)
        for s in pending_slots:
            compat.kv_set(driver, standby_worker.GO, slot_key(s), standby_worker.slot_env(s))
            with self.lock:
                released = standby.pop(slot_key(s), None) is not None
            if not released:
                driver._start_worker_process(s)

    def handle_worker_exit(self, driver: Any, slot: Any, exit_code: int,
                           timestamp: Any) -> None:
        """A standby that exits before its release (a broken environment on the new host, an
        OOM kill) leaves the table, so that the reset starts its slot afresh, and a failure of
        that fresh worker is a worker failure Horovod handles. Without this the driver would
        release a dead process and the new world would wait for it until the Gloo timeout."""
        standby = standby_table(driver)
        with self.lock:
            unreleased = standby.get(slot_key(slot)) is slot
            if unreleased:
                del standby[slot_key(slot)]
        if unreleased:
            logger.warning("standby worker for %s exited (code %s) before its release; the "
                           "slot will start a fresh worker at the reset", slot_key(slot),
                           exit_code)
            return
        self._handle_exit(driver, slot, exit_code, timestamp)

    def run_elastic(self, args: Any) -> Any:
        """`launch._run_elastic`: the job's command runs through the standby worker when it
        is this very Python (anything else starts as given, cold)."""
        cmd = list(args.command or [])
        if cmd and standby_worker.same_python(cmd[0]):
            args.command = [cmd[0], "-m", "hvd_resilient.launch.horovod.standby", *cmd]
            self.wrapped = True
        return self._run_elastic(args)


def _method(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(driver, ...)` as a function Horovod's class binds: `self` is the driver."""
    def method(self: Any, *args: Any) -> Any:
        return fn(self, *args)

    method.__name__ = method.__qualname__ = fn.__name__
    return method


def install(ctx: PatchContext) -> None:
    from horovod.runner import launch
    from horovod.runner.elastic.driver import ElasticDriver

    patch = Standby(ctx, notify=ElasticDriver._notify_workers_host_changes,
                    handle_exit=ElasticDriver._handle_worker_exit,
                    run_elastic=launch._run_elastic)
    compat.replace(ElasticDriver, "_notify_workers_host_changes",
                   _method(patch.notify_host_changes))
    compat.replace(ElasticDriver, "_start_worker_processes", _method(patch.start_or_release))
    compat.replace(ElasticDriver, "_handle_worker_exit", _method(patch.handle_worker_exit))
    compat.replace(launch, "_run_elastic", patch.run_elastic)
