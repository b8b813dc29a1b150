"""The in-place agent: one per host; starts that host's workers and hosts the store they talk
to (`launch/inplace/host_agent.py`); the first host's agent also decides every generation
(`launch/inplace/decide.py`), the others report to it (`launch/inplace/embedded.py`); with
``--etcd`` every agent is alike and the generations are agreed in etcd
(`launch/inplace/agreed.py`).

    python -m hvd_resilient.launch.inplace_agent --nproc 4 [--min-np 2] -- python train.py ...

Across hosts `python -m hvd_resilient.launch.inplace.fanout --hosts h1:2,h2:2 -- ...` starts
one agent per host over ssh (`--host-index`, `--coordinator` or `--etcd`, `--control-stdin`).

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
import socket
import sys
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple, NoReturn, TextIO

import torch.distributed as dist

from hvd_resilient import log
from hvd_resilient.cli_errors import exit_on_error
from hvd_resilient.errors import CUT_OFF_EXIT_CODE, ConfigError
from hvd_resilient.launch.inplace.decide import Coordinator, Decision, Record
from hvd_resilient.launch.inplace.embedded import (
    CLUSTER,
    LEAVE_S,
    RECHECK_S,
    Coordinating,
    Following,
    successor,
)
from hvd_resilient.launch.inplace.fanout import worker_command
from hvd_resilient.launch.inplace.host_agent import LEAVING_WAIT_S, HostAgent, raise_priority
from hvd_resilient.launch.inplace.launched import AGENT_LINE, COORDINATOR_LINE

logger = logging.getLogger("hvd_resilient.launch.inplace_agent")  # not __name__: run as __main__
POLL_S = 0.01
START_S = 120.0
"""How long the coordinator waits for every host's first report before generation 0."""
CONNECT_S = 10.0
"""How long an agent tries to reach host 0's coordinating store at the start."""


class Left(NamedTuple):
    """A coordinator this agent follows no more: the newest record it published, and whether
    its agent was seen to exit (its connection closed) or only went silent."""

    record: Record
    exited: bool


class Agent:
    """One host's agent; the coordinating one when it is given no ``coordinator``."""

    def __init__(self, cmd: Sequence[str], nproc: int, min_np: int, last_call_s: float,
                 host: str = "127.0.0.1", replace: bool = False, standby: int = 0, *,
                 host_index: int = 0, hosts: int = 1, coordinator: str | None = None,
                 job_nproc: int | None = None, announce: bool = False, joins: bool = False,
                 late: bool = False) -> None:
        """``coordinator``: the coordinating agent's store, or several agents' stores (comma
        separated) of which the coordinating one is found (a host that joins later: the launch
        does not know which agent coordinates by then); ``joins``, ``late``: `HostAgent`."""
        self.announce = announce
        """Print `COORDINATOR_LINE` or `AGENT_LINE` (for the launch across hosts)."""
        self.host = HostAgent(cmd, nproc, host_index=host_index, address=host,
                              replace=replace, standby=standby, joins=joins, late=late)
        self.host_index, self.hosts = host_index, hosts
        self.coordinator_address = coordinator
        self.decide = Coordinator(job_nproc or nproc, min_np, last_call_s)
        self.cluster = (Coordinating(self.host.server, host_index, self.host.ip)
                        if coordinator is None else None)
        """The coordinator's side, on the agent that coordinates (host 0's, or a successor)."""
        self.began = time.monotonic()
        self.leaving_since: float | None = None

    def run(self) -> int:
        self.host.install_signals()
        if self.coordinator_address is None:
            if self.announce:
                print(f"{COORDINATOR_LINE} {self.host.address}", flush=True)
            return self._coordinate()
        if self.announce:  # where a host added later may look for the coordinator
            print(f"{AGENT_LINE} {self.host.address}", flush=True)
        candidates = self.coordinator_address.split(",")
        if len(candidates) > 1:
            return self._follow(self._find_coordinator(candidates))
        return self._follow(self.coordinator_address)

    def _find_coordinator(self, candidates: list[str]) -> str:
        """The one of ``candidates`` (agents' stores) that coordinates: its store holds the
        coordinator's beat (a follower's holds none; a coordinator left behind is gone or
        stopped). Tried for `CONNECT_S`: a successor may be taking over just now."""
        deadline = time.monotonic() + CONNECT_S
        while True:
            for address in candidates:
                host, _, port = address.rpartition(":")
                try:
                    client = dist.TCPStore(host, int(port), is_master=False,
                                           timeout=datetime.timedelta(seconds=0.5))
                    if dist.PrefixStore(CLUSTER, client).check(["beat"]):
                        return address
                except Exception as e:  # gone, or not answering: the next one
                    logger.debug("agent store %s: %s", address, e)
            if time.monotonic() > deadline:
                self._stop_here(f"no coordinating agent among {', '.join(candidates)} "
                                f"within {CONNECT_S:g}s")
            time.sleep(0.1)

    # -- the coordinating agent -------------------------------------------------------------
    def _coordinate(self) -> int:
        self.host.start()
        return self._decide_until_the_end()

    def _decide_until_the_end(self) -> int:
        self.began = time.monotonic()
        while True:
            code = self.step()
            if code is not None:
                return code
            time.sleep(POLL_S)

    def step(self) -> int | None:
        """One look at every host (the coordinating agent); an exit code when the job is
        over."""
        host, decide, cluster = self.host, self.decide, self.cluster
        assert cluster is not None, "the coordinating agent's"
        now = time.monotonic()
        host.reap()
        if host.leaving and not host.alive and self._may_leave(cluster, now):
            self._leave_here()
        reports = {**cluster.reports(self.hosts, now), self.host_index: host.report()}
        if decide.generation >= 0:
            quorum = cluster.quorum(reports, now)
            if quorum is None:  # a successor still waiting for the others' reports
                cluster.beat()
                return None
            if not quorum:
                self._stop_here(f"cut off from the job's majority (hearing hosts "
                                f"{sorted(reports)} of {sorted(cluster.settled().agents)}); "
                                f"the others go on without this host")
        if decide.generation < 0:
            if len(reports) < self.hosts:
                if now - self.began > START_S:
                    missing = sorted(set(range(self.hosts)) - set(reports))
                    host.end_all()
                    host.finish()
                    raise ConfigError(f"inplace: host(s) {missing} did not report within "
                                      f"{START_S:.0f}s; check their agents' output")
                cluster.beat()
                return None
            decision = decide.first(reports)
        else:
            decision = decide.step(reports, now, host.at_door)
        leaving = {h for h, r in reports.items() if r.leaving and h != self.host_index}
        code = self._carry_out(cluster, decision, sorted(reports), leaving)
        cluster.beat()
        return code

    def _may_leave(self, cluster: Coordinating, now: float) -> bool:
        """A removed coordinator's workers are gone: it exits once the group of the generation
        it decided without them has formed on its store and every agent read that generation
        (the one after it goes on from there), or after `LEAVING_WAIT_S`."""
        if self.leaving_since is None:
            self.leaving_since = now
        g = self.decide.generation
        return (now - self.leaving_since > LEAVING_WAIT_S
                or (self.host.formed(g, self.decide.members)
                    and cluster.settled().generation >= g))

    def _leave_here(self) -> NoReturn:
        """This host was removed and its workers are gone: the agent exits (`CUT_OFF_EXIT_CODE`:
        the others go on). Never returns, for the reason `_stop_here` gives."""
        logger.info("this host's workers have left the job: the agent exits")
        self._exit_now()

    def _carry_out(self, cluster: Coordinating, d: Decision, heard: list[int],
                   leaving: Collection[int] = ()) -> int | None:
        """``leaving``: other hosts being removed: named in no record (none of them is the next
        coordinator)."""
        host = self.host
        if d.fence:
            cluster.fence(d.fence)
            for m, why in d.fence.items():
                host.fence([m], why)
        if d.publish is not None:
            agents = {**{h: a for h, a in cluster.addresses.items()
                         if h in heard and a and h not in leaving},
                      self.host_index: host.address}
            record = Record(self.decide.generation, d.publish, host.address, agents)
            cluster.publish(record)
            host.mirror(record.generation, record.members, record.store)
        if d.finishing:
            cluster.finishing()
            host.end_standbys()
        if d.end is None:
            return None
        host.end_all(refusal=d.refusal is not None)
        cluster.end(d.end, heard)
        host.finish()
        if d.refusal is not None:
            raise ConfigError(d.refusal)
        return d.end

    # -- an agent that follows ------------------------------------------------------------
    def _follow(self, coordinator: str) -> int:
        """Follows the coordinator; when its agent exits or goes silent, the successor the
        newest record names coordinates (this agent, or another that this one follows from
        then on)."""
        self.host.start()
        left: set[int] = set()
        """Coordinators left behind: none of them is followed again."""
        exited: set[int] = set()
        """Of them, those seen to exit: they count in no majority."""
        within, record = CONNECT_S, None
        while True:
            outcome = self._follow_one(coordinator, within, record)
            if isinstance(outcome, int):
                return outcome
            record = outcome.record
            old = next((h for h, a in record.agents.items() if a == coordinator), None)
            if old is not None:
                left.add(old)
                if outcome.exited:
                    exited.add(old)
            nxt = successor(record, left)
            if old is None or nxt is None:
                self._stop_here(f"the coordinator ({coordinator}) is gone and the newest "
                                f"generation names no agent after it")
            logger.warning("the coordinator's agent (host %s) %s: host %d coordinates from "
                           "generation %d on, once it hears a majority", old,
                           "is gone" if outcome.exited else "is not heard from", nxt,
                           record.generation)
            if nxt == self.host_index:
                return self._take_over(record, left, exited)
            coordinator, within = record.agents[nxt], LEAVE_S

    def _take_over(self, record: Record, left: set[int], exited: set[int]) -> int:
        """Coordinates from ``record``'s generation on, on this agent's own store, once it
        hears a majority of that generation's agents (`Coordinating.quorum`)."""
        self.cluster = Coordinating(self.host.server, self.host_index, self.host.ip,
                                    after=record, left=left, exited=exited,
                                    now=time.monotonic())
        self.decide.go_on_from(record)
        return self._decide_until_the_end()

    def _stop_here(self, why: str) -> NoReturn:
        """Ends this host's workers and the agent (`CUT_OFF_EXIT_CODE`: the others may go on,
        and when none does the job is relaunched); never returns (see `_follow_one`)."""
        logger.error("%s: ending this host's workers", why)
        self.host.end_all()
        self._exit_now()

    def _exit_now(self) -> NoReturn:
        """Waits for this host's workers, then exits `CUT_OFF_EXIT_CODE` at once. Not a return:
        a hearing thread may be inside a store call that never ends, and the interpreter's exit
        would abort on it (std::terminate)."""
        self.host.finish()
        logging.shutdown()
        sys.stdout.flush()
        os._exit(CUT_OFF_EXIT_CODE)

    def _follow_one(self, coordinator: str, within: float, record: Record | None) -> int | Left:
        """Follows one coordinator until the job's end (its code), or until it exits or is not
        heard for `CUT_OFF_S` (the newest record, which names who comes next: ``record``, the
        one the coordinator before it published, until this one publishes). Heard on a
        thread of its own: a store call over a link that is down blocks until the link comes
        back (torch's store timeout bounds the wait for a key, not a reply that never
        arrives), and this loop must still leave a coordinator that went silent."""
        host = self.host
        cluster = self._connect(coordinator, within)
        cluster.last = record  # a successor that goes before it decides: the next one
        lock = threading.Lock()
        ended: list[int] = []
        gone = threading.Event()
        hearing = threading.Thread(target=self._hear, args=(cluster, lock, ended, gone),
                                   daemon=True, name="inplace-coordinator")
        hearing.start()
        while True:
            with lock:
                host.reap()
                done = bool(ended)
                left = host.leaving and not host.alive
            if left:
                with lock:
                    gone.set()
                self._leave_here()
            if done:
                host.finish()
                hearing.join(1.0)  # its acknowledgement sent: the coordinator may exit
                return ended[0]
            now = time.monotonic()
            exited = cluster.link.closed()
            if not exited and not cluster.heard(now):  # this loop may have woken first
                cluster.read.clear()
                cluster.read.wait(RECHECK_S)
                now = time.monotonic()
            if exited or not cluster.heard(now):  # the next one takes over
                with lock:
                    gone.set()  # the old hearing thread acts on nothing from now on
                if cluster.last is not None and cluster.last.agents:
                    return Left(cluster.last, exited)
                self._stop_here(f"the coordinator ({coordinator}) is "
                                f"{'gone' if exited else 'not heard from'}")
            time.sleep(POLL_S)

    def _connect(self, coordinator: str, within: float) -> Following:
        """The coordinator's store, tried for ``within`` seconds (a successor sets itself up
        just as its followers come). Bounded by a timer too: connecting across a link that is
        down may block past any timeout, and a host that cannot reach the successor is the
        one cut off."""
        why = f"the coordinator ({coordinator}) cannot be reached within {within:g}s"
        watchdog = threading.Timer(within + 0.2, self._stop_here, args=(why,))
        watchdog.daemon = True
        watchdog.start()
        deadline = time.monotonic() + within
        try:
            while True:
                try:
                    return Following(coordinator, self.host_index, time.monotonic(),
                                     self.host.address)
                except Exception as e:
                    if time.monotonic() > deadline:
                        self._stop_here(f"{why}: {e}")
                    time.sleep(0.05)
        finally:
            watchdog.cancel()

    def _hear(self, cluster: Following, lock: threading.Lock, ended: list[int],
              gone: threading.Event) -> None:
        """Sends this host's report and carries out what the coordinator decided, until the
        job's end (its code lands in ``ended``)."""
        host = self.host
        while not gone.is_set():
            with lock:
                report, alive = host.report(), sorted(host.alive)
            try:
                cluster.read_beat(time.monotonic())
                cluster.send(report)
                record = cluster.newest()
                fences = cluster.fences(alive)
                finishing = cluster.finishing()
                code = cluster.ended()
            except Exception as e:  # the coordinator's store does not answer: time counts
                logger.debug("coordinator's store: %s", e)
                if "Broken pipe" in str(e) or "Connection reset" in str(e):
                    return  # torch's store client never reconnects: the cut-off is counted
                time.sleep(POLL_S)
                continue
            with lock:
                if gone.is_set():  # this coordinator died: the next one decides
                    return
                if record is not None:
                    host.mirror(record.generation, record.members, record.store)
                for m, why in fences.items():
                    host.fence([m], why)
                if finishing:
                    host.end_standbys()
                if code is not None:
                    host.end_all()
                    ended.append(code)
            if code is not None:  # acknowledged once `ended` holds it: the coordinator
                cluster.acknowledge()  # exits after this, and its link closes
                return
            time.sleep(POLL_S)


def read_control(host: HostAgent, stream: TextIO | None = None) -> None:
    """``--control-stdin``: the first line is the environment (JSON), set before any worker
    starts; then ``TERM``/``INT`` lines are signals for the workers, ``LEAVE`` removes this
    host from the job (`HostAgent.leave`); EOF means the launch is gone, and the workers are
    ended with the agent."""
    src = stream if stream is not None else sys.stdin
    first = src.readline()
    if first.strip():
        os.environ.update({str(k): str(v) for k, v in json.loads(first).items()})

    def watch() -> None:
        for line in src:
            word = line.strip()
            if word in ("TERM", "INT"):
                host.forward(getattr(signal, f"SIG{word}"))
            elif word == "LEAVE":  # the launch removed this host (its discovery script)
                host.leave_asked = True
        logger.error("the launch is gone (its connection closed): ending this host's workers")
        host.end_all()
        os._exit(1)

    threading.Thread(target=watch, name="inplace-control", daemon=True).start()


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hvd_resilient.launch.inplace_agent",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, required=True, help="workers to start on this machine")
    p.add_argument("--min-np", type=int, default=1,
                   help="fewer live workers (in the whole job) end the job (exit 1) for a "
                        "restart")
    p.add_argument("--last-call", type=float, default=60.0,
                   help="seconds a live worker may take to ask for the next generation before "
                        "it is ended (it asks at its next collective, normally within "
                        "milliseconds of a fault; longer inside an evaluation, which is why "
                        "this is generous; a dead one is dropped at once, a frozen one by "
                        "the heartbeats)")
    p.add_argument("--replace", action="store_true",
                   help="start a new worker for each one lost; it joins once it is up")
    p.add_argument("--standby", type=int, default=0, metavar="K",
                   help="start K more workers (per host) that set up and wait; a lost worker's "
                        "place goes to one of them at once (default 0)")
    p.add_argument("--host-index", type=int, default=None,
                   help="this host's place among the job's hosts (0 coordinates; default: "
                        "$SLURM_NODEID under srun, $JOB_COMPLETION_INDEX in a Kubernetes "
                        "Indexed Job, else 0)")
    p.add_argument("--hosts-count", type=int, default=None,
                   help="how many hosts the job starts on (the coordinator waits for each; "
                        "default: $SLURM_NNODES under srun, else 1)")
    p.add_argument("--job-nproc", type=int, default=None,
                   help="the whole job's first size (default: --nproc on every host)")
    p.add_argument("--address", default=None,
                   help="this host's address as the other hosts reach it (default: this "
                        "machine's hostname across hosts, 127.0.0.1 on one)")
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="the coordinating agent's store (every host but the first)")
    p.add_argument("--etcd", default=None, metavar="URL,URL,...",
                   help="agree on the generations in etcd (its client URLs): every host's agent "
                        "alike, none whose loss ends the job (default: the first host's agent "
                        "coordinates)")
    p.add_argument("--job", default="job",
                   help="the keys' folder in etcd: one per launch (the launch across hosts "
                        "makes it)")
    p.add_argument("--joins", action="store_true",
                   help="hosts may join the running job (a discovery script): every member "
                        "looks for a newer generation at its commits")
    p.add_argument("--late", action="store_true",
                   help="this host joins a job already running: its workers are newcomers, "
                        "taken in at the members' next commit")
    p.add_argument("--control-stdin", action="store_true",
                   help="read the environment and stop requests from stdin (the launch over "
                        "ssh); EOF ends the workers")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the worker command")
    a = p.parse_args(argv)
    a.cmd = worker_command(a.cmd)
    if a.standby < 0:
        raise ConfigError(f"need --standby >= 0, got {a.standby}")
    _place(a, os.environ)
    job = a.job_nproc = a.job_nproc or a.nproc * a.hosts_count
    if a.nproc < 1 or not 1 <= a.min_np <= job:
        raise ConfigError(f"need --nproc >= 1 and 1 <= --min-np <= the job's size, got "
                          f"--nproc {a.nproc} --min-np {a.min_np}")
    if not 0 <= a.host_index < a.hosts_count:
        raise ConfigError(f"need 0 <= --host-index < --hosts-count, got {a.host_index} of "
                          f"{a.hosts_count}")
    if a.etcd is None and (a.coordinator is None) != (a.host_index == 0):
        raise ConfigError("--coordinator is given to every host's agent but the first's")
    if a.late and a.host_index == 0:
        raise ConfigError("--late is for a host that joins a running job, never the first")
    if a.etcd is not None and a.coordinator is not None:
        raise ConfigError("--coordinator and --etcd exclude each other: with etcd no agent "
                          "coordinates")
    return a


def _place(a: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Under `srun --ntasks-per-node 1` (one agent per node), or as a pod of a Kubernetes
    Indexed Job (one agent per pod, docker/k8s/inplace-indexed-job.yaml), each agent finds its
    place in the scheduler's variables, so that one command line serves every node (with
    --etcd: no agent needs another's address)."""
    slurm = "SLURM_NODEID" in env or "SLURM_NNODES" in env
    index = "SLURM_NODEID" if slurm else "JOB_COMPLETION_INDEX"
    try:
        if a.host_index is None:
            a.host_index = int(env.get(index, 0))
        if a.hosts_count is None:
            a.hosts_count = int(env.get("SLURM_NNODES", 1))
    except ValueError as e:
        raise ConfigError(f"{'SLURM_NODEID / SLURM_NNODES' if slurm else index} must be "
                          f"numbers: {e}") from None
    if a.address is None:
        a.address = socket.gethostname() if a.hosts_count > 1 else "127.0.0.1"


@exit_on_error
def main(argv: Sequence[str] | None = None) -> int:
    raise_priority()  # first: threads started later inherit it
    a = parse(sys.argv[1:] if argv is None else argv)
    # the agent speaks as rank 0 does (INFO), and says which host's it is
    log.setup(rank_fn=lambda: 0, who=f"agent h{a.host_index}")
    if a.etcd is not None:
        return _run_agreed(a)
    agent = Agent(a.cmd, a.nproc, a.min_np, a.last_call, a.address, a.replace, a.standby,
                  host_index=a.host_index, hosts=a.hosts_count, coordinator=a.coordinator,
                  job_nproc=a.job_nproc, announce=a.control_stdin or a.hosts_count > 1,
                  joins=a.joins, late=a.late)
    if a.control_stdin:
        read_control(agent.host)
    return agent.run()


def _run_agreed(a: argparse.Namespace) -> int:
    """Every host's agent alike, the generations agreed in etcd (`inplace.agreed`)."""
    try:
        from hvd_resilient.launch.inplace.agreed import EtcdAgent
        from hvd_resilient.launch.inplace.etcd_agreement import EtcdAgreement
    except ImportError as e:
        raise ConfigError(f"--etcd needs etcd's client ({e.name}): pip install "
                          f"'hvd_resilient[etcd]'") from None

    host = HostAgent(a.cmd, a.nproc, host_index=a.host_index, address=a.address,
                     replace=a.replace, standby=a.standby, joins=a.joins, late=a.late)
    if a.control_stdin:
        read_control(host)
    if a.host_index == 0 and a.control_stdin:  # the launch waits for host 0's line
        print(f"{COORDINATOR_LINE} {host.address}", flush=True)
    agreement = EtcdAgreement([u.strip() for u in a.etcd.split(",") if u.strip()], a.job,
                              a.host_index)
    return EtcdAgent(host, Coordinator(a.job_nproc or a.nproc, a.min_np, a.last_call),
                     agreement, a.host_index, a.hosts_count).run()

if __name__ == "__main__":
    sys.exit(main())
