"""Partition benchmark: a host's link silently down, ours against vanilla Horovod Elastic.

The hosts are the chaos harness's (network namespaces on a private bridge, reached over ssh).

Why a benchmark of its own: a partition sends nothing. No reset, no FIN: nobody learns from
the kernel, so the stacks differ only in how they notice silence. Ours has heartbeats; plain
horovodrun learns when its ssh session's ServerAlive gives up (6-8 s here), and its workers only
at the Gloo timeout. The cut-off side matters too: a worker that trains on (or writes) beside
the survivors is a split brain, so the benchmark also checks whether it stopped.

Each run builds 3 one-slot hosts with the harness (`tests/support/netns.py`, through the chaos
fixture's `Chaos` class, which stops the jobs before the network goes), starts an elastic job,
waits for a commit at size 3 at step >= 20 (training runs, a few commits made), cuts rank 2's
host off (`Cluster.partition`: the veth goes down; its return value is the fault's time) and
reads the shared event log:

- ours: exactly what `test_a_partitioned_host_is_evicted_in_seconds_and_stops_itself` runs
  (`ElasticRun(..., supervised=0)`: `hvd-resilient run` over `tests/scripts/elastic_job.py`,
  heartbeats 1.5 s, Gloo timeout 15 s, the launcher's default cooldown 10-30 s). As there, the
  link is healed inside the cooldown, so the job grows back to 3 and finishes, and the chaos
  test's checks (exactly once, equal digests, ...) run on it. Unlike there, the heal waits
  for the survivors' reset AND for the cut-off workers to be gone (or `--heal-by`, 8 s): healed
  at the reset (1.9 s), the link came back while the cut-off worker's own check (heartbeats
  1.5 s, then a 0.5 s probe of the driver) was still running, and the driver's `kill -9` over
  ssh could have been what ended it.
- vanilla: plain `horovodrun --host-discovery-script` with Horovod's defaults (30 s Gloo
  timeout, a failed host blacklisted for good) over `bench/partition_job.py`
  (`hvd.elastic.run` + `TorchState`: bench/recovery_job.py's vanilla job, commits every 5
  steps like ours). Never healed: nothing would readmit the host. If it has not trained at the
  smaller size `--vanilla-timeout` s after the fault, the run is recorded as "never".

Seconds after the fault, from survivors' events (the cut-off worker's own events are
reported apart):

- detect: the first `failure_detected` (the training loop caught a failed collective; for
  vanilla recorded by partition_job.py where `hvd.elastic.run` restores), `peer_silent`
  (heartbeats) or `hang_detected`;
- driver knew: the launcher's first `Process N exit with status code` line after the fault
  (polled from its console log, so within 0.1 s);
- reset: the first reset to the smaller world (ours: `reset`, after `hvd.init()`; vanilla: the
  reset callback, also after `hvd.init()`);
- first step: the first step at the smaller size (ours: its first samples.jsonl line, written
  before the step's forward pass; vanilla: `enter`, the training function entered after the
  new world's sync);
- steps lost: the most any survivor's restore went back (steps trained since the last commit);
- false resets: rank 0's resets not caused by the fault: any after training began and before
  the fault, and any after it but the shrink to 2 (and, for ours, the growth back to 3 after
  the heal);
- cut-off side stopped: the job's workers on the partitioned host (those running at the
  fault) gone while the host was still cut off (within `--stop-window` s; for ours, before
  the heal), and no event written by them after the fault (the run folder is shared, so a
  cut-off worker can still write there; a real partition would often cut that too). When
  every process of the host that existed at the fault (the ssh sessions too; not the sshd
  listener) was gone is recorded beside it: the sessions end at sshd's ClientAlive.

Every run tears down its job, processes and namespaces in a `finally` (Chaos.close), and checks
that none is left. Prints a markdown table (medians, min-max in brackets) and writes every
run's raw numbers to `--out`. Needs root, iproute2 and openssh-server (docs/chaos.md).

Usage: ``.venv/bin/python bench/partition.py --repeats 5 --vanilla-repeats 3`` (about 13
minutes on the 2 busy cores here: a run of ours takes 75-90 s, it grows back to 3 after its
cooldown; one of vanilla 70-105 s, most of it the 30 s Gloo timeout and the cold start).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from recovery import spread  # noqa: E402  (bench/recovery.py: this script's folder)

from tests.chaos.conftest import Chaos  # noqa: E402
from tests.support.elastic_run import ElasticRun  # noqa: E402
from tests.support.jobs import PYTHON, VENV_BIN, Job, marked_processes, write_discovery  # noqa: E402
from tests.support.netns import (  # noqa: E402
    NETNS_DIR,
    PREFIX,
    REGISTRY,
    SSHD,
    Cluster,
    Host,
    Unavailable,
)

SCENARIO = "partition: rank 2's host cut off (link down), 3 hosts x 1 slot"
SIZE, SMALL = 3, 2  # the world before and after the fault
CUT_RANK = 2  # never rank 0's host: rank 0 keeps the run going and its events are the record
COMMIT_EVERY = 5  # ElasticRun's (elastic_job.py's) commit interval; vanilla gets the same
WARM_STEP = 20  # the fault comes after a commit at size 3 at this step or later
VANILLA_STEPS = 150  # past a 30 s Gloo timeout at step ~20, and done soon after at size 2
POLL_S = 0.1  # how often the event log and the processes are looked at
DETECT_EVENTS = ("failure_detected", "peer_silent", "hang_detected")
RESET_EVENT = {"ours": "reset", "vanilla": "reset_callback"}
METRICS = ("detect_s", "driver_knew_s", "reset_s", "first_step_s", "first_commit_s",
           "steps_lost", "false_resets", "cut_off_workers_gone_s", "cut_off_sessions_gone_s",
           "heal_s", "fault_to_end_s", "run_s")


class VanillaRun(ElasticRun):
    """Plain Horovod Elastic on the harness's hosts: `horovodrun --host-discovery-script`
    with Horovod's defaults over bench/partition_job.py. Only the launch differs from
    ElasticRun; its readers (events, commits, wait_commit, pid_of_rank, host_of_rank) read
    the same event format and are inherited."""

    def __init__(self, chaos: Chaos, cluster: Cluster, name: str) -> None:
        self.cluster, self.name, self.commit_every = cluster, name, COMMIT_EVERY
        self.dir = chaos.tmp / name
        self.run = self.dir / "run"
        self.run.mkdir(parents=True)
        self.hosts_file, discover = write_discovery(self.dir, cluster.hostfile())
        cmd = [str(VENV_BIN / "horovodrun"), "-np", str(SIZE), "--min-np", "1",
               "--max-np", str(SIZE), "--host-discovery-script", str(discover),
               *cluster.horovodrun_args(),
               PYTHON, str(ROOT / "bench" / "partition_job.py"), "--run-dir", str(self.run),
               "--stack", "vanilla", "--steps", str(VANILLA_STEPS),
               "--commit-every", str(COMMIT_EVERY), "--step-time", "0.01"]
        self.job = chaos.jobs.start(cmd, env=cluster.env(chaos.jobs.env()), cwd=self.dir,
                                    name=name)
        cluster.adopt(self.job.proc.pid)
        self.marks = {}


def _running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running (a zombie has ended; is_running() also catches a reused pid)."""
    out = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
    return out


def _procs(pids: list[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            out.append(psutil.Process(pid))
    return out


class CutOff:
    """What ran on the partitioned host when its link went down, and when it ended: the job's
    workers (what could train or write beside the survivors), and everything (their ssh
    sessions too, which end at sshd's ClientAlive, 6-8 s, not by anything the stack does).
    Only processes that existed at the fault count: after the heal a new worker may start
    there."""

    def __init__(self, cluster: Cluster, host: Host, marker: str) -> None:
        self.workers = _procs(cluster.workers(host, marker))
        self.all = _procs(cluster.pids(host))  # workers and ssh sessions, not the listener
        self.workers_gone: float | None = None
        self.all_gone: float | None = None

    def poll(self) -> bool:
        """Notes when the workers, and everything, were first seen gone; True once nothing
        is left."""
        now = time.time()
        if self.workers_gone is None and not _running(self.workers):
            self.workers_gone = now
        if self.all_gone is None and not _running(self.all):
            self.all_gone = now
        return self.all_gone is not None

    def alive(self) -> list[str]:
        out = []
        for p in _running(self.all):
            with contextlib.suppress(psutil.Error):
                out.append(f"{p.pid} {p.name()}")
        return out


class DriverNotice:
    """When the launcher first reported a worker gone after the fault: Horovod prints
    `Process N exit with status code C.` when its ssh session to a worker ends (ServerAlive
    for vanilla, the evictor for ours). The console log has no timestamps, so it is polled."""

    LINE = "exit with status code"

    def __init__(self, job: Job) -> None:
        self.job = job
        self.before = job.output().count(self.LINE)
        self.at: float | None = None

    def poll(self) -> None:
        if self.at is None and self.job.output().count(self.LINE) > self.before:
            self.at = time.time()


def poll(pred: Callable[[], Any], deadline: float, ticks: list[Callable[[], object]]) -> Any:
    """Calls the ticks and then pred every POLL_S until pred is truthy or the deadline
    passes; returns pred's last value. The sleep paces the polling, it waits for nothing."""
    while True:
        for tick in ticks:
            tick()
        value = pred()
        if value or time.time() >= deadline:
            return value
        time.sleep(POLL_S)


def _first(evs: list[dict[str, Any]], t0: float, pred: Callable[[dict], bool]) -> float | None:
    ts = [e["ts"] for e in evs if e["ts"] >= t0 and pred(e)]
    return round(min(ts) - t0, 3) if ts else None


def _first_sample_at(run: Path, size: int, t0: float) -> float | None:
    """ours: the first samples.jsonl line at `size` after t0 (elastic_job.py writes one per
    rank and step, before the forward pass: the step's real start)."""
    try:
        lines = (run / "samples.jsonl").read_text().splitlines()
    except OSError:
        return None
    ts = [r["t"] for r in map(json.loads, lines) if r["size"] == size and r["t"] >= t0]
    return round(min(ts) - t0, 3) if ts else None


def transitions(evs: list[dict[str, Any]], stack: str) -> list[tuple[float, int, int]]:
    """(time, old size, new size) of every reset rank 0 went through. Vanilla's reset
    callback does not say the old size: it is the size of rank 0's event before it."""
    out, size = [], None
    for e in sorted((e for e in evs if e["rank"] == 0), key=lambda e: e["ts"]):
        if e["event"] == RESET_EVENT[stack] and size is not None:
            out.append((e["ts"], int(e.get("old_size", size)), int(e["size"])))
        size = e["size"]
    return out


def measure(run: ElasticRun, stack: str, healed: bool) -> dict[str, Any]:
    """Seconds after the fault (run.marks["fault"]) to each milestone; see the module doc."""
    t0 = run.marks["fault"]
    evs = run.events()
    restarted = min((e["ts"] for e in evs if e["event"] == "start" and e["ts"] > t0),
                    default=math.inf)

    def by_cut_off(e: dict[str, Any]) -> bool:
        """Until a new worker starts, rank 2 of a size-3 world can only be the cut-off one."""
        return e["rank"] == CUT_RANK and e["size"] == SIZE and t0 < e["ts"] < restarted

    cut = [e for e in evs if by_cut_off(e)]
    ok = [e for e in evs if not by_cut_off(e)]
    restores = [e["lost_steps"] for e in ok if e["event"] == "restore" and e["ts"] >= t0]
    first_step = (_first_sample_at(run.run, SMALL, t0) if stack == "ours" else
                  _first(ok, t0, lambda e: e["event"] == "enter" and e["size"] == SMALL))
    commits = [e for e in ok if e["event"] == "commit" and e["rank"] == 0]
    began = commits[0]["ts"] if commits else math.inf
    expected = [(SIZE, SMALL)] + ([(SMALL, SIZE)] if healed else [])
    resets, false = [], 0
    for ts, old, new in transitions(ok, stack):
        resets.append([round(ts - t0, 3), old, new])
        if ts < began:
            continue  # the first world forming, before training
        if ts >= t0 and expected and (old, new) == expected[0]:
            expected.pop(0)
        else:
            false += 1
    before = [e["step"] for e in commits if e["ts"] < t0]
    return {
        "detect_s": _first(ok, t0, lambda e: e["event"] in DETECT_EVENTS),
        "reset_s": _first(ok, t0, lambda e: e["event"] == RESET_EVENT[stack]
                          and e["size"] == SMALL),
        "first_step_s": first_step,
        "first_commit_s": _first(commits, t0, lambda e: e["size"] == SMALL),
        "last_commit_before_fault": before[-1] if before else None,
        "steps_lost": max(restores) if restores else (0 if first_step is not None else None),
        "restores_lost_steps": sorted(restores),
        "false_resets": false,
        "resets": resets,
        "detect_events": sorted({e["event"] for e in ok if e["ts"] >= t0
                                 and e["event"] in DETECT_EVENTS}),
        "cut_off_events": [[e["event"], round(e["ts"] - t0, 3)] for e in cut],
        "finished": any(e["event"] == "done" and e["ts"] >= t0 for e in evs),
    }


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def run_once(stack: str, work: Path, a: argparse.Namespace) -> dict[str, Any]:
    """One run of `stack`: cluster, job, fault, measurements; always torn down."""
    name = f"{stack}-{time.time_ns()}"
    tmp = work / name
    tmp.mkdir(parents=True)
    chaos = Chaos(tmp)
    out: dict[str, Any] = {"stack": stack, "load_before": os.getloadavg()[0]}
    t_start = time.time()
    try:
        out.update(_fault_and_measure(chaos, stack, name, a, t_start))
    except (AssertionError, RuntimeError, subprocess.SubprocessError, OSError) as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    finally:
        out["teardown"] = teardown(chaos)
        out["run_s"] = round(time.time() - t_start, 1)
    return out


def _fault_and_measure(chaos: Chaos, stack: str, name: str, a: argparse.Namespace,
                       t_start: float) -> dict[str, Any]:
    c = chaos.cluster(SIZE)
    run: ElasticRun = (ElasticRun(chaos, c, name, expect_sizes=[SIZE, SMALL, SIZE], supervised=0)
                       if stack == "ours" else VanillaRun(chaos, c, name))
    end = t_start + a.timeout
    run.wait_commit(SIZE, min_step=WARM_STEP, timeout=max(1.0, end - time.time()))
    host = run.host_of_rank(CUT_RANK)
    if host == run.host_of_rank(0):
        raise RuntimeError(f"rank {CUT_RANK} shares rank 0's host {host}")
    cut, driver = CutOff(c, host, run.job.marker), DriverNotice(run.job)
    if not cut.workers:
        raise RuntimeError(f"no worker of the job found on {host}")
    out: dict[str, Any] = {"host": str(host), "cut_off_pids": [p.pid for p in cut.all],
                           "startup_s": round(time.time() - t_start, 1)}
    t0 = run.marks["fault"] = c.partition(host)
    ticks = [cut.poll, driver.poll]
    exited = run.job.proc.poll

    def reset_to_small() -> bool:
        return any(e["event"] == RESET_EVENT[stack] and e["size"] == SMALL and e["ts"] >= t0
                   for e in run.events()) or exited() is not None

    def committed_small() -> bool:
        return any(e["size"] == SMALL and e["ts"] >= t0 for e in run.commits()) or \
            exited() is not None

    recover_by = min(end, t0 + (a.vanilla_timeout if stack == "vanilla" else a.timeout))
    # The stop check runs while the host is still cut off, or a heal could be what ends it.
    # ours: the host must be back inside the launcher's cooldown (10-30 s), as in the chaos
    # test, so it is healed once the cut-off workers are gone and the survivors reset, or at
    # --heal-by; vanilla is never healed (its host is blacklisted for good).
    window = min(a.stop_window, a.heal_by) if stack == "ours" else a.stop_window
    if stack == "ours":
        poll(lambda: cut.workers_gone and reset_to_small(), min(end, t0 + window), ticks)
        out["cut_off_alive_at_heal"] = cut.alive()
        run.marks["heal"] = c.heal(host)
    poll(committed_small, recover_by, ticks)
    poll(cut.poll, min(end, t0 + window), ticks)
    out["cut_off_alive_after_window"] = cut.alive()
    if committed_small():  # recovered: let the job finish (ours grows back to 3 first)
        poll(lambda: exited() is not None, end, ticks)
    out["rc"] = exited()
    out["fault_to_end_s"] = round(time.time() - t0, 1)
    out.update(measure(run, stack, healed="heal" in run.marks))
    out.update(driver_knew_s=_since(driver.at, t0), heal_s=_since(run.marks.get("heal"), t0),
               cut_off_workers_gone_s=_since(cut.workers_gone, t0),
               cut_off_sessions_gone_s=_since(cut.all_gone, t0))
    cut_until = min(run.marks.get("heal", math.inf), t0 + window)
    out["cut_off_gone"] = cut.workers_gone is not None and cut.workers_gone <= cut_until
    out["cut_off_wrote"] = bool(out["cut_off_events"])
    out["cut_off_stopped"] = out["cut_off_gone"] and not out["cut_off_wrote"]
    out["stop_window_s"] = window
    if stack == "ours":  # the chaos test's own checks and timings on the same run
        out["chaos_timings"] = run.timings()
        try:
            run.check([SIZE, SMALL, SIZE], timeout=1.0)
            out["checks"] = "ok"
        except AssertionError as e:
            out["checks"] = str(e).splitlines()[0][:500]
    return out


def teardown(chaos: Chaos) -> str:
    """Stops the jobs and removes the hosts (Chaos.close), then checks that no namespace,
    no process of a job and no registry entry of the run is left: "clean", or what is."""
    ids = [c.run_id for c in chaos.clusters]
    markers = [j.marker for j in chaos.jobs.jobs]
    problems = []
    try:
        chaos.close()
    except Exception as e:  # recorded, and the next run goes on: the sweep retries it
        problems.append(f"close: {e}")
    for run_id in ids:
        problems += [f"namespace {p.name}" for p in NETNS_DIR.glob(f"{PREFIX}-{run_id}-*")]
        if (REGISTRY / f"{run_id}.json").exists():
            problems.append(f"registry entry {run_id}")
    for marker in markers:
        problems += [f"process {p.pid}" for p in marked_processes(marker)]
    return "; ".join(problems) or "clean"


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and ranges over the runs that reached each milestone; `never` counts those
    that did not (an errored run counts in neither)."""
    good = [r for r in runs if "error" not in r]
    out: dict[str, Any] = {
        "runs": len(runs), "errors": len(runs) - len(good),
        "finished": sum(bool(r.get("finished")) and r.get("rc") == 0 for r in good),
        **{k: sum(bool(r.get(k)) for r in good)
           for k in ("cut_off_stopped", "cut_off_gone", "cut_off_wrote")},
    }
    for m in METRICS:
        xs = [r[m] for r in good if r.get(m) is not None]
        out[m] = round(statistics.median(xs), 3) if xs else None
        if len(xs) > 1:
            out[m + "_range"] = [min(xs), max(xs)]
        out[m + "_never"] = len(good) - len(xs)
    return out


def cell(s: dict[str, Any], m: str, unit: str = " s") -> str:
    if s["runs"] == s["errors"]:
        return "-"
    if s[m] is None:
        return "never"
    text = spread(s, m, unit)
    return text + (f", never in {s[m + '_never']}" if s[m + "_never"] else "")


def table(results: dict[str, Any]) -> str:
    lines = [
        "| scenario | stack | runs (finished) | detect | driver knew | reset | first step "
        "| steps lost | false resets | cut-off side stopped |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for stack in ("ours", "vanilla"):
        s = results.get(stack)
        if not s or not s["runs"]:
            continue
        errors = f", {s['errors']} failed" if s["errors"] else ""
        n = s["runs"] - s["errors"]
        gone = (f" at {spread(s, 'cut_off_workers_gone_s')}"
                if s["cut_off_workers_gone_s"] is not None else "")
        stopped = (f"{s['cut_off_stopped']}/{n} (workers gone while cut off "
                   f"{s['cut_off_gone']}/{n}{gone}; wrote after the fault "
                   f"{s['cut_off_wrote']}/{n})")
        lines.append(
            f"| {SCENARIO} | {stack} | {s['runs']} ({s['finished']}){errors} | "
            f"{cell(s, 'detect_s')} | {cell(s, 'driver_knew_s')} | {cell(s, 'reset_s')} | "
            f"{cell(s, 'first_step_s')} | {cell(s, 'steps_lost', '')} | "
            f"{cell(s, 'false_resets', '')} | {stopped} |")
    return "\n".join(lines)


def provenance() -> dict[str, Any]:
    """Where a result file's numbers came from: the command, when, the commit (``-dirty`` when
    tracked files differ from it) and the machine; the multi-host benches open their JSON
    with it."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return {"command": "python " + " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": commit + ("-dirty" if dirty else ""),
            "machine": {"node": platform.node(), "cpus": os.cpu_count(),
                        "platform": platform.platform()}}


def stats(xs: list[float]) -> dict[str, float]:
    """Median, p90 and max, as every bench's table shows them."""
    ordered = sorted(xs)
    return {"median": round(statistics.median(xs), 3),
            "p90": ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)], "max": max(xs)}


def torn_down(scenario: str, work: Path,
              body: Callable[[Chaos, str, float], dict[str, Any]]) -> dict[str, Any]:
    """One run of a multi-host bench: ``body(chaos, name, t_start)``'s measurements in a fresh
    `Chaos` under ``work``, always torn down (`teardown`); an error is recorded, not raised, and
    the job's output tail is kept when the run failed or did not end with equal digests."""
    name = f"{scenario.replace('_', '-')}-{time.time_ns()}"
    tmp = work / name
    tmp.mkdir(parents=True)
    chaos = Chaos(tmp)
    out: dict[str, Any] = {"scenario": scenario, "load_before": round(os.getloadavg()[0], 2)}
    t_start = time.time()
    try:
        out.update(body(chaos, name, t_start))
    except (AssertionError, RuntimeError, subprocess.SubprocessError, OSError,
            psutil.Error) as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    finally:
        jobs = list(chaos.jobs.jobs)
        out["teardown"] = teardown(chaos)
        out["run_s"] = round(time.time() - t_start, 1)
        if jobs and ("error" in out or out.get("rc") != 0 or not out.get("digests_equal")):
            out["output_tail"] = jobs[0].output()[-4000:]  # complete: the job is stopped
    return out


def write_results(out: str, results: dict[str, list[dict[str, Any]]],
                  summary: dict[str, Any], table: str, header: dict[str, Any], *,
                  interrupted: bool, t_start: float, load_before: float,
                  needs_digests: bool = True) -> int:
    """A multi-host bench's end: its table printed, its JSON written (`provenance`, then
    ``header``: the settings and targets, then the load, wall time, summary and every run),
    and its exit code: 130 interrupted, 1 when a run failed, was not torn down cleanly or (with
    ``needs_digests``) did not end with equal digests, else 0."""
    print()
    print(table)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({
        **provenance(), **header,
        "load_before": load_before, "load_after": os.getloadavg()[0],
        "wall_s": round(time.time() - t_start, 1), "interrupted": interrupted,
        "summary": summary, "runs": results}, indent=1) + "\n")
    print(f"\nwrote {out}")
    failed = [r for rs in results.values() for r in rs
              if "error" in r or r.get("teardown") != "clean"
              or (needs_digests and not r.get("digests_equal"))]
    return 130 if interrupted else (1 if failed else 0)


def run_rows(rows: list[tuple[str, Callable[[Path], dict[str, Any]]]], repeats: int,
             prefix: str, keep: bool, show_tail: Callable[[str, Any], None],
             ) -> tuple[dict[str, list[dict[str, Any]]], bool]:
    """Every row's run, ``repeats`` times, the rows taking turns within each repeat (the
    machine's load drifts over all alike), in a fresh work folder removed at the end (kept with
    ``keep``); each run printed as it ends, its ``output_tail`` through ``show_tail``. Ctrl-C
    stops with the runs so far (a run tears itself down): (results by row, interrupted)."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    results: dict[str, list[dict[str, Any]]] = {}
    interrupted = False
    try:
        for i in range(repeats):
            for row, run_once in rows:
                r = run_once(work)
                results.setdefault(row, []).append(r)
                tail = r.pop("output_tail", None)
                print(f"{row} #{i + 1}: {json.dumps(r)}", flush=True)
                if tail is not None:
                    r["output_tail"] = tail
                    show_tail(f"{row} #{i + 1}", tail)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: writing the runs so far", file=sys.stderr)
    finally:
        if keep:
            print(f"run folders kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return results, interrupted


def hosts_unavailable() -> str | None:
    """Why namespaced hosts cannot be built here (a line for the user), None when they can."""
    try:
        Cluster._probe()
    except Unavailable as e:
        return f"network namespaces unavailable (run as root): {e}"
    if not SSHD.exists():
        return f"{SSHD} not found: install openssh-server (make install)"
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs of ours")
    p.add_argument("--vanilla-repeats", type=int, default=3, help="runs of vanilla")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "partition.json"))
    p.add_argument("--timeout", type=float, default=300.0,
                   help="per run, from the launch to the job's end (s)")
    p.add_argument("--vanilla-timeout", type=float, default=120.0,
                   help="vanilla: no step at the smaller size by then after the fault: never")
    p.add_argument("--stop-window", type=float, default=60.0,
                   help="the cut-off side must be gone this long after the fault (s)")
    p.add_argument("--heal-by", type=float, default=8.0,
                   help="ours: heal the link by then after the fault, stop check or not; keep "
                        "it under the launcher's shortest cooldown (10 s) (s)")
    p.add_argument("--keep", action="store_true", help="keep the run folders (logs, events)")
    a = p.parse_args()
    why = hosts_unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="hvd-resilient-partition-"))
    # ours and vanilla take turns: the machine's load drifts over both alike
    order = [st for i in range(max(a.repeats, a.vanilla_repeats))
             for st, n in (("ours", a.repeats), ("vanilla", a.vanilla_repeats)) if i < n]
    t_start = time.time()
    results: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv), "scenario": SCENARIO,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "settings": {"warm_step": WARM_STEP, "commit_every": COMMIT_EVERY,
                     "vanilla_steps": VANILLA_STEPS, "timeout": a.timeout,
                     "vanilla_timeout": a.vanilla_timeout, "stop_window": a.stop_window,
                     "heal_by": a.heal_by},
        "load_before": os.getloadavg()[0],
    }
    runs: dict[str, list[dict[str, Any]]] = {"ours": [], "vanilla": []}
    try:
        for stack in order:
            r = run_once(stack, work, a)
            runs[stack].append(r)
            print(f"{stack} #{len(runs[stack])}: {json.dumps(r)}", flush=True)
    finally:
        if a.keep:
            print(f"run folders kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    for stack, rs in runs.items():
        results[stack] = summarize(rs)
        results[stack + "_runs"] = rs
    results["load_after"] = os.getloadavg()[0]
    results["wall_s"] = round(time.time() - t_start, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"\nwall time {results['wall_s']} s; {a.out}")
    unclean = [r for rs in runs.values() for r in rs if r["teardown"] != "clean" or "error" in r]
    return 1 if unclean else 0


if __name__ == "__main__":
    raise SystemExit(main())
