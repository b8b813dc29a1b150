"""`horovodrun`, taught seven things: `python -m hvd_resilient.launch.horovod.driver ARGS`.

Takes exactly `horovodrun`'s arguments and runs Horovod's own launcher in this process, after
teaching it
- slot hosts (`slot_hosts`): the discovery output is split per slot, and address lookups and
  ssh commands get the real host back (`HVD_RESILIENT_SLOT_HOSTS=0` turns it off);
- standby workers (`standby`; `HVD_RESILIENT_STANDBY=0` turns them off): when hosts or slots
  are added, their workers are started at once, importing torch, torch._dynamo (which the first
  optimizer pulls in) and Horovod ahead of the reset, and rank 0 is told of the change at once,
  as plain Horovod does; the reset at the next commit then waits in Horovod's rendezvous
  barrier (no timeout there) for the rest of the newcomers' warm-up, never in the new world's
  Gloo connect, which aborts the old workers at the Gloo timeout (`install_standby`);
- the discovery interval: Horovod runs the discovery script every second, and that poll is
  most of what a scale change waits for; `HVD_RESILIENT_DISCOVERY_INTERVAL=0.25` (seconds)
  polls faster, at the cost of running the script that much more often.
- discovery output checked (`install_discovery_check`): a line Horovod would misread
  (`hello world`, `localhost:lots`) is refused with one line before the job starts; during the
  run the last good host list stays in force, with a warning naming the bad line and a
  `discovery_invalid` event in the run's event log;
- a worker exiting with FATAL_EXIT_CODE (78: an error no restart fixes, such as a bad config)
  stops the whole job at once (`install_fatal_stop`) instead of having its slot blacklisted and
  restarted into the same error;
- a slot its workers found silent (frozen, cut off) is ended at once (`evict`), so the reset
  does not wait for a worker that will never reach the rendezvous;
- one line instead of the launcher's traceback (`main`): nothing at all when a worker stopped
  on a fatal error (that worker recorded it; `hvd-resilient run` prints it once).
All of it only wraps methods of Horovod's launcher; the protocol between driver and workers
is Horovod's own.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from hvd_resilient.backends.horovod import compat
from hvd_resilient.backends.horovod import slots as slot_hosts
from hvd_resilient.errors import FATAL_EXIT_CODE, LaunchError, one_line
from hvd_resilient.launch.horovod import evict
from hvd_resilient.launch.horovod import standby as standby_mod

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
    compat.replace(network, "resolve_host_address",
                   lambda name: resolve(slot_hosts.real_host(name)))
    for mod in (remote, gloo_run, launch, driver_service):  # each checked by check_compatible
        compat.replace(mod, "get_remote_command", _real_host_arg(mod.get_remote_command))
    for cls in (discovery.HostDiscoveryScript, discovery.FixedHosts):
        find = cls.find_available_hosts_and_slots
        compat.replace(cls, "find_available_hosts_and_slots",
                       lambda self, _find=find: slot_hosts.split(_find(self)))


def _key(slot: Any) -> str:
    return f"{slot.hostname}:{slot.local_rank}"


def _standby_table(driver: Any) -> dict[str, Any]:
    """The driver's standby workers: started, not yet released (slot key -> SlotInfo)."""
    return driver.__dict__.setdefault("_hvdr_standby", {})


def install_standby(ready_timeout_s: float = 120.0) -> None:
    """Newcomers started at once as standby workers; rank 0 told at once too; the new world
    formed once they are warm.

    Rank 0 is told of every discovery change as it is seen, warm-up or not: Horovod's contract
    is that rank 0 hears of a change within one discovery interval, and a script may wait for
    that (Horovod's own elastic test worker gives up after 3 s, "Timed out waiting for
    notifications from driver."). Holding the notice back until the newcomers were warm (the
    first design) kept the old world training through the warm-up, but left rank 0 blind for
    5-20 s, and with it every script that acts on the notice.

    The reset that follows (at the next commit) waits for the newcomers' warm-up, and where it
    waits matters: inside Horovod's rendezvous barrier (the old workers' request for their new
    rank, which the driver answers when it likes), not in the new world's Gloo connect, which
    gives up after the Gloo timeout and aborts every old worker with it (seen here: a newcomer
    still importing 30 s later, on 2 cores at load 8, cost the whole job). So the release of a
    standby into the new world waits until it said it is ready (imports done), it died (its
    slot then starts afresh), `ready_timeout_s` passed, or the job stopped; only then is the
    new world formed, and its Gloo connect waits for warm processes only. A slot that joins at
    a reset without having been started ahead (back from its cooldown, or replacing a standby
    that died) is started as a standby at that moment and waited for the same way."""
    from horovod.runner import launch
    from horovod.runner.elastic.driver import ElasticDriver

    notify = ElasticDriver._notify_workers_host_changes
    handle_exit = ElasticDriver._handle_worker_exit
    lock = threading.Lock()  # the standby table: started, not yet released
    wrapped = {"on": False}  # the workers run through the standby module (same Python)

    def start_standby_and_notify(self: Any, current_hosts: Any, update_res: Any) -> None:
        standby = _standby_table(self)
        if self._host_assignments and (
            current_hosts.count_available_slots() >= self._min_num_proc
        ):
            nxt, _ = self._get_host_assignments(current_hosts)
            active = {(h, s.local_rank) for h, slots in self._host_assignments.items()
                      for s in slots}
            new = [s for h, slots in nxt.items() for s in slots
                   if (h, s.local_rank) not in active and _key(s) not in standby]
            for s in new:
                start_standby(self, s)
            if new:
                logger.info("hosts changed: started %d standby worker(s) (%s); telling rank 0 "
                            "now", len(new), ", ".join(_key(s) for s in new))
                _events().emit("standby_started", slots=[_key(s) for s in new])
        notify(self, current_hosts, update_res)

    def wait_until_warm(self: Any, slots: dict[str, Any]) -> None:
        """Runs in the reset's barrier action: the old workers wait in their rendezvous
        request meanwhile, which has no timeout (Horovod waits there for --min-np slots too).
        A standby that dies meanwhile is replaced by a new one, once; after that its slot is
        no longer waited for (it starts cold, and a failure there is Horovod's to handle)."""
        standby = _standby_table(self)
        deadline = time.monotonic() + ready_timeout_s
        t0 = time.monotonic()
        replaced: set[str] = set()
        keys = list(slots)
        while not self.finished():
            ready = compat.kv_get(self, standby_mod.READY)
            with lock:
                died = [k for k in keys if k not in standby and k not in replaced]
            for k in died if wrapped["on"] else ():
                replaced.add(k)
                start_standby(self, slots[k])
            with lock:
                waiting = [k for k in keys if k in standby and k not in ready]
            if not waiting:
                break
            if time.monotonic() > deadline:
                logger.warning("standby worker(s) %s not ready after %.0f s; releasing them "
                               "anyway", ", ".join(waiting), ready_timeout_s)
                break
            time.sleep(0.05)
        if keys:
            waited = time.monotonic() - t0
            logger.info("released %d standby worker(s) after %.2f s of warm-up wait",
                        len(keys), waited)
            _events().emit("standby_released", slots=keys, waited_s=round(waited, 3),
                           replaced=sorted(replaced) or None)

    def start_standby(self: Any, s: Any) -> None:
        compat.kv_set(self, standby_mod.READY, _key(s), None)
        compat.kv_set(self, standby_mod.GO, _key(s), None)
        with lock:
            _standby_table(self)[_key(s)] = s
        self._start_worker_process(s)

    def start_or_release(self: Any, pending_slots: list[Any]) -> None:
        standby = _standby_table(self)
        if wrapped["on"] and self.__dict__.get("_hvdr_formed"):
            # A reset: a slot nobody started ahead (back from its cooldown, or a standby that
            # died) starts as a standby now, so that its cold start is waited for here too.
            for s in pending_slots:
                if _key(s) not in standby:
                    start_standby(self, s)
        self.__dict__["_hvdr_formed"] = True
        with lock:
            warming = {_key(s): s for s in pending_slots if _key(s) in standby}
        wait_until_warm(self, warming)
        for s in pending_slots:
            compat.kv_set(self, standby_mod.GO, _key(s), standby_mod.slot_env(s))
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

    compat.replace(ElasticDriver, "_notify_workers_host_changes", start_standby_and_notify)
    compat.replace(ElasticDriver, "_start_worker_processes", start_or_release)
    compat.replace(ElasticDriver, "_handle_worker_exit", exit_of_standby)

    run_elastic = launch._run_elastic

    def run_elastic_with_standby(args: Any) -> Any:
        cmd = list(args.command or [])
        if cmd and standby_mod.same_python(cmd[0]):
            args.command = [cmd[0], "-m", "hvd_resilient.launch.horovod.standby", *cmd]
            wrapped["on"] = True  # every worker speaks the standby protocol (ready, go)
        return run_elastic(args)

    compat.replace(launch, "_run_elastic", run_elastic_with_standby)


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

    compat.replace(driver, "DISCOVER_HOSTS_FREQUENCY_SECS", seconds)


class _Run:
    """What the patches tell `main` about this launch (one launcher per process)."""

    fatal: str = ""  # set when a worker exited with FATAL_EXIT_CODE
    discovery_error: str = ""  # the discovery script's first answer was unusable
    thread_errors: list[str] = []  # first lines of exceptions that ended launcher threads
    events: Any = None


def _one_line(e: BaseException | str) -> str:
    from hvd_resilient.masking import mask_text

    return mask_text(one_line(e, limit=10_000))


def _events() -> Any:
    """The run's event log when started by `hvd-resilient run` (rank -1: not a worker)."""
    if _Run.events is None:
        from hvd_resilient.events import EventLog

        run_dir = os.environ.get("HVD_RESILIENT_RUN_DIR", "")
        _Run.events = EventLog(os.path.join(run_dir, "events.jsonl") if run_dir else None,
                               rank=-1, size=0, step=0)
    return _Run.events


def install_discovery_check() -> None:
    """Horovod's parsing of the discovery script's output, replaced by `parse_discovery_output`;
    a bad answer after a good one keeps the last good host list (the script's non-zero exits
    stay Horovod's: a warning, hosts kept)."""
    from horovod.runner.elastic import discovery

    from hvd_resilient.discovery.validate import DiscoveryOutputError, parse_discovery_output

    def find_available_hosts_and_slots(self: Any) -> dict[str, int]:
        text = self._execute_discovery_script()
        state = self.__dict__.setdefault("_hvdr", {"good": None, "bad": None})
        script = self._discovery_script
        try:
            hosts = parse_discovery_output(text, default_slots=self._default_slots or 1)
        except DiscoveryOutputError as e:
            if state["good"] is None:  # the first answer: nothing to fall back on
                _Run.discovery_error = _one_line(f"discovery script {script} printed {e}")
                raise RuntimeError(_Run.discovery_error) from None
            if state["bad"] != str(e):  # once per distinct bad answer, not every second
                state["bad"] = str(e)
                logger.warning("discovery script %s printed %s; keeping the last good host "
                               "list %s", script, e, _hosts_arg(state["good"]))
                _events().emit("discovery_invalid", script=script, error=str(e),
                               kept=_hosts_arg(state["good"]))
            return dict(state["good"])
        state["good"], state["bad"] = hosts, None
        return hosts

    compat.replace(discovery.HostDiscoveryScript, "find_available_hosts_and_slots",
                   find_available_hosts_and_slots)


def _hosts_arg(hosts: dict[str, int]) -> str:
    return ",".join(f"{h}:{n}" for h, n in sorted(hosts.items())) or "(none)"


def install_fatal_stop() -> None:
    """A worker that exits with FATAL_EXIT_CODE stopped on an error every restart would meet
    again: stop the job at once (the shutdown event terminates the other workers) instead of
    blacklisting its slot and resetting. Installed before `install_standby`, which wraps it
    (a standby that exits before its release is still only logged)."""
    from horovod.runner.elastic.driver import ElasticDriver
    from horovod.runner.elastic.registration import WorkerStateRegistry

    handle_exit = ElasticDriver._handle_worker_exit
    wait = WorkerStateRegistry._wait

    def wait_unless_stopped(self: Any, key: Any, state: Any, rendezvous_id: int) -> int:
        """Threads waiting at a reset's barrier (a worker's exit, a survivor's rendezvous
        request) when the job is stopped are let go quietly, not left blocking the driver."""
        try:
            return wait(self, key, state, rendezvous_id)
        except threading.BrokenBarrierError:
            if self._driver.finished():
                return rendezvous_id
            raise

    def stop_on_fatal(self: Any, slot: Any, exit_code: int, timestamp: Any) -> None:
        if exit_code == FATAL_EXIT_CODE and not self.finished():
            name = f"{slot.hostname}[{slot.local_rank}]"
            _Run.fatal = _Run.fatal or name
            message = (f"worker {name} (rank {slot.rank}) stopped on an error no restart "
                       f"fixes (exit code {FATAL_EXIT_CODE}); stopping the job")
            logger.debug("%s", message)
            self.stop(error_message=message)
            barrier = self._worker_registry._barrier  # None until the first reset
            if barrier is not None:  # workers already waiting at a reset must not wait forever
                barrier.abort()
        handle_exit(self, slot, exit_code, timestamp)

    compat.replace(ElasticDriver, "_handle_worker_exit", stop_on_fatal)
    compat.replace(WorkerStateRegistry, "_wait", wait_unless_stopped)
    _quiet_hung_up_clients()


def _quiet_hung_up_clients() -> None:
    """A worker killed while it waited for its rendezvous answer (the job was stopped) leaves
    the answer nowhere to go: socketserver would print a BrokenPipeError traceback for it."""
    from horovod.runner.http.http_server import RendezvousHTTPServer

    handle_error = RendezvousHTTPServer.handle_error

    def handle_error_quietly(self: Any, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            logger.debug("rendezvous client %s hung up before its answer", client_address)
            return
        handle_error(self, request, client_address)

    compat.replace(RendezvousHTTPServer, "handle_error", handle_error_quietly)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    """A launcher thread that ends in an exception: one line instead of a traceback. The
    discovery thread's failure on its first call is only noted: `main` prints it as the cause
    of Horovod's "Job has been shutdown, see above"."""
    if args.exc_type is SystemExit:
        return
    line = _one_line(args.exc_value or args.exc_type.__name__)
    _Run.thread_errors.append(line)
    logger.debug("launcher thread %s ended", getattr(args.thread, "name", "?"),
                 exc_info=(args.exc_type, args.exc_value, args.exc_traceback))
    if line != _Run.discovery_error:
        print(f"hvd-resilient: launcher thread {getattr(args.thread, 'name', '?')}: {line}",
              file=sys.stderr, flush=True)


def _fatal_recorded(since: float) -> bool:
    """A worker recorded a `fatal` event in the run's event log since this launcher started."""
    run_dir = os.environ.get("HVD_RESILIENT_RUN_DIR", "")
    if not run_dir:
        return False
    from hvd_resilient.events import read_recent_events

    return any(e["event"] == "fatal" and e["ts"] >= since
               for e in read_recent_events(os.path.join(run_dir, "events.jsonl")))


def main(argv: list[str] | None = None) -> None:
    from hvd_resilient.masking import install_log_scrubber

    install_log_scrubber()
    since = time.time()
    try:  # before any patch: an untested Horovod stops here, not minutes into the job
        compat.check_compatible(driver=True)
    except LaunchError as e:
        sys.exit(f"hvd-resilient: launcher: {e}")
    set_discovery_interval()
    install_discovery_check()  # first: the slot split below wraps the checked answer
    if os.environ.get(ENV, "1") != "0":
        install()
    install_fatal_stop()  # before the standby, which wraps the worker-exit handler again
    if os.environ.get(STANDBY_ENV, "1") != "0":
        install_standby()
    args = sys.argv[1:] if argv is None else argv
    evict.install(args, lambda name, **fields: _events().emit(name, **fields))
    threading.excepthook = _thread_excepthook
    from horovod.runner.launch import run_commandline

    sys.argv = ["horovodrun", *args]
    try:
        run_commandline()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:
        if _Run.fatal or _fatal_recorded(since):
            # The worker said why (in the event log under `hvd-resilient run`, else on its
            # stderr); Horovod's "processes exited with non-zero status" adds nothing.
            sys.exit(FATAL_EXIT_CODE)
        reason = _one_line(e)
        if re.search(rf"Exit code: {FATAL_EXIT_CODE}\b", reason):
            sys.exit(FATAL_EXIT_CODE)  # static horovodrun: a worker stopped on a fatal error
        if reason.startswith("Job has been shutdown") and _Run.thread_errors:
            reason = _Run.thread_errors[0]  # the cause, which Horovod only says "see above" of
        print(f"hvd-resilient: launcher: {reason}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
