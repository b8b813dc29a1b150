"""What a worker does when its heartbeats find a peer silent (`detect/heartbeat.py`).

For a silent peer, the same everywhere: record `peer_silent`, SIGKILL the silent peers that
run on this machine (SIGKILL works on a stopped process, so it can never wake up inside a world
that moved on). Then it depends on what the launcher can do:
- Horovod elastic (`evict` given): the driver is told which slots to end and this rank's
  collectives are failed at once, so the job resets in memory without them;
- everything else (torchrun, mpirun, a static Horovod job): this worker exits with
  HUNG_EXIT_CODE; a dead worker is what those launchers already handle (torchrun restarts
  its workers now rather than after the process-group timeout, mpirun ends the job and
  `hvd-resilient run` relaunches it).
A worker that finds itself frozen, or cut off from its peers and from the launcher's
coordinator, exits without writing anything: the others have moved on without it. Under the
launchers that restart every worker, a peer on this machine whose process ended is reported at
the next ping (`peer_exited`) and this worker exits as for a silent one: under mpirun nothing
else would end it.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any, Protocol

from hvd_resilient import event_names as ev
from hvd_resilient.detect import heartbeat
from hvd_resilient.errors import HUNG_EXIT_CODE, exit_now

logger = logging.getLogger(__name__)


class Evict(Protocol):
    """What a launcher that can drop workers in place does with silent peers."""

    def evicted_first(self, peers: list[heartbeat.Peer], alone: bool) -> bool:
        """True when the others evicted this worker (it is the frozen or cut-off one);
        `alone`: `peers` are every peer it watches."""

    def __call__(self, peers: list[heartbeat.Peer], detail: str) -> None:
        """Drops `peers` and makes this rank's collectives fail now."""


def kill_local(peers: list[heartbeat.Peer], machine: str, view: str) -> list[int]:
    """SIGKILLs the silent peers that run on this machine; returns their pids."""
    killed = []
    for p in peers:
        if heartbeat.same_host(p, machine, view) and p.pid != os.getpid():
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
            except OSError:
                pass
    return killed


def outward_ip(target: tuple[str, int] | None) -> str:
    """The local address on the route to `target` (the driver or store): where peers can
    reach this worker."""
    import socket

    if target is None:
        return "127.0.0.1"
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(target)  # UDP: no packet is sent, only the route is chosen
        return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


class SilentPeers:
    """Built once per worker process; `peer()` goes into the allgather at every (re)start.
    A `detect.Detector` (what it offers the others: where its heartbeats answer)."""

    name = "heartbeats"

    def __init__(self, timeout_s: float, events: Any, *, machine: str, slot: str,
                 coordinator: tuple[str, int] | None, evict: Evict | None = None,
                 quiet_for: Callable[[int], float | None] = lambda rank: None) -> None:
        """`quiet_for(rank)`: seconds since data last came from that rank over the job's own
        connections (`GlooWatch.quiet_for`), so a peer still sending is never evicted as
        silent."""
        self.events = events
        self.machine, self.slot = machine, slot
        self.coordinator = coordinator
        self.evict = evict
        self.hb = heartbeat.Heartbeat(
            timeout_s, on_lost=self._lost, on_self_frozen=self._self_frozen,
            on_cut_off=self._cut_off,
            is_cut_off=lambda: coordinator is not None and not heartbeat.probe(coordinator),
            machine=machine, quiet_for=quiet_for,
            on_gone=self._gone if evict is None else None)
        self.address = (outward_ip(coordinator), self.hb.port)

    def peer(self, rank: int) -> heartbeat.Peer:
        return heartbeat.Peer(rank, self.address, self.machine, os.getpid(), self.slot,
                              self.hb.view)

    def offer(self, rank: int) -> heartbeat.Peer:
        return self.peer(rank)

    def arm(self, me: int, everyone: list[heartbeat.Peer]) -> int:
        return self.hb.arm(me, everyone)

    def disarm(self) -> None:
        self.hb.disarm()

    def _lost(self, peers: list[heartbeat.Peer], silent_s: float) -> None:
        names = ", ".join(f"rank {p.rank} ({p.slot or p.machine})" for p in peers)
        if self.evict is not None and self.evict.evicted_first(
                peers, len(peers) == self.hb.watching()):
            logger.error("%s silent, but the others evicted this worker first (it is the one cut "
                      "off or frozen); exiting (code %d) without writing", names, HUNG_EXIT_CODE)
            self._exit()
        logger.warning("%s silent for %.1fs: frozen or cut off; evicting", names, silent_s)
        self.events.emit(ev.PEER_SILENT, ranks=[p.rank for p in peers],
                         slots=[p.slot for p in peers], silent_seconds=round(silent_s, 3))
        killed = kill_local(peers, self.machine, self.hb.view)
        detail = f"{names} silent for {silent_s:.1f}s" + (f"; killed pid {killed}" if killed
                                                           else "")
        if self.evict is not None:
            self.evict(peers, detail)
            return
        logger.error("%s; exiting (code %d) so that the launcher restarts the job now",
                  detail, HUNG_EXIT_CODE)
        self._exit()

    def _gone(self, peers: list[heartbeat.Peer]) -> None:
        """A peer on this machine ended (SIGKILL, the OOM killer, a crash): under a launcher
        that restarts every worker, this one's collectives may never fail (MPI's do not), so
        it leaves now and the launcher restarts the job at once."""
        names = ", ".join(f"rank {p.rank} (pid {p.pid})" for p in peers)
        self.events.emit(ev.PEER_EXITED, ranks=[p.rank for p in peers],
                         pids=[p.pid for p in peers])
        logger.error("%s ended; exiting (code %d) so that the launcher restarts the job now",
                     names, HUNG_EXIT_CODE)
        self._exit()

    @staticmethod
    def _exit() -> None:
        exit_now(HUNG_EXIT_CODE)

    def _self_frozen(self, gap_s: float) -> None:
        """No event: the others have moved on, and nothing of an evicted worker may land in
        the run folder beside them (its stderr says why)."""
        logger.error("this worker did not run for %.1fs (stopped or starved); its peers have "
                  "evicted it, so it exits (code %d)", gap_s, HUNG_EXIT_CODE)
        self._exit()

    def _cut_off(self, peers: list[heartbeat.Peer]) -> None:
        logger.error("ranks %s and the coordinator are unreachable: this host is cut off; "
                  "exiting (code %d) so that it does not train or write beside the others",
                  [p.rank for p in peers], HUNG_EXIT_CODE)
        self._exit()
