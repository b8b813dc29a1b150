"""What every patch family is handed, and what they tell the driver's entry point back.

One launcher runs per driver process, so one context: the switches read at the entry, the
run's event log (opened on first use: rank -1, not a worker), and what the patches saw that
decides the driver's last line (a worker's fatal stop, an unusable first discovery answer,
launcher threads that ended in an exception). What a family keeps for itself about one of
Horovod's objects (its standbys, the slots whose worker exited) it keeps in a `PerObject` of
its own, never in that object.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from hvd_resilient.errors import one_line
from hvd_resilient.launch.horovod.options import DriverOptions


def masked_line(e: BaseException | str) -> str:
    """An error as one line, credentials masked: what the driver prints or records."""
    from hvd_resilient.masking import mask_text

    return mask_text(one_line(e, limit=10_000))


def slot_key(slot: Any) -> str:
    """A Horovod slot (SlotInfo) as the driver's tables and the store name it: `host:local_rank`."""
    return f"{slot.hostname}:{slot.local_rank}"


def driver_method(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn(driver, ...)` as a function Horovod's class binds: `self` is the driver."""
    def method(self: Any, *args: Any) -> Any:
        return fn(self, *args)

    method.__name__ = method.__qualname__ = fn.__name__
    return method


T = TypeVar("T")


class PerObject(Generic[T]):
    """What a patch family keeps about each of Horovod's objects it serves (the driver, the
    discovery script's object), held by the family instead of written into that object as an
    attribute: Horovod's objects stay as Horovod built them (nothing of ours can collide with
    a name a later release adds, or ride along where Horovod copies or inspects them), and a
    family's state is found beside its code. ``of(obj)`` is that object's state, made by
    ``new()`` at the first ask.

    Keyed by identity, since Horovod's objects need not be hashable (nor can every stand-in of
    the tests be weakly referenced); each entry holds its object, so an identity is never
    reused while its entry lives. A driver process has one driver and one discovery object,
    which live as long as it does."""

    def __init__(self, new: Callable[[], T]) -> None:
        self._new = new
        self._lock = threading.Lock()  # a first ask from two of Horovod's threads at once
        self._entries: dict[int, tuple[object, T]] = {}

    def of(self, obj: object) -> T:
        with self._lock:
            entry = self._entries.get(id(obj))
            if entry is None:
                entry = self._entries[id(obj)] = (obj, self._new())
            return entry[1]


@dataclass
class PatchContext:
    options: DriverOptions = field(default_factory=DriverOptions)
    fatal: str = ""
    """The first worker that exited with FATAL_EXIT_CODE (`host[local_rank]`)."""
    discovery_error: str = ""
    """Why the discovery script's first answer was unusable."""
    thread_errors: list[str] = field(default_factory=list)
    """First lines of the exceptions that ended launcher threads."""
    stopped_by: str = ""
    """The signal that stopped the job (SIGTERM, SIGINT), if one did."""
    exits_after_stop: list[int] = field(default_factory=list)
    """The exit codes of the workers that ended after that signal."""
    _events: Any = field(default=None, repr=False)

    def emit(self, event: str, **fields: Any) -> None:
        """One event in the run's event log (none outside `hvd-resilient run`)."""
        if self._events is None:
            from hvd_resilient.events import EventLog
            from hvd_resilient.fatal_events import EVENTS_FILE

            run_dir = self.options.run_dir
            self._events = EventLog(os.path.join(run_dir, EVENTS_FILE) if run_dir else None,
                                    rank=-1, size=0, step=0)
        self._events.emit(event, **fields)
