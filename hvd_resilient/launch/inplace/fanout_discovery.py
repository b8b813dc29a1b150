"""`--launcher inplace --discovery SCRIPT`: the fan-out's hosts follow a host-discovery script
(Horovod's contract: ``host:slots`` lines), while the job trains in place.

The first call names the hosts the job starts on (the first host's agent coordinates, as with
--hosts); the script is then called every `--discovery-interval` seconds, and:

* a host no longer listed is told to leave (`LEAVE` on its agent's stdin): the coordinator
  decides a generation without its members, the others move to it at their next commit, as at
  a join, and its workers exit when they find themselves left out, so nothing trained is lost;
  its agent then exits. Losing a host without notice (its processes killed, its link down)
  stays a fault, answered in place as before.
* a host newly listed gets an agent with the next host index (never reused) and ``--late``:
  its workers set up while the others train and join at their next commit, with the state
  sent from a peer. It is given every agent's store it knows (each prints it on its stdout),
  and finds the coordinating one there (the first host's may be gone by then); with etcd it
  needs none.
* a host's slots count against `--max-np` from its start until its agent exits: a listed host
  that would pass the cap waits (its slots are trimmed to what is left) until places free.

A listed host whose agent exited while it was still listed (lost, or cut off) is not started
again until the script drops it and lists it again: a broken machine is not restarted every
second. Empty output, or a failing call, changes nothing (said once): a transient empty answer
must not end the job; a host that is really gone is a fault the job answers anyway.

The job's exit code is the one the survivors end with (`job_code`). Once the job is over (an
agent says it finished, or most end with the coordinator's code), the others get `--end-grace`
seconds, as with --hosts, then their stdin is closed.
"""

from __future__ import annotations

import argparse
import time
from typing import Protocol

from hvd_resilient.errors import LaunchError
from hvd_resilient.launch.hosts import discover_hosts, first_discovered, is_loopback
from hvd_resilient.launch.inplace.launched import (
    SSH_FAILED,
    LaunchedAgent,
    Passthrough,
    end,
    exit_code,
    job_code,
    own_code,
    say,
)

LOOK_S = 0.1
"""How often the agents' exits are looked at between two calls of the script."""


def first_hosts(script: str, max_np: int | None) -> list[tuple[str, int]]:
    """The hosts the job starts on: the script's first answer, in its order, up to --max-np
    slots (the host that passes it gets what is left). LaunchError, one line, when the script
    fails or lists no host."""
    return trim(list(first_discovered(script).items()), max_np)


def trim(hosts: list[tuple[str, int]], room: int | None) -> list[tuple[str, int]]:
    """As many of ``hosts`` as ``room`` slots hold, in order (None: all)."""
    out: list[tuple[str, int]] = []
    for host, slots in hosts:
        take = slots if room is None else min(slots, room - sum(n for _, n in out))
        if take < 1:
            break
        out.append((host, take))
    return out


class Launch(Protocol):
    """What `Discovered` uses of the launch (`fanout.Fanout`)."""

    a: argparse.Namespace
    agents: list[LaunchedAgent]
    """Every agent started, in order: appended to by `start_agent`."""
    told: list[str]
    """The signal words passed on so far: none after a stop is asked."""

    def start_agent(self, index: int, coordinator: str | None, *,
                    late: tuple[str, int] | None = None) -> LaunchedAgent: ...


class Discovered:
    """Runs the job's agents while the script's answers change (`Fanout._run` hands over once
    the first hosts' agents are started)."""

    def __init__(self, fanout: Launch, out: Passthrough) -> None:
        self.f, self.out = fanout, out
        self.script: str = fanout.a.discovery
        self.interval: float = fanout.a.discovery_interval
        self.max_np: int | None = fanout.a.max_np
        self.codes: dict[int, int] = {}
        """Agent index -> its exit code, once it exited."""
        self.failed: set[str] = set()
        """Hosts whose agent exited while listed: not started again until dropped and listed."""
        self.said: set[str] = set()
        self.ending_at: float | None = None

    # -- the loop ------------------------------------------------------------------------
    def supervise(self) -> int:
        next_call = time.monotonic() + self.interval
        while True:
            now = time.monotonic()
            self._reap(now)
            live = [a for a in self.f.agents if a.index not in self.codes]
            if not live:
                break
            if self.ending_at is not None and now > self.ending_at:
                say(f"{', '.join(a.name for a in live)}: agent still running "
                    f"{self.f.a.end_grace:g} s after the job ended; closing its stdin")
                end(live)
                continue
            if now >= next_call and self.ending_at is None and not self.f.told:
                self.look()
                next_call = time.monotonic() + self.interval
            time.sleep(LOOK_S)
        self.out.thread.join(timeout=5.0)
        return job_code([c for i, c in sorted(self.codes.items())
                         if not self._agent(i).removed])

    def _agent(self, index: int) -> LaunchedAgent:
        return next(a for a in self.f.agents if a.index == index)

    def _reap(self, now: float) -> None:
        for agent in self.f.agents:
            if agent.index in self.codes:
                continue
            rc = agent.proc.poll()
            if rc is None:
                continue
            code = self.codes[agent.index] = exit_code(rc)
            if agent.removed:
                self._once(f"{agent.name} left the job (exit {code})")
                continue
            self.failed.add(agent.host)
            if not agent.local and rc == SSH_FAILED:
                self._once(f"ssh to {agent.name} ended with 255: the connection was lost or "
                           "ssh failed; its workers are gone from the job")
        if self.ending_at is None and self._job_ended():
            self.ending_at = now + self.f.a.end_grace

    def _job_ended(self) -> bool:
        """The job is over once an agent (not told to leave) says it finished (0), or, with a
        coordinating agent, once most of them ended with a code of the job's own (neither a
        signal's nor "cut off, the others go on"): the coordinator's end reaches every agent,
        while one agent's own failure ends only its host. With etcd only 0 counts here (a
        host's own exit, its lease lost say, ends only that host); the others are waited for."""
        stay = [a for a in self.f.agents if not a.removed]
        codes = [self.codes[a.index] for a in stay if a.index in self.codes]
        if 0 in codes:
            return True
        return not self.f.a.etcd and 2 * sum(map(own_code, codes)) > len(stay)

    # -- one call of the script ----------------------------------------------------------------
    def look(self) -> None:
        """One call of the script, and the hosts it adds or drops."""
        try:
            found = discover_hosts(self.script)
        except LaunchError as e:
            self._once(f"{e}; the hosts stay as they are")
            return
        if not found:
            self._once(f"discovery script {self.script} printed no hosts; the hosts stay as "
                       "they are")
            return
        running = [a for a in self.f.agents if a.index not in self.codes]
        for agent in running:
            if agent.host not in found and not agent.removed:
                self._remove(agent)
        self.failed &= set(found)
        present = {a.host for a in running}
        for host, slots in found.items():
            if host in present or host in self.failed:
                continue
            room = (None if self.max_np is None else
                    self.max_np - sum(a.slots for a in running))
            take = trim([(host, slots)], room)
            if not take:
                self._once(f"{host} waits: --max-np {self.max_np} slots are taken")
                continue
            self._add(*take[0])
            running = [a for a in self.f.agents if a.index not in self.codes]

    def _remove(self, agent: LaunchedAgent) -> None:
        agent.removed = True
        say(f"{agent.name} is no longer listed by the discovery script: its workers leave at "
            "the others' next commit")
        agent.send(b"LEAVE\n")

    def _add(self, host: str, slots: int) -> None:
        if is_loopback(host) and len(self.f.agents) > 0:
            self._once(f"discovery script {self.script} lists {host}, which means each host "
                       "itself: not started; list this machine by an address the others reach")
            return
        coordinator = None
        if not self.f.a.etcd:  # every agent's store it knows: the coordinating one among them
            known = [a.address for a in self.f.agents
                     if a.index not in self.codes and not a.removed and a.address]
            if not known:
                return  # none has said where it listens yet: at the next call
            coordinator = ",".join(known)
        index = 1 + max(a.index for a in self.f.agents)
        say(f"host {index} ({host}) is listed by the discovery script: starting its "
                   f"agent; its {slots} worker(s) join at the others' next commit")
        try:
            self.f.start_agent(index, coordinator, late=(host, slots))
        except OSError as e:
            self.failed.add(host)
            say(f"error: cannot start the in-place agent of host {index} ({host}): {e}")

    def _once(self, line: str) -> None:
        if line not in self.said:
            self.said.add(line)
            say(line)
