"""In place with etcd: every host's agent alike, the generations agreed in etcd, no host whose
loss ends the job.

Each agent holds a lease and keeps its report (`decide.HostReport`, its store's address, its
liveness listener, its lease id) in ``hosts/<h>`` on it. The agent holding the ``leader`` key
(also on its lease) decides (`decide.Coordinator`), and publishes each generation with one
compare-and-swap (`EtcdAgreement.publish`), so two generations with the same number can never
exist, even with two agents that both believe they lead. The generation's record names the
store its group forms on: the deciding agent's own, so when the leader's host is lost the next
generation forms on the store of the agent that leads after it (the store moves). The other
decisions (members to end, the run finishing, the job's end) are one ``control`` key.

A dead agent is seen two ways: its connection to the leader's liveness listener closes (the
leader revokes its lease; a dead leader's lease is revoked by the agent that saw its connection
close, and another agent takes ``leader``), or its lease expires (a host silent or cut off,
after the TTL). An agent whose lease is gone stops its workers: the others have counted it out.

etcd unreachable: nothing is decided, and nothing needs to be while every worker trains; once a
worker asks for a new generation (a membership change), the agent ends its workers with one
line and exits restartable, since no generation can be agreed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

from hvd_resilient.errors import CUT_OFF_EXIT_CODE, RESTARTABLE_EXIT_CODE, ConfigError
from hvd_resilient.launch.inplace.decide import Coordinator, Decision, HostReport, Record
from hvd_resilient.launch.inplace.etcd_agreement import (
    AgreementUnavailable,
    EtcdAgreement,
    LeaseLost,
)
from hvd_resilient.launch.inplace.host_agent import LEAVING_WAIT_S, HostAgent
from hvd_resilient.launch.inplace.liveness import Link, Listener

logger = logging.getLogger(__name__)
POLL_S = 0.02
START_S = 120.0
LINK_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Peer:
    """What a host's report in etcd says beyond its workers."""

    report: HostReport
    liveness: str
    lease: int | None


class EtcdAgent:
    """One host's agent when the generations are agreed in etcd."""

    def __init__(self, host: HostAgent, decide: Coordinator, agreement: EtcdAgreement,
                 host_index: int, hosts: int) -> None:
        self.host, self.decide, self.ag = host, decide, agreement
        self.host_index, self.hosts = host_index, hosts
        self.listener = Listener(host.ip)
        self.sent = ""
        self.leading = False
        self.gone: set[int] = set()
        self.link: Link | None = None
        self.lease_lost = False
        self.control = ""
        self.began = time.monotonic()
        self.leaving_since: float | None = None
        self._stop = threading.Event()

    def run(self) -> int:
        self.ag.start()
        self.host.install_signals()
        self.host.start()
        threading.Thread(target=self._renew, name="inplace-etcd-lease", daemon=True).start()
        try:
            while True:
                code = self.step()
                if code is not None:
                    return code
                time.sleep(POLL_S)
        finally:
            self._stop.set()
            self.listener.close()
            try:  # this host's keys go now, not a TTL later
                self.ag.close()
            except AgreementUnavailable:
                pass

    def _renew(self) -> None:
        """Keeps the lease while etcd answers; a lease found gone is final."""
        while not self._stop.wait(self.ag.ttl / 4):
            try:
                if not self.ag.renew():
                    self.lease_lost = True
                    return
            except AgreementUnavailable:
                continue  # etcd unreachable: the main loop decides what that means

    def _may_leave(self) -> bool:
        """A removed host's workers are gone: its agent exits, the leader's once the group it
        decided without them formed on its store (or after `LEAVING_WAIT_S`)."""
        now = time.monotonic()
        if self.leaving_since is None:
            self.leaving_since = now
        return (not self.leading or now - self.leaving_since > LEAVING_WAIT_S
                or self.host.formed(self.decide.generation, self.decide.members))

    def _end(self, code: int) -> int:
        self.host.end_all()
        self.host.finish()
        return code

    def step(self) -> int | None:
        """One look; an exit code when this host is done."""
        host = self.host
        host.reap()
        if host.leaving and not host.alive and self._may_leave():
            logger.info("this host's workers have left the job: the agent exits")
            return self._end(CUT_OFF_EXIT_CODE)
        report = host.report()
        if self.lease_lost:
            logger.error("this host's etcd lease is gone: the other hosts have counted it out; "
                         "ending its workers")
            return self._end(RESTARTABLE_EXIT_CODE)
        try:
            return self._look(report)
        except LeaseLost:
            self.lease_lost = True
            return None  # said and ended at the next look
        except AgreementUnavailable as e:
            if report.asked or set(host.members) - set(host.alive):
                logger.error("etcd is unreachable (%s) and the job's members changed: no "
                             "generation can be agreed; ending this host's workers", e)
                return self._end(RESTARTABLE_EXIT_CODE)
            return None  # nothing to agree on: every worker trains on

    def _look(self, report: HostReport) -> int | None:
        host, ag = self.host, self.ag
        payload = json.dumps({"report": report.to_json(), "liveness": self.listener.address,
                              "lease": ag.lease_id})
        if payload != self.sent:
            ag.put_report(payload)
            self.sent = payload
        peers = self._peers()
        code = self._obey()
        if code is not None:
            return code
        leader = ag.leader()
        if leader is None:
            self.leading = ag.lead()
            leader = ag.leader()
        self.leading = leader == self.host_index
        if self.leading:
            code = self._lead(report, peers)
        else:
            self._watch_leader(leader, peers)
        record = self._newest()
        if record is not None:
            host.mirror(record.generation, record.members, record.store)
        return code

    def _newest(self) -> Record | None:
        newest = self.ag.newest()
        return Record.from_json(*newest) if newest is not None else None

    def _peers(self) -> dict[int, Peer]:
        out = {}
        for h, (raw, _rev) in self.ag.reports().items():
            p = json.loads(raw)
            out[h] = Peer(HostReport.from_json(p["report"]), str(p["liveness"]), p.get("lease"))
        return out

    def _obey(self) -> int | None:
        """The leader's decisions for this host's workers."""
        raw = self.ag.get("control")
        if raw is None or raw == self.control:
            return None
        self.control = raw
        c = json.loads(raw)
        host = self.host
        for m, why in c.get("fence", {}).items():
            host.fence([int(m)], why)
        if c.get("finishing"):
            host.end_standbys()
        if c.get("end") is not None:
            host.end_all(refusal=bool(c.get("refusal")))
            host.finish()
            if c.get("refusal"):
                raise ConfigError(c["refusal"])
            return int(c["end"])
        return None

    def _watch_leader(self, leader: int | None, peers: dict[int, Peer]) -> None:
        """A connection to the leader's listener; when it closes the leader died, and its
        lease is revoked now so that another agent leads at once."""
        lead = peers.get(leader) if leader is not None else None
        if lead is None:
            return
        if self.link is None or self.link.address != lead.liveness:
            if self.link is not None:
                self.link.close()
            try:
                self.link = Link(lead.liveness, self.host_index, LINK_TIMEOUT_S)
            except OSError:
                self.link = None
            return
        if self.link.closed():
            logger.warning("the leading agent (host %s) is gone (its connection closed): "
                           "revoking its lease", leader)
            self.link.close()
            self.link = None
            if lead.lease is not None:
                self.ag.revoke(lead.lease)

    # -- the leader ------------------------------------------------------------------------
    def _lead(self, mine: HostReport, peers: dict[int, Peer]) -> int | None:
        decide, ag = self.decide, self.ag
        for h in self.listener.closed():
            peer = peers.get(h)
            if h != self.host_index and h not in self.gone:
                self.gone.add(h)
                logger.warning("host %d's agent is gone (its connection closed): its members "
                               "are lost", h)
                if peer is not None and peer.lease is not None:
                    ag.revoke(peer.lease)
        reports = {h: p.report for h, p in peers.items()
                   if h != self.host_index and h not in self.gone}
        reports[self.host_index] = mine
        now = time.monotonic()
        if decide.generation < 0:
            newest = self._newest()
            if newest is not None:  # a leader after another: go on from its last generation
                decide.go_on_from(newest)
                logger.info("leading from generation %d (members %s)", decide.generation,
                            decide.members)
        if decide.generation < 0:
            if len(reports) < self.hosts:
                if now - self.began > START_S:
                    missing = sorted(set(range(self.hosts)) - set(reports))
                    self._end(1)
                    raise ConfigError(f"inplace: host(s) {missing} did not report to etcd "
                                      f"within {START_S:.0f}s; check their agents' output")
                return None
            decision = decide.first(reports)
        else:
            decision = decide.step(reports, now, self.host.at_door)
        return self._carry_out(decision)

    def _carry_out(self, d: Decision) -> int | None:
        decide, ag, host = self.decide, self.ag, self.host
        if d.publish is not None:
            g = decide.generation
            if not ag.publish(g, Record(g, d.publish, host.address).to_json()):
                # another agent published g (it led meanwhile)
                newest = self._newest()
                logger.warning("generation %d was published by another agent; following it", g)
                if newest is not None:
                    decide.go_on_from(newest)
                return None
        if d.fence or d.finishing or d.end is not None:
            old = json.loads(self.control) if self.control else {}
            fence = {**old.get("fence", {}), **{str(m): why for m, why in d.fence.items()}}
            ag.put("control", json.dumps({"fence": fence, "finishing": d.finishing or
                                          bool(old.get("finishing")), "end": d.end,
                                          "refusal": d.refusal}))
        return self._obey()
