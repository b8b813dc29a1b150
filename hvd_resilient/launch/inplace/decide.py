"""What the next generation is: the coordinator's decisions over every host's report.

Each host's agent (`host_agent`) reports what it sees of its own workers (`HostReport`): which
are alive, which asked for the next generation, which are up and waiting to join, which are
busy in a declared section, which finished or failed, and which peers its workers found
silent. `Coordinator.step` turns the reports of the hosts still heard from into one
`Decision`: a generation to publish, members to end, or the end of the job. It reads nothing
and writes nothing itself, so the same decisions hold whether the reports travel through the
first host's store (`embedded`) or through etcd, and the rules are tested without processes
(tests/unit/test_inplace_decide.py).

A host that is no longer heard from (its agent died, its link is down) is absent from the
reports: its members count as lost, like a worker that died on a live host.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

@dataclass
class HostReport:
    """One host agent's view of its own workers (JSON on the wire, `to_json`/`from_json`)."""

    start: list[int] = field(default_factory=list)
    """The members it started for generation 0 (not its standbys)."""
    alive: list[int] = field(default_factory=list)
    asked: dict[int, int] = field(default_factory=dict)
    """Member -> the generation it saw fail (it asks for the next one)."""
    ready: list[int] = field(default_factory=list)
    """Workers up and waiting to be taken in (replacements, standbys)."""
    busy: list[int] = field(default_factory=list)
    """Members inside a declared section (no collective, so they cannot ask)."""
    finished: list[int] = field(default_factory=list)
    failed: dict[int, int] = field(default_factory=dict)
    """Member -> its exit code."""
    evict: dict[int, str] = field(default_factory=dict)
    """Members (of any host) its workers found silent, and why."""
    stopping: bool = False
    """A signal asked this host to stop (the run ends at a final checkpoint)."""
    unadopted: str | None = None
    """A worker died of torch's own env:// rendezvous: the job ends with this line."""
    slots: int = 0
    """Its workers' places (--nproc), standbys not counted."""
    late: bool = False
    """The host joined a running job (a discovery script added it): its slots raise the cap on
    the members."""
    leaving: bool = False
    """The host is being removed (a discovery script dropped it): its members leave at the
    others' next commit, with nothing lost."""

    def to_json(self) -> dict[str, object]:
        return {"start": self.start, "alive": self.alive,
                "asked": {str(k): v for k, v in self.asked.items()}, "ready": self.ready,
                "busy": self.busy, "finished": self.finished,
                "failed": {str(k): v for k, v in self.failed.items()},
                "evict": {str(k): v for k, v in self.evict.items()},
                "stopping": self.stopping, "unadopted": self.unadopted, "slots": self.slots,
                "late": self.late, "leaving": self.leaving}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> HostReport:
        def ints(key: str) -> list[int]:
            return [int(x) for x in d.get(key) or []]

        def by_member(key: str) -> dict[int, Any]:
            return {int(k): v for k, v in (d.get(key) or {}).items()}

        return cls(start=ints("start"), alive=ints("alive"),
                   asked={k: int(v) for k, v in by_member("asked").items()},
                   ready=ints("ready"), busy=ints("busy"), finished=ints("finished"),
                   failed={k: int(v) for k, v in by_member("failed").items()},
                   evict={k: str(v) for k, v in by_member("evict").items()},
                   stopping=bool(d.get("stopping")),
                   unadopted=str(d["unadopted"]) if d.get("unadopted") else None,
                   slots=int(d.get("slots") or 0), late=bool(d.get("late")),
                   leaving=bool(d.get("leaving")))


@dataclass(frozen=True)
class Record:
    """A decided generation, as the agreement carries it (JSON, `to_json`/`from_json`)."""

    generation: int
    members: list[int]
    store: str
    """``host:port`` of the store its process group forms on."""
    agents: dict[int, str] = field(default_factory=dict)
    """Every agent heard from, by host index: its store's address. Each agent keeps the
    newest, so that when the coordinator's agent dies the next one (`embedded.successor`) is
    known to all, and where to reach it."""

    def to_json(self) -> str:
        return json.dumps({"members": self.members, "store": self.store,
                           "agents": {str(h): a for h, a in self.agents.items()}})

    @classmethod
    def from_json(cls, generation: int, raw: str | bytes) -> Record:
        d = json.loads(raw)
        return cls(generation, [int(m) for m in d["members"]], str(d["store"]),
                   {int(h): str(a) for h, a in d.get("agents", {}).items()})


def has_quorum(heard: Collection[int], base: Collection[int]) -> bool:
    """Whether the hosts ``heard`` may go on deciding for the job whose last settled generation
    had the agents ``base`` (those known to have exited left out): more than half of them, or
    exactly half with the lowest among them. Two sides of a cut have disjoint hosts, so at most
    one of them passes, and a tie goes the same way on both sides; the side that fails stops
    itself instead of forming a world of its own. Without any agent to count (every other one
    exited) the one that is left goes on."""
    base = set(base)
    mine = base & set(heard)
    if not base:
        return True
    return 2 * len(mine) > len(base) or (2 * len(mine) == len(base) and min(base) in mine)


@dataclass
class Decision:
    """What the agents do now; empty: nothing (the coordinator waits)."""

    publish: list[int] | None = None
    """The next generation's members, in rank order."""
    fence: dict[int, str] = field(default_factory=dict)
    """Members to end, and why (their host's agent ends them)."""
    end: int | None = None
    """The job is over: every agent ends what is left and exits with this code."""
    finishing: bool = False
    """The run is ending (a worker finished, or a stop was asked): no new generation; the
    agents end their workers that never joined (they wait for a generation that will not
    come)."""
    refusal: str | None = None
    """The line the job ends with when it cannot run at all (`HostReport.unadopted`)."""


TOGETHER_S = 10.0
"""How long the first ready worker of a host that joined waits for the others of its host, so
that the members move once for the host, not once per newcomer."""


class Coordinator:
    """The generations' decisions: one instance, on the agent that coordinates."""

    def __init__(self, nproc: int, min_np: int, last_call_s: float) -> None:
        self.nproc, self.min_np, self.last_call_s = nproc, min_np, last_call_s
        """``nproc``: the members never exceed it (the job's first size)."""
        self.generation = -1
        self.members: list[int] = []
        self.finished: set[int] = set()
        self.failed: dict[int, int] = {}
        self._asked_since: float | None = None
        self._said_busy: list[int] = []
        self._late_since: dict[int, float] = {}
        """A late host -> when its first worker was seen ready (`TOGETHER_S`)."""

    def go_on_from(self, record: Record) -> None:
        """Decides after another coordinator, from the newest generation it published."""
        self.generation, self.members = record.generation, list(record.members)

    def first(self, reports: Mapping[int, HostReport]) -> Decision:
        """Generation 0: every host's first workers, host by host."""
        members = [m for h in sorted(reports) for m in sorted(reports[h].start)]
        return self._publish(members)

    def _publish(self, members: list[int]) -> Decision:
        """Survivors keep their order (rank 0 is always one that holds the state), newcomers
        come after them."""
        old = [m for m in self.members if m in members]
        members = old + sorted(set(members) - set(old))
        self.generation += 1
        self.members = members
        self._asked_since = None
        logger.info("generation %d: members %s", self.generation, members)
        return Decision(publish=members)

    def _late_ready(self, host: int, rep: HostReport, now: float) -> list[int]:
        """A late host's workers join together, once every one of them is ready (or
        `TOGETHER_S` after the first was): one move for the members, not one per newcomer."""
        ready = [m for m in rep.ready if m not in self.members]
        if not ready:
            self._late_since.pop(host, None)
            return []
        first = self._late_since.setdefault(host, now)
        unready = [m for m in rep.alive if m not in self.members and m not in rep.ready]
        return ready if not unready or now - first >= TOGETHER_S else []

    def step(self, reports: Mapping[int, HostReport], now: float,
             at_door: Callable[[int, list[int]], set[int]]) -> Decision:
        """One look at every host heard from; ``at_door(g, members)``: which of them wait at
        generation g's door, not through it (a member of g died before it arrived, and they
        can ask for nothing else)."""
        alive: set[int] = set()
        asked: set[int] = set()
        ready: list[int] = []
        busy: set[int] = set()
        evict: dict[int, str] = {}
        leaving: set[int] = set()
        stopping = False
        cap = self.nproc
        for host, rep in reports.items():
            if rep.unadopted:
                return Decision(end=78, refusal=rep.unadopted)
            alive.update(rep.alive)
            asked.update(m for m, g in rep.asked.items() if g >= self.generation)
            busy.update(rep.busy)
            evict.update(rep.evict)
            if rep.leaving:
                leaving.update(rep.alive)
            elif rep.late:  # its workers first: the places its slots add are theirs
                cap += rep.slots
                ready[:0] = self._late_ready(host, rep, now)
            else:
                ready.extend(rep.ready)
            self.finished.update(rep.finished)
            self.failed.update(rep.failed)
            stopping = stopping or rep.stopping
        asked &= alive
        if not alive:
            # a worker's own exit code (78: not to be relaunched), never a signal's negative one
            return Decision(end=0 if self.finished else max(
                (c for c in self.failed.values() if c > 0), default=1))
        if self.finished or stopping:  # the run is ending: no new generation
            return Decision(finishing=True)
        fence = {m: f"its peers found it silent ({why})" for m, why in evict.items()
                 if m in alive}
        live = alive - set(fence)
        lost = [m for m in self.members if m not in live]
        if lost:
            asked |= at_door(self.generation, sorted(live & set(self.members)))
        ready = [m for m in ready if m not in leaving]
        if not lost and not asked:
            if leaving & set(self.members):  # a host removed: its members leave at a commit
                return self._without(leaving, fence)
            taking = self._take_in(ready, cap)
            taking.fence.update(fence)
            return taking
        if self._asked_since is None:
            self._asked_since = now
        waiting = sorted(set(self.members) & live - asked)
        if waiting and now - self._asked_since < self.last_call_s:
            return Decision(fence=fence)  # a live member still in its step: it fails soon
        still_busy = [m for m in waiting if m in busy]
        if still_busy:  # in a declared section (an evaluation): it asks when it leaves it
            if still_busy != self._said_busy:
                logger.info("waiting for member(s) %s: busy in a declared section",
                            ", ".join(map(str, still_busy)))
                self._said_busy = still_busy
            return Decision(fence=fence)
        for m in waiting:
            fence[m] = (f"it did not ask for generation {self.generation + 1} within "
                        f"{self.last_call_s:g}s")
        # a replacement or standby up by now joins too, into the places of the lost
        newcomers = [m for m in ready if m not in self.members and m in live]
        stay = sorted(asked - leaving)
        members = stay + newcomers[:max(0, cap - len(stay))]
        if len(members) < self.min_np:
            logger.error("%d live members, fewer than --min-np %d: ending the job so that it "
                         "restarts from its durable checkpoint", len(members), self.min_np)
            return Decision(fence={m: "the job ends" for m in alive}, end=1)
        decision = self._publish(members)
        decision.fence = fence
        return decision

    def _take_in(self, ready: list[int], cap: int) -> Decision:
        """Workers up and waiting (replacements, standbys, a joined host's) join in a
        generation of their own while there is a place for them (``cap``: the job's first size
        and the slots of the hosts that joined since), which the members move to at their next
        commit; never while a fault is being answered."""
        newcomers = [m for m in ready if m not in self.members]
        newcomers = newcomers[:max(0, cap - len(self.members))]
        if newcomers:
            return self._publish([*self.members, *newcomers])
        return Decision()

    def _without(self, leaving: set[int], fence: dict[int, str]) -> Decision:
        """A generation without the members of a host being removed: the others move to it at
        their next commit, as at a join, and the leaving ones find themselves left out there
        and exit. Fewer than --min-np left: the job ends (a relaunch on the hosts left)."""
        members = [m for m in self.members if m not in leaving]
        if len(members) < self.min_np:
            logger.error("removing member(s) %s leaves %d, fewer than --min-np %d: ending the "
                         "job so that it restarts from its durable checkpoint",
                         sorted(leaving), len(members), self.min_np)
            return Decision(fence={m: "the job ends" for m in [*self.members, *leaving]},
                            end=1)
        logger.info("member(s) %s leave with their host", sorted(leaving & set(self.members)))
        decision = self._publish(members)
        decision.fence = fence
        return decision
