"""The recovery loop (backends/recovery.py) driven in process by a fake world that fails on
purpose: in training, in the sync, in forming the next world, twice in a row, in a stuck
teardown; evicted, leaving, a host change with nothing to restore. Each test asserts the events
(order and field sets) and the calls the loop made; none starts a process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hvd_resilient.backends import recovery
from hvd_resilient.backends.recovery import Evicted, Fault, FaultKind, GenerationsFailed
from hvd_resilient.detect import Detectors, gloo_watch
from hvd_resilient.errors import HUNG_EXIT_CODE

WATCH = {"connections", "heartbeats", "threads", "generation"}
SYNC = {"seconds"}
FAILURE = {"error", "peer_hangup", "generation", "detect_seconds"}
RESET = {"old_size", "new_size", "generation", "seconds", "shutdown_s", "init_s", "state_s",
         "joined", "threads", "fds", "rss_bytes"}


class Boom(Exception):
    """A failed collective, as the fake world classifies it."""


class Change(Exception):
    """A host change at a commit, as the fake world classifies it."""

    def __init__(self, skip_sync: bool = False, joined: bool = False) -> None:
        super().__init__("hosts changed")
        self.skip_sync, self.joined = skip_sync, joined


class Exited(BaseException):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Events:
    def __init__(self, calls: list[str]) -> None:
        self.calls, self.log = calls, []  # type: list[str], list[tuple[str, dict[str, Any]]]

    def emit(self, event: str, **fields: Any) -> None:
        self.calls.append(f"event:{event}")
        self.log.append((event, fields))

    def names(self) -> list[str]:
        return [name for name, _ in self.log]

    def of(self, name: str) -> list[dict[str, Any]]:
        return [f for n, f in self.log if n == name]


class State:
    def __init__(self, calls: list[str]) -> None:
        self.calls, self.events, self.last_commit_step = calls, Events(calls), 0

    def restore(self) -> None:
        self.calls.append("restore")


class Detector:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls, self.armed = name, calls, False

    def offer(self, rank: int) -> str:
        return f"{self.name}@{rank}"

    def arm(self, me: int, everyone: list[Any]) -> int:
        self.calls.append(f"arm:{self.name}")
        self.armed = True
        return len(everyone) - 1

    def disarm(self) -> None:
        self.armed = False


class HangupWatch(Detector):
    """The hang-up watch: a detector that also stands down at a failure."""

    def __init__(self, calls: list[str]) -> None:
        super().__init__("connections", calls)
        self.detected_at: float | None = None
        self.detail = ""

    def stand_down(self) -> list[Any]:
        self.calls.append("stand_down")
        return []


class World:
    """Fails where a test says: `fail[point]` is a list of exceptions raised at the next calls
    of that point (sync, form, tear_down); `train` outcomes are a script."""

    def __init__(self, *, budget: int | None = None, size: int = 3) -> None:
        self.calls: list[str] = []
        self.hangup = HangupWatch(self.calls)
        self.beats = Detector("heartbeats", self.calls)
        self.detectors = Detectors(self.hangup, self.beats)
        self.failure_budget = budget
        self._size, self.gen = size, 0
        self.fail: dict[str, list[BaseException]] = {}
        self.evicted_reason: str | None = None
        self.leaving_slot: str | None = None
        self.tear_down_s = 0.0
        self.torn_down = threading.Event()
        self.may_skip_sync = False  # True: as Horovod's elastic world
        self.newcomers = 0
        """Ranks of the next formed world that are new: they never skip the sync."""
        self.armed_with: list[list[Any]] = []

    def _point(self, name: str) -> None:
        self.calls.append(name)
        if self.fail.get(name):
            raise self.fail[name].pop(0)

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size

    def generation(self) -> int | None:
        return self.gen

    def machine(self) -> str:
        return "m1"

    def allgather(self, obj: Any) -> list[Any]:
        """This rank's `obj` from the survivors; a newcomer's start says it syncs."""
        self.calls.append("allgather")
        new = min(self.newcomers, self._size - 1)
        if new and isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], bool):
            return [obj] * (self._size - new) + [(obj[0], False)] * new
        return [obj] * self._size

    def sync(self, state: Any, rider: Any, arm: Callable[[list[Any]], None]) -> None:
        arm(self.allgather(rider))
        self._point("sync")

    def armed(self, counts: dict[str, int], on_this_machine: int) -> int | None:
        return 8 // on_this_machine

    def classify(self, error: Exception) -> Fault | None:
        if isinstance(error, Boom):
            return Fault(FaultKind.FAILURE)
        if isinstance(error, Change):
            return Fault(FaultKind.CHANGE, skip_sync=error.skip_sync, joined=error.joined)
        return None

    def evicted(self) -> str | None:
        self.calls.append("evicted?")
        return self.evicted_reason

    def changed(self, fault: Fault) -> None:
        self.calls.append("changed")

    def leaving(self) -> str | None:
        return self.leaving_slot

    def leave(self, slot: str) -> int:
        self.calls.append(f"leave:{slot}")
        return 0

    def tear_down(self, fault: Fault) -> None:
        time.sleep(self.tear_down_s)  # one instruction: what a stuck shutdown looks like
        self.torn_down.set()
        self._point("tear_down")

    def form(self, fault: Fault) -> None:
        self._point("form")
        self.gen += 1
        self._size -= fault.kind is FaultKind.FAILURE

    def rejoined(self, state: Any) -> None:
        self.calls.append("rejoined")

    def finish(self) -> None:
        assert not self.hangup.armed and not self.beats.armed, "finish before disarm"
        self.calls.append("finish")


def script(world: World, state: State, *outcomes: BaseException | str) -> Callable[[], str]:
    """`train`: each call takes the next outcome, raises it or returns it; a string that
    starts with "commit" commits first."""
    left = list(outcomes)

    def train() -> str:
        world.calls.append("train")
        out = left.pop(0)
        if isinstance(out, BaseException):
            raise out
        if out.startswith("commit"):
            state.last_commit_step += 1
        return out

    return train


@pytest.fixture
def sections(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The progress sections the loop opened, in order (no watchdog is installed here)."""
    opened: list[str] = []

    @contextlib.contextmanager
    def section(name: str, budget_s: float | None) -> Iterator[None]:
        assert budget_s is None
        opened.append(name)
        yield

    monkeypatch.setattr(recovery.progress, "section", section)
    return opened


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    codes: list[int] = []

    def exit_now(code: int) -> None:
        codes.append(code)
        raise Exited(code)

    monkeypatch.setattr(recovery, "exit_now", exit_now)
    return codes


def fields(state: State, name: str) -> set[str]:
    """The one field set of an event: every emission of it has the same keys."""
    sets = {frozenset(f) for f in state.events.of(name)}
    assert len(sets) == 1, (name, sets)
    return set(next(iter(sets)))


def test_a_clean_run_arms_from_the_sync_trains_disarms_and_meets(sections):
    world = World()
    state = State(world.calls)
    assert recovery.run(world, state, script(world, state, "done")) == "done"
    assert state.events.names() == ["watch", "sync"]
    assert world.calls == ["allgather", "arm:connections", "arm:heartbeats", "event:watch",
                           "sync", "event:sync", "train", "finish"]
    (watch,) = state.events.of("watch")
    assert watch == {"connections": 2, "heartbeats": 2, "threads": 8 // 3, "generation": 0}
    assert fields(state, "watch") == WATCH and fields(state, "sync") == SYNC
    assert sections == ["sync"]


def test_a_failed_collective_hangs_up_restores_reforms_and_trains_again(sections):
    world = World()
    state = State(world.calls)
    world.hangup.detected_at, world.hangup.detail = time.time() - 0.5, "rank 2 hung up"
    assert recovery.run(world, state, script(world, state, Boom("gloo"), "done")) == "done"
    assert state.events.names() == ["watch", "sync", "failure_detected", "reset", "watch", "sync"]
    i = world.calls.index("stand_down")
    assert world.calls[i:i + 7] == ["stand_down", "evicted?", "event:failure_detected",
                                    "restore", "tear_down", "form", "rejoined"]
    (failed,) = state.events.of("failure_detected")
    assert failed["error"] == "Boom: gloo" and failed["peer_hangup"] == "rank 2 hung up"
    assert failed["detect_seconds"] >= 0.5 and failed["generation"] == 0
    (reset,) = state.events.of("reset")
    assert (reset["old_size"], reset["new_size"], reset["generation"]) == (3, 2, 1)
    assert reset["seconds"] >= 0.5, "a reset counts from the first hang-up"
    assert reset["joined"] is False
    assert state.events.of("watch")[1]["generation"] == 1
    for name, want in (("failure_detected", FAILURE), ("reset", RESET), ("watch", WATCH)):
        assert fields(state, name) == want
    assert sections == ["sync", "recovery", "reset", "sync"]
    assert world.calls[-1] == "finish" and not world.hangup.armed


def test_a_failure_in_the_sync_is_recovered_like_one_in_training(sections):
    world = World()
    world.fail["sync"] = [Boom("sync broke")]
    state = State(world.calls)
    assert recovery.run(world, state, script(world, state, "done")) == "done"
    assert state.events.names() == ["watch", "failure_detected", "reset", "watch", "sync"]
    assert world.calls.count("train") == 1 and world.calls.count("restore") == 1


def test_evicted_in_forming_the_next_world_exits_as_hung_without_a_reset(sections, exits):
    world = World()
    world.fail["form"] = [Evicted("generation 1 does not hold this worker")]
    state = State(world.calls)
    with pytest.raises(Exited):
        recovery.run(world, state, script(world, state, Boom("gloo")))
    assert exits == [HUNG_EXIT_CODE]
    assert state.events.names() == ["watch", "sync", "failure_detected"]
    assert not world.hangup.armed and not world.beats.armed


def test_left_out_of_the_next_world_by_its_hosts_removal_leaves_with_0(sections, exits):
    """A fault came before the commit at which the removed host's workers would have left:
    the next world leaves them out all the same, and that is their leave, not an eviction."""
    world = World()
    world.fail["form"] = [recovery.Left("2000001")]
    state = State(world.calls)
    with pytest.raises(SystemExit) as left:
        recovery.run(world, state, script(world, state, Boom("gloo")))
    assert left.value.code == 0 and exits == []
    assert state.events.names() == ["watch", "sync", "failure_detected", "left_job"]
    assert state.events.of("left_job") == [{"slot": "2000001"}]
    assert not world.hangup.armed and not world.beats.armed


def test_another_error_in_forming_ends_the_run_disarmed(sections):
    world = World()
    world.fail["form"] = [RuntimeError("rendezvous closed")]
    state = State(world.calls)
    with pytest.raises(RuntimeError, match="rendezvous closed"):
        recovery.run(world, state, script(world, state, Boom("gloo")))
    assert "reset" not in state.events.names() and not world.beats.armed


def test_failures_in_a_row_without_a_commit_stop_the_job_at_the_budget(sections):
    world = World(budget=1, size=5)
    state = State(world.calls)
    with pytest.raises(GenerationsFailed, match="2 generations in a row failed before a commit"):
        recovery.run(world, state, script(world, state, Boom("one"), Boom("two"), "done"))
    assert world.calls.count("restore") == 1, "the second failure stops before restoring"
    assert state.events.names().count("failure_detected") == 1


def test_a_commit_between_failures_refills_the_budget(sections):
    world = World(budget=1, size=5)
    state = State(world.calls)
    state.last_commit_step = 0

    def train() -> str:
        world.calls.append("train")
        n = world.calls.count("train")
        if n <= 3:
            state.last_commit_step += 1  # each world commits once, then fails
            raise Boom(f"failure {n}")
        return "done"

    assert recovery.run(world, state, train) == "done"
    assert state.events.names().count("reset") == 3


def test_without_a_budget_failures_go_on(sections):
    world = World(budget=None, size=9)
    state = State(world.calls)
    boom = [Boom(str(n)) for n in range(6)]
    assert recovery.run(world, state, script(world, state, *boom, "done")) == "done"
    assert state.events.names().count("reset") == 6


def test_the_teardown_is_guarded_by_the_stuck_exit(sections, monkeypatch):
    """The loop wraps every teardown in `exit_if_stuck("reset:")`; here with a short limit, a
    teardown that sits on one instruction is exited as hung (exit_now recorded, not run)."""
    seen: list[tuple[str, float]] = []
    real = gloo_watch.exit_if_stuck

    @contextlib.contextmanager
    def short(what: str, limit_s: float = gloo_watch.SHUTDOWN_WAIT_S) -> Iterator[None]:
        seen.append((what, limit_s))
        with real(what, 0.3):
            yield

    codes: list[int] = []

    def exit_now(code: int) -> None:
        codes.append(code)
        world.torn_down.wait(5)  # the real one ends the process here; this one lets it go on

    monkeypatch.setattr(recovery.gloo_watch, "exit_if_stuck", short)
    monkeypatch.setattr(gloo_watch, "COLLECTIVE_CODE", (*gloo_watch.COLLECTIVE_CODE, __file__))
    monkeypatch.setattr(gloo_watch, "exit_now", exit_now)
    world = World()
    world.tear_down_s = 1.0
    state = State(world.calls)
    recovery.run(world, state, script(world, state, Boom("gloo"), "done"))
    assert seen == [("reset:", gloo_watch.SHUTDOWN_WAIT_S)]
    assert codes[:1] == [HUNG_EXIT_CODE] and set(codes) == {HUNG_EXIT_CODE}


def test_a_worker_its_peers_evicted_exits_before_restoring(sections, exits):
    world = World()
    world.evicted_reason = "the other workers evicted this one"
    state = State(world.calls)
    with pytest.raises(Exited):
        recovery.run(world, state, script(world, state, Boom("gloo")))
    assert exits == [HUNG_EXIT_CODE]
    assert world.calls[-2:] == ["stand_down", "evicted?"]
    assert state.events.names() == ["watch", "sync"], "an evicted worker writes nothing more"


def test_a_worker_whose_slot_the_change_removed_leaves_with_the_worlds_code(sections):
    world = World()
    world.leaving_slot = "host-b:0"
    state = State(world.calls)
    with pytest.raises(SystemExit) as left:
        recovery.run(world, state, script(world, state, Change(skip_sync=True)))
    assert left.value.code == 0
    assert state.events.names() == ["watch", "sync", "left_job"]
    assert state.events.of("left_job") == [{"slot": "host-b:0"}]
    assert world.calls[-3:] == ["changed", "event:left_job", "leave:host-b:0"]
    assert sections[-1] == "leaving" and "restore" not in world.calls


def test_hosts_removed_only_restore_nothing_and_arm_without_a_sync(sections):
    world = World()
    world.may_skip_sync = True
    state = State(world.calls)
    assert recovery.run(world, state, script(world, state, Change(skip_sync=True), "done")) \
        == "done"
    assert state.events.names() == ["watch", "sync", "reset", "watch"]
    assert "restore" not in world.calls and "evicted?" not in world.calls
    assert world.calls.count("sync") == 1, "only hosts removed: no second sync"
    i = world.calls.index("changed")
    assert world.calls[i:i + 4] == ["changed", "tear_down", "form", "rejoined"]
    (reset,) = state.events.of("reset")
    assert reset["new_size"] == 3 and reset["joined"] is False


def test_hosts_removed_but_a_newcomer_in_the_new_world_every_rank_syncs(sections):
    """Horovod's driver may readmit a host at the rendezvous that follows a removal: the
    newcomer syncs, so the survivors must too, or both sides wait for good (Horovod #3494)."""
    world = World()
    world.may_skip_sync = True
    state = State(world.calls)
    run = script(world, state, Change(skip_sync=True), "done")

    def form(fault: Fault) -> None:
        world._point("form")
        world.newcomers = 1  # the readmitted host's worker is in the world formed
    world.form = form  # type: ignore[method-assign]
    assert recovery.run(world, state, run) == "done"
    assert state.events.names() == ["watch", "sync", "reset", "watch", "sync"]
    assert world.calls.count("sync") == 2, "the survivor skipped the sync the newcomer runs"
    i = world.calls.index("rejoined")
    assert [c for c in world.calls[i:] if not c.startswith("event:")][:6] == [
        "rejoined", "allgather", "arm:connections", "arm:heartbeats", "allgather", "sync"], \
        "armed once, from the start's allgather, then the sync"


def test_a_world_that_never_skips_syncs_after_a_removal_in_one_allgather(sections):
    world = World()
    world.may_skip_sync = False
    state = State(world.calls)
    recovery.run(world, state, script(world, state, Change(skip_sync=True), "done"))
    assert state.events.names() == ["watch", "sync", "reset", "watch", "sync"]
    assert world.calls.count("allgather") == 2, "the rider rides in the sync's allgather"


def test_a_join_syncs_the_newcomer_and_says_joined(sections):
    world = World()
    state = State(world.calls)
    recovery.run(world, state, script(world, state, Change(joined=True), "done"))
    assert state.events.names() == ["watch", "sync", "reset", "watch", "sync"]
    assert state.events.of("reset")[0]["joined"] is True
    assert fields(state, "reset") == RESET


def test_an_error_that_is_not_the_worlds_is_raised_disarmed(sections):
    world = World()
    state = State(world.calls)
    with pytest.raises(ValueError):
        recovery.run(world, state, script(world, state, ValueError("a bug")))
    assert state.events.names() == ["watch", "sync"]
    assert not world.hangup.armed and not world.beats.armed and "finish" not in world.calls


class OnceWorld(recovery.FormOnce):
    """mpirun, torchrun: formed once; the same loop, nothing recoverable."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.detectors = Detectors(Detector("heartbeats", calls))

    def rank(self) -> int:
        return 1

    def size(self) -> int:
        return 2

    def machine(self) -> str:
        return "m1"

    def allgather(self, obj: Any) -> list[Any]:
        return [obj, obj]

    def sync(self, state: Any, rider: Any, arm: Callable[[list[Any]], None]) -> None:
        arm(self.allgather(rider))
        self.calls.append("sync")

    def finish(self) -> None:
        self.calls.append("finish")


def test_a_world_formed_once_trains_once_and_raises_every_failure(sections):
    calls: list[str] = []
    state = State(calls)
    assert recovery.run(OnceWorld(calls), state, lambda: "done") == "done"
    assert state.events.of("watch") == [{"connections": None, "heartbeats": 1, "threads": None,
                                         "generation": None}]
    assert calls[-2:] == ["event:sync", "finish"]
    with pytest.raises(Boom):
        recovery.run(OnceWorld(calls), State(calls), script(World(), state, Boom("gloo")))
