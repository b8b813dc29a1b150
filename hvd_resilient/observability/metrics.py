"""The Prometheus endpoint: what a cluster's monitoring scrapes from a running job.

Rank 0 serves it (`observability.metrics_port`, 0: off), for three reasons: a job is one scrape
target whatever its size and however its ranks are renumbered; rank 0 already holds every
rank's step times (the straggler exchange hands them to every rank); and the run-wide counts
come from the run's event log, which every rank, the Horovod driver and the supervisor append
to, so one reader sees them all. A process that stops being rank 0 at a reset stops serving and
the new rank 0 starts (the scrape target's address moves with it when it is on another host:
point the scraper at the job's service or at each host's port).

Two sources, read at scrape time on the endpoint's own thread, never on the training thread:

* live values the training loop leaves in `LiveStats` (step, samples/s, world size, the last
  straggler window's per-rank numbers);
* run totals from `events.jsonl`, read incrementally from where the last scrape stopped (a
  torn last line is left for the next scrape). They count the whole run as its log recorded
  it, earlier launches included, so they do not fall to zero when a restarted job's rank 0
  comes back. Goodput and lost time are the report's own arithmetic: `hvd-resilient report
  --json` run in a child process at low priority (`ReportInChild`), never in this one, where
  its pass over a long log would hold the interpreter lock against the training thread and
  make rank 0 look like a straggler. A scrape serves its last result and never waits for it.

Metric names, labels and meanings are listed in docs/observability.md.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from hvd_resilient import event_names as ev
from hvd_resilient.events import ckpt_step

logger = logging.getLogger(__name__)

PREFIX = "hvd_resilient_"
RECOVERY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds: in-memory recoveries take under a second to a few seconds; a driver waiting for
hosts takes minutes."""
GOODPUT_MIN_S = 5.0
GOODPUT_SHARE = 0.05
"""The report reads the whole log: it runs at most every GOODPUT_MIN_S, and waits at least
1/GOODPUT_SHARE times as long as the last one took, so that a long run's log never costs rank
0's host more than this share of a core."""
REPORT_NICE = 10
FAILURE_CLASSES = ("hang", "straggler", "silent", "hangup", "collective")
"""How a failure was found, most specific first: the progress watchdog (`hang_detected`),
straggler eviction (`straggler_evicted`), heartbeats (`peer_silent`), a peer's hang-up
(`failure_detected` naming it), or a collective that failed otherwise."""
RESET_CAUSES = ("failure", "hosts_changed")
CHECKPOINT_TIERS = ("durable", "memory")


class EventTally:
    """Run totals from the event log, read a little more at each `refresh()`."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._offset = 0
        self.events: Counter[str] = Counter()
        self.resets: Counter[str] = Counter({c: 0 for c in RESET_CAUSES})
        self.failures: Counter[str] = Counter({c: 0 for c in FAILURE_CLASSES})
        self.restarts = 0
        self.recovery_s: list[float] = []
        self.last: dict[str, tuple[float, int]] = {}
        """Checkpoint tier -> (ts, step) of the newest one."""
        self._pending: dict[str, Any] | None = None
        """The recovery being detected: first detection time, cause, classes seen."""
        self._awaiting: tuple[float, float] | None = None
        """(detected, reset done) of a reset whose rank-0 sync has not been seen yet."""

    def refresh(self) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1  # a torn last line waits for the next scrape
        for raw in data[:end].splitlines():
            try:
                rec = json.loads(raw)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("event"), str):
                self.add(rec)
        self._offset += end

    def add(self, e: dict[str, Any]) -> None:
        """One event, in log order."""
        kind, ts = e["event"], _num(e.get("ts"))
        self.events[kind] += 1
        rank0 = e.get("rank") == 0
        if kind in (ev.FAILURE_DETECTED, ev.PEER_SILENT, ev.HANG_DETECTED, ev.STRAGGLER_EVICTED):
            p = self._detecting(ts, "failure")
            p["cause"] = "failure"
            if kind == ev.FAILURE_DETECTED:
                p["classes"].add("hangup" if e.get("peer_hangup") else "collective")
            else:
                p["classes"].add({ev.PEER_SILENT: "silent", ev.HANG_DETECTED: "hang",
                                  ev.STRAGGLER_EVICTED: "straggler"}[kind])
        elif kind == ev.HOSTS_CHANGED:
            self._detecting(ts, "hosts_changed")
        elif kind == ev.RESET and rank0:
            # One rank-0 reset per recovery: the new world's rank 0 writes it.
            pending, self._pending = self._pending, None
            cause = pending["cause"] if pending else "failure"
            self.resets[cause] += 1
            if cause == "failure":
                self.failures[_failure_class(pending["classes"] if pending else set())] += 1
            detected = pending["ts"] if pending else ts - _num(e.get("seconds"))
            self._awaiting = (detected, ts)
        elif kind == ev.SYNC and rank0 and self._awaiting:
            self.recovery_s.append(max(0.0, ts - self._awaiting[0]))
            self._awaiting = None
        elif kind == ev.RESTART:  # the supervisor relaunches the whole job
            self.restarts += 1
            if self._pending and self._pending["cause"] == "failure":
                self.failures[_failure_class(self._pending["classes"])] += 1
            self._pending = self._awaiting = None
        if kind == ev.COMMIT and rank0:
            if self._awaiting:  # hosts were only removed: no sync, training went on at reset
                self.recovery_s.append(max(0.0, self._awaiting[1] - self._awaiting[0]))
                self._awaiting = None
            self.last["memory"] = (ts, int(_num(e.get("step"))))
        elif kind == ev.CHECKPOINT_SAVED:
            if ts >= self.last.get("durable", (0.0, 0))[0]:
                self.last["durable"] = (ts, int(_num(ckpt_step(e))))

    def _detecting(self, ts: float, cause: str) -> dict[str, Any]:
        if self._pending is None:
            self._pending = {"ts": ts, "cause": cause, "classes": set()}
        self._pending["ts"] = min(self._pending["ts"], ts)
        return self._pending


def _failure_class(classes: set[str]) -> str:
    return next((c for c in FAILURE_CLASSES if c in classes), "collective")


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


class RunCollector:
    """A prometheus_client collector: every family is built at scrape time."""

    def __init__(self, events_path: str | os.PathLike[str] | None, live: Any, *,
                 run_id: str = "", backend: str = "", host: str = "") -> None:
        self.tally = EventTally(events_path)
        self.live = live
        self.info = {"run_id": run_id, "backend": backend, "host": host, "pid": str(os.getpid())}
        self._lock = threading.Lock()  # two scrapers at once must not read the log twice
        self.report = ReportInChild(events_path)

    def close(self) -> None:
        self.report.close()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            self.tally.refresh()
            yield from self._run()
            yield from self._live()
            yield from self._totals()
            yield from self._stragglers()
            yield from self._goodput_families()

    # -- families ---------------------------------------------------------------------------------
    def _run(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(PREFIX + "run_info", "The job this endpoint belongs to (1).",
                                 labels=list(self.info))
        info.add_metric(list(self.info.values()), 1.0)
        yield info

    def _live(self) -> Iterator[Metric]:
        live = self.live
        yield _gauge("step", "Optimizer steps done (the training state's step).",
                     live.step if live.step >= 0 else None)
        yield _gauge("samples_per_second",
                     "Samples trained per second over the last steps (all ranks together).",
                     live.samples_per_s())
        yield _gauge("world_size", "Ranks training now.", live.world_size or None)
        yield _gauge("step_compute_seconds",
                     "Rank 0's compute time in its last step (step minus waiting for peers).",
                     live.compute_s)
        yield _gauge("step_wait_seconds",
                     "Rank 0's time waiting for the other ranks in its last step.", live.wait_s)

    def _totals(self) -> Iterator[Metric]:
        t = self.tally
        events = CounterMetricFamily(PREFIX + "events", "Events in the run's log, by kind "
                                     "(every rank, the driver and the supervisor).",
                                     labels=["event"])
        for kind, n in sorted(t.events.items()):
            events.add_metric([kind], n)
        yield events
        resets = CounterMetricFamily(PREFIX + "resets", "In-memory recoveries (elastic resets) "
                                     "by cause.", labels=["cause"])
        for cause, n in sorted(t.resets.items()):
            resets.add_metric([cause], n)
        yield resets
        failures = CounterMetricFamily(
            PREFIX + "failures", "Failures by how they were found: hang (progress watchdog), "
            "straggler (evicted), silent (heartbeats), hangup (a peer's connections closed), "
            "collective (a collective failed otherwise).", labels=["class"])
        for cls, n in sorted(t.failures.items()):
            failures.add_metric([cls], n)
        yield failures
        yield CounterMetricFamily(PREFIX + "restarts", "Full restarts of the job by the "
                                  "supervisor (`hvd-resilient run`).", value=t.restarts)
        yield _histogram("recovery_seconds", "In-memory recovery: detection to training going "
                         "on (the new world's first sync).", t.recovery_s, RECOVERY_BUCKETS)
        now = time.time()
        age = GaugeMetricFamily(PREFIX + "checkpoint_age_seconds", "Seconds since the newest "
                                "checkpoint: durable (in the store) or memory (in-memory "
                                "commit).", labels=["tier"])
        step = GaugeMetricFamily(PREFIX + "checkpoint_step", "Step of the newest checkpoint.",
                                 labels=["tier"])
        for tier in CHECKPOINT_TIERS:
            if tier in t.last:
                ts, s = t.last[tier]
                age.add_metric([tier], max(0.0, now - ts))
                step.add_metric([tier], s)
        yield age
        yield step

    def _stragglers(self) -> Iterator[Metric]:
        t, live = self.tally, self.live
        yield CounterMetricFamily(PREFIX + "straggler_reports", "Straggler reports "
                                  "(`straggler` events) in the run.",
                                  value=t.events.get(ev.STRAGGLER, 0))
        yield CounterMetricFamily(PREFIX + "straggler_evictions", "Stragglers evicted "
                                  "(`straggler_evicted` events).",
                                  value=t.events.get(ev.STRAGGLER_EVICTED, 0))
        verdict = live.verdict
        flagged = set(verdict.flagged) if verdict else set()
        yield _gauge("stragglers", "Ranks reported as stragglers after the last window.",
                     len(flagged) if verdict else None)
        ratio = GaugeMetricFamily(PREFIX + "straggler_ratio", "Each rank's median compute over "
                                  "the last window / the other ranks' median.",
                                  labels=["rank", "host"])
        compute = GaugeMetricFamily(PREFIX + "rank_compute_seconds", "Each rank's median "
                                    "compute per step over the last window.",
                                    labels=["rank", "host"])
        wait = GaugeMetricFamily(PREFIX + "rank_wait_seconds", "Each rank's median wait for "
                                 "its peers per step over the last window.",
                                 labels=["rank", "host"])
        for timing in live.timings:
            labels = [str(timing.rank), timing.host]
            if verdict and timing.rank in verdict.ratios:
                ratio.add_metric(labels, verdict.ratios[timing.rank])
            compute.add_metric(labels, timing.compute_s)
            wait.add_metric(labels, timing.wait_s)
        yield ratio
        yield compute
        yield wait

    def _goodput_families(self) -> Iterator[Metric]:
        doc = self.report.poll()
        yield _gauge("goodput_ratio", "Productive time / wall time so far, as "
                     "`hvd-resilient report` counts it.", doc.get("goodput") if doc else None)
        lost = GaugeMetricFamily(PREFIX + "lost_seconds", "Time lost so far by category, as "
                                 "`hvd-resilient report` counts it.", labels=["category"])
        for cat, secs in sorted((doc or {}).get("lost_s", {}).items()):
            lost.add_metric([cat], secs)
        yield lost


class ReportInChild:
    """`python -m hvd_resilient.report RUN --json --no-plot` in a child process at low priority,
    its output in a temporary file (a pipe would fill up on a long run's JSON and stall it).
    `poll()` starts one when it is due, collects a finished one, and never blocks."""

    def __init__(self, events_path: str | os.PathLike[str] | None) -> None:
        self.path = Path(events_path) if events_path else None
        self.result: dict[str, Any] | None = None
        self.runs = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._out: Any = None
        self._started = 0.0
        self._next = 0.0

    def poll(self) -> dict[str, Any] | None:
        now = time.monotonic()
        if self._proc is not None and self._proc.poll() is not None:
            self._collect(now)
        if self._proc is None and now >= self._next and self.path and self.path.is_file():
            self._start(now)
        return self.result

    def _start(self, now: float) -> None:
        self._out = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "hvd_resilient.report", str(self.path), "--json",
                 "--no-plot"], stdout=self._out, stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL, close_fds=True)
        except OSError as e:
            logger.debug("goodput: cannot start the report: %s", e)
            self._out.close()
            self._next = now + GOODPUT_MIN_S
            return
        try:
            os.setpriority(os.PRIO_PROCESS, self._proc.pid, REPORT_NICE)
        except OSError:
            pass  # already gone, or not allowed: it runs at normal priority
        self._started = now

    def _collect(self, now: float) -> None:
        proc, out, self._proc, self._out = self._proc, self._out, None, None
        took = now - self._started
        self._next = self._started + max(GOODPUT_MIN_S, took / GOODPUT_SHARE)
        self.runs += 1
        try:
            out.seek(0)
            doc = json.loads(out.read()) if proc is not None and proc.returncode == 0 else None
        except ValueError:
            doc = None
        finally:
            out.close()
        if isinstance(doc, dict):
            self.result = {"goodput": doc.get("goodput"), "lost_s": doc.get("lost_s") or {}}

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        if self._out is not None:
            self._out.close()
            self._out = None


def _gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
    """A gauge family; without a value it is served with no sample (not yet known)."""
    g = GaugeMetricFamily(PREFIX + name, doc)
    if value is not None:
        g.add_metric([], float(value))
    return g


def _histogram(name: str, doc: str, values: list[float],
               buckets: tuple[float, ...]) -> HistogramMetricFamily:
    cumulative = [(repr(b), float(sum(v <= b for v in values))) for b in buckets]
    cumulative.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(PREFIX + name, doc, buckets=cumulative,
                                 sum_value=float(sum(values)))


class MetricsEndpoint:
    """prometheus_client's HTTP server on a private registry (never the global one: a second
    trainer in the same process, or a test, gets its own)."""

    def __init__(self, port: int, addr: str, collector: RunCollector) -> None:
        self.port = port
        self.addr = addr
        self.collector = collector
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def address(self) -> tuple[str, int] | None:
        if self._server is None:
            return None
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def start(self) -> None:
        """Listens now; raises OSError when the port is taken."""
        self._server, self._thread = start_http_server(self.port, self.addr, self.registry)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        self.collector.close()
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
