"""A hosts file the discovery script reads, watched: the script runs the moment it changes.

Horovod runs the discovery script once a second, so a host added to or removed from a hosts
file waits 0-1 s (0.5 s on average) before anything moves: half of a warm scale-up's second.
Polling faster runs the script that much more often (a Python script is 50-120 ms of a core
here, a run). With `--discovery-watch FILE` (HVD_RESILIENT_DISCOVERY_WATCH) the driver looks
at FILE's identity (inode, size, modification time) every `TICK_S` instead, which costs a
`stat`, and runs the script once that identity has changed and then held still for one tick
(an editor that rewrites the file in place is read once it is done, not half-written). The
script still runs at the interval as well (Horovod's 1 s, or HVD_RESILIENT_DISCOVERY_INTERVAL),
so a script that reads more than the file misses nothing it saw before.

Horovod's discovery thread is left as it is, only woken every tick: between runs the script's
last answer is handed back, which Horovod sees as "no change". A failing run is retried at the
interval, not every tick, with the last good answer kept meanwhile (Horovod keeps its hosts on
a failure too, and would warn twenty times a second).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hvd_resilient.backends.horovod import compat
from hvd_resilient.launch.horovod.patches.context import PatchContext, PerObject

TICK_S = 0.05
"""How often the file is looked at (Horovod's discovery loop wakes this often)."""

Identity = tuple[int, int, int] | None


def identity(path: str) -> Identity:
    """What changes when the file is written or replaced; None while it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class Pace:
    """When the script is due: at the interval, or once the file changed and held still."""

    def __init__(self, path: str, interval_s: float, clock: Any = time.monotonic) -> None:
        self.path, self.interval_s, self.clock = path, interval_s, clock
        self.ran_at: float | None = None
        self.ran_on: Identity = None
        self.seen: Identity = None

    def due(self) -> bool:
        now, seen = self.clock(), identity(self.path)
        held_still, self.seen = seen == self.seen, seen
        if self.ran_at is None or now - self.ran_at >= self.interval_s:
            return True
        return seen != self.ran_on and held_still

    def ran(self) -> None:
        """Called as a run starts: a write during the run is a change after it."""
        self.ran_at, self.ran_on = self.clock(), self.seen


@dataclass
class Watched:
    """One discovery object's script, as the watch paces it."""

    pace: Pace
    text: str | None = None
    """The script's last answer, handed back between runs (None: it never answered)."""


def paced(run: Callable[[Any], str], path: str, interval_s: float,
          clock: Callable[[], float] = time.monotonic) -> Callable[[Any], str]:
    """`HostDiscoveryScript._execute_discovery_script` run only when due; `run` is the one
    in place (discovery_check's). ``clock``: the pace's (a test's stand-in)."""
    watched: PerObject[Watched] = PerObject(lambda: Watched(Pace(path, interval_s, clock)))

    def execute(self: Any) -> str:
        state = watched.of(self)
        if not state.pace.due() and state.text is not None:
            return state.text
        state.pace.ran()
        text = run(self)  # raises on a failure: Horovod warns, keeps its hosts
        state.text = text
        return text

    return execute


def install(ctx: PatchContext) -> None:
    from horovod.runner.elastic import discovery, driver

    path = ctx.options.discovery_watch
    assert path, "installed only with a watched file"
    interval_s = ctx.options.discovery_interval_s or driver.DISCOVER_HOSTS_FREQUENCY_SECS
    run = discovery.HostDiscoveryScript._execute_discovery_script
    compat.replace(discovery.HostDiscoveryScript, "_execute_discovery_script",
                   paced(run, path, interval_s))
    compat.replace(driver, "DISCOVER_HOSTS_FREQUENCY_SECS", min(TICK_S, interval_s))
