"""The JSONL event log: the one record of what a run went through.

Every rank that has something to say appends to the same file (a shared filesystem across
hosts). Each event is one `os.write` of one line to a file opened with O_APPEND, so lines from
different processes never interleave; a reader skips a torn last line (a process killed
mid-write) instead of failing. Benchmarks and `hvd-resilient report` read only this file.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hvd_resilient.masking import MASK, is_secret_name, mask_text


def _clean(value: Any) -> Any:
    """JSON-safe (non-finite floats become null) and free of credentials: secret-named keys
    are masked and every string goes through `masking.mask_text` (a URL's user:password@),
    whatever a caller passes: the last line of defence before the shared log."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, dict):
        return {k: (MASK if is_secret_name(str(k)) and v not in (None, "") else _clean(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    return mask_text(str(value))  # what json.dumps(default=str) would write, masked


LEASE_EPOCH_ENV = "HVD_RESILIENT_CHECKPOINT_LEASE_EPOCH"
"""Where `hvd-resilient run` puts its job's lease epoch (the workers' checkpoint.lease_epoch)."""

RESERVED = ("ts", "event", "rank", "size", "step")
"""The keys `EventLog.emit` fills in itself; a field of one of these names is refused. `step`
is always the training step at the time of the event: a checkpoint's own step is `ckpt_step`."""


def ckpt_step(record: dict[str, Any]) -> int | None:
    """The step of the checkpoint (or memory commit) an event is about, in logs of any version:
    `ckpt_step`; else `at_step` (memory tier events before it); else `step` (checkpoint events
    before it wrote their checkpoint's step there). None when none is an int."""
    for key in ("ckpt_step", "at_step", "step"):
        v = record.get(key)
        if type(v) is int:
            return v
    return None


class EventLog:
    """Appends events with the fixed keys `ts`, `event`, `rank`, `size`, `step` (`RESERVED`)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        rank: Callable[[], int] | int = 0,
        size: Callable[[], int] | int = 1,
        step: Callable[[], int] | int | None = None,
        lease_epoch: int | None = None,
    ) -> None:
        """``lease_epoch``: the run's lease epoch of the job writing (`run_lease.py`), carried
        by each of its events, so that a reader tells the jobs of one run apart. None: the one
        `hvd-resilient run` gave this process (`LEASE_EPOCH_ENV`), so that the events of the
        Horovod driver and of custom loops carry it too; 0: none."""
        self.path = Path(path) if path else None
        if lease_epoch is None:
            given = os.environ.get(LEASE_EPOCH_ENV, "")
            lease_epoch = int(given) if given.isdigit() else 0
        self.lease_epoch = lease_epoch
        self._rank = rank
        self._size = size
        self.step_source = step
        """Where `step` comes from; an ElasticState fills it in when it is left unset."""
        self._last = (-1, -1)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def _value(v: Callable[[], int] | int) -> int:
        try:
            return int(v() if callable(v) else v)
        except Exception:  # a size() before init or after shutdown must not break logging
            return -1

    def _rank_size(self) -> tuple[int, int]:
        """While Horovod is down (a reset) a background thread's event (the checkpoint writer's)
        keeps the rank and size this process last had, not -1: readers filter on rank 0."""
        rank, size = self._value(self._rank), self._value(self._size)
        if rank < 0 or size < 0:
            return self._last
        self._last = (rank, size)
        return rank, size

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        """Writes one event. ``event`` is a constant of `event_names` (the catalogue every
        reader imports; a unit test holds the emitters to it). A field named like a fixed key
        (`RESERVED`) is a programming error, a ValueError: it would overwrite what every reader
        relies on (`step`: the training step)."""
        clash = [k for k in RESERVED if k in fields]
        if clash:
            raise ValueError(f"event {event!r}: field {clash[0]!r} is reserved "
                             f"(the event log's own {', '.join(RESERVED)})")
        rank, size = self._rank_size()
        record: dict[str, Any] = {
            "ts": time.time(),
            "event": event,
            "rank": rank,
            "size": size,
            "step": self._value(self.step_source if self.step_source is not None else 0),
        }
        if self.lease_epoch:
            record["lease_epoch"] = self.lease_epoch
        record.update(_clean(fields))
        if self.path is not None:
            line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
        return record


def read_events(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yields every well-formed event; torn or foreign lines are skipped, never raised."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        for raw in fh:
            if not raw.endswith(b"\n"):
                break  # a torn last line: the writer died mid-write or is writing now
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and "event" in rec and "ts" in rec:
                yield rec


def read_recent_events(path: str | os.PathLike[str],
                       max_bytes: int = 1 << 20) -> Iterator[dict[str, Any]]:
    """Like `read_events`, over the last `max_bytes` of the file only (a long run's log can be
    large; "did anyone report X since I started" needs only its end)."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        size = os.fstat(fh.fileno()).st_size
        if size > max_bytes:
            fh.seek(size - max_bytes)
            fh.readline()  # most likely a partial line
        for raw in fh:
            if not raw.endswith(b"\n"):
                break
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and "event" in rec and "ts" in rec:
                yield rec
