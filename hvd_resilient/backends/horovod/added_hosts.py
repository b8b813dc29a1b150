"""Rank 0 holds an added host's reset back until its standby workers are warm.

Discovery tells rank 0 of an added host at once (Horovod's contract), and Horovod resets at
the next commit. The newcomers, started ahead as standbys
(`launch/horovod/patches/standby_slots.py`), may still be importing torch and Horovod then
(5-20 s on a busy host); a reset at that moment makes the whole old world wait for them in the
rendezvous. So while every pending change is an addition and the driver lists standbys that
have not said READY, rank 0 treats the change as not yet arrived: the old world trains on, and
the reset comes at the first commit after the newcomers are warm (the driver's barrier still
waits for any that are not, as a backstop). A removal is never held: a leaving host must stop
at once. The hold ends after `driver_kv.READY_TIMEOUT_S` whatever the standbys say, and when
the driver does not answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hvd_resilient.backends.horovod import driver_kv

logger = logging.getLogger(__name__)

ADDED = 2
"""Horovod's `HostUpdateResult.added` (an IntFlag: removed 1, added 2, mixed 3)."""
ASK_EVERY_S = 0.2
"""The driver is asked at most this often (a step may be milliseconds)."""


class AddedHostsHold:
    """``holding(updates)``: True while the reset of these pending updates should wait."""

    def __init__(self, warming: Callable[[], list[str] | None] = driver_kv.warming, *,
                 timeout_s: float = driver_kv.READY_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._warming = warming
        self.timeout_s = timeout_s
        self._clock = clock
        self._since: float | None = None
        self._asked_at = -float("inf")
        self._answer = False
        self.held_s: float | None = None
        """How long the last hold lasted (None: nothing was held)."""

    def holding(self, updates: list[int]) -> bool:
        """``updates``: the pending host messages' HostUpdateResults (IntFlags)."""
        if not updates or any(int(u) != ADDED for u in updates):
            return self._end()
        now = self._clock()
        if self._since is not None and now - self._since > self.timeout_s:
            logger.warning("standby workers still not warm after %.0f s; resetting anyway",
                           self.timeout_s)
            return self._end()
        if now - self._asked_at >= ASK_EVERY_S:
            self._asked_at = now
            slots = self._warming()
            self._answer = bool(slots)
            if self._answer and self._since is None:
                self._since = now
                logger.info("hosts added; training on while standby worker(s) %s warm up",
                            ", ".join(slots or ()))
        return self._answer or self._end()

    def _end(self) -> bool:
        if self._since is not None:
            self.held_s = self._clock() - self._since
            logger.info("added hosts held for %.2f s; resetting at this commit", self.held_s)
        self._since, self._answer, self._asked_at = None, False, -float("inf")
        return False
