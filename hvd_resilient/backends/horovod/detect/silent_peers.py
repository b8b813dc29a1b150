"""Horovod's side of the heartbeats: evict a frozen or cut-off peer in seconds.

A peer found silent (`backends/heartbeat`) is handled in three moves, all at once:
1. the driver is told (a PUT into its rendezvous key-value store, scope `LOST_SCOPE`, key the
   slot): it ends that slot's worker, so the reset does not wait for a process that will never
   reach the rendezvous (Horovod re-forms the world only when every worker has failed or
   arrived), and the slot goes through the cooldown like any failure;
2. a peer on this machine is killed outright (SIGKILL works on a stopped process), so it can
   never wake up inside a world that moved on;
3. this rank's Gloo connections are shut down (the hang-up watch's `trip`): the collective it is
   blocked in fails now, and its other peers see hang-ups of their own.
A worker that finds itself frozen, or cut off from its peers and from the driver, exits
(HUNG_EXIT_CODE): the others have given up on it, and it must not train or write beside them.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import urllib.error
import urllib.request
from typing import Any

from hvd_resilient.backends import heartbeat
from hvd_resilient.backends.horovod import slots
from hvd_resilient.backends.horovod.detect import driver_watch
from hvd_resilient.errors import HUNG_EXIT_CODE
from hvd_resilient.log import get

log = get("silent_peers")

LOST_SCOPE = "hvd_resilient_lost"
"""Rendezvous KV scope where workers name the slots they found silent; the driver reads it."""


def slot_key() -> str:
    """This worker's slot as the driver names it: "<HOROVOD_HOSTNAME>:<HOROVOD_LOCAL_RANK>"."""
    return f"{os.environ.get('HOROVOD_HOSTNAME', '')}:{os.environ.get('HOROVOD_LOCAL_RANK', '')}"


def outward_ip(target: tuple[str, int] | None) -> str:
    """The local address on the route to `target` (the driver): where peers can reach us."""
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


def report(peers: list[heartbeat.Peer], address: tuple[str, int] | None) -> None:
    """Names each silent peer's slot to the driver (best effort: the driver's own heartbeat
    of its workers is their ssh sessions; this makes it learn as fast as the workers did)."""
    if address is None:
        return
    for p in peers:
        body = f"{p.pid} {p.machine}".encode()
        req = urllib.request.Request(f"http://{address[0]}:{address[1]}/{LOST_SCOPE}/{p.slot}",
                                     data=body, method="PUT")
        try:
            with urllib.request.urlopen(req, timeout=2):
                pass
        except (urllib.error.URLError, OSError) as e:
            log.warning("could not tell the driver that %s is silent: %s", p.slot, e)


def kill_local(peers: list[heartbeat.Peer], machine: str) -> list[int]:
    """SIGKILLs the silent peers that run on this machine; returns their pids."""
    killed = []
    for p in peers:
        if p.machine == machine and p.pid != os.getpid():
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.append(p.pid)
            except OSError:
                pass
    return killed


class SilentPeers:
    """Built once per worker process; `peer()` goes into the allgather at every (re)start."""

    def __init__(self, timeout_s: float, events: Any, trip: Any) -> None:
        self.events = events
        self.trip = trip
        self.driver = driver_watch.driver_address()
        self.machine = slots.machine()
        self.hb = heartbeat.Heartbeat(
            timeout_s, on_lost=self._lost, on_self_frozen=self._self_frozen,
            on_cut_off=self._cut_off,
            is_cut_off=lambda: self.driver is not None and not heartbeat.probe(self.driver))
        self.address = (outward_ip(self.driver), self.hb.port)

    def peer(self, rank: int) -> heartbeat.Peer:
        return heartbeat.Peer(rank, self.address, self.machine, os.getpid(), slot_key())

    def arm(self, me: int, everyone: list[heartbeat.Peer]) -> int:
        return self.hb.arm(me, everyone)

    def disarm(self) -> None:
        self.hb.disarm()

    def _lost(self, peers: list[heartbeat.Peer], silent_s: float) -> None:
        names = ", ".join(f"rank {p.rank} ({p.slot})" for p in peers)
        log.warning("%s silent for %.1fs: frozen or cut off; evicting", names, silent_s)
        self.events.emit("peer_silent", ranks=[p.rank for p in peers],
                         slots=[p.slot for p in peers], silent_seconds=round(silent_s, 3))
        killed = kill_local(peers, self.machine)
        report(peers, self.driver)
        self.trip(f"{names} silent for {silent_s:.1f}s" + (f"; killed pid {killed}" if killed
                                                            else ""))

    @staticmethod
    def _exit() -> None:
        """No event: the others have moved on, and nothing of an evicted worker may land in
        the run folder beside them (its stderr says why)."""
        logging.shutdown()
        os._exit(HUNG_EXIT_CODE)

    def _self_frozen(self, gap_s: float) -> None:
        log.error("this worker did not run for %.1fs (stopped or starved); its peers have "
                  "evicted it, so it exits (code %d)", gap_s, HUNG_EXIT_CODE)
        self._exit()

    def _cut_off(self, peers: list[heartbeat.Peer]) -> None:
        log.error("ranks %s and the driver are unreachable: this host is cut off; exiting "
                  "(code %d) so that it does not train or write beside the others",
                  [p.rank for p in peers], HUNG_EXIT_CODE)
        self._exit()
