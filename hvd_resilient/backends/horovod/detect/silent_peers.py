"""Horovod elastic's answer to a silent peer: tell the driver, fail the collectives now.

Horovod re-forms the world only when every worker has failed or reached the rendezvous; a
frozen worker does neither. So the detecting rank PUTs the silent slot into the driver's
rendezvous key-value store (scope `LOST_SCOPE`), where the project's driver
(`launch/horovod/evict.py`) ends that slot's worker at once, and trips the hang-up watch so
that its own blocked collective fails and its peers see hang-ups. The rest (the event, killing
a silent peer on this machine) is `backends/silent_peers.py`.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Callable

from hvd_resilient.backends import heartbeat
from hvd_resilient.log import get

log = get("silent_peers")

LOST_SCOPE = "hvd_resilient_lost"
"""Rendezvous KV scope where workers name the slots they found silent; the driver reads it."""


def slot_key() -> str:
    """This worker's slot as the driver names it: "<HOROVOD_HOSTNAME>:<HOROVOD_LOCAL_RANK>"."""
    return f"{os.environ.get('HOROVOD_HOSTNAME', '')}:{os.environ.get('HOROVOD_LOCAL_RANK', '')}"


def report(peers: list[heartbeat.Peer], address: tuple[str, int] | None) -> None:
    """Names each silent peer's slot to the driver (best effort)."""
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


def evictor(driver: tuple[str, int] | None,
            trip: Callable[[str], None]) -> Callable[[list[heartbeat.Peer], str], None]:
    def evict(peers: list[heartbeat.Peer], detail: str) -> None:
        report(peers, driver)
        trip(detail)

    return evict
