"""Standby workers: newcomers started at once, rank 0 told at once, the new world formed once
they are warm.

Horovod starts the workers of an added host (or a slot back from its cooldown) only at the
reset, so the whole world waits for their cold start (Python, torch, Horovod: 5-20 s). Here
they are started as soon as discovery sees them, through the standby worker
(`launch/warm/standby.py`), which does its imports while the old world trains.

Rank 0 is told of every discovery change as it is seen, warm-up or not: Horovod's contract is
that rank 0 hears of a change within one discovery interval, and a script may wait for that
(Horovod's own elastic test worker gives up after 3 s, "Timed out waiting for notifications
from driver."). Holding the notice back until the newcomers were warm (the first design) kept
the old world training through the warm-up, but left rank 0 blind for 5-20 s, and with it
every script that acts on the notice.

Rank 0 acts on an addition only once the newcomers are warm: the driver lists its unreleased
standbys in its store (`publish`), and rank 0 holds the reset back while any of them has not
said READY (`backends/horovod/added_hosts.py`), so the old world trains on through their cold
start. A removal is never held. Should a reset come while a standby is still warming (a failure
in between, the hold's timeout), it waits for the warm-up, and where it waits matters:
inside Horovod's rendezvous barrier (the old workers' request for their new rank, which the
driver answers when it likes), not in the new world's Gloo connect, which gives up after the
Gloo timeout and aborts every old worker with it (seen here: a newcomer still importing 30 s
later, on 2 cores at load 8, cost the whole job). So the release of a
standby into the new world waits until it said it is ready (imports and the script's set-up
done: it waits at its first `hvd.init()`), it died (its slot
then starts afresh), the ready timeout passed, or the job stopped; only then is the new world
formed, and its Gloo connect waits for warm processes only. A slot that joins at a reset
without having been started ahead (back from its cooldown, or replacing a standby that died)
is started as a standby at that moment and waited for the same way.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.backends.horovod import compat, driver_kv
from hvd_resilient.launch.horovod.patches.context import (
    PatchContext,
    PerObject,
    driver_method,
    slot_key,
)
from hvd_resilient.launch.warm import standby as standby_worker

logger = logging.getLogger(__name__)


@dataclass
class DriverStandbys:
    """What the patch keeps about one driver."""

    table: dict[str, Any] = field(default_factory=dict)
    """Its standby workers: started, not yet released (slot key -> SlotInfo)."""
    formed: bool = False
    """Its first world was formed: every later `_start_worker_processes` is a reset."""


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
        self.drivers: PerObject[DriverStandbys] = PerObject(DriverStandbys)
        self.wrapped = False
        """Every worker runs through the standby module (same Python), speaking its protocol
        (ready, go); set when the job's command is seen."""

    def table(self, driver: Any) -> dict[str, Any]:
        """The driver's standby workers: started, not yet released (slot key -> SlotInfo)."""
        return self.drivers.of(driver).table

    def notify_host_changes(self, driver: Any, current_hosts: Any, update_res: Any) -> None:
        """`_notify_workers_host_changes`: the newcomers of the world to be formed start now,
        as standbys; rank 0 is told at once, as plain Horovod does."""
        standby = self.table(driver)
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
                self.ctx.emit(ev.STANDBY_STARTED, slots=[slot_key(s) for s in new])
        self._notify(driver, current_hosts, update_res)

    def start_standby(self, driver: Any, s: Any) -> None:
        compat.kv_set(driver, driver_kv.READY, slot_key(s), None)
        compat.kv_set(driver, driver_kv.GO, slot_key(s), None)
        with self.lock:
            self.table(driver)[slot_key(s)] = s
        self.publish(driver)
        driver._start_worker_process(s)

    def publish(self, driver: Any) -> None:
        """Lists the unreleased standbys in the store, where rank 0 reads them: an added host
        is acted on (the commit, the reset) once they are warm, so the old world trains on
        through their cold start instead of waiting for it in the reset. Written again after
        each rendezvous, which clears the store."""
        if not self.wrapped:
            return
        with self.lock:
            listed = ",".join(sorted(self.table(driver)))
        compat.kv_set(driver, driver_kv.WARMING, driver_kv.WARMING_KEY,
                      listed.encode() if listed else None)

    def wait_until_warm(self, driver: Any, slots: dict[str, Any]) -> None:
        """Runs in the reset's barrier action: the old workers wait in their rendezvous
        request meanwhile, which has no timeout (Horovod waits there for --min-np slots too).
        A standby that dies meanwhile is replaced by a new one, once; after that its slot is
        no longer waited for (it starts cold, and a failure there is Horovod's to handle)."""
        standby = self.table(driver)
        deadline = time.monotonic() + self.ready_timeout_s
        t0 = time.monotonic()
        replaced: set[str] = set()
        keys = list(slots)
        while not driver.finished():
            ready = compat.kv_get(driver, driver_kv.READY)
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
            self.ctx.emit(ev.STANDBY_RELEASED, slots=keys, waited_s=round(waited, 3),
                          replaced=sorted(replaced) or None)

    def start_or_release(self, driver: Any, pending_slots: list[Any]) -> None:
        """`_start_worker_processes`: a slot with a standby is released into the new world
        once it is warm; any other slot starts its worker as Horovod would."""
        kept = self.drivers.of(driver)
        standby = kept.table
        if self.wrapped and kept.formed:
            # A reset: a slot nobody started ahead (back from its cooldown, or a standby that
            # died) starts as a standby now, so that its cold start is waited for here too.
            for s in pending_slots:
                if slot_key(s) not in standby:
                    self.start_standby(driver, s)
        kept.formed = True
        with self.lock:
            warming = {slot_key(s): s for s in pending_slots if slot_key(s) in standby}
        self.wait_until_warm(driver, warming)
        for s in pending_slots:
            compat.kv_set(driver, driver_kv.GO, slot_key(s), standby_worker.slot_env(s))
            compat.kv_set(driver, driver_kv.READY, slot_key(s), None)  # it said so as a standby
            with self.lock:
                released = standby.pop(slot_key(s), None) is not None
            if not released:
                driver._start_worker_process(s)
        self.publish(driver)

    def handle_worker_exit(self, driver: Any, slot: Any, exit_code: int,
                           timestamp: Any) -> None:
        """A standby that exits before its release (a broken environment on the new host, an
        OOM kill) leaves the table, so that the reset starts its slot afresh, and a failure of
        that fresh worker is a worker failure Horovod handles. Without this the driver would
        release a dead process and the new world would wait for it until the Gloo timeout."""
        standby = self.table(driver)
        with self.lock:
            unreleased = standby.get(slot_key(slot)) is slot
            if unreleased:
                del standby[slot_key(slot)]
        if unreleased:
            compat.kv_set(driver, driver_kv.READY, slot_key(slot), None)
            self.publish(driver)
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
            args.command = [cmd[0], "-m", "hvd_resilient.launch.warm.standby", *cmd]
            self.wrapped = True
        pool = self.start_pool(cmd) if self.wrapped and self.ctx.options.warm_pool else None
        try:
            return self._run_elastic(args)
        finally:
            if pool is not None:
                pool.stop()

    def start_pool(self, cmd: list[str]) -> Any:
        """The warm pool of this machine, before any worker starts: every local worker is
        forked from it, the first ones and those that join later alike (the first launch
        waits for its imports instead of doing them in each worker)."""
        from hvd_resilient.launch.warm import pool as warm_pool
        from hvd_resilient.launch.warm import pool_server as warm_pool_server

        if warm_pool.alive(os.environ.get(warm_pool.SOCKET_ENV, "")):
            # `hvd-resilient run` holds it across launches: a relaunched driver forks warm too
            self.ctx.emit(ev.WARM_POOL_READY, seconds=0.0, held_by="supervisor")
            return None
        t0 = time.monotonic()
        pool = warm_pool_server.Started(cmd)
        if not pool.wait_ready():
            logger.warning("warm pool did not start (exit code %s); workers start cold",
                           pool.proc.poll())
            pool.stop()
            return None
        os.environ[warm_pool.SOCKET_ENV] = pool.path  # the workers' environment is this one
        seconds = time.monotonic() - t0
        logger.info("warm pool ready after %.1f s: this machine's workers fork from it", seconds)
        self.ctx.emit(ev.WARM_POOL_READY, seconds=round(seconds, 3))
        return pool


def keeping_ready(init: Callable[..., None]) -> Callable[..., None]:
    """`RendezvousHTTPServer.init`, which clears the whole store at every rendezvous, keeping
    the standbys' READY: the reset that releases them starts with that rendezvous, and each
    would say it again only at its next beat (0-0.2 s, waited for in the stall of every
    growth). A READY there is always the word of an unreleased, live standby: the driver
    removes it when it starts, releases or loses that standby."""
    def init_keeping_ready(self: Any, *args: Any) -> None:
        with self.cache_lock:
            ready = dict(self.cache.get(driver_kv.READY, {}))
        init(self, *args)
        if ready:
            with self.cache_lock:
                self.cache.setdefault(driver_kv.READY, {}).update(ready)

    return init_keeping_ready


def install(ctx: PatchContext) -> Standby:
    """Returns the installed patch: what it keeps of each driver can be looked at."""
    from horovod.runner import launch
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.http.http_server import RendezvousHTTPServer

    patch = Standby(ctx, notify=ElasticDriver._notify_workers_host_changes,
                    handle_exit=ElasticDriver._handle_worker_exit,
                    run_elastic=launch._run_elastic)
    compat.replace(ElasticDriver, "_notify_workers_host_changes",
                   driver_method(patch.notify_host_changes))
    compat.replace(ElasticDriver, "_start_worker_processes", driver_method(patch.start_or_release))
    compat.replace(ElasticDriver, "_handle_worker_exit", driver_method(patch.handle_worker_exit))
    compat.replace(launch, "_run_elastic", patch.run_elastic)
    compat.replace(RendezvousHTTPServer, "init", keeping_ready(RendezvousHTTPServer.init))
    return patch
