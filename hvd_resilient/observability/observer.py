"""The one object the trainer holds: step timing, the straggler exchange, the metrics endpoint.

The trainer calls `waited(seconds)` for the time a step spent inside `waiting_for_peers()`,
`step_end(...)` once per step, and `close()` at the end. Per step this costs two clock reads
and two list appends; the collective happens once per straggler window.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.config import ObservabilityOptions
from hvd_resilient.errors import HUNG_EXIT_CODE, exit_now
from hvd_resilient.observability.stragglers import (
    RankTiming,
    StragglerDetector,
    StragglerRule,
    Verdict,
)

logger = logging.getLogger(__name__)

BIND_RETRY_S = 5.0
"""A rank 0 that could not listen (a previous rank 0 on this machine still holds the port
for a moment after a reset) tries again at most this often."""


class LiveStats:
    """What the training loop knows now, for the metrics endpoint to read (one writer, the
    training thread; the endpoint's thread only reads whole values)."""

    def __init__(self) -> None:
        self.step = -1
        self.world_size = 0
        self.rank = -1
        self.compute_s: float | None = None
        self.wait_s: float | None = None
        self.samples: deque[tuple[float, int]] = deque(maxlen=200)
        self.timings: list[RankTiming] = []
        self.verdict: Verdict | None = None

    def add(self, step: int, samples: int, size: int, rank: int, compute_s: float,
            wait_s: float) -> None:
        if self.samples and samples < self.samples[-1][1]:
            self.samples.clear()  # a restore went back: the rate starts afresh
        self.samples.append((time.monotonic(), samples))
        self.step, self.world_size, self.rank = step, size, rank
        self.compute_s, self.wait_s = compute_s, wait_s

    def samples_per_s(self) -> float | None:
        """Over the last steps (at most 200): a rate that follows changes within seconds."""
        points = list(self.samples)
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


def _exit_evicted() -> None:
    exit_now(HUNG_EXIT_CODE)  # as the watchdog: a dead process is what every launcher handles


class Observer:
    """Per worker process; see the module docstring."""

    def __init__(self, options: ObservabilityOptions, *, backend: Any, emit: Callable[..., Any],
                 events_path: str | os.PathLike[str] | None, run_id: str = "",
                 waiting: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
                 on_evict: Callable[[], None] | None = None) -> None:
        self.options = options
        self.backend = backend
        self.emit = emit
        self.rule = StragglerRule.from_options(options)
        self.detector = StragglerDetector(self.rule)
        self.evict = bool(options.straggler_evict)
        self.live = LiveStats()
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self._waiting = waiting or contextlib.nullcontext
        self._on_evict = on_evict or _exit_evicted
        self._wait_s = 0.0
        self._endpoint: Any = None
        self._next_bind = 0.0
        if options.metrics_port:
            from hvd_resilient.observability.metrics import MetricsEndpoint, RunCollector

            collector = RunCollector(events_path, self.live, run_id=run_id,
                                     backend=getattr(backend, "name", ""), host=self.host)
            self._endpoint = MetricsEndpoint(options.metrics_port, options.metrics_addr,
                                             collector)
            self._serve_if_rank0()

    # -- what the trainer calls ----------------------------------------------------------------
    def waited(self, seconds: float) -> None:
        """Time this step spent waiting for the other ranks (inside the collective)."""
        self._wait_s += seconds

    def step_end(self, step: int, started: float, samples: int, size: int) -> None:
        """After every step: `started` is its `time.perf_counter()` at the start."""
        total = time.perf_counter() - started
        wait, self._wait_s = self._wait_s, 0.0
        compute = max(0.0, total - wait)
        self.detector.record(step, size, compute, wait)
        rank = self.backend.rank()
        self.live.add(step, samples, size, rank, compute, wait)
        if self._endpoint is not None:
            self._serve_if_rank0(rank)
        if self.detector.due(step, size):
            self._exchange(rank, step)

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.stop()

    # -- stragglers ------------------------------------------------------------------------------
    def _exchange(self, rank: int, step: int) -> None:
        mine = self.detector.summary(rank, self.host, self.pid)
        with self._waiting():  # a collective: the watchdog treats a stall here as a victim's
            gathered = self.backend.allgather_object(mine)
        verdict = self.detector.judge(list(gathered))
        self.live.timings, self.live.verdict = list(gathered), verdict
        if rank == 0:  # one line per window: what the rule saw, for the report and for tuning
            self.emit(ev.STEP_TIMES, window_steps=self.rule.window_steps,
                      judged=verdict.evaluated, steps=[t.steps for t in gathered],
                      compute_seconds=[round(t.compute_s, 6) for t in gathered],
                      wait_seconds=[round(t.wait_s, 6) for t in gathered],
                      ratios=[round(verdict.ratios.get(t.rank, 0.0), 3) for t in gathered],
                      stragglers=verdict.flagged)
        if rank == 0 and logger.isEnabledFor(logging.DEBUG):
            logger.debug("straggler window at step %d%s: %s", step,
                      "" if verdict.evaluated else " (too few steps: not judged)",
                      ", ".join(f"rank {t.rank} {t.compute_s * 1000:.1f}+{t.wait_s * 1000:.1f} "
                                f"ms x{verdict.ratios.get(t.rank, 0):.2f}" for t in gathered))
        for t in verdict.reported:
            ratio, others = verdict.ratios[t.rank], verdict.others_s[t.rank]
            if rank == 0:
                logger.warning(
                    "straggler: rank %d on %s (pid %d) computes %.2fx the other ranks' median "
                    "(%.4f s vs %.4f s per step) for %d windows of %d steps%s", t.rank, t.host,
                    t.pid, ratio, t.compute_s, others, self.rule.windows,
                    self.rule.window_steps, "; it is evicted" if self.evict else "")
            if t.key != mine.key:
                continue
            self.emit(ev.STRAGGLER, host=t.host, pid=t.pid, ratio=round(ratio, 3),
                      compute_seconds=round(t.compute_s, 6), others_seconds=round(others, 6),
                      wait_seconds=round(t.wait_s, 6), windows=self.rule.windows,
                      window_steps=self.rule.window_steps, threshold=self.rule.ratio)
            if self.evict:
                self.emit(ev.STRAGGLER_EVICTED, host=t.host, pid=t.pid, ratio=round(ratio, 3),
                          exit_code=HUNG_EXIT_CODE)
                logger.error("rank %d is a persistent straggler (%.2fx the others' compute) and "
                          "straggler eviction is on: ending this process so that the job "
                          "goes on without it", rank, ratio)
                self._on_evict()
        for t in verdict.cleared:
            if t.key == mine.key:
                self.emit(ev.STRAGGLER_CLEARED, host=t.host, pid=t.pid,
                          ratio=round(verdict.ratios.get(t.rank, 0.0), 3))
            if rank == 0:
                logger.info("straggler: rank %d on %s keeps pace again (%.2fx)", t.rank, t.host,
                         verdict.ratios.get(t.rank, 0.0))

    # -- the endpoint ---------------------------------------------------------------------------
    def _serve_if_rank0(self, rank: int | None = None) -> None:
        """Rank 0 serves; a process that is no longer rank 0 after a reset stops serving."""
        rank = self.backend.rank() if rank is None else rank
        ep = self._endpoint
        if rank != 0:
            if ep.serving:
                ep.stop()
                logger.debug("metrics endpoint stopped: this process is rank %d now", rank)
            return
        now = time.monotonic()
        if ep.serving or now < self._next_bind:
            return
        self._next_bind = now + BIND_RETRY_S
        try:
            ep.start()
        except OSError as e:
            logger.warning("metrics endpoint: cannot listen on %s:%d (%s); retrying every %.0f s",
                        ep.addr, ep.port, e.strerror or e, BIND_RETRY_S)
            return
        host, port = ep.address or (ep.addr, ep.port)
        logger.info("metrics endpoint: http://%s:%d/metrics", host, port)
