"""The structure of a run folder's event log: launches, recovery episodes and restarts.

Everything here is a pure function of the event list, so the report's arithmetic can be tested
on hand-written logs. Three kinds of structure matter:

* A *launch* is one start of the whole job. Full restarts (after a crash, a preemption or an
  operator's relaunch) append to the same file, so one file may hold several. A launch begins
  at a rank-0 `start` event, except when that `start` belongs to a worker that joins a running
  elastic job: that happens only while survivors are recovering (a `failure_detected` or
  `hosts_changed` not yet followed by `reset`) and then fewer than `size` ranks start together.
* An *episode* is one in-process elastic recovery inside a launch: detection events
  (`failure_detected`, `restore`, `hosts_changed`) from every surviving rank, then `reset` from
  every rank, then `sync`, and it is over at the first `commit` after the reset. Grouping by
  this sequence rather than by a time window is what turns restore events on several ranks
  into one failure, however slowly the ranks noticed.
* A *restart* joins two consecutive launches: the redone work (from the moment the resumed
  checkpoint's step was reached to the end of the old launch), the downtime between them and
  the start-up of the new one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.events import ckpt_step

Event = dict[str, Any]

DETECTION = (ev.FAILURE_DETECTED, ev.RESTORE, ev.HOSTS_CHANGED)
"""Events a surviving rank writes when it notices that the world changed."""

START_CLUSTER_S = 30.0
"""All ranks of one launch write `start` right after the same rendezvous: this is generous."""


def normalize(raw: Iterable[Event]) -> list[Event]:
    """Events with numeric `ts`, int `rank`/`size`/`step`, sorted by time (stable).

    Lines from several processes are appended in nearly, not exactly, time order; anything that
    lacks a usable timestamp is dropped rather than guessed at.
    """
    out: list[Event] = []
    for e in raw:
        ts = e.get("ts")
        if (type(ts) is float and type(e.get("rank")) is int and type(e.get("size")) is int
                and type(e.get("step")) is int and math.isfinite(ts)
                and isinstance(e.get("event"), str)):
            out.append(e)  # the usual line: nothing to fix, no copy
            continue
        try:
            ts = float(ts)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if not math.isfinite(ts) or not isinstance(e.get("event"), str):
            continue
        rec = dict(e)
        rec["ts"] = ts
        for key, default in (("rank", -1), ("size", -1), ("step", 0)):
            try:
                rec[key] = int(e.get(key, default))
            except (TypeError, ValueError):
                rec[key] = default
        out.append(rec)
    out.sort(key=lambda r: r["ts"])
    return out


@dataclass
class Episode:
    """One in-process recovery: detection on the survivors, reset, sync, first commit."""

    kind: str
    """"failure" (a collective failed: work since the last commit is redone) or
    "hosts_changed" (hosts were added or removed at a commit: nothing is redone)."""
    detected_ts: float
    last_progress_ts: float
    """The last commit or sync before detection: the fault happened after it."""
    anchor_ts: float
    """When the state restored to was reached; [anchor, detected] is work that is redone."""
    from_step: int | None = None
    to_step: int | None = None
    lost_steps: int = 0
    ranks: set[int] = field(default_factory=set)
    reset_ts: float | None = None
    reset_seconds: float | None = None
    old_size: int | None = None
    new_size: int | None = None
    resumed_ts: float | None = None
    """Training went on: the last `sync` after the reset, else the reset itself."""
    first_commit_ts: float | None = None

    @property
    def recovered(self) -> bool:
        return self.reset_ts is not None


@dataclass
class Launch:
    index: int
    events: list[Event]
    start_ts: float
    end_ts: float
    train_ts: float
    """Start-up over: the last start/resume/sync before the first commit."""
    end: str
    """"done", "preempted", "fatal" (gave up: a restart would not help) or "unfinished"
    (crashed, killed, or still running)."""
    resume_from_step: int | None
    first_step: int
    last_step: int
    size: int
    config: dict[str, Any] | None
    run_id: str | None
    episodes: list[Episode] = field(default_factory=list)
    resume_source: str = ""
    """Where the resume came from: memory, peer or durable ('' : no resume, or a log from
    before the field existed)."""


@dataclass
class Restart:
    """The step from launch `before` to launch `before + 1`."""

    before: int
    reason: str
    """"crash" (no done/preempted/fatal), "fatal", "preempted", or "relaunch" (after done)."""
    from_step: int
    """The step the new launch resumed from (0: no checkpoint, started over)."""
    anchor_ts: float
    """When the old launch reached `from_step`: [anchor, old end] was redone."""
    last_progress_ts: float
    old_end_ts: float
    new_start_ts: float
    new_train_ts: float
    lost_steps: int
    episode: Episode | None
    """The old launch's unfinished recovery, when it died while recovering."""
    source: str = ""
    """Where the new launch resumed from: memory, peer, durable."""


def _is_progress(e: Event) -> bool:
    return (e["event"] == ev.COMMIT and e["rank"] in (0, -1)) or e["event"] in (ev.SYNC, ev.RESUME)


def _full_start_cluster(events: list[Event], i: int) -> bool:
    """Whether every rank of the world of `start` event i started within the cluster window."""
    t0, size = events[i]["ts"], events[i]["size"]
    ranks = {
        e["rank"] for e in events
        if e["event"] == ev.START and e["size"] == size and abs(e["ts"] - t0) <= START_CLUSTER_S
    }
    return size > 0 and len(ranks) >= size


def split_launches(events: list[Event]) -> list[list[Event]]:
    """Cuts the sorted events into launches (see the module docstring for the rule)."""
    if not events:
        return []
    cuts = [0]
    recovering = False
    for i, e in enumerate(events):
        kind = e["event"]
        if kind in (ev.FAILURE_DETECTED, ev.HOSTS_CHANGED):
            recovering = True
        elif kind == ev.RESET:
            recovering = False
        elif kind == ev.START and e["rank"] == 0 and i > 0:
            if recovering and not _full_start_cluster(events, i):
                continue  # a worker joining the running job
            # The launch begins at the first of the contiguous `start` lines around rank 0's.
            j = i
            while (j > cuts[-1] and events[j - 1]["event"] == ev.START
                   and e["ts"] - events[j - 1]["ts"] <= START_CLUSTER_S):
                j -= 1
            # the launcher's own lines before its workers' first start (rank -1: the warm
            # pool's readiness, say) belong to that launch, not to one of their own
            if j > cuts[-1] and any(ev["rank"] >= 0 for ev in events[cuts[-1]:j]):
                cuts.append(j)
                recovering = False
    cuts.append(len(events))
    return [events[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def _anchor(events: list[Event], before_ts: float, step: int | None, default: float) -> float:
    """When the state at `step` was last reached before `before_ts` (a commit, sync or resume
    at that step; else the snapshot moment of a checkpoint of that step)."""
    best: float | None = None
    for e in events:
        if e["ts"] > before_ts:
            break
        if step is not None and e["step"] == step and (_is_progress(e) or e["event"] == ev.START):
            best = e["ts"]
    if best is None and step is not None:
        for e in events:
            if (e["event"] == ev.CHECKPOINT_SAVED and ckpt_step(e) == step
                    and e["ts"] <= before_ts):
                best = e["ts"] - float(e.get("seconds") or 0.0)
    return default if best is None else best


def _last_progress(events: list[Event], before_ts: float, default: float) -> float:
    best = default
    for e in events:
        if e["ts"] > before_ts:
            break
        if _is_progress(e):
            best = max(best, e["ts"])
    return best


def find_episodes(events: list[Event], train_ts: float) -> list[Episode]:
    """The in-process recoveries of one launch, in order (one pass: logs can be long)."""
    episodes: list[Episode] = []
    ep: Episode | None = None
    last = train_ts  # the last sign of progress so far
    reached: dict[int, float] = {}  # step -> when the state was last at it
    for e in events:
        kind, ts = e["event"], e["ts"]
        if _is_progress(e) or kind == ev.START:
            reached[e["step"]] = ts
            if kind != ev.START:
                last = max(last, ts)
        if kind in DETECTION or (kind == ev.RESET and ep is None):
            if ep is None or ep.reset_ts is not None:
                if ep is not None:
                    episodes.append(ep)
                detected = ts - float(e.get("seconds") or 0.0) if kind == ev.RESET else ts
                ep = Episode("hosts_changed", detected, last, detected)
            ep.ranks.add(e["rank"])
            if kind in (ev.FAILURE_DETECTED, ev.RESTORE):
                if ep.kind != "failure":
                    ep.kind = "failure"
                    ep.anchor_ts = ep.last_progress_ts
                ep.detected_ts = min(ep.detected_ts, ts)
            if kind == ev.RESTORE:
                to_step = e.get("to_step")
                if isinstance(to_step, int):
                    ep.to_step = to_step
                    ep.anchor_ts = reached.get(to_step, ep.last_progress_ts)
                if isinstance(e.get("from_step"), int):
                    ep.from_step = max(ep.from_step or 0, e["from_step"])
                ep.lost_steps = max(ep.lost_steps, int(e.get("lost_steps") or 0))
        if ep is None:
            continue
        if kind == ev.RESET:
            ep.reset_ts = max(ep.reset_ts or ts, ts)
            ep.resumed_ts = max(ep.resumed_ts or ts, ts)
            secs = e.get("seconds")
            if isinstance(secs, (int, float)):
                ep.reset_seconds = max(ep.reset_seconds or 0.0, float(secs))
            ep.old_size = e.get("old_size", ep.old_size)
            ep.new_size = e.get("new_size", ep.new_size)
        elif kind == ev.SYNC and ep.reset_ts is not None:
            ep.resumed_ts = max(ep.resumed_ts or ts, ts)
        elif kind == ev.COMMIT and ep.reset_ts is not None:
            ep.first_commit_ts = ts
            episodes.append(ep)
            ep = None
    if ep is not None:
        episodes.append(ep)
    return episodes


def build_launch(index: int, events: list[Event]) -> Launch:
    first_commit = next((e["ts"] for e in events if e["event"] == ev.COMMIT), math.inf)
    boot = [e["ts"] for e in events
            if e["event"] in (ev.START, ev.RESUME, ev.SYNC) and e["ts"] <= first_commit]
    train_ts = max(boot) if boot else events[0]["ts"]
    kinds = {e["event"] for e in events}
    end = next((k for k in (ev.DONE, ev.PREEMPTED, ev.FATAL) if k in kinds), "unfinished")
    resume = next((e for e in events if e["event"] == ev.RESUME), None)
    resume_from = resume.get("from_step", resume["step"]) if resume else None
    steps = [e["step"] for e in events] + [
        e["from_step"] for e in events if isinstance(e.get("from_step"), int)
        and e["event"] == ev.RESTORE
    ]
    starts = [e for e in events if e["event"] == ev.START]
    rank0 = next((e for e in starts if e["rank"] == 0), starts[0] if starts else events[0])
    config = rank0.get("config") if isinstance(rank0.get("config"), dict) else None
    launch = Launch(
        index=index, events=events, start_ts=events[0]["ts"], end_ts=events[-1]["ts"],
        train_ts=train_ts, end=end,
        resume_from_step=int(resume_from) if isinstance(resume_from, int) else None,
        resume_source=str(resume.get("source", "")) if resume else "",
        first_step=min(steps), last_step=max(steps), size=rank0["size"], config=config,
        run_id=rank0.get("run_id"),
    )
    launch.episodes = find_episodes(events, train_ts)
    return launch


def build_restart(old: Launch, new: Launch) -> Restart:
    reason = {ev.DONE: "relaunch", ev.PREEMPTED: "preempted", ev.FATAL: "fatal"}.get(
        old.end, "crash")
    from_step = new.resume_from_step or 0
    open_ep = old.episodes[-1] if old.episodes and not old.episodes[-1].recovered else None
    if from_step >= old.last_step:
        anchor = old.end_ts  # resumed where it stopped (a preemption's final checkpoint)
    elif from_step <= old.first_step:
        anchor = old.train_ts  # resumed from where the old launch began: all of it is redone
    else:
        anchor = _anchor(old.events, old.end_ts, from_step, old.end_ts)
    last = _last_progress(old.events, open_ep.detected_ts if open_ep else old.end_ts,
                          old.train_ts)
    return Restart(
        before=old.index, reason=reason, from_step=from_step, anchor_ts=anchor,
        last_progress_ts=last, old_end_ts=old.end_ts, new_start_ts=new.start_ts,
        new_train_ts=new.train_ts, lost_steps=max(0, old.last_step - from_step),
        episode=open_ep, source=new.resume_source,
    )


def parse(events: list[Event]) -> tuple[list[Launch], list[Restart]]:
    """Launches (with their episodes) and the restarts between them, from normalized events."""
    launches = [build_launch(i, evs) for i, evs in enumerate(split_launches(events))]
    restarts = [build_restart(a, b) for a, b in zip(launches, launches[1:], strict=False)]
    return launches, restarts
