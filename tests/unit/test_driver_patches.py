"""Each patch family of the Horovod driver against a small stub driver: the replacement
functions are built from stand-ins for Horovod's originals and called on plain objects, so
nothing here patches the test session's Horovod classes; the only processes started are the
discovery scripts of the discovery tests (shell scripts)."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from hvd_resilient.backends.horovod import compat, driver_kv
from hvd_resilient.errors import FATAL_EXIT_CODE
from hvd_resilient.events import read_events
from hvd_resilient.launch.horovod import patches
from hvd_resilient.launch.horovod.options import DriverOptions
from hvd_resilient.launch.horovod.patches import (
    discovery_check,
    discovery_watch,
    evict,
    fatal_stop,
    gloo_check,
    next_slots,
    orphan_slots,
    slot_hosts,
    standby_slots,
)
from hvd_resilient.launch.horovod.patches.context import PatchContext


class Httpd:
    def __init__(self) -> None:
        self.cache_lock = threading.Lock()
        self.cache: dict[str, dict[str, bytes]] = {}


class StubDriver:
    """What the patches reach of Horovod's ElasticDriver: its state flags, its rendezvous
    store, its worker start and stop."""

    def __init__(self) -> None:
        self._rendezvous = SimpleNamespace(_httpd=Httpd())
        self._worker_registry = SimpleNamespace(_barrier=None)
        self._host_assignments: dict[str, list[Any]] = {}
        self._min_num_proc = 1
        self.started: list[str] = []
        self.stopped: list[str | None] = []
        self.done = False

    def finished(self) -> bool:
        return self.done

    def stop(self, error_message: str | None = None) -> None:
        self.stopped.append(error_message)
        self.done = True

    def _start_worker_process(self, slot: Any) -> None:
        self.started.append(standby_slots.slot_key(slot))


def slot(host: str, rank: int = 0, local_rank: int = 0) -> SimpleNamespace:
    return SimpleNamespace(hostname=host, local_rank=local_rank, rank=rank, size=2,
                           local_size=1, cross_rank=rank, cross_size=2)


def recorder() -> tuple[list[tuple[Any, ...]], Any]:
    calls: list[tuple[Any, ...]] = []
    return calls, lambda *args: calls.append(args)


# -- the one order ----------------------------------------------------------------------------
def test_the_order_is_one_list_and_the_switches_pick_from_it():
    names = [p.name for p in patches.ORDER]
    assert names == ["discovery_interval", "discovery_check", "discovery_watch", "slot_hosts",
                     "fatal_stop", "stop_signal", "standby_slots", "evict", "orphan_slots",
                     "gloo_check", "fast_middleman", "next_slots"]

    def wanted(options: DriverOptions) -> list[str]:
        return [p.name for p in patches.ORDER if p.wanted(options)]

    assert wanted(DriverOptions()) == [n for n in names[1:] if n != "discovery_watch"]
    assert wanted(DriverOptions(slot_hosts=False, standby=False, discovery_interval_s=0.5)) \
        == ["discovery_interval", "discovery_check", "fatal_stop", "stop_signal", "evict",
            "orphan_slots", "gloo_check", "fast_middleman", "next_slots"]


def test_install_follows_the_order_it_is_given():
    seen: list[str] = []
    order = tuple(patches.Patch(n, lambda ctx, n=n: seen.append(n), wanted)
                  for n, wanted in (("a", lambda o: True), ("b", lambda o: o.standby),
                                    ("c", lambda o: True)))
    assert patches.install(PatchContext(DriverOptions(standby=False)), order) == ["a", "c"]
    assert seen == ["a", "c"]


# -- orphan slots -----------------------------------------------------------------------------
def test_a_world_that_waits_for_a_failed_slot_starts_it_again():
    """Horovod's own `_update_host_assignments` on a driver holding the world it had: slots a,
    b, c; a and b died in one reset (min 2), a came back from its cooldown. Horovod assigns a
    rank to a and starts nothing (a was in the last world): the new world would wait for a
    process that does not exist. Patched, a is started; once started, it is not again."""
    from horovod.runner.elastic.discovery import DiscoveredHosts
    from horovod.runner.elastic.driver import ElasticDriver

    driver: Any = object.__new__(ElasticDriver)  # no discovery thread, no rendezvous server
    driver.__dict__.update(_host_assignments={}, _min_num_proc=2, _max_num_proc=3,
                           _rendezvous=SimpleNamespace(init=lambda assignments: None))
    started: list[str] = []
    exits: list[str] = []
    patch = orphan_slots.OrphanSlots(
        PatchContext(), update=ElasticDriver._update_host_assignments,
        start=lambda d, s: started.append(orphan_slots.slot_key(s)),
        handle_exit=lambda d, s, *a: exits.append(orphan_slots.slot_key(s)))

    def world(*hosts: str) -> list[str]:
        found = DiscoveredHosts({h: 1 for h in hosts}, list(hosts))
        return sorted(orphan_slots.slot_key(s)
                      for s in patch.update_host_assignments(driver, found))

    assert world("a", "b", "c") == ["a:0", "b:0", "c:0"]
    for key in ("a", "b", "c"):
        patch.start_worker_process(driver, SimpleNamespace(hostname=key, local_rank=0))
    for key in ("a", "b"):
        patch.handle_worker_exit(driver, SimpleNamespace(hostname=key, local_rank=0), 137, 0.0)
    assert exits == ["a:0", "b:0"]
    found = DiscoveredHosts({"a": 1, "c": 1}, ["a", "c"])
    assert ElasticDriver._update_host_assignments(driver, found) == [], \
        "Horovod's own answer: nothing to start (the bug this patch exists for)"
    assert world("a", "c") == ["a:0"]
    patch.start_worker_process(driver, SimpleNamespace(hostname="a", local_rank=0))
    assert world("a", "c") == [], "a slot started since its exit is not started twice"
    assert started == ["a:0", "b:0", "c:0", "a:0"]


# -- discovery check --------------------------------------------------------------------------
class StubDiscovery:
    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self._discovery_script = "/d.sh"
        self._default_slots = None

    def _execute_discovery_script(self) -> str:
        return self.answers.pop(0)


def test_a_bad_first_discovery_answer_stops_with_one_line():
    ctx = PatchContext()
    find = discovery_check.checked_find(ctx)
    with pytest.raises(RuntimeError) as e:
        find(StubDiscovery(["localhost:lots\n"]))
    assert str(e.value) == ctx.discovery_error
    assert ctx.discovery_error.startswith("discovery script /d.sh printed line 1")
    assert "\n" not in ctx.discovery_error


def test_a_bad_answer_later_keeps_the_last_good_hosts_and_is_recorded_once(tmp_path):
    ctx = PatchContext(DriverOptions(run_dir=str(tmp_path)))
    find = discovery_check.checked_find(ctx)
    d = StubDiscovery(["b:2\na:1\n", "hello world\n", "hello world\n", "a:1\n"])
    assert find(d) == {"a": 1, "b": 2}
    assert find(d) == {"a": 1, "b": 2}
    assert find(d) == {"a": 1, "b": 2}
    assert find(d) == {"a": 1}
    (ev,) = [e for e in read_events(tmp_path / "events.jsonl")]
    assert (ev["event"], ev["rank"], ev["kept"]) == ("discovery_invalid", -1, "a:1,b:2")


def _script(tmp_path, body: str) -> SimpleNamespace:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return SimpleNamespace(_discovery_script=str(path))


def test_the_discovery_script_runs_as_a_plain_child_with_horovod_s_errors(tmp_path, capfd):
    """No spawned middleman interpreter (1.2-2.2 s a poll under load): the script's stdout is
    the answer, its stderr the driver's, a non-zero exit Horovod's RuntimeError."""
    ok = _script(tmp_path, "echo b:2; echo a:1; echo why >&2\n")
    assert discovery_check.run_script(ok) == "b:2\na:1\n"
    assert capfd.readouterr().err == "why\n"
    bad = _script(tmp_path, "exit 3\n")
    with pytest.raises(RuntimeError, match="Exit code: 3"):
        discovery_check.run_script(bad)


def test_a_discovery_script_that_never_answers_is_ended_with_its_children(tmp_path, monkeypatch):
    import psutil

    monkeypatch.setattr(discovery_check, "SCRIPT_TIMEOUT_S", 0.5)
    pid_file = tmp_path / "child.pid"
    hung = _script(tmp_path, f"sleep 60 & echo $! > {pid_file}; wait\n")
    with pytest.raises(RuntimeError, match="No answer within"):
        discovery_check.run_script(hung)
    child = int(pid_file.read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"


# -- slot hosts -------------------------------------------------------------------------------
def test_slot_hosts_split_discovery_and_give_ssh_the_machine():
    calls, fn = recorder()
    wrapped = slot_hosts.real_host_arg(lambda *a, **k: calls.append((a, k)))
    wrapped("kill -9 1", host="node-a+1", port="22")
    wrapped("true", host=None)
    assert calls == [(("kill -9 1",), {"host": "node-a", "port": "22"}),
                     (("true",), {"host": None})]
    find = slot_hosts.split_hosts(lambda self: {"node-a": 2, "node-b": 1})
    assert find(object()) == {"node-a+0": 1, "node-a+1": 1, "node-b+0": 1}


# -- fatal stop -------------------------------------------------------------------------------
def test_a_fatal_exit_stops_the_driver_and_lets_the_barrier_go():
    ctx, driver = PatchContext(), StubDriver()
    aborted = []
    driver._worker_registry._barrier = SimpleNamespace(abort=lambda: aborted.append(True))
    calls, handle_exit = recorder()
    on_exit = fatal_stop.stop_on_fatal(ctx, handle_exit)
    on_exit(driver, slot("h+1", rank=1), 1, 0.0)  # an ordinary failure: Horovod's to handle
    assert driver.stopped == [] and ctx.fatal == "" and len(calls) == 1
    on_exit(driver, slot("h+1", rank=1), FATAL_EXIT_CODE, 1.0)
    assert ctx.fatal == "h+1[0]" and aborted == [True]
    assert driver.stopped == ["worker h+1[0] (rank 1) stopped on an error no restart fixes "
                              f"(exit code {FATAL_EXIT_CODE}); stopping the job"]
    on_exit(driver, slot("h+0"), FATAL_EXIT_CODE, 2.0)  # already stopping: said once
    assert len(driver.stopped) == 1 and ctx.fatal == "h+1[0]" and len(calls) == 3


def test_waiters_at_a_broken_barrier_go_quietly_only_when_the_job_stopped():
    def broken(self: Any, key: Any, state: Any, rendezvous_id: int) -> int:
        raise threading.BrokenBarrierError

    wait = fatal_stop.wait_unless_stopped(broken)
    registry = SimpleNamespace(_driver=StubDriver())
    with pytest.raises(threading.BrokenBarrierError):
        wait(registry, "k", "s", 3)
    registry._driver.done = True
    assert wait(registry, "k", "s", 3) == 3


def test_a_client_that_hung_up_is_not_a_traceback():
    calls, handle_error = recorder()
    quiet = fatal_stop.quiet_hang_ups(handle_error)
    for exc in (BrokenPipeError(), ValueError("a real one")):
        try:
            raise exc
        except Exception:
            quiet(object(), "request", ("127.0.0.1", 9))
    assert [c[2] for c in calls] == [("127.0.0.1", 9)]  # only the ValueError went on


# -- standby ----------------------------------------------------------------------------------
def make_standby(ctx: PatchContext) -> tuple[standby_slots.Standby, dict[str, list[Any]]]:
    seen: dict[str, list[Any]] = {"notify": [], "exit": [], "run": []}
    patch = standby_slots.Standby(
        ctx, notify=lambda d, hosts, res: seen["notify"].append(res),
        handle_exit=lambda d, s, code, ts: seen["exit"].append((standby_slots.slot_key(s),
                                                                  code)),
        run_elastic=lambda args: seen["run"].append(list(args.command)))
    return patch, seen


class Hosts:
    def __init__(self, names: list[str]) -> None:
        self.names = names

    def count_available_slots(self) -> int:
        return len(self.names)


def grown_driver() -> StubDriver:
    driver = StubDriver()
    driver._host_assignments = {"a+0": [slot("a+0")]}
    driver._get_host_assignments = lambda hosts: (  # type: ignore[attr-defined]
        {h: [slot(h, rank=i)] for i, h in enumerate(hosts.names)}, None)
    return driver


def test_newcomers_start_as_standbys_and_rank_0_is_told_in_the_same_call(tmp_path):
    ctx = PatchContext(DriverOptions(run_dir=str(tmp_path)))
    patch, seen = make_standby(ctx)
    driver = grown_driver()
    patch.notify_host_changes(driver, Hosts(["a+0", "b+0"]), "added")
    assert driver.started == ["b+0:0"] and seen["notify"] == ["added"]
    assert sorted(patch.table(driver)) == ["b+0:0"]
    patch.notify_host_changes(driver, Hosts(["a+0", "b+0"]), "added")  # not started twice
    assert driver.started == ["b+0:0"] and len(seen["notify"]) == 2
    (ev,) = read_events(tmp_path / "events.jsonl")
    assert (ev["event"], ev["slots"]) == ("standby_started", ["b+0:0"])


def test_the_reset_releases_a_standby_once_it_is_ready_and_starts_the_others():
    ctx = PatchContext(DriverOptions(standby_ready_timeout_s=30.0))
    patch, _ = make_standby(ctx)
    patch.wrapped = True
    driver = grown_driver()
    fields = set(vars(driver))
    patch.notify_host_changes(driver, Hosts(["a+0", "b+0"]), "added")
    patch.drivers.of(driver).formed = True
    pending = [slot("a+0", rank=0), patch.table(driver)["b+0:0"]]
    pending[1].rank = 1
    release = threading.Thread(target=patch.start_or_release, args=(driver, pending))
    release.start()
    release.join(0.3)
    assert release.is_alive(), "released before the standby said it is ready"
    # a+0 had no standby: at a reset it starts as one too, and is waited for the same way
    assert driver.started == ["b+0:0", "a+0:0"]
    httpd = driver._rendezvous._httpd
    with httpd.cache_lock:
        httpd.cache.setdefault(driver_kv.READY, {}).update({"a+0:0": b"1", "b+0:0": b"1"})
    release.join(10)
    assert not release.is_alive()
    go = httpd.cache[driver_kv.GO]
    assert go == {"a+0:0": b"0,2,0,1,0,2", "b+0:0": b"1,2,0,1,1,2"}
    assert driver.started == ["b+0:0", "a+0:0"], "a released standby is not started again"
    assert patch.table(driver) == {}
    assert httpd.cache[driver_kv.READY] == {}, "a released worker is no standby's READY"
    assert set(vars(driver)) == fields, "the patch keeps what it knows itself, not in the driver"


def test_a_rendezvous_keeps_the_standbys_ready_and_clears_the_rest():
    """Horovod's store is cleared by the rendezvous that releases the standbys: their READY
    must survive it, or the release waits for each one's next beat."""
    from horovod.runner.http.http_server import RendezvousHTTPServer

    server = SimpleNamespace(cache={driver_kv.READY: {"b+0:0": b"1"},
                                    "rank_and_size": {"a+0:0": b"x"}},
                             cache_lock=threading.Lock(), finished_list_lock=threading.Lock(),
                             finished_list={}, scope_size={}, _extract_scope_size=lambda plan: 0)
    standby_slots.keeping_ready(RendezvousHTTPServer.init)(server, [])
    assert server.cache == {driver_kv.READY: {"b+0:0": b"1"}}


def test_the_store_lists_the_unreleased_standbys_for_rank_0_after_every_change():
    patch, _ = make_standby(PatchContext(DriverOptions(standby_ready_timeout_s=5.0)))
    patch.wrapped = True
    driver = grown_driver()
    httpd = driver._rendezvous._httpd

    def listed() -> bytes | None:
        with httpd.cache_lock:
            return httpd.cache.get(driver_kv.WARMING, {}).get(driver_kv.WARMING_KEY)

    patch.notify_host_changes(driver, Hosts(["a+0", "b+0", "c+0"]), "added")
    assert listed() == b"b+0:0,c+0:0", "listed before rank 0 is told"
    patch.handle_worker_exit(driver, patch.table(driver)["c+0:0"], 1, 0.0)
    assert listed() == b"b+0:0", "a standby that died is not waited for"
    with httpd.cache_lock:
        httpd.cache.clear()  # the reset's rendezvous clears the store
        httpd.cache[driver_kv.READY] = {"b+0:0": b"1"}
    patch.start_or_release(driver, [slot("a+0"), patch.table(driver)["b+0:0"]])
    assert listed() is None and patch.table(driver) == {}


def test_a_standby_that_exits_before_its_release_is_only_logged():
    patch, seen = make_standby(PatchContext())
    driver = grown_driver()
    patch.notify_host_changes(driver, Hosts(["a+0", "b+0"]), "added")
    waiting = patch.table(driver)["b+0:0"]
    compat.kv_set(driver, driver_kv.READY, "b+0:0", b"1")
    patch.handle_worker_exit(driver, waiting, FATAL_EXIT_CODE, 0.0)
    assert seen["exit"] == [] and patch.table(driver) == {}
    assert compat.kv_get(driver, driver_kv.READY) == {}, "a dead standby is not ready"
    patch.handle_worker_exit(driver, slot("a+0"), 1, 0.0)  # a released worker: Horovod's
    assert seen["exit"] == [("a+0:0", 1)]


def test_only_a_command_of_this_python_runs_through_the_standby_worker():
    patch, seen = make_standby(PatchContext())
    patch.run_elastic(SimpleNamespace(command=["/bin/sh", "train.sh"]))
    assert not patch.wrapped and seen["run"] == [["/bin/sh", "train.sh"]]
    patch.run_elastic(SimpleNamespace(command=[sys.executable, "train.py"]))
    assert patch.wrapped
    assert seen["run"][1] == [sys.executable, "-m", "hvd_resilient.launch.warm.standby",
                              sys.executable, "train.py"]


# -- eviction ---------------------------------------------------------------------------------
def test_the_eviction_watch_starts_once_with_the_first_workers(monkeypatch):
    driver = StubDriver()
    watched: list[Any] = []
    monkeypatch.setattr(evict, "watch", lambda d, *a: watched.append(d))  # returns at once
    calls, start = recorder()
    start_workers = evict.start_and_watch(start, lambda host, pid: None, lambda *a, **k: None)
    before, fields = set(threading.enumerate()), set(vars(driver))
    start_workers(driver, ["s0"])
    start_workers(driver, ["s1"])
    assert [c[1] for c in calls] == [["s0"], ["s1"]]
    for t in set(threading.enumerate()) - before:
        if t.name == "hvd-resilient-evict":
            t.join(5)
    assert watched == [driver], "one watch, started with the first workers"
    assert isinstance(driver._rendezvous._httpd.cache, evict._KeepsVerdicts)
    assert set(vars(driver)) == fields, "the patch keeps what it knows itself, not in the driver"


# -- next slots -------------------------------------------------------------------------------
def test_the_next_world_s_slots_are_written_before_the_workers_are_told():
    driver = grown_driver()
    told: list[Any] = []

    def notify(d: Any, hosts: Any, res: Any) -> None:  # what the store holds when told
        told.append(compat.kv_get(d, driver_kv.NEXT_SLOTS).get(driver_kv.NEXT_SLOTS_KEY))

    publish = next_slots.publishing(notify)
    publish(driver, Hosts(["a+0", "b+0"]), "added")
    publish(driver, Hosts(["b+0"]), "removed")
    assert told == [b"a+0:0,b+0:0", b"b+0:0"]


def test_no_slots_are_written_where_no_world_would_form_now():
    driver = grown_driver()
    driver._min_num_proc = 2
    compat.kv_set(driver, driver_kv.NEXT_SLOTS, driver_kv.NEXT_SLOTS_KEY, b"stale:0")
    next_slots.publishing(lambda *a: None)(driver, Hosts(["a+0"]), "removed")
    assert compat.kv_get(driver, driver_kv.NEXT_SLOTS) == {}  # the stale list is gone too
    assert next_slots.next_slots(StubDriver(), Hosts(["a+0"])) is None  # no world formed yet
    before_any_world = StubDriver()
    before_any_world._rendezvous._httpd = None  # Horovod's first discovery comes before it
    told: list[str] = []
    next_slots.publishing(lambda *a: told.append(a[2]))(before_any_world, Hosts(["a+0"]), "added")
    assert told == ["added"]


# -- the watched hosts file -------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _rewrite(path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)  # a new inode: a new identity whatever the clock's granularity


def test_a_watched_file_runs_the_script_once_it_changed_and_held_still(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\n")
    clock, runs = Clock(), []
    d = SimpleNamespace()

    def run(self: Any) -> str:
        runs.append(clock.now)
        return hosts.read_text()

    execute = discovery_watch.paced(run, str(hosts), 1.0, clock)
    assert execute(d) == "a:1\n" and runs == [100.0]  # the first answer, at once
    clock.now += 0.05
    assert execute(d) == "a:1\n" and runs == [100.0]  # nothing changed: the last answer
    _rewrite(hosts, "a:1\nb:1\n")
    clock.now += 0.05
    assert execute(d) == "a:1\n" and len(runs) == 1  # changed since the last look: not yet
    clock.now += 0.05
    assert execute(d) == "a:1\nb:1\n" and len(runs) == 2  # held still for a tick: run
    clock.now += 0.05
    assert execute(d) == "a:1\nb:1\n" and len(runs) == 2
    clock.now = runs[-1] + 1.0
    execute(d)
    assert len(runs) == 3  # the interval still runs it, changed or not


def test_a_file_being_rewritten_waits_until_the_writes_stop(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\n")
    clock, runs = Clock(), []
    d = SimpleNamespace()
    execute = discovery_watch.paced(lambda self: runs.append(1) or hosts.read_text(),
                                    str(hosts), 10.0, clock)
    execute(d)
    with open(hosts, "a") as f:  # an editor writing in place, a line a tick
        for line in ("b:1\n", "c:1\n", "d:1\n"):
            f.write(line)
            f.flush()
            clock.now += 0.05
            assert execute(d) == "a:1\n"
    clock.now += 0.05
    assert execute(d) == "a:1\nb:1\nc:1\nd:1\n" and len(runs) == 2


def test_a_failing_run_is_retried_at_the_interval_with_the_last_answer_kept(tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a:1\n")
    clock, answers = Clock(), ["a:1\n", RuntimeError("Exit code: 3"), "a:1\nb:1\n"]
    d = SimpleNamespace()

    def run(self: Any) -> str:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    execute = discovery_watch.paced(run, str(hosts), 1.0, clock)
    assert execute(d) == "a:1\n"
    clock.now += 1.0
    with pytest.raises(RuntimeError):  # Horovod warns once and keeps its hosts
        execute(d)
    clock.now += 0.05
    assert execute(d) == "a:1\n" and len(answers) == 1  # not retried every tick
    clock.now += 1.0
    assert execute(d) == "a:1\nb:1\n"


def test_the_watch_runs_horovods_discovery_on_a_real_script(tmp_path, monkeypatch):
    """Installed on Horovod's own classes (restored afterwards): the loop ticks, a real
    script answers, and only a change of the file makes it run again."""
    from horovod.runner.elastic import discovery, driver

    for name in ("_execute_discovery_script", "find_available_hosts_and_slots"):
        monkeypatch.setattr(discovery.HostDiscoveryScript, name,
                            getattr(discovery.HostDiscoveryScript, name))
    monkeypatch.setattr(driver, "DISCOVER_HOSTS_FREQUENCY_SECS", 1.0)
    hosts, count = tmp_path / "hosts.txt", tmp_path / "runs"
    hosts.write_text("a:1\n")
    script = _script(tmp_path, f"echo run >> {count}; cat {hosts}\n")._discovery_script
    ctx = PatchContext(DriverOptions(discovery_watch=str(hosts)))
    patches.install(ctx, tuple(p for p in patches.ORDER
                               if p.name in ("discovery_check", "discovery_watch")))
    assert driver.DISCOVER_HOSTS_FREQUENCY_SECS == discovery_watch.TICK_S
    found = discovery.HostDiscoveryScript(script, 1)
    fields = set(vars(found))
    assert found.find_available_hosts_and_slots() == {"a": 1}
    assert found.find_available_hosts_and_slots() == {"a": 1}
    assert count.read_text().count("run") == 1
    _rewrite(hosts, "a:1\nb:2\n")
    assert found.find_available_hosts_and_slots() == {"a": 1}  # seen, not yet still
    assert found.find_available_hosts_and_slots() == {"a": 1, "b": 2}
    assert count.read_text().count("run") == 2
    assert set(vars(found)) == fields, "the patches keep their state themselves, not in Horovod's"


# -- Horovod's Gloo check, remembered ---------------------------------------------------------
def test_a_yes_is_remembered_per_installation_and_a_no_is_asked_again(tmp_path, monkeypatch):
    asked: list[bool] = []

    def ask(verbose: bool = False) -> Any:
        asked.append(verbose)
        return answers.pop(0)

    answers: list[Any] = [False, None, True]
    built = gloo_check.remembered(ask, str(tmp_path))
    assert built() is False and built() is None  # a no is never kept
    assert built() is True and built() is True and built(verbose=True) is True
    assert len(asked) == 3, "the yes was asked once"
    monkeypatch.setattr(gloo_check, "installation_key", lambda: "another-torch")
    answers.append(True)
    assert built() is True and len(asked) == 4, "a reinstall is asked again"


def test_the_installation_key_follows_the_extension_files(tmp_path, monkeypatch):
    import horovod

    key = gloo_check.installation_key()
    assert key == gloo_check.installation_key()
    root = tmp_path / "horovod"
    (root / "torch").mkdir(parents=True)
    lib = root / "torch" / "mpi_lib_v2.so"
    lib.write_bytes(b"x")
    monkeypatch.setattr(horovod, "__file__", str(root / "__init__.py"))
    moved = gloo_check.installation_key()
    assert moved != key
    lib.write_bytes(b"rebuilt")
    assert gloo_check.installation_key() != moved
