"""The horovodrun driver's key-value store as its workers reach it: the standby protocol's keys
(a standby says it is READY, the driver gives its GO, the driver lists the standbys still
WARMING and the NEXT_SLOTS of a host change) and the HTTP calls on them.

The store is Horovod's rendezvous server (`HOROVOD_GLOO_RENDEZVOUS_ADDR`/`PORT`), which every
elastic worker is given; Horovod clears it at each rendezvous, so whoever writes a key writes it
again (the driver its WARMING list after each rendezvous; a standby's READY is kept across it
by the driver, and said again by the standby every 0.2 s all the same).
Here, below `launch/`, because a training worker (rank 0 deciding when to reset) reads it too.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
from collections.abc import Mapping

READY = "hvd_resilient_standby_ready"
"""Scope: one key per standby (`host:local_rank`), PUT by the standby once its imports are done."""
GO = "hvd_resilient_standby_go"
"""Scope: one key per standby, set by the driver when it releases the standby into a world."""
WARMING = "hvd_resilient_standby_warming"
"""Scope: key `slots`, the driver's standbys not yet released, comma-separated."""
WARMING_KEY = "slots"
NEXT_SLOTS = "hvd_resilient_next_slots"
"""Scope: key `slots`, the slots of the world the driver forms at the host change it is about
to announce, comma-separated (`launch/horovod/patches/next_slots.py`)."""
NEXT_SLOTS_KEY = "slots"
READY_TIMEOUT_S = 120.0
"""How long a standby's warm-up is waited for, by the driver's reset and by rank 0's hold."""


def address(env: Mapping[str, str] = os.environ) -> tuple[str, str] | None:
    addr, port = env.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), env.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    return (addr, port) if addr and port else None


def url(scope: str, key: str, env: Mapping[str, str] = os.environ) -> str:
    where = address(env)
    if where is None:
        raise KeyError("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    return f"http://{where[0]}:{where[1]}/{scope}/{key}"


def get(url: str, timeout: float = 5.0) -> bytes | bool | None:
    """The value; False when the driver says there is none; None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            value: bytes = r.read()
            return value
    except urllib.error.HTTPError:
        return False
    except (urllib.error.URLError, OSError):
        return None


def put(url: str, value: bytes = b"1", timeout: float = 5.0) -> None:
    """A driver that does not answer is noticed by whoever waits on it, not here."""
    req = urllib.request.Request(url, data=value, method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            pass
    except (urllib.error.URLError, OSError):
        pass


def warming(env: Mapping[str, str] = os.environ, timeout: float = 2.0) -> list[str] | None:
    """The driver's standbys that are still importing (listed and not READY); None when the
    driver does not answer (or this is not an elastic worker): nothing is known to wait for."""
    if address(env) is None:
        return None
    listed = get(url(WARMING, WARMING_KEY, env), timeout)
    if listed is None:
        return None
    if not isinstance(listed, bytes) or not listed:
        return []
    return [s for s in _slots(listed) if get(url(READY, s, env), timeout) is False]


def next_slots(env: Mapping[str, str] = os.environ, timeout: float = 2.0) -> set[str] | None:
    """The slots of the world the driver forms at its latest host change; None when it did
    not say (no such change since the last rendezvous, or no driver answering)."""
    if address(env) is None:
        return None
    listed = get(url(NEXT_SLOTS, NEXT_SLOTS_KEY, env), timeout)
    if not isinstance(listed, bytes) or not listed:
        return None
    return set(_slots(listed))


def _slots(listed: bytes) -> list[str]:
    """The slot keys of a comma-separated list the driver wrote."""
    return [s for s in listed.decode(errors="replace").split(",") if s]
