"""Stragglers: a rank that is persistently slower than the others at its own work.

In synchronous data parallelism the slowest rank sets everyone's pace: the others finish their
forward and backward passes and then wait for it inside the gradient allreduce. So each rank
splits every step into *compute* (its own work: fetching the batch, forward, backward, the
optimizer's local update) and *wait* (the time inside the collective, `waiting_for_peers()` in
the trainer). A healthy job has similar compute everywhere; a straggler has more compute and
the least wait, its peers wait for it.

The rule, and why it does not fire on noise (a shared machine, a garbage collection, a slow
batch now and then):

* a rank's number for a window of `window_steps` steps is the **median** of its per-step
  compute times, so a few slow steps in a window change nothing;
* it is compared with the median of the **other** ranks' medians (with two ranks the median
  of all would be the mean, which halves the contrast; with many it is the same), and it is
  slow in that window only when it is above `ratio` times that **and** at least `min_seconds`
  above it (a 1.4x ratio between 2 ms steps is the scheduler, not a slow machine);
* it is reported only after `windows` consecutive slow windows; one fast window starts the
  count again;
* the ranks exchange one small record per window (`allgather_object`), never per step, so
  watching costs one collective every `window_steps` steps.

A rank is followed by its process (host and pid), not by its rank number: ranks are renumbered
at every elastic reset. Every rank receives every rank's numbers and applies the same rule, so
the straggler itself knows, and reports (and, with eviction on, ends) itself, and rank 0 warns.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from hvd_resilient.config import ObservabilityOptions

MIN_FILL = 0.5
"""A window counts only when every rank timed at least this share of its steps: right after a
reset or a restore the window holds a few steps, and its median would be noise."""


@dataclass(frozen=True)
class StragglerRule:
    """The thresholds (`observability.straggler_*` settings)."""

    window_steps: int = 50
    ratio: float = 1.3
    windows: int = 3
    min_seconds: float = 0.02

    @classmethod
    def from_options(cls, options: ObservabilityOptions) -> StragglerRule:
        return cls(window_steps=options.straggler_window_steps,
                   ratio=options.straggler_ratio, windows=options.straggler_windows,
                   min_seconds=options.straggler_min_seconds)

    @property
    def enabled(self) -> bool:
        return self.window_steps > 0


@dataclass(frozen=True)
class RankTiming:
    """One rank's window, as exchanged. Horovod names an object allgather after the object's
    class, so this class name also keeps the exchange apart from every other one."""

    rank: int
    host: str
    pid: int
    steps: int
    """Steps timed in this window (fewer than the window after a reset or a restore)."""
    compute_s: float
    """Median compute seconds per step over the window."""
    wait_s: float
    """Median seconds per step spent waiting for the other ranks inside the collective."""

    @property
    def key(self) -> str:
        """Who this is across resets (ranks are renumbered; processes are not)."""
        return f"{self.host}:{self.pid}"


@dataclass
class Verdict:
    """What one window showed; identical on every rank that saw the same windows."""

    evaluated: bool
    """False when some rank timed too few steps for its median to mean anything."""
    ratios: dict[int, float] = field(default_factory=dict)
    """Rank -> its median compute / the median of the other ranks' medians."""
    others_s: dict[int, float] = field(default_factory=dict)
    """Rank -> the median of the other ranks' medians it was compared with."""
    reported: list[RankTiming] = field(default_factory=list)
    """Ranks that became stragglers in this window (slow for `windows` windows in a row)."""
    cleared: list[RankTiming] = field(default_factory=list)
    """Reported stragglers that were not slow in this window."""
    flagged: list[int] = field(default_factory=list)
    """Ranks that are reported stragglers after this window."""


def compare(timings: list[RankTiming]) -> tuple[dict[int, float], dict[int, float]]:
    """(rank -> ratio, rank -> the others' median) for every rank of one window."""
    ratios: dict[int, float] = {}
    others: dict[int, float] = {}
    for t in timings:
        rest = [o.compute_s for o in timings if o.key != t.key]
        if not rest:
            continue
        base = statistics.median(rest)
        others[t.rank] = base
        ratios[t.rank] = t.compute_s / base if base > 0 else (1.0 if t.compute_s <= 0
                                                                else float("inf"))
    return ratios, others


class StragglerDetector:
    """Per process: collects this rank's step times and judges the exchanged windows."""

    def __init__(self, rule: StragglerRule) -> None:
        self.rule = rule
        self._compute: list[float] = []
        self._wait: list[float] = []
        self._last_step: int | None = None
        self._size: int | None = None
        self.streaks: dict[str, int] = {}
        """Process key -> consecutive slow windows."""
        self.reported: set[str] = set()
        self.last: list[RankTiming] = []
        self.last_verdict: Verdict | None = None

    def record(self, step: int, size: int, compute_s: float, wait_s: float) -> None:
        """One step's times. A step that does not follow the last one (a restore went back)
        or a new world size (a reset) starts the window afresh: times of another world say
        nothing about this one."""
        if self._last_step is None or step != self._last_step + 1 or size != self._size:
            self._compute.clear()
            self._wait.clear()
        self._compute.append(compute_s)
        self._wait.append(wait_s)
        self._last_step, self._size = step, size

    def due(self, step: int, size: int) -> bool:
        """Every rank asks this after the same step, so every rank joins the same exchange."""
        return self.rule.enabled and size > 1 and step % self.rule.window_steps == 0

    def summary(self, rank: int, host: str, pid: int) -> RankTiming:
        """This rank's window, closed: the next one starts empty."""
        compute = statistics.median(self._compute) if self._compute else 0.0
        wait = statistics.median(self._wait) if self._wait else 0.0
        out = RankTiming(rank, host, pid, len(self._compute), compute, wait)
        self._compute.clear()
        self._wait.clear()
        return out

    def judge(self, timings: list[RankTiming]) -> Verdict:
        """Applies the rule to one exchanged window and updates the streaks."""
        rule = self.rule
        self.last = list(timings)
        present = {t.key for t in timings}
        for key in list(self.streaks):  # a process that left is forgotten
            if key not in present:
                del self.streaks[key]
                self.reported.discard(key)
        need = max(2, int(rule.window_steps * MIN_FILL))
        ratios, others = compare(timings)
        verdict = Verdict(evaluated=bool(timings) and all(t.steps >= need for t in timings),
                          ratios=ratios, others_s=others)
        if verdict.evaluated:
            for t in timings:
                slow = (ratios.get(t.rank, 0.0) > rule.ratio
                        and t.compute_s - others.get(t.rank, t.compute_s) >= rule.min_seconds)
                if slow:
                    self.streaks[t.key] = self.streaks.get(t.key, 0) + 1
                    if self.streaks[t.key] >= rule.windows and t.key not in self.reported:
                        self.reported.add(t.key)
                        verdict.reported.append(t)
                else:
                    self.streaks[t.key] = 0
                    if t.key in self.reported:
                        self.reported.discard(t.key)
                        verdict.cleared.append(t)
        verdict.flagged = sorted(t.rank for t in timings if t.key in self.reported)
        self.last_verdict = verdict
        return verdict
