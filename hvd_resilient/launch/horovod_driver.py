"""`horovodrun`, taught two things: `python -m hvd_resilient.launch.horovod_driver ARGS`.

Takes exactly `horovodrun`'s arguments and runs Horovod's own launcher in this process, after
teaching it
- slot hosts (`slot_hosts`): the discovery output is split per slot, and address lookups and
  ssh commands get the real host back (`HVD_RESILIENT_SLOT_HOSTS=0` turns it off);
- standby workers (`standby`; `HVD_RESILIENT_STANDBY=0` turns them off): when hosts or slots
  are added, their workers are started at once and the running workers are told of the change
  only once the newcomers have imported torch, torch._dynamo (which the first optimizer pulls
  in) and Horovod. Measured (bench/recovery.py): the old world stops training for ~0.8 s at a
  scale-up instead of ~7.5 s; on one shared 2-core machine the newcomers' imports compete
  with the training, so the new size arrives later there than with a cold start.
- the discovery interval: Horovod runs the discovery script every second, and that poll is
  most of what a scale change waits for; `HVD_RESILIENT_DISCOVERY_INTERVAL=0.25` (seconds)
  polls faster, at the cost of running the script that much more often.
Both only wrap methods of Horovod's elastic driver; the protocol between driver and workers is
Horovod's own.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hvd_resilient import slot_hosts
from hvd_resilient.launch import standby as standby_mod

logger = logging.getLogger("hvd_resilient.launch")

ENV = "HVD_RESILIENT_SLOT_HOSTS"
STANDBY_ENV = "HVD_RESILIENT_STANDBY"
INTERVAL_ENV = "HVD_RESILIENT_DISCOVERY_INTERVAL"


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


def _kv(driver: Any, scope: str) -> dict[str, bytes]:
    httpd = driver._rendezvous._httpd
    with httpd.cache_lock:
        return dict(httpd.cache.get(scope, {}))


def _kv_set(driver: Any, scope: str, key: str, value: bytes | None) -> None:
    httpd = driver._rendezvous._httpd
    with httpd.cache_lock:
        bucket = httpd.cache.setdefault(scope, {})
        if value is None:
            bucket.pop(key, None)
        else:
            bucket[key] = value


def _key(slot: Any) -> str:
    return f"{slot.hostname}:{slot.local_rank}"


def _standby_table(driver: Any) -> dict[str, Any]:
    """The driver's standby workers: started, not yet released (slot key -> SlotInfo)."""
    return driver.__dict__.setdefault("_hvdr_standby", {})


def install_standby(ready_timeout_s: float = 120.0) -> None:
    from horovod.runner import launch
    from horovod.runner.elastic.driver import ElasticDriver

    notify = ElasticDriver._notify_workers_host_changes
    handle_exit = ElasticDriver._handle_worker_exit
    lock = threading.Lock()  # the standby table: started, not yet released

    def notify_when_ready(self: Any, current_hosts: Any, update_res: Any) -> None:
        standby = _standby_table(self)
        if self._host_assignments and (
            current_hosts.count_available_slots() >= self._min_num_proc
        ):
            nxt, _ = self._get_host_assignments(current_hosts)
            active = {(h, s.local_rank) for h, slots in self._host_assignments.items()
                      for s in slots}
            new = [s for h, slots in nxt.items() for s in slots
                   if (h, s.local_rank) not in active and _key(s) not in standby]
            if new:
                for s in new:
                    _kv_set(self, standby_mod.READY, _key(s), None)
                    _kv_set(self, standby_mod.GO, _key(s), None)
                    with lock:
                        standby[_key(s)] = s
                    self._start_worker_process(s)
                threading.Thread(target=_notify_later, args=(self, new, update_res),
                                 daemon=True, name="hvd-resilient-standby").start()
                return
        notify(self, current_hosts, update_res)

    def _notify_later(self: Any, new: list[Any], update_res: Any) -> None:
        deadline = time.monotonic() + ready_timeout_s
        standby = _standby_table(self)
        while time.monotonic() < deadline and not self.finished():
            ready = _kv(self, standby_mod.READY)
            with lock:  # a standby that died is not waited for: its slot starts cold instead
                waiting = [s for s in new if _key(s) in standby and _key(s) not in ready]
            if not waiting:
                break
            time.sleep(0.05)
        with self._wait_hosts_cond:
            notify(self, self._host_manager.current_hosts, update_res)

    def start_or_release(self: Any, pending_slots: list[Any]) -> None:
        standby = _standby_table(self)
        for s in pending_slots:
            _kv_set(self, standby_mod.GO, _key(s), standby_mod.slot_env(s))
            with lock:
                released = standby.pop(_key(s), None) is not None
            if not released:
                self._start_worker_process(s)

    def exit_of_standby(self: Any, slot: Any, exit_code: int, timestamp: Any) -> None:
        """A standby that exits before its release (a broken environment on the new host, an
        OOM kill) leaves the table, so that the reset starts its slot afresh, and a failure of
        that fresh worker is a worker failure Horovod handles. Without this the driver would
        release a dead process and the new world would wait for it until the Gloo timeout."""
        standby = _standby_table(self)
        with lock:
            unreleased = standby.get(_key(slot)) is slot
            if unreleased:
                del standby[_key(slot)]
        if unreleased:
            logger.warning("standby worker for %s exited (code %s) before its release; the "
                           "slot will start a fresh worker at the reset", _key(slot), exit_code)
            return
        handle_exit(self, slot, exit_code, timestamp)

    ElasticDriver._notify_workers_host_changes = notify_when_ready
    ElasticDriver._start_worker_processes = start_or_release
    ElasticDriver._handle_worker_exit = exit_of_standby

    run_elastic = launch._run_elastic

    def run_elastic_with_standby(args: Any) -> Any:
        cmd = list(args.command or [])
        if cmd and standby_mod.same_python(cmd[0]):
            args.command = [cmd[0], "-m", "hvd_resilient.launch.standby", *cmd]
        return run_elastic(args)

    launch._run_elastic = run_elastic_with_standby


def set_discovery_interval() -> None:
    """Applies HVD_RESILIENT_DISCOVERY_INTERVAL; a bad value stops here with one line."""
    raw = os.environ.get(INTERVAL_ENV, "")
    if not raw:
        return
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0.05 <= seconds <= 3600:
        sys.exit(f"hvd-resilient: {INTERVAL_ENV}={raw!r} must be seconds between 0.05 and 3600 "
                 f"(unset it for Horovod's 1 s)")
    from horovod.runner.elastic import driver

    driver.DISCOVER_HOSTS_FREQUENCY_SECS = seconds


def main(argv: list[str] | None = None) -> None:
    set_discovery_interval()
    if os.environ.get(ENV, "1") != "0":
        install()
    if os.environ.get(STANDBY_ENV, "1") != "0":
        install_standby()
    from horovod.runner.launch import run_commandline

    sys.argv = ["horovodrun", *(sys.argv[1:] if argv is None else argv)]
    run_commandline()


if __name__ == "__main__":
    main()
