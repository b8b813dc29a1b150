"""The `fatal` event: an error no restart fixes, written once to the run's event log.

A worker records it (the trainer, or `exit_on_error` at the script's entry point), and three
places decide from it: that entry point (record it once, not again), the Horovod driver (say
nothing more of a job a worker stopped: the worker said why) and the supervisor (do not
relaunch; print the first one, once). All of them read it through `fatal_events`, so what
counts as "a fatal error since then" is decided in one place.
"""

from __future__ import annotations

import os
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.events import EventLog, read_events, read_recent_events

EVENTS_FILE = "events.jsonl"
"""The run's event log, inside its run folder."""

TAIL_BYTES = 1 << 20
"""How much of the log's end "did anyone record one since I started" reads."""


def fatal_events(path: str | os.PathLike[str], since: float, *,
                 tail_bytes: int | None = TAIL_BYTES) -> list[dict[str, Any]]:
    """The `fatal` events recorded at or after `since` (unix seconds), oldest first.

    ``tail_bytes``: read only the log's last bytes, which is where a process that started at
    `since` finds what was written since; None reads the whole log (the supervisor: after a
    rank's fatal error the other ranks may train on and write far more than the tail)."""
    events = read_events(path) if tail_bytes is None else read_recent_events(path, tail_bytes)
    return [e for e in events if e["event"] == ev.FATAL and e["ts"] >= since]


def record_fatal(run_dir: str, error: str, since: float, *, rank: int | None,
                 size: int | None) -> bool:
    """Appends a `fatal` event with `error` to the run folder's event log, unless one with this
    error was recorded since `since` (the trainer records its own); True once it is there.
    ``rank``/``size``: the launcher's, None when unknown (no backend is up at this point)."""
    if not run_dir:
        return False
    path = os.path.join(run_dir, EVENTS_FILE)
    try:
        if any(e.get("error") == error for e in fatal_events(path, since)):
            return True
        EventLog(path, rank=-1 if rank is None else rank, size=size or 0, step=-1).emit(
            ev.FATAL, error=error, restartable=False, pid=os.getpid(),
            rank_source="launcher environment")
        return True
    except Exception:  # a full disk or a vanished run folder: the caller prints the line
        return False
