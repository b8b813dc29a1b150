"""What a run went through, in numbers: goodput, failures and MTTR, checkpoints, Young/Daly.

All pure functions of the event list (`analyze(events, now=None)`), so every number can be
checked against a hand-written log.

Definitions (times are event timestamps, so they share the writers' clocks):

* wall = last event - first event, over every launch in the file.
* lost time is the union of the intervals below; where they overlap the time is counted once,
  under the first category in this order:

  1. ``restart``: downtime between launches and start-up after a full restart, from the last
     event of the old launch to the new launch's training start (its last `start`, `resume` or
     `sync` before its first commit). Process start-up before the first event is in here too.
  2. ``recovery``: an in-process recovery, from `failure_detected` (or `hosts_changed`) to
     training going on (the last `sync` after the `reset`, else the `reset`). A recovery that
     never finished runs to the end of its launch.
  3. ``rollback``: time thrown away by rolling back: for an in-process failure from the
     moment the restored commit (`restore.to_step`) was reached to `failure_detected`; for a
     full restart from the moment the resumed checkpoint's step was reached (its commit, else
     the checkpoint's snapshot) to the end of the old launch (everything, when nothing was
     resumed). The fault itself happened somewhere in this window: the log cannot tell the
     work that is redone from detection latency, so both are here.
  4. ``startup``: the first launch's start-up (first event to training start).
  5. ``checkpoint_stall``: the training thread blocked by a durable checkpoint
     (`stall_seconds`, placed just before the background write began).
  6. ``commit``: in-memory commits (`commit.seconds`), a small but real price of elasticity.

* productive = wall - lost; goodput = productive / wall. Work done since the newest checkpoint
  of a run that died and was never restarted is not counted as lost (it may yet be resumed);
  it is reported as "at risk" instead.
* a failure is one in-process failure episode (restore events from several ranks grouped by the
  recovery they belong to), or the end of a launch by a crash (no `done`/`preempted`) or a
  `fatal` error, followed by a full restart; a launch that died while recovering in-process is
  one failure, not two. `hosts_changed` recoveries are resets, not failures; a preemption and
  its restart cost time (``restart``) but are not failures.
* MTTR of a failure = training going on again - last sign of progress (commit or sync) before
  it. Split into detection (last progress -> `failure_detected`: an upper bound, the fault time
  is not logged), reset (`reset.seconds`, detection -> reset done), restore/sync (reset done ->
  last `sync`) and, for full restarts, restart (detection, or last progress when no rank noticed,
  -> training start of the new launch).
* throughput: steps/s between consecutive rank-0 commits (from a `sync`/`resume`/`start` for
  the first), times size * batch_size for samples/s; segments that span a recovery are left
  out. The step rate for Young/Daly is their time-weighted mean.
* silent: a run without `done` whose last event is older than max(60 s, 10 x the median gap
  between rank-0 commits) at `now` is hung or dead (a killed launcher writes nothing);
  "goodput to now" then counts the silence as lost: productive / (now - first event).
* Young/Daly (see `checkpoints`): C = median `stall_seconds` of saved checkpoints (median
  `seconds` when no stall was measured), MTBF = wall / failures.
* stragglers: every `straggler` event (written by the slow rank itself, so its `rank` is the
  straggler's), joined with the `straggler_evicted` / `straggler_cleared` of the same process
  (host and pid). An eviction is also a failure when a reset followed it: that is counted
  above, like any other.
* data: each `epoch_end` event's sample count and digest of sample ids against the data set's
  (`data.py`); a mismatch is one of the report's `problems`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.report import data, jobs
from hvd_resilient.report.checkpoints import (
    Summary,
    YoungDaly,
    at_risk,
    checkpoint_stats,
    current_step,
    is_num,
    num,
    step_of,
    young_daly,
)
from hvd_resilient.report.timeline import Episode, Event, Launch, Restart, normalize, parse

CATEGORIES = ("restart", "recovery", "rollback", "startup", "checkpoint_stall", "commit")
"""Lost-time categories, highest priority first (see the module docstring)."""
SILENT_MIN_S = 60.0
SILENT_GAPS = 10
"""A run quiet for more than max(SILENT_MIN_S, SILENT_GAPS x its commit interval) is silent."""


@dataclass
class Failure:
    at: float
    """Seconds since the first event: detection, or the end of the launch that died."""
    kind: str
    """"elastic" (recovered in-process), "restart" (recovered by a full restart) or
    "unrecovered" (the log ends before training went on)."""
    steps_lost: int
    detect_s: float | None
    detect_is_upper_bound: bool
    reset_s: float | None
    restore_s: float | None
    restart_s: float | None
    total_s: float | None
    old_size: int | None = None
    new_size: int | None = None


@dataclass
class Report:
    run_id: str | None
    status: str
    """"finished", "preempted", "failed" (a `fatal` event: a restart would not help) or
    "unfinished" (crashed, or still running)."""
    fatal_error: str | None
    started_at: float
    last_event_at: float
    since_last_event_s: float | None
    wall_s: float
    productive_s: float
    goodput: float | None
    lost_s: dict[str, float]
    launches: int
    restarts: list[dict[str, Any]]
    resumes: int
    """Launches that resumed from a durable checkpoint."""
    failures: list[Failure]
    resets: int
    mttr: dict[str, Summary]
    steps_lost: int
    checkpoints: dict[str, Any]
    at_risk: dict[str, Any]
    final_step: int
    world_sizes: list[int]
    world_size_changes: list[list[float]]
    """[[seconds since the first event, size]] each time the size changed (0: nothing ran)."""
    step_rate: float | None
    samples_per_s: float | None
    throughput_by_size: dict[int, dict[str, float | None]]
    """Mean steps/s and samples/s at each world size: does adding workers pay?"""
    memory: dict[str, int]
    young_daly: YoungDaly
    config: dict[str, Any] | None
    series: dict[str, list[Any]] = field(default_factory=dict)
    """For plots, times in seconds since the first event: world_size [[t, size]], throughput
    [[t0, t1, steps_per_s, samples_per_s | null, size]], lost [[t0, t1, category]] (failure
    categories only, merged), failures [[t, kind]], resets [[t, old, new]], checkpoints [[t,
    step, "saved" | "failed"]], stragglers [[t, rank, ratio | null, evicted]]."""
    silent_s: float | None = None
    """Seconds without an event at `now`, when that is far longer than a healthy run is quiet."""
    usual_gap_s: float | None = None
    """Median seconds between rank-0 commits."""
    goodput_to_now: float | None = None
    """For a silent run: productive / (now - first event)."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """Every straggler report: at (seconds since the first event), step, rank, host, pid,
    ratio, compute_s, others_s, evicted, cleared_at (see `stragglers_of`)."""
    straggler_rule: dict[str, Any] | None = None
    """The detection thresholds the run's config recorded (None: not recorded, or off)."""
    step_times: dict[str, Any] | None = None
    """From rank 0's `step_times` events (one per straggler window): windows, judged, the
    highest ratio seen (and its rank and time), median compute and wait seconds per step."""
    data_epochs: list[dict[str, Any]] = field(default_factory=list)
    """Each distinct `epoch_end` record checked (`data.epochs_of`): epoch, samples,
    expected_samples, exactly_once (True, False, or None when not checkable), text, times."""
    problems: list[str] = field(default_factory=list)
    """What the log proves went wrong: samples missing or used twice, two jobs training on
    the run at once."""
    jobs: list[dict[str, Any]] = field(default_factory=list)
    """The jobs that trained on the run, one per lease epoch (`jobs.jobs_of`)."""
    step_unit: str = "step"
    """What the log's `step` counts: "step" (optimizer steps), or "commit" where a custom loop
    never advanced `state.step` and the state counted its commits instead (`step_unit` on
    its events): steps redone are then commits redone."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- lost time -------------------------------------------------------------------------------


Interval = tuple[float, float, str]


def lost_intervals(launches: list[Launch], restarts: list[Restart]) -> list[Interval]:
    """Every interval of non-productive time with its category (overlaps resolved later)."""
    out: list[Interval] = []
    if launches:
        first = launches[0]
        out.append((first.start_ts, first.train_ts, "startup"))
    for launch in launches:
        for ep in launch.episodes:
            if ep.kind == "failure":
                out.append((ep.anchor_ts, ep.detected_ts, "rollback"))
            end = ep.resumed_ts if ep.recovered else launch.end_ts
            out.append((ep.detected_ts, end or launch.end_ts, "recovery"))
        for e in launch.events:
            if e["event"] == ev.COMMIT:
                out.append((e["ts"] - num(e, "seconds"), e["ts"], "commit"))
            elif e["event"] == ev.CHECKPOINT_SAVED:
                out.append((*_stall_window(e), "checkpoint_stall"))
    for r in restarts:
        out.append((r.anchor_ts, r.old_end_ts, "rollback"))
        out.append((r.old_end_ts, r.new_train_ts, "restart"))
    return [(a, b, c) for a, b, c in out if b > a]


def _stall_window(e: Event) -> tuple[float, float]:
    """Where the training thread stalled for checkpoint event `e` (written when it was saved).

    A blocking save stalls throughout (stall >= seconds): the stall ends at the event. An async
    one stalls only for the snapshot, just before the background write of `seconds` began.
    """
    stall, secs = num(e, "stall_seconds"), num(e, "seconds")
    if stall >= secs:
        return e["ts"] - stall, e["ts"]
    return e["ts"] - secs - stall, e["ts"] - secs


def attribute(intervals: list[Interval], lo: float, hi: float) -> dict[str, float]:
    """Seconds per category inside [lo, hi], each instant under its highest-priority category."""
    rank = {c: i for i, c in enumerate(CATEGORIES)}
    points: list[tuple[float, int, int]] = []
    for a, b, cat in intervals:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            points += [(a, 1, rank[cat]), (b, -1, rank[cat])]
    points.sort(key=lambda p: p[0])
    active = [0] * len(CATEGORIES)
    totals = [0.0] * len(CATEGORIES)
    prev = lo
    for t, delta, i in points:
        if t > prev:
            top = next((j for j, n in enumerate(active) if n > 0), None)
            if top is not None:
                totals[top] += t - prev
        prev = t
        active[i] += delta
    return dict(zip(CATEGORIES, totals, strict=True))


def merged_spans(intervals: list[Interval], categories: tuple[str, ...]) -> list[Interval]:
    """Intervals of the given categories with overlaps merged (for shading a plot)."""
    picked = sorted((a, b, c) for a, b, c in intervals if c in categories)
    out: list[Interval] = []
    for a, b, c in picked:
        if out and a <= out[-1][1] and out[-1][2] == c:
            out[-1] = (out[-1][0], max(out[-1][1], b), c)
        else:
            out.append((a, b, c))
    return out


# -- failures ---------------------------------------------------------------------------------


def _elastic_failure(ep: Episode, t0: float) -> Failure:
    detect = ep.detected_ts - ep.last_progress_ts
    # ep.recovered is ep.reset_ts is not None, spelled out so the type checker sees it
    restore = (ep.resumed_ts - ep.reset_ts) if ep.reset_ts is not None and ep.resumed_ts else None
    total = (ep.resumed_ts - ep.last_progress_ts) if ep.recovered and ep.resumed_ts else None
    return Failure(
        at=ep.detected_ts - t0, kind="elastic" if ep.recovered else "unrecovered",
        steps_lost=ep.lost_steps, detect_s=detect, detect_is_upper_bound=True,
        reset_s=ep.reset_seconds, restore_s=restore, restart_s=None, total_s=total,
        old_size=ep.old_size, new_size=ep.new_size,
    )


def _restart_failure(r: Restart, new_size: int, t0: float) -> Failure:
    ep = r.episode
    noticed = ep.detected_ts if ep else r.last_progress_ts
    return Failure(
        at=noticed - t0 if ep else r.old_end_ts - t0, kind="restart",
        steps_lost=r.lost_steps, detect_s=(ep.detected_ts - r.last_progress_ts) if ep else None,
        detect_is_upper_bound=True, reset_s=None, restore_s=None,
        restart_s=r.new_train_ts - noticed, total_s=r.new_train_ts - r.last_progress_ts,
        new_size=new_size,
    )


def failures_of(launches: list[Launch], restarts: list[Restart], t0: float) -> list[Failure]:
    by_old = {r.before: r for r in restarts}
    out: list[Failure] = []
    for launch in launches:
        restart = by_old.get(launch.index)
        for ep in launch.episodes:
            if restart is not None and ep is restart.episode:
                continue  # the full restart that follows is the recovery from this one
            if ep.kind == "failure":
                out.append(_elastic_failure(ep, t0))
        if restart is not None and restart.reason in ("crash", "fatal"):
            out.append(_restart_failure(restart, launches[launch.index + 1].size, t0))
    return sorted(out, key=lambda f: f.at)


# -- throughput and memory -----------------------------------------------------------------------


def throughput(launches: list[Launch], batch_size: int | None,
               t0: float) -> list[list[Any]]:
    """[t0, t1, steps/s, samples/s | None, world size] between consecutive commits (or a sync
    and the next commit) that no recovery interrupted;
    rank 0's `progress` events (samples_per_s) instead, when the log has them."""
    progress = [e for lch in launches for e in lch.events
                if e["event"] == ev.PROGRESS and is_num(e.get("samples_per_s"))]
    if len(progress) >= 2:
        out: list[list[Any]] = []
        for a, b in zip(progress, progress[1:], strict=False):
            steps = (b["step"] - a["step"]) / (b["ts"] - a["ts"]) if b["ts"] > a["ts"] else None
            if steps is not None and steps > 0:
                out.append([a["ts"] - t0, b["ts"] - t0, steps, float(b["samples_per_s"]),
                            b["size"]])
        return out
    out = []
    for launch in launches:
        prev: Event | None = None
        committed = False
        for e in launch.events:
            kind = e["event"]
            if kind in (ev.FAILURE_DETECTED, ev.RESTORE, ev.HOSTS_CHANGED, ev.RESET):
                prev = None
            elif kind in (ev.SYNC, ev.RESUME):
                prev = e  # training (re)starts here: measure from it to the next commit
            elif kind == ev.START and not committed and prev is None:
                prev = e  # no sync event (a static MPI world): training starts after `start`
            elif kind == ev.COMMIT:
                committed = True
                if prev is not None and e["ts"] > prev["ts"] and e["step"] > prev["step"]:
                    rate = (e["step"] - prev["step"]) / (e["ts"] - prev["ts"])
                    size = e["size"] if e["size"] > 0 else None
                    samples = rate * size * batch_size if size and batch_size else None
                    out.append([prev["ts"] - t0, e["ts"] - t0, rate, samples, e["size"]])
                prev = e
    return out


def _mean_rate(segments: list[list[Any]], col: int) -> float | None:
    """Time-weighted mean of column `col` over the segments that have it."""
    num = sum((s[col] or 0.0) * (s[1] - s[0]) for s in segments if s[col] is not None)
    den = sum(s[1] - s[0] for s in segments if s[col] is not None)
    return num / den if den > 0 else None


def memory_peaks(events: list[Event]) -> dict[str, int]:
    """Highest `rss_bytes` and any `cuda*` byte counts seen in memory/progress events."""
    peaks: dict[str, int] = {}
    for e in events:
        if e["event"] not in (ev.MEMORY, ev.PROGRESS):
            continue
        for k, v in e.items():
            if (k == "rss_bytes" or k.startswith("cuda")) and isinstance(v, int):
                peaks[k] = max(peaks.get(k, 0), v)
    return peaks


# -- stragglers ---------------------------------------------------------------------------------


def stragglers_of(events: list[Event], t0: float) -> list[dict[str, Any]]:
    """Each `straggler` report with what became of it (evicted, or keeping pace again)."""
    out: list[dict[str, Any]] = []
    latest: dict[tuple[Any, Any], dict[str, Any]] = {}
    for e in events:
        kind = e["event"]
        who = (e.get("host"), e.get("pid"))
        if kind == ev.STRAGGLER:
            rec = {"at": e["ts"] - t0, "step": e["step"], "rank": e["rank"],
                   "host": e.get("host"), "pid": e.get("pid"),
                   "ratio": num(e, "ratio") if is_num(e.get("ratio")) else None,
                   "compute_s": e.get("compute_seconds") if is_num(
                       e.get("compute_seconds")) else None,
                   "others_s": e.get("others_seconds") if is_num(
                       e.get("others_seconds")) else None,
                   "evicted": False, "cleared_at": None}
            out.append(rec)
            latest[who] = rec
        elif kind == ev.STRAGGLER_EVICTED and who in latest:
            latest[who]["evicted"] = True
        elif kind == ev.STRAGGLER_CLEARED and who in latest:
            latest[who]["cleared_at"] = e["ts"] - t0
    return out


def _list_or_empty(e: Event, key: str) -> list[Any]:
    v = e.get(key)
    return v if isinstance(v, list) else []


def step_times_of(events: list[Event], t0: float) -> dict[str, Any] | None:
    """How close the run came to a straggler report, and what a step cost, per window."""
    windows = [e for e in events if e["event"] == ev.STEP_TIMES and e.get("rank") == 0]
    if not windows:
        return None
    best: tuple[float, int, float] | None = None
    computes: list[float] = []
    waits: list[float] = []
    judged = 0
    for e in windows:
        ratios, comp, wait = (_list_or_empty(e, k) for k in
                              ("ratios", "compute_seconds", "wait_seconds"))
        computes += [float(x) for x in comp if is_num(x)]
        waits += [float(x) for x in wait if is_num(x)]
        if not e.get("judged"):
            continue
        judged += 1
        for rank, x in enumerate(ratios):
            if is_num(x) and (best is None or x > best[0]):
                best = (float(x), rank, e["ts"] - t0)
    return {"windows": len(windows), "judged": judged,
            "max_ratio": best[0] if best else None, "max_ratio_rank": best[1] if best else None,
            "max_ratio_at": best[2] if best else None,
            "compute_s": statistics.median(computes) if computes else None,
            "wait_s": statistics.median(waits) if waits else None}


def straggler_rule(config: dict[str, Any] | None) -> dict[str, Any] | None:
    """The thresholds from the recorded config, when detection was on."""
    obs = (config or {}).get("observability")
    if not isinstance(obs, dict) or not obs.get("straggler_window_steps"):
        return None
    return {k: obs.get(f"straggler_{k}") for k in
            ("window_steps", "ratio", "windows", "min_seconds", "evict")}


# -- the whole report -------------------------------------------------------------------------


def world_size_changes(series: list[list[float]]) -> list[list[float]]:
    """The world-size series with repeats dropped: the sizes a run went through, in order."""
    out: list[list[float]] = []
    for t, n in series:
        if not out or out[-1][1] != n:
            out.append([t, n])
    return out


def world_size_series(launches: list[Launch], t0: float) -> list[list[float]]:
    out: list[list[float]] = []
    for i, launch in enumerate(launches):
        out.append([launch.start_ts - t0, launch.size])
        for ep in launch.episodes:
            if ep.recovered and isinstance(ep.new_size, int):
                out.append([(ep.reset_ts or 0.0) - t0, ep.new_size])
        if i + 1 < len(launches):
            out.append([launch.end_ts - t0, 0])
    if launches:
        out.append([launches[-1].end_ts - t0, out[-1][1]])
    return out


def usual_gap(events: list[Event]) -> float | None:
    """Median seconds between consecutive rank-0 commits: how often a healthy run speaks."""
    ts = [e["ts"] for e in events if e["event"] == ev.COMMIT and e.get("rank") == 0]
    gaps = [b - a for a, b in zip(ts, ts[1:], strict=False) if b > a]
    return statistics.median(gaps) if gaps else None


def analyze(raw: Iterable[Event], now: float | None = None,
            mtbf_s: float | None = None) -> Report:
    """The report of a run from its events (any order; torn lines already skipped).

    `now` (unix seconds) adds "since the last event" and "at risk now" for a run that may still
    be going; `mtbf_s` replaces the observed failure rate in the Young/Daly suggestion.
    Raises ValueError when there is no event at all.
    """
    events = normalize(raw)
    if not events:
        raise ValueError("no events")
    launches, restarts = parse(events)
    t0, t1 = events[0]["ts"], events[-1]["ts"]
    wall = t1 - t0
    intervals = lost_intervals(launches, restarts)
    lost = attribute(intervals, t0, t1)
    productive = max(0.0, wall - sum(lost.values()))
    failures = failures_of(launches, restarts, t0)
    last = launches[-1]
    config = next((lch.config for lch in reversed(launches) if lch.config), None)
    batch = config.get("batch_size") if config else None
    segments = throughput(launches, batch if isinstance(batch, int) else None, t0)
    step_rate = _mean_rate(segments, 2)
    recovered = [f for f in failures if f.total_s is not None]
    episodes = [ep for lch in launches for ep in lch.episodes]
    status = {ev.DONE: "finished", ev.PREEMPTED: "preempted", ev.FATAL: "failed"}.get(
        last.end, "unfinished")
    fatal = next((e for e in reversed(last.events) if e["event"] == ev.FATAL), None)
    gap = usual_gap(events)
    silent = None
    if now is not None and status == "unfinished" and (
            now - t1 > max(SILENT_MIN_S, SILENT_GAPS * (gap or 0.0))):
        silent = now - t1
    ws = world_size_series(launches, t0)
    stragglers = stragglers_of(events, t0)
    epochs = data.epochs_of(events)
    ran = jobs.jobs_of(events, t0)
    series: dict[str, list[Any]] = {
        "world_size": ws,
        "throughput": segments,
        "lost": [[a - t0, b - t0, c] for a, b, c in merged_spans(
            intervals, ("restart", "recovery", "rollback", "startup"))],
        "failures": [[f.at, f.kind] for f in failures],
        "resets": [[(ep.reset_ts or 0.0) - t0, ep.old_size, ep.new_size]
                   for ep in episodes if ep.recovered],
        "checkpoints": [[e["ts"] - t0, step_of(e), e["event"][len("checkpoint_"):]]
                        for e in events if e["event"] in (ev.CHECKPOINT_SAVED,
                                                          ev.CHECKPOINT_FAILED)],
        "stragglers": [[s["at"], s["rank"], s["ratio"], s["evicted"]] for s in stragglers],
    }
    return Report(
        run_id=next((lch.run_id for lch in launches if lch.run_id), None),
        status=status, fatal_error=str(fatal.get("error", "")) if fatal else None,
        started_at=t0, last_event_at=t1,
        since_last_event_s=(now - t1) if now is not None else None,
        wall_s=wall, productive_s=productive,
        goodput=productive / wall if wall > 0 else None, lost_s=lost,
        launches=len(launches),
        restarts=[{"after_s": r.old_end_ts - t0, "reason": r.reason, "from_step": r.from_step,
                   "down_s": r.new_start_ts - r.old_end_ts,
                   "startup_s": r.new_train_ts - r.new_start_ts, "steps_lost": r.lost_steps,
                   "source": r.source}
                  for r in restarts],
        resumes=sum(lch.resume_from_step is not None for lch in launches),
        failures=failures, resets=sum(ep.recovered for ep in episodes),
        mttr={
            "total": Summary.of(f.total_s for f in recovered),
            "detect": Summary.of(f.detect_s for f in recovered),
            "reset": Summary.of(f.reset_s for f in recovered),
            "restore": Summary.of(f.restore_s for f in recovered),
            "restart": Summary.of(f.restart_s for f in recovered),
        },
        steps_lost=sum(f.steps_lost for f in failures),
        checkpoints=checkpoint_stats(events), at_risk=at_risk(events, now),
        final_step=current_step(events),
        world_sizes=sorted({int(p[1]) for p in ws if p[1] > 0}),
        world_size_changes=world_size_changes(ws),
        step_rate=step_rate, samples_per_s=_mean_rate(segments, 3),
        throughput_by_size={
            n: {"steps_per_s": _mean_rate(segs, 2), "samples_per_s": _mean_rate(segs, 3)}
            for n in sorted({int(x[4]) for x in segments})
            if (segs := [x for x in segments if x[4] == n])
        },
        memory=memory_peaks(events),
        young_daly=young_daly(events, wall, len(failures),
                              sum(f.kind != "elastic" for f in failures), step_rate, config,
                              mtbf_s),
        config=config, series=series, silent_s=silent, usual_gap_s=gap,
        goodput_to_now=productive / (now - t0) if silent and now is not None else None,
        stragglers=stragglers, straggler_rule=straggler_rule(config),
        step_times=step_times_of(events, t0),
        data_epochs=epochs, problems=data.problems(epochs) + jobs.problems(ran),
        jobs=ran, step_unit=step_unit_of(events),
    )


def step_unit_of(events: list[Event]) -> str:
    """The unit the newest event that names one names ("step" when none does)."""
    for e in reversed(events):
        unit = e.get("step_unit")
        if unit in ("step", "commit"):
            return str(unit)
    return "step"
