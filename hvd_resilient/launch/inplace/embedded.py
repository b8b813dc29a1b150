"""The agreement without a service: the first host's agent coordinates, the others report to its
store and carry out what it decides.

Keys (under `CLUSTER`, on the coordinating agent's store): ``hosts`` (one more than the highest
host index that reported: a host a discovery script added comes after the first ones),
``report/<h>`` (host h's
`decide.HostReport` and a sequence number it bumps at every look), ``gen`` and ``gen/<g>`` (the
generations decided: members and the address of the store the group forms on), ``fence/<m>``
(a member to end, and why), ``finishing``, ``end`` (the job's exit code), ``ack/<h>`` (host h
saw the end), ``beat`` (the coordinator's own sequence number).

Liveness is judged by numbers that stop moving, never by comparing two hosts' clocks: a host
whose report has not changed for `HOST_LOST_S` is not heard from (its members are lost). Each
other host's agent also holds one TCP connection to the coordinator (`liveness`): a host whose
processes were killed is lost in milliseconds, not after `HOST_LOST_S`, which is left to a
host that went silent (power lost, link down, frozen).

The coordinator is replaceable, and never twice at once:

* Its agent seen to exit (its connection closed), or not heard for `CUT_OFF_S` (its beat has
  not moved), the others leave it behind: every one computes the same successor from the
  newest record it holds (`successor`: the lowest other host, whose store's address the record
  carries), which coordinates from that generation on, on its own store; the others follow it
  there, and the lost host costs one generation.
* A majority decides (`decide.has_quorum`). A coordinator that hears fewer than half of the
  agents of the last generation every one of them has seen (`Coordinating.quorum`; an agent
  known to have exited does not count) stops its own workers and exits at its next look, and a
  successor takes over only once it hears a majority of the newest generation it holds
  (waiting at most `TAKEOVER_WAIT_S` for their reports), else it stops too. A coordinator that
  is only cut off stops after `HOST_LOST_S`, before the others leave it at `CUT_OFF_S`, so the
  two never decide at once, and a cut-off host that cannot reach the successor either stops
  within `LEAVE_S` of leaving. A cut with no majority on either side (two hosts, and the tie
  goes to the lower) ends the job for `hvd-resilient run` to relaunch. This rests on the hosts'
  clocks running at the same rate over two seconds, as any lease does; etcd (`agreed`) needs
  no such margin.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Collection, Mapping

import torch.distributed as dist

from hvd_resilient.launch.inplace.decide import HostReport, Record, has_quorum
from hvd_resilient.launch.inplace.liveness import Link, Listener

logger = logging.getLogger(__name__)
CLUSTER = "hvd_resilient/cluster/"
HOST_LOST_S = 1.0
CUT_OFF_S = 1.4
"""A follower that has not seen the coordinator's beat move for this long leaves it behind. Later
than `HOST_LOST_S` by a margin: a coordinator cut off from the majority has stopped by then."""
RECHECK_S = 0.15
"""Before a follower leaves a coordinator not heard for `CUT_OFF_S`, it waits this long for one
more read of its beat: a process that was not scheduled for a while (a starved machine) may run
the judging loop before the thread that reads the beat, and take its own pause for the
coordinator's silence."""
TAKEOVER_WAIT_S = 0.5
"""How long a successor waits for the reports of the newest generation's other agents before it
counts who it hears."""
LEAVE_S = 0.8
"""How long an agent that left its coordinator behind may take to reach the successor's store:
one that cannot (it is the one cut off) stops its workers."""
STORE_TIMEOUT_S = 0.5
"""A follower's calls to the coordinator's store give up after this (a link that is down
answers nothing): the loop goes on and counts the time towards `CUT_OFF_S`."""


def successor(record: Record, left: Collection[int]) -> int | None:
    """The agent that coordinates once the agents ``left`` behind are: the lowest other host
    index of the newest generation's agents (every survivor computes the same from the same
    record)."""
    others = [h for h in record.agents if h not in left]
    return min(others) if others else None


class _Clock:
    """When a number was last seen to change (monotonic time of this host)."""

    def __init__(self, now: float) -> None:
        self.value: object = None
        self.changed_at = now
        self.said = False
        """Its host's loss was logged (once)."""

    def see(self, value: object, now: float) -> None:
        if value != self.value:
            self.value, self.changed_at = value, now


class Coordinating:
    """The coordinator's side: reads the reports, publishes the decisions."""

    def __init__(self, server: dist.TCPStore, host_index: int, address: str, *,
                 after: Record | None = None, left: Collection[int] = (),
                 exited: Collection[int] = (), now: float = 0.0) -> None:
        """``after``: the newest record of the coordinators ``left`` behind, which this one
        follows on from; those of them that ``exited`` (seen to: their connection closed)
        count for nothing."""
        self.store = dist.PrefixStore(CLUSTER, server)
        self.host_index = host_index
        self.seq = 0
        self.clocks: dict[int, _Clock] = {}
        self.listener = Listener(address)
        self.store.set("liveness", self.listener.address)
        self.gone: set[int] = set(exited)
        """Hosts whose agent's connection closed: lost for good, and out of every count."""
        self.addresses: dict[int, str] = {}
        """Every other agent's store, as its reports give it."""
        self.seen: dict[int, int] = {}
        """The newest generation each other agent says it holds."""
        self.records: list[Record] = [after] if after is not None else []
        """The generations published that not every agent of theirs has seen yet, and the
        newest that every one has (first)."""
        self.wait_until = now + TAKEOVER_WAIT_S if after is not None else 0.0
        self.expected = set(after.agents if after else ()) - set(left) - {host_index}
        """The agents whose first reports a successor waits for (`TAKEOVER_WAIT_S` at most)."""

    def _watch_links(self) -> None:
        for h in self.listener.closed():
            if h not in self.gone:
                self.gone.add(h)
                logger.warning("host %d's agent is gone (its connection closed): its members "
                               "are lost", h)

    def reports(self, hosts: int, now: float) -> dict[int, HostReport]:
        """The reports of every other host still heard from: the first ``hosts`` and any that
        joined later."""
        self._watch_links()
        out: dict[int, HostReport] = {}
        if self.store.check(["hosts"]):
            hosts = max(hosts, int(self.store.get("hosts")))
        for h in range(hosts):
            if h == self.host_index or h in self.gone or not self.store.check([f"report/{h}"]):
                continue
            raw = json.loads(self.store.get(f"report/{h}"))
            self.addresses[h] = str(raw.get("address", ""))
            clock = self.clocks.setdefault(h, _Clock(now))
            clock.see(raw["seq"], now)
            if now - clock.changed_at < HOST_LOST_S:
                out[h] = HostReport.from_json(raw["report"])
                self.seen[h] = int(raw.get("generation", -1))
            elif not clock.said:
                logger.warning("host %d not heard from for %.1fs: its members are lost", h,
                               now - clock.changed_at)
                clock.said = True
        return out

    def quorum(self, heard: Collection[int], now: float) -> bool | None:
        """Whether this coordinator may decide, hearing ``heard`` (itself among them): None
        while a successor still waits for the others' first reports. Counted against the
        newest generation every one of its agents has seen (`settled`): a host that missed
        the newest may still count by the one before, and so must this coordinator."""
        if not self.records:
            return True  # generation 0 is not decided yet
        if now < self.wait_until and not self.expected - self.gone <= set(heard):
            return None
        base = set(self.settled().agents) - self.gone
        self.wait_until = 0.0
        return has_quorum(heard, base)

    def settled(self) -> Record:
        """The newest generation published that every agent of it still counted has seen
        (the oldest kept, failing that); older ones are forgotten."""
        for i in range(len(self.records) - 1, 0, -1):
            r = self.records[i]
            if all(self.seen.get(h, -1) >= r.generation
                   for h in set(r.agents) - self.gone - {self.host_index}):
                del self.records[:i]
                break
        return self.records[0]

    def publish(self, record: Record) -> None:
        self.store.set(f"gen/{record.generation}", record.to_json())
        self.store.set("gen", str(record.generation))
        self.records.append(record)

    def fence(self, fence: Mapping[int, str]) -> None:
        for m, why in fence.items():
            self.store.set(f"fence/{m}", why)

    def finishing(self) -> None:
        self.store.set("finishing", "1")

    def end(self, code: int, heard: list[int], wait_s: float = 5.0) -> None:
        """Publishes the job's end and waits (bounded) until every host still heard from saw
        it: a host that missed it would take the coordinator's exit for a cut-off."""
        self.store.set("end", str(code))
        deadline = time.monotonic() + wait_s
        keys = [f"ack/{h}" for h in heard if h != self.host_index]
        while keys and not self.store.check(keys) and time.monotonic() < deadline:
            self.beat()
            time.sleep(0.01)

    def beat(self) -> None:
        self.seq += 1
        self.store.set("beat", str(self.seq))


class Following:
    """A follower's side: sends its report, reads the decisions, notices a lost coordinator."""

    def __init__(self, coordinator: str, host_index: int, now: float,
                 address: str = "") -> None:
        """``address``: this agent's own store, sent with every report (a coordinator after
        this one is reached there)."""
        self.address = address
        self.coordinator = coordinator
        self.last: Record | None = None
        """The newest generation's record seen."""
        host, _, port = coordinator.rpartition(":")
        self.client = dist.TCPStore(host, int(port), is_master=False,
                                    timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
        self.store = dist.PrefixStore(CLUSTER, self.client)
        self.host_index = host_index
        self.seq = 0
        self.beat = _Clock(now)
        self.read = threading.Event()
        """Set at every beat read (`RECHECK_S`)."""
        self.generation = -1
        self._register()
        self.link = self._connect_liveness()

    def _register(self) -> None:
        """Raises the coordinator's ``hosts`` to cover this host's index (compare-and-set: many
        agents may register at once), so that a host added after the start is read too."""
        want, seen = str(self.host_index + 1), ""
        while True:
            now = self.store.compare_set("hosts", seen, want).decode()
            if now == want or int(now or 0) >= self.host_index + 1:
                return
            seen = now

    def _connect_liveness(self) -> Link:
        """The connection whose closing tells the coordinator this agent is gone."""
        return Link(self.store.get("liveness").decode(), self.host_index, STORE_TIMEOUT_S)

    def send(self, report: HostReport) -> None:
        """This host's report, the address of its store, and the newest generation it holds
        (what the coordinator's count of a majority goes by)."""
        self.seq += 1
        self.store.set(f"report/{self.host_index}",
                       json.dumps({"seq": self.seq, "report": report.to_json(),
                                   "address": self.address, "generation": self.generation}))

    def read_beat(self, now: float) -> None:
        """The coordinator's beat, as this host hears it (a store that does not answer raises:
        the time since the last change counts on)."""
        self.beat.see(self.store.get("beat"), now)
        self.read.set()

    def heard(self, now: float) -> bool:
        """False once the coordinator's beat has not moved for `CUT_OFF_S`."""
        return now - self.beat.changed_at < CUT_OFF_S

    def newest(self) -> Record | None:
        if not self.store.check(["gen"]):
            return None
        g = int(self.store.get("gen"))
        if g <= self.generation:
            return None
        self.generation = g
        self.last = Record.from_json(g, self.store.get(f"gen/{g}"))
        return self.last

    def fences(self, members: list[int]) -> dict[int, str]:
        return {m: self.store.get(f"fence/{m}").decode() for m in members
                if self.store.check([f"fence/{m}"])}

    def finishing(self) -> bool:
        return self.store.check(["finishing"])

    def ended(self) -> int | None:
        """The job's exit code once the coordinator ended it (`acknowledge` after)."""
        if not self.store.check(["end"]):
            return None
        return int(self.store.get("end"))

    def acknowledge(self) -> None:
        """This host saw the end: the coordinator may exit."""
        try:
            self.store.set(f"ack/{self.host_index}", "1")
        except Exception as e:  # gone already: it waits for acks a bounded time
            logger.debug("acknowledging the end: %s", e)
