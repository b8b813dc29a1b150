"""A member busy in a declared section says so, so that the agent does not end it.

After a fault the agent publishes the next generation once every live member asked for it,
and ends a member that did not ask within `--last-call` (60 s). A member asks when a
collective fails, so one inside a long evaluation (every rank evaluating on its own shard, no
collective) when a peer died could not ask before the evaluation ended, and a healthy member,
often every survivor at once, was ended with the culprit: the job fell below `--min-np` and
restarted. The watchdog already knows such phases (`progress.section`): while the worker is
in one, this thread renews `busy/<member>` in the agent's store, and the agent's last call
waits for a member whose time is fresh. A member that stops renewing (frozen, stuck holding
the interpreter lock) is waited for no longer; the watchdog ends one that overruns its
section's budget; the heartbeats find a frozen one.

Its own connection to the store: the training thread's may be inside a long wait.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from torch._C._distributed_c10d import PrefixStore

from hvd_resilient.backends.inplace.membership import (
    BUSY_EVERY_S,
    PREFIX,
    agent_store,
    busy_key,
)
from hvd_resilient.detect import progress


class BusyReporter:
    def __init__(self, member: int, *, section: Callable[[], str] = progress.declared_section,
                 every_s: float = BUSY_EVERY_S, store_timeout_s: float = 30.0) -> None:
        self.member, self.section, self.every_s = member, section, every_s
        self.store_timeout_s = store_timeout_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: PrefixStore | None = None

    def start(self) -> BusyReporter:
        # Connected now, not at the first section: a connection opened at some later reset
        # made this process's descriptors grow by one between generations (the 50-generation
        # leak test failed so, at random: a short section is seen only when a tick hits it).
        self._store = self._connect()
        self._thread = threading.Thread(target=self._run, name="hvdr-inplace-busy",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.every_s + 1)

    def _connect(self) -> PrefixStore | None:
        try:
            return PrefixStore(PREFIX, agent_store(dict(os.environ), self.store_timeout_s))
        except Exception:  # noqa: BLE001 - the agent gone: the job ends anyway
            return None

    def _run(self) -> None:
        store = self._store
        while not self._stop.wait(self.every_s):
            if not self.section():
                continue
            if store is None and (store := self._connect()) is None:
                continue
            try:
                store.set(busy_key(self.member), f"{time.time():.3f}")
            except Exception:  # noqa: BLE001 - the agent gone: the job ends anyway
                store = None
