"""Durable checkpoints in numbers: their cost, what is at risk now, and how often to take them.

Young/Daly: with C the cost of one checkpoint to training (the median `stall_seconds`, or the
median `seconds` when no stall was measured: a synchronous writer) and MTBF the mean time
between failures (wall / failures, or given), Young's interval sqrt(2*C*MTBF) minimizes the
expected time lost to checkpointing plus rework; Daly's refinement matters only when C is not
small against MTBF. Both are also given in steps at the measured step rate, next to the
configured `checkpoint_every` from the rank-0 `start` config.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, TypeGuard

from hvd_resilient import event_names as ev
from hvd_resilient.events import ckpt_step
from hvd_resilient.report.timeline import Event


@dataclass
class Summary:
    median: float | None
    max: float | None
    total: float

    @staticmethod
    def of(values: Iterable[Any]) -> Summary:
        """Median, max and sum of the finite numbers in `values` (anything else is skipped)."""
        vals = [float(v) for v in values if is_num(v)]
        if not vals:
            return Summary(None, None, 0.0)
        return Summary(statistics.median(vals), max(vals), sum(vals))


@dataclass
class YoungDaly:
    checkpoint_cost_s: float | None
    cost_source: str | None
    """"stall_seconds" or "seconds" (no stall measured)."""
    failures: int
    mtbf_s: float | None
    mtbf_source: str
    """"observed", "given" (from the command line) or "none" (no failures: no suggestion)."""
    young_s: float | None
    daly_s: float | None
    young_steps: float | None
    daly_steps: float | None
    step_rate: float | None
    configured_every_steps: int | None
    configured_every_s: float | None
    restart_failures: int
    """Failures that needed the durable checkpoint; in-process ones only need the last commit."""


def is_num(v: Any) -> TypeGuard[int | float]:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def num(e: Event, key: str) -> float:
    v = e.get(key)
    return float(v) if is_num(v) else 0.0


PUBLISHED = (ev.CHECKPOINT_SAVED, ev.CHECKPOINT_ALREADY_PUBLISHED)
"""The events that leave a checkpoint in the store: saved now, or published already by an
earlier rank 0 (the redo rule's second writer); either is a checkpoint a restart resumes."""


def published(events: list[Event]) -> list[Event]:
    return [e for e in events if e["event"] in PUBLISHED]


def step_of(e: Event) -> int:
    """The step of the checkpoint event `e` is about (`events.ckpt_step`; 0: none)."""
    return ckpt_step(e) or 0


def checkpoint_stats(events: list[Event]) -> dict[str, Any]:
    """Saved, failed, superseded (dropped before upload for a newer one), published already
    (by an earlier rank 0) and skipped (corrupt at a resume, by reason) checkpoints."""
    kinds = Counter(e["event"] for e in events if e["event"].startswith("checkpoint_"))
    saved = [e for e in events if e["event"] == ev.CHECKPOINT_SAVED]
    failed = [e for e in events if e["event"] == ev.CHECKPOINT_FAILED]
    skipped = Counter(str(e.get("reason", "?")) for e in events
                      if e["event"] == ev.CHECKPOINT_SKIPPED)
    upload = [e.get("upload_seconds", e.get("seconds")) for e in saved]
    stalls = [e.get("stall_seconds") for e in saved]
    sizes = [int(e["bytes"]) for e in saved if isinstance(e.get("bytes"), int)]
    newest = max(published(events), key=step_of, default=None)
    return {
        "saved": len(saved), "failed": len(failed), "skipped": dict(skipped),
        "superseded": kinds[ev.CHECKPOINT_SUPERSEDED],
        "already_published": kinds[ev.CHECKPOINT_ALREADY_PUBLISHED],
        "failed_steps": [step_of(e) for e in failed],
        "newest_step": step_of(newest) if newest else None,
        "stall_s": asdict(Summary.of(v for v in stalls if isinstance(v, (int, float)))),
        "seconds": asdict(Summary.of(e.get("seconds") for e in saved)),
        "upload_s": asdict(Summary.of(v for v in upload if isinstance(v, (int, float)))),
        "bytes_last": sizes[-1] if sizes else None, "bytes_total": sum(sizes),
    }


def _step_reached(events: list[Event], step: int) -> float | None:
    """When `step` was (last) reached: its commit, else the snapshot of its checkpoint."""
    best = None
    for e in events:
        if e["step"] == step and e["event"] in (ev.COMMIT, ev.SYNC, ev.RESUME):
            best = e["ts"]
    if best is None:
        for e in events:
            if e["event"] == ev.CHECKPOINT_SAVED and step_of(e) == step:
                best = e["ts"] - num(e, "seconds")
    return best


def current_step(events: list[Event]) -> int:
    """The state's step at the last event (`step`; in older logs a checkpoint event's `step`
    was its snapshot's, so those are passed over). The launcher's own events (rank -1: the
    supervisor's `launcher_exit`, the driver's) hold no state and say step 0: passed over
    too, or every finished run read "at step 0"."""
    for e in reversed(events):
        if e.get("rank", 0) < 0:
            continue
        if not e["event"].startswith("checkpoint_") or "ckpt_step" in e:
            return e["step"]
    return events[-1]["step"] if events else 0


def at_risk(events: list[Event], now: float | None) -> dict[str, Any]:
    """What dying at the last event (and now) would cost: the work since the newest checkpoint."""
    step = current_step(events)
    newest = max(published(events), key=lambda e: (step_of(e), e["ts"]), default=None)
    since = _step_reached(events, step_of(newest)) if newest else None
    since = since if since is not None else events[0]["ts"]
    steps = max(0, step - (step_of(newest) if newest else 0))
    return {
        "newest_checkpoint_step": step_of(newest) if newest else None,
        "steps": steps,
        # no step since the checkpoint: the time after it (an upload, `done`) is not work
        "seconds": max(0.0, events[-1]["ts"] - since) if steps else 0.0,
        "seconds_now": max(0.0, now - since) if now is not None else None,
    }


# -- Young/Daly -------------------------------------------------------------------------------


def young_interval(cost_s: float, mtbf_s: float) -> float:
    """Young (1974): the checkpoint interval that minimizes expected lost time, sqrt(2*C*M)."""
    return math.sqrt(2.0 * cost_s * mtbf_s)


def daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Daly (2006) higher-order estimate; equals Young's to first order when C << M."""
    if cost_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = cost_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * cost_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - cost_s


def young_daly(events: list[Event], wall_s: float, failures: int, restart_failures: int,
               step_rate: float | None, config: dict[str, Any] | None,
               mtbf_s: float | None = None) -> YoungDaly:
    """The suggested checkpoint interval next to the configured one (see the module doc)."""
    saved = [e for e in events if e["event"] == ev.CHECKPOINT_SAVED]
    stalls = [float(e["stall_seconds"]) for e in saved
              if isinstance(e.get("stall_seconds"), (int, float))]
    secs = [float(e["seconds"]) for e in saved if isinstance(e.get("seconds"), (int, float))]
    cost, source = None, None
    if any(s > 0 for s in stalls):
        cost, source = statistics.median(stalls), "stall_seconds"
    elif secs:
        cost, source = statistics.median(secs), "seconds"
    n = failures
    if mtbf_s is not None:
        mtbf, msource = mtbf_s, "given"
    elif n and wall_s > 0:
        mtbf, msource = wall_s / n, "observed"
    else:
        mtbf, msource = None, "none"
    young = young_interval(cost, mtbf) if cost and mtbf else None
    daly = daly_interval(cost, mtbf) if cost and mtbf else None
    config = config or {}
    section = config.get("checkpoint")  # the start event records the config by section
    every = section.get("every") if isinstance(section, dict) else None
    every = int(every) if isinstance(every, int) else None
    return YoungDaly(
        checkpoint_cost_s=cost, cost_source=source, failures=n, mtbf_s=mtbf,
        mtbf_source=msource, young_s=young, daly_s=daly,
        young_steps=young * step_rate if young is not None and step_rate else None,
        daly_steps=daly * step_rate if daly is not None and step_rate else None,
        step_rate=step_rate, configured_every_steps=every,
        configured_every_s=every / step_rate if every and step_rate else None,
        restart_failures=restart_failures,
    )
