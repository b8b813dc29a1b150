"""Horovod elastic's answer to a silent peer: tell the driver, fail the collectives now.

Horovod re-forms the world only when every worker has failed or reached the rendezvous; a
frozen worker does neither. So the detecting rank PUTs the silent slot into the driver's
rendezvous key-value store (scope `LOST_SCOPE`), where the project's driver
(`launch/horovod/patches/evict.py`) ends that slot's worker at once, and trips the hang-up
watch so that its own blocked collective fails and its peers see hang-ups. The rest (the
event, killing a silent peer on this machine) is `detect/silent_peers.py`.
"""

from __future__ import annotations

import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from hvd_resilient.detect import heartbeat

logger = logging.getLogger(__name__)

LOST_SCOPE = "hvd_resilient_lost"
"""Rendezvous KV scope where workers name the slots they found silent; the driver reads it."""


def slot_key() -> str:
    """This worker's slot as the driver names it: "<HOROVOD_HOSTNAME>:<HOROVOD_LOCAL_RANK>"."""
    return f"{os.environ.get('HOROVOD_HOSTNAME', '')}:{os.environ.get('HOROVOD_LOCAL_RANK', '')}"


def report(peers: list[heartbeat.Peer], address: tuple[str, int] | None,
           reporter: str = "") -> None:
    """Names each silent peer's slot to the driver (best effort), and who names it: the
    driver ignores a report from a slot it has already ended
    (`launch/horovod/patches/evict.py`)."""
    if address is None:
        return
    for p in peers:
        body = f"{p.pid} {p.machine} {reporter or '-'} {os.getpid()}".encode()
        req = urllib.request.Request(f"http://{address[0]}:{address[1]}/{LOST_SCOPE}/{p.slot}",
                                     data=body, method="PUT")
        try:
            with urllib.request.urlopen(req, timeout=2):
                pass
        except (urllib.error.URLError, OSError) as e:
            logger.warning("could not tell the driver that %s is silent: %s", p.slot, e)


def evicted(address: tuple[str, int] | None, slot: str, pid: int) -> bool | None:
    """True when a peer has named this process (its slot and pid) silent to the driver; None
    when the driver cannot be asked (no driver, or not reachable from here right now).

    A worker cut off for a moment (a partition that heals within seconds) has not yet found
    itself cut off when its link returns; its collectives then fail on its peers' hang-ups as
    if it were a survivor. Asked before it records anything, this tells it that the others
    already went on without it."""
    if address is None or not slot:
        return None
    url = f"http://{address[0]}:{address[1]}/{LOST_SCOPE}/{slot}"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            fields = r.read().decode(errors="replace").split()
    except urllib.error.HTTPError:  # 404: never named
        return False
    except (urllib.error.URLError, OSError):
        return None
    return bool(fields) and fields[0] == str(pid)


ASK_S = 3.0
"""How long a worker whose collective failed keeps asking a driver it cannot reach whether it
was evicted: a link that just came back answers "host unreachable" at once for a moment (the
neighbour entries that failed during the cut have not been renewed yet)."""

ARBITRATION_S = 1.0
"""How long a worker that finds every watched peer silent waits for the others' verdict on
itself before it reports them: it is more likely the one cut off (from its peers but not from
the driver, or its link just came back), and they report it at the same timeout."""


def evicted_within(address: tuple[str, int] | None, slot: str, pid: int, seconds: float, *,
                   until_answer: bool = False, poll_s: float = 0.1) -> bool:
    """`evicted`, asked until it says yes (or, `until_answer`, until the driver answers at
    all) or `seconds` have passed. No driver at all: False at once."""
    if address is None or not slot:
        return False
    deadline = time.monotonic() + seconds
    while True:
        answer = evicted(address, slot, pid)
        if answer or (until_answer and answer is not None) or time.monotonic() >= deadline:
            return bool(answer)
        time.sleep(poll_s)


class DriverEvict:
    """The Horovod answer to silent peers: name them to the driver, fail this rank's
    collectives. Before either, `evicted_first` asks whether this worker is the one its peers
    evicted (then it must exit without writing): a worker that hears none of its peers any
    more gives their verdict `ARBITRATION_S` to arrive, so that the side cut off does not name
    the healthy majority (the driver would end them all)."""

    def __init__(self, driver: tuple[str, int] | None, slot: str,
                 trip: Callable[[str], None]) -> None:
        self.driver, self.slot, self.trip = driver, slot, trip

    def evicted_first(self, peers: list[heartbeat.Peer], alone: bool) -> bool:
        wait = ARBITRATION_S if alone and len(peers) >= 2 else 0.0
        return evicted_within(self.driver, self.slot, os.getpid(), wait)

    def __call__(self, peers: list[heartbeat.Peer], detail: str) -> None:
        report(peers, self.driver, self.slot)
        self.trip(detail)
