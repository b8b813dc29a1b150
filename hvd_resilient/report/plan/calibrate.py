"""Measured inputs from a run folder's event log.

What a log can give, and what it cannot: the log has no event at the moment of a fault, only
when survivors noticed it. So "fault -> noticed" (detection) is not in it, and stays the
benchmarks' number (`bench/recovery.py` knows its own injection times); "noticed -> training
again" (recovery), the stall when a host joins or leaves, the delay before a crashed worker's
host is back, the commit and checkpoint stalls, the checkpoint size, the step time, full
restarts and throughput by world size all are. Each value keeps its samples, so a plan draws
recoveries as they happened (a rare 30 s stall weighs in at its real frequency), and says
"measured: <run folder>, n samples" next to it.

Failure *rates* are not taken from a run folder: a benchmark's faults are injected, and even a
real run of days says little about a month at another scale. The observed counts are reported
instead (`Calibration.observed`).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.errors import ConfigError
from hvd_resilient.events import read_events
from hvd_resilient.report.analysis import Report, analyze
from hvd_resilient.report.plan.model import Value
from hvd_resilient.report.timeline import Episode, Launch, normalize, parse

logger = logging.getLogger(__name__)

EVENTS_FILE = "events.jsonl"


@dataclass
class Calibration:
    """What one run folder measured, ready for `Inputs.defaults(measured=...)`."""

    source: str
    stack: str
    """The strategy the run used: its recovery costs calibrate that strategy's inputs."""
    measured: dict[str, Value] = field(default_factory=dict)
    capacity_by_size: dict[int, float] = field(default_factory=dict)
    observed: dict[str, Any] = field(default_factory=dict)
    """Counts seen in the log (failures, joins, restarts, wall time, world size)."""
    notes: list[str] = field(default_factory=list)


def _value(samples: list[float], where: str, what: str, mean: bool = False) -> Value:
    """A measured value: the median of `samples` (the mean for stalls that add up)."""
    xs = [float(x) for x in samples]
    v = statistics.fmean(xs) if mean else statistics.median(xs)
    return Value(v, f"measured: {where}, {len(xs)} {what}", tuple(xs))


def read(path: str | Path) -> tuple[list[dict[str, Any]], Path]:
    """The normalized events of a run folder (or of an events file)."""
    target = Path(path)
    file = target / EVENTS_FILE if target.is_dir() else target
    if not file.is_file():
        raise ConfigError(f"plan: no event log at {file}")
    try:
        events = normalize(read_events(file))
    except OSError as e:
        raise ConfigError(f"plan: cannot read {file}: {e.strerror or e}") from None
    if not events:
        raise ConfigError(f"plan: no events in {file} (empty, or nothing but a torn line)")
    return events, file


def stack_of(launches: list[Launch], events: list[dict[str, Any]]) -> str:
    """Which strategy the run used, from rank 0's `start` (config.stack of the goodput bench,
    else the trainer's backend)."""
    for launch in launches:
        cfg = launch.config or {}
        if cfg.get("stack") == "vanilla":
            return "vanilla-horovod"
        if cfg.get("stack") == "ours":
            return "ours"
    backend = next((e.get("backend") for e in events if e["event"] == ev.START
                    and isinstance(e.get("backend"), str)), "horovod")
    return "ours-torchrun" if backend == "torchrun" else "ours"


def _episodes(launches: list[Launch]) -> list[Episode]:
    return [ep for lch in launches for ep in lch.episodes]


def calibrate(path: str | Path, gloo_timeout_s: float = 30.0) -> Calibration:
    """Measured inputs from the run folder at `path` (see the module docstring)."""
    events, file = read(path)
    where = str(file.parent if file.name == EVENTS_FILE else file)
    report = analyze(events)
    launches, restarts = parse(events)
    stack = stack_of(launches, events)
    cal = Calibration(source=where, stack=stack)
    m = cal.measured
    prefix = {"ours": "ours", "vanilla-horovod": "vanilla"}.get(stack)

    sizes = {n: rate for n, t in report.throughput_by_size.items()
             if (rate := t.get("steps_per_s"))}
    if sizes:  # at full size: a smaller world steps faster on a shared machine
        full = max(sizes)
        m["step_s"] = Value(1.0 / sizes[full], f"measured: {where}, {sizes[full]:.3g} "
                            f"steps/s at world size {full}")
    elif report.step_rate:
        m["step_s"] = Value(1.0 / report.step_rate, f"measured: {where}, rank-0 step rate "
                            f"{report.step_rate:.3g} steps/s")
    commits = [float(e["seconds"]) for e in events if e["event"] == ev.COMMIT
               and e["rank"] in (0, -1) and isinstance(e.get("seconds"), (int, float))]
    if commits:
        m["commit_s"] = _value(commits, where, "commits (mean)", mean=True)

    eps = _episodes(launches)
    failures = [ep for ep in eps if ep.kind == "failure" and ep.recovered and ep.resumed_ts]
    joins = [ep for ep in eps if ep.kind == "hosts_changed" and ep.recovered and ep.resumed_ts
             and isinstance(ep.new_size, int) and isinstance(ep.old_size, int)]
    added = [ep for ep in joins if ep.new_size > ep.old_size]  # type: ignore[operator]
    removed = [ep for ep in joins if ep.new_size < ep.old_size]  # type: ignore[operator]
    if failures and prefix:
        rec = [ep.resumed_ts - ep.detected_ts for ep in failures]  # type: ignore[operator]
        if prefix == "vanilla":
            # vanilla's first notice is the rank that talked to the dead one; the others wait
            # out the Gloo timeout, which the plan adds as detection: do not count it twice
            rec = [x - gloo_timeout_s if x >= gloo_timeout_s else x for x in rec]
        m[f"{prefix}_recover_s"] = _value(rec, where, "in-process recoveries (noticed -> "
                                          "training)")
        cal.notes.append("detection (fault -> noticed) is not in an event log: "
                         f"{prefix}_detect_s keeps the benchmarks' value"
                         if prefix == "ours" else
                         "vanilla detection is the Gloo timeout (gloo_timeout_s)")
    if added and prefix:
        m[f"{prefix}_join_stall_s"] = _value(
            [ep.resumed_ts - ep.detected_ts for ep in added], where,  # type: ignore[operator]
            "joins (stall of the running job)")
    if removed and prefix:
        m[f"{prefix}_leave_stall_s"] = _value(
            [ep.resumed_ts - ep.detected_ts for ep in removed], where,  # type: ignore[operator]
            "hosts removed (stall)")
    back = _rejoin_delays(failures, added)
    if back and prefix:
        m[f"{prefix}_rejoin_s"] = _value(back, where, "failed workers back (failure noticed "
                                         "-> hosts_changed), median")
    if restarts and stack == "ours-torchrun":
        m["ours_torchrun_restart_s"] = _value(
            [r.new_train_ts - r.old_end_ts for r in restarts], where,
            "worker restarts (last event -> training again, restore included)")
    elif restarts:
        starts = [r.new_train_ts - r.new_start_ts for r in restarts]
        m["cold_start_s"] = _value(starts, where, "relaunches (first event -> training)")
        gaps = [r.new_start_ts - r.old_end_ts for r in restarts]
        if stack == "ours":
            m["supervisor_delay_s"] = _value(gaps, where, "gaps between launches")
    unrecovered = sum(1 for f in report.failures if f.kind in ("unrecovered", "restart"))
    elastic = sum(1 for f in report.failures if f.kind == "elastic")
    if prefix and elastic + unrecovered:
        cal.observed["in_process_recoveries_failed"] = f"{unrecovered} of {elastic + unrecovered}"
    silent = [float(e["silent_seconds"]) for e in events if e["event"] == ev.PEER_SILENT
              and isinstance(e.get("silent_seconds"), (int, float))]
    if silent:
        m["ours_silent_detect_s"] = _value(silent, where, "silent peers (peer_silent)")
    hangs = [float(e["idle_seconds"]) for e in events if e["event"] == ev.HANG_DETECTED
             and isinstance(e.get("idle_seconds"), (int, float))]
    if hangs:
        m["ours_hang_detect_s"] = _value(hangs, where, "hangs (hang_detected idle time)")
    _checkpoints(events, where, m, cal)
    cal.capacity_by_size = _capacity(report)
    cal.observed.update({
        "stack": stack, "wall_s": report.wall_s, "world_sizes": report.world_sizes,
        "failures": len(report.failures), "joins": len(added), "leaves": len(removed),
        "restarts": len(restarts), "goodput": report.goodput, "status": report.status,
        "preempted": sum(1 for e in events if e["event"] == ev.PREEMPTED),
        "hangs_detected": sum(1 for e in events if e["event"] == ev.HANG_DETECTED),
    })
    if not failures:
        cal.notes.append("no in-process failure in this log: recovery costs are defaults")
    logger.info("calibrated %s (%s): %s", where, stack, ", ".join(sorted(m)))
    return cal


def _rejoin_delays(failures: list[Episode], added: list[Episode]) -> list[float]:
    """For each failure, the first join after it (a worker or host back): how long the job
    ran short. Only pairs in order, each join used once."""
    out: list[float] = []
    pool = sorted(added, key=lambda ep: ep.detected_ts)
    for f in sorted(failures, key=lambda ep: ep.detected_ts):
        nxt = next((j for j in pool if j.detected_ts > f.detected_ts), None)
        if nxt is not None:
            out.append(nxt.detected_ts - f.detected_ts)
            pool.remove(nxt)
    return out


def _checkpoints(events: list[dict[str, Any]], where: str, m: dict[str, Value],
                 cal: Calibration) -> None:
    saved = [e for e in events if e["event"] == ev.CHECKPOINT_SAVED]
    sizes = [int(e["bytes"]) for e in saved if isinstance(e.get("bytes"), int) and e["bytes"] > 0]
    if not sizes:
        return
    m["checkpoint_gb"] = Value(statistics.median(sizes) / 1e9,
                               f"measured: {where}, {len(sizes)} checkpoints (median bytes)")
    stalls = [float(e["stall_seconds"]) for e in saved
              if isinstance(e.get("stall_seconds"), (int, float))]
    secs = [float(e["seconds"]) for e in saved if isinstance(e.get("seconds"), (int, float))]
    ups = [float(up) for e in saved
           if isinstance(up := e.get("upload_seconds", e.get("seconds")), (int, float))]
    blocking = bool(stalls and secs) and statistics.median(stalls) >= statistics.median(secs)
    if stalls:
        name = "ckpt_sync_s" if blocking else "ckpt_async_stall_s"
        m[name] = _value(stalls, where, "checkpoint stalls (mean)", mean=True)
    if ups and not blocking:
        m["ckpt_upload_s"] = _value(ups, where, "checkpoint uploads (mean)", mean=True)
    cal.notes.append("restore time is not in the event log: restore_s follows the checkpoint "
                     "benchmark's fit at the measured size")


def _capacity(report: Report) -> dict[int, float]:
    """Throughput at each world size / at the largest one (samples/s, else steps/s x size)."""
    rows: dict[int, float] = {}
    for size, t in report.throughput_by_size.items():
        rate = t.get("samples_per_s")
        steps_per_s = t.get("steps_per_s")
        if rate is None and steps_per_s is not None:
            rate = steps_per_s * size
        if rate and size > 0:
            rows[int(size)] = float(rate)
    if not rows:
        return {}
    full = rows[max(rows)]
    return {n: r / full for n, r in sorted(rows.items())} if full > 0 else {}
