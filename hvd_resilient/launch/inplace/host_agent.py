"""One host's agent: starts and watches this host's workers, hosts the store they talk to, and
carries out the generations the coordinator decides (`decide`).

Its workers speak only to this store (`backends/inplace/membership.py`: ``want``, ``evict``,
``ready``, ``busy`` keys in, ``gen`` records out), whichever agent coordinates and wherever the
generation's group forms: `report` reads their keys into a `decide.HostReport`, `mirror` writes a
decided generation's record (its members and the address of the store its group forms on) for
them to read, `fence` ends the members a decision drops. It is never a training rank, so the
store outlives any worker.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Sequence

import torch.distributed as dist

from hvd_resilient.backends.inplace.membership import (
    AGENT_ENV,
    LEAVING_KEY,
    MEMBER_ENV,
    MEMBER_STRIDE,
    PREFIX,
    door_key,
    evict_key,
    formed_key,
    gen_key,
    is_busy,
    ready_key,
    store_key,
    want_key,
)
from hvd_resilient.die_with_parent import die_with_parent
from hvd_resilient.errors import FATAL_EXIT_CODE
from hvd_resilient.launch.inplace.decide import HostReport
from hvd_resilient.launch.inplace_unadopted import REFUSAL, StderrWatch

logger = logging.getLogger(__name__)
WATCH_JOIN_S = 5.0
"""How long the agent waits for the last stderr line of a worker that exited on its own
(code > 0), where a child of it (a loader worker) still holds the pipe; a killed worker is
judged at once."""


LEAVING_WAIT_S = 10.0
"""How long the agent of a removed host that coordinates, its workers gone, waits for the group
it decided to form on its store (and, embedded, for every agent to read that generation) before
it exits anyway."""


WORKERS_NICENESS = os.getpriority(os.PRIO_PROCESS, 0)
"""The niceness this process started with (read at import, before `raise_priority`): what the
workers run at."""
AGENT_PRIORITY_BOOST = 5


def raise_priority() -> bool:
    """The agent ahead of its own workers for the CPU (5 nicer steps, where allowed: root, or
    CAP_SYS_NICE): it is the host's control plane, a few polls a second, and a host whose agent
    is starved by its workers' imports or loaders goes silent to the others and is taken for
    lost (seen on 2 cores at a load of 20-30). Called before any thread starts: on Linux the
    value is per thread, and threads inherit it. Where it is not allowed, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, WORKERS_NICENESS - AGENT_PRIORITY_BOOST)
    except OSError:
        return False
    return True


def _as_worker(parent: int) -> None:
    """In the forked worker, before it runs: the niceness the agent started with (a worker is
    never ahead of anything but its agent), and the kernel ends it with the agent."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, WORKERS_NICENESS)
    except OSError:
        pass
    die_with_parent(parent)


class HostAgent:
    def __init__(self, cmd: Sequence[str], nproc: int, *, host_index: int = 0,
                 address: str = "127.0.0.1", replace: bool = False, standby: int = 0,
                 joins: bool = False, late: bool = False) -> None:
        """``joins``: workers may join the running job (a discovery script adds hosts), so
        every member looks for a newer generation at its commits; ``late``: this host joins a
        job already running, all its workers as newcomers."""
        self.cmd, self.nproc, self.host_index = list(cmd), nproc, host_index
        self.replace, self.standby = replace, standby
        self.joins, self.late = joins or late or replace or standby > 0, late
        self.leaving = False
        """The launch removed this host: its members leave at the others' next commit."""
        self.leave_asked = False
        """Set by the thread that reads the launch's words; `reap` (the agent's loop) acts."""
        self.first_member = host_index * MEMBER_STRIDE
        self.next_member = self.first_member + nproc + standby
        self.server = dist.TCPStore(address, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=60))
        self.store = dist.PrefixStore(PREFIX, self.server)
        self.ip = address
        """This host's address as the other hosts reach it (its listeners bind there)."""
        self.address = f"{address}:{self.server.port}"
        self.alive: dict[int, subprocess.Popen[bytes]] = {}
        self.start_members: list[int] = []
        self.finished: set[int] = set()
        self.failed: dict[int, int] = {}
        self.generation = -1
        self.members: list[int] = []
        self.stopping = False
        self.finishing = False
        """The coordinator said the run is ending: no replacement is started any more."""
        self._ended: set[int] = set()
        self.watches: dict[int, StderrWatch] = {}
        self.unadopted = False

    def start(self) -> None:
        """Every first worker and standby; before any reads it, whether workers join later."""
        self.store.set("joins", "1" if self.joins else "0")
        for n in range(self.nproc + self.standby):
            self._start(self.first_member + n)
        if not self.late:  # a late host's workers are all newcomers
            self.start_members = [self.first_member + n for n in range(self.nproc)]

    def _start(self, member: int) -> None:
        env = {**os.environ, AGENT_ENV: self.address, MEMBER_ENV: str(member),
               "PYTHONUNBUFFERED": "1"}
        parent = os.getpid()
        p = self.alive[member] = subprocess.Popen(
            self.cmd, env=env, stderr=subprocess.PIPE,
            preexec_fn=lambda: _as_worker(parent))
        assert p.stderr is not None
        self.watches[member] = StderrWatch(p.stderr, sys.stderr.fileno())

    def reap(self) -> None:
        """Notes every worker that exited; starts a replacement for a lost one (--replace)."""
        if self.leave_asked:
            self.leave()
        for m, p in list(self.alive.items()):
            rc = p.poll()
            if rc is None:
                continue
            del self.alive[m]
            watch = self.watches.pop(m, None)
            if watch is not None and rc > 0:  # an exit of its own: maybe after a traceback,
                watch.join(WATCH_JOIN_S)     # read before the exit is judged (never a signal's)
                if watch.unadopted:
                    self.unadopted = True
                    continue
            if self.leaving:  # this host was removed: an exit is its member leaving
                logger.info("member %d left the job (code %d)", m, rc)
            elif rc == 0:
                self.finished.add(m)
            else:
                self.failed[m] = rc
                logger.warning("member %d exited (code %d)", m, rc)
                # 78: a fault of the job itself (a bad config), which a newcomer would repeat
                if (self.replace and rc != FATAL_EXIT_CODE and not self.finished
                        and not self.finishing and not self.stopping and not self.leaving):
                    self._start(self.next_member)
                    logger.info("member %d started in place of member %d", self.next_member, m)
                    self.next_member += 1

    def report(self) -> HostReport:
        """What the coordinator needs of this host, read from its workers' keys."""
        asked = {}
        for m in self.alive:
            key = want_key(m)
            if self.store.check([key]):
                asked[m] = int(self.store.get(key))
        evict = {}  # the silent peers this host's workers found: members of any host
        for m in self.members:
            key = evict_key(m)
            if self.store.check([key]):
                evict[m] = self.store.get(key).decode()
        return HostReport(
            start=self.start_members, alive=sorted(self.alive), asked=asked,
            ready=[m for m in sorted(self.alive) if m not in self.members
                   and self.store.check([ready_key(m)])],
            busy=[m for m in self.alive if is_busy(self.store, m)],
            finished=sorted(self.finished), failed=dict(self.failed), evict=evict,
            stopping=self.stopping, unadopted=REFUSAL if self.unadopted else None,
            slots=self.nproc, late=self.late, leaving=self.leaving)

    def mirror(self, g: int, members: list[int], store: str) -> None:
        """Generation ``g`` for this host's workers: the record before the number they poll."""
        if g <= self.generation:
            return
        self.store.set(store_key(g), store)
        self.store.set(gen_key(g), json.dumps(members))
        self.store.set("gen", str(g))
        self.generation, self.members = g, members

    def at_door(self, g: int, members: Sequence[int]) -> set[int]:
        """Members waiting at generation ``g``'s door, not through it, when ``g``'s group
        forms on this agent's store (the deciding agent's); else none it can see."""
        key = store_key(g)
        if self.store.check([key]) and self.store.get(key).decode() != self.address:
            return set()
        return {m for m in members if self.store.check([door_key(g, m)])
                and not self.store.check([formed_key(g, m)])}

    def formed(self, g: int, members: Sequence[int]) -> bool:
        """Every one of ``members`` went through generation ``g``'s door on this agent's store
        (a leaving coordinator's store must outlive the formation of the group it decided)."""
        return all(self.store.check([formed_key(g, m)]) for m in members)

    def fence(self, members: Sequence[int], why: str) -> None:
        """Ends this host's workers among ``members`` (SIGKILL works on a stopped one too)."""
        for m in members:
            p = self.alive.get(m)
            if p is not None and p.poll() is None and m not in self._ended:
                logger.warning("ending member %d: %s", m, why)
                p.kill()
                self._ended.add(m)

    def end_standbys(self) -> None:
        """The run is over (or stopping): workers that never joined hold nothing; they are
        waiting for a generation that will not come."""
        self.finishing = True
        self._end_non_members("the run is over")

    def _end_non_members(self, why: str) -> None:
        """Ends this host's workers that are no members (standbys, newcomers not taken in):
        they hold nothing."""
        for m, p in self.alive.items():
            if m not in self.members and m not in self._ended and p.poll() is None:
                logger.info("ending standby member %d: %s", m, why)
                p.kill()
                self._ended.add(m)

    def leave(self) -> None:
        """The launch removed this host (its discovery script no longer lists it): the
        coordinator leaves its members out of the next generation, which the others move to at
        their next commit, and they exit when they find themselves left out; its workers that
        are no members (standbys, newcomers not taken in yet) hold nothing and end now."""
        if self.leaving:
            return
        self.leaving = True
        self.store.set(LEAVING_KEY, "1")  # its members left out after a fault leave too
        logger.warning("this host is removed from the job: its members leave at the others' "
                       "next commit")
        self._end_non_members("this host is removed")

    def end_all(self, refusal: bool = False) -> None:
        """The job is over here: every worker left is ended (``refusal``: killed mid-traceback,
        no half of torch's to print)."""
        if refusal:
            for w in self.watches.values():
                w.ending = True
        for p in self.alive.values():
            if p.poll() is None:
                p.kill()

    def finish(self) -> None:
        """Every worker waited for, and its last lines passed on."""
        for p in self.alive.values():
            p.wait()
        for w in self.watches.values():
            w.join(WATCH_JOIN_S)

    def forward(self, signum: int) -> None:
        """A stop for the whole host: every worker gets the signal (its final checkpoint)."""
        self.stopping = True
        for p in self.alive.values():
            if p.poll() is None:
                p.send_signal(signum)

    def install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self.forward(signum))
