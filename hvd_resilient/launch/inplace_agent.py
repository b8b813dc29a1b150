"""The in-place agent: starts the workers of one machine, hosts the generations' store, and
decides every membership (`backends/inplace/membership.py`).

    python -m hvd_resilient.launch.inplace_agent --nproc 4 [--min-np 2] -- python train.py ...

It is never a training rank, so the store outlives any worker. A worker that dies (or that its
peers found silent, which the agent ends) is dropped from the next generation; the survivors
go on in their processes. With ``--replace`` the agent starts a new worker for each one lost
(not for one that exited 78, a fault of the job's own that a newcomer would repeat);
it imports while the others train and joins at their next commit once it is up (a generation
with it). ``--standby K`` starts K more workers at launch, which set up and wait: a lost worker's
place goes to one of them in the very generation that answers the fault, without an import
(with ``--replace`` a new standby is started in its place); at the end of the run they are
ended. The members never exceed ``--nproc``. Fewer than ``--min-np`` live workers end the job
(exit 1), so that `hvd-resilient run` relaunches it from the durable checkpoint. SIGTERM and
SIGINT are passed on to every worker (the trainer's preemption path: a final checkpoint, exit
75). Each worker's stderr passes through the agent, which tells a torchrun script that has not
adopted `hvd_resilient.inplace` from its traceback and ends the job with one line saying what to
add (`inplace_unadopted`, exit 78, not relaunched).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

import torch.distributed as dist

from hvd_resilient import log
from hvd_resilient.backends.inplace.membership import (
    AGENT_ENV,
    MEMBER_ENV,
    PREFIX,
    door_key,
    evict_key,
    formed_key,
    gen_key,
    is_busy,
    ready_key,
    want_key,
)
from hvd_resilient.cli_errors import exit_on_error
from hvd_resilient.die_with_parent import die_with_parent
from hvd_resilient.errors import FATAL_EXIT_CODE, ConfigError
from hvd_resilient.launch.inplace_unadopted import REFUSAL, StderrWatch

logger = logging.getLogger("hvd_resilient.launch.inplace_agent")  # not __name__: run as __main__
POLL_S = 0.01
WATCH_JOIN_S = 5.0
"""How long the agent waits for the last stderr line of a worker that exited on its own
(code > 0), where a child of it (a loader worker) still holds the pipe; a killed worker is
judged at once."""


class Agent:
    def __init__(self, cmd: Sequence[str], nproc: int, min_np: int, last_call_s: float,
                 host: str = "127.0.0.1", replace: bool = False, standby: int = 0) -> None:
        self.cmd, self.nproc, self.min_np, self.last_call_s = list(cmd), nproc, min_np, last_call_s
        self.replace, self.standby = replace, standby
        self.next_member = nproc + standby
        self.server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=60))
        self.store = dist.PrefixStore(PREFIX, self.server)
        self.address = f"{host}:{self.server.port}"
        self.alive: dict[int, subprocess.Popen[bytes]] = {}
        self.failed: dict[int, int] = {}
        self.finished: set[int] = set()
        self.generation, self.members = -1, list[int]()
        self._asked_since: float | None = None
        self._said_busy: list[int] = []
        self._ended: set[int] = set()
        self._stopping = False
        self.watches: dict[int, StderrWatch] = {}
        self.unadopted = False
        """A worker died of torch's own env:// rendezvous (`inplace_unadopted`): the job ends
        with one line saying what to add, instead of a generation without it."""

    def _start(self, member: int) -> None:
        env = {**os.environ, AGENT_ENV: self.address, MEMBER_ENV: str(member),
               "PYTHONUNBUFFERED": "1"}
        parent = os.getpid()
        p = self.alive[member] = subprocess.Popen(
            self.cmd, env=env, stderr=subprocess.PIPE,
            preexec_fn=lambda: die_with_parent(parent))
        assert p.stderr is not None
        self.watches[member] = StderrWatch(p.stderr, sys.stderr.fileno())

    def _publish(self, members: list[int]) -> None:
        self.generation += 1
        self.members = members
        self.store.set(gen_key(self.generation), json.dumps(members))
        self.store.set("gen", str(self.generation))
        self._asked_since = None
        logger.info("generation %d: members %s", self.generation, members)

    def _reap(self) -> None:
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
            if rc == 0:
                self.finished.add(m)
            else:
                self.failed[m] = rc
                logger.warning("member %d exited (code %d)", m, rc)
                # 78: a fault of the job itself (a bad config), which a newcomer would repeat
                if (self.replace and rc != FATAL_EXIT_CODE and not self.finished
                        and not self._stopping):
                    self._start(self.next_member)
                    logger.info("member %d started in place of member %d", self.next_member, m)
                    self.next_member += 1

    def _fence(self, members: list[int], why: str) -> None:
        for m in members:
            p = self.alive.get(m)
            if p is not None and p.poll() is None:
                logger.warning("ending member %d: %s", m, why)
                p.kill()

    def _asked(self) -> set[int]:
        out = set()
        for m in self.alive:
            key = want_key(m)
            if self.store.check([key]) and int(self.store.get(key)) >= self.generation:
                out.add(m)
        return out

    def _at_door(self) -> set[int]:
        """Live members waiting at the newest generation's door, not through it: a member of
        that generation died before it arrived, and they can ask for nothing else."""
        g = self.generation
        return {m for m in self.alive if m in self.members
                and self.store.check([door_key(g, m)]) and not self.store.check([formed_key(g, m)])}

    def _evictions(self) -> None:
        for m in list(self.alive):
            key = evict_key(m)
            if self.store.check([key]):
                self._fence([m], f"its peers found it silent ({self.store.get(key).decode()})")
                self.store.delete_key(key)

    def _step(self) -> int | None:
        """One look at the workers; an exit code when the job is over."""
        self._reap()
        if self.unadopted:  # every other worker would fail the same way: no generation
            for w in self.watches.values():
                w.ending = True  # killed mid-traceback: no half of torch's to print
            for p in self.alive.values():
                p.kill()
            raise ConfigError(REFUSAL)
        if not self.alive:
            # a worker's own exit code (78: not to be relaunched), never a signal's negative one
            return 0 if self.finished else max((c for c in self.failed.values() if c > 0),
                                               default=1)
        if self.finished or self._stopping:  # the run is ending: no new generation
            self._end_standbys()
            return None
        self._evictions()
        lost = [m for m in self.members if m not in self.alive]
        asked = self._asked() | (self._at_door() if lost else set())
        if not lost and not asked:
            self._take_in()
            return None
        now = time.monotonic()
        if self._asked_since is None:
            self._asked_since = now
        waiting = sorted(set(self.members) & set(self.alive) - asked)
        if waiting and now - self._asked_since < self.last_call_s:
            return None  # a live member still in its step: it fails at its next collective
        busy = [m for m in waiting if is_busy(self.store, m)]
        if busy:  # in a declared section (an evaluation): it asks when it leaves it
            if busy != self._said_busy:
                logger.info("waiting for member(s) %s: busy in a declared section",
                            ", ".join(map(str, busy)))
                self._said_busy = busy
            return None
        if waiting:
            self._fence(waiting, f"it did not ask for generation {self.generation + 1} within "
                                 f"{self.last_call_s:g}s")
        # a replacement or standby up by now joins too, into the places of the lost
        members = sorted(asked | set(self._ready_for(len(asked))))
        if len(members) < self.min_np:
            logger.error("%d live members, fewer than --min-np %d: ending the job so that it "
                         "restarts from its durable checkpoint", len(members), self.min_np)
            self._fence(list(self.alive), "the job ends")
            return 1
        self._publish(members)
        return None

    def _ready(self) -> list[int]:
        return [m for m in self.alive if m not in self.members
                and self.store.check([ready_key(m)])]

    def _ready_for(self, taken: int) -> list[int]:
        """Workers up and waiting, as many as there are places beside ``taken`` members (the
        members never exceed --nproc)."""
        return self._ready()[:max(0, self.nproc - taken)]

    def _end_standbys(self) -> None:
        """The run is over (or stopping): workers that never joined hold nothing; they are
        waiting for a generation that will not come."""
        for m, p in self.alive.items():
            if m not in self.members and m not in self._ended and p.poll() is None:
                logger.info("ending standby member %d: the run is over", m)
                p.kill()
                self._ended.add(m)

    def _take_in(self) -> None:
        """Workers up and waiting (replacements, standbys) join in a generation of their own
        while there is a place for them, which the members move to at their next commit;
        never while a fault is being answered."""
        ready = self._ready_for(len(self.members))
        if ready:
            self._publish(sorted([*self.members, *ready]))

    def _finish(self) -> None:
        """Every worker waited for, and its last lines passed on."""
        for p in self.alive.values():
            p.wait()
        for w in self.watches.values():
            w.join(WATCH_JOIN_S)

    def _forward(self, signum: int, _frame: object) -> None:
        self._stopping = True
        for p in self.alive.values():
            if p.poll() is None:
                p.send_signal(signum)

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward)
        # before any worker reads it
        self.store.set("joins", "1" if self.replace or self.standby else "0")
        for m in range(self.nproc + self.standby):
            self._start(m)
        self._publish(list(range(self.nproc)))
        while True:
            try:
                code = self._step()
            except ConfigError:
                self._finish()
                raise
            if code is not None:
                self._finish()
                return code
            time.sleep(POLL_S)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hvd_resilient.launch.inplace_agent",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, required=True, help="workers to start on this machine")
    p.add_argument("--min-np", type=int, default=1,
                   help="fewer live workers end the job (exit 1) for a restart")
    p.add_argument("--last-call", type=float, default=60.0,
                   help="seconds a live worker may take to ask for the next generation before "
                        "it is ended (it asks at its next collective, normally within "
                        "milliseconds of a fault; longer inside an evaluation, which is why "
                        "this is generous; a dead one is dropped at once, a frozen one by "
                        "the heartbeats)")
    p.add_argument("--replace", action="store_true",
                   help="start a new worker for each one lost; it joins once it is up")
    p.add_argument("--standby", type=int, default=0, metavar="K",
                   help="start K more workers that set up and wait; a lost worker's place goes "
                        "to one of them at once (default 0)")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the worker command")
    a = p.parse_args(argv)
    if a.cmd[:1] == ["--"]:
        a.cmd = a.cmd[1:]
    if not a.cmd:
        raise ConfigError("no worker command: put it after --, e.g. -- python train.py")
    if a.standby < 0:
        raise ConfigError(f"need --standby >= 0, got {a.standby}")
    if a.nproc < 1 or not 1 <= a.min_np <= a.nproc:
        raise ConfigError(f"need --nproc >= 1 and 1 <= --min-np <= --nproc, got --nproc "
                          f"{a.nproc} --min-np {a.min_np}")
    return a


@exit_on_error
def main(argv: Sequence[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    log.setup(rank_fn=lambda: 0)  # the agent speaks as rank 0 does
    return Agent(a.cmd, a.nproc, a.min_np, a.last_call, replace=a.replace,
                 standby=a.standby).run()


if __name__ == "__main__":
    sys.exit(main())
