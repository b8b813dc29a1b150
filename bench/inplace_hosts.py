"""In place across hosts: 3 namespaced hosts x 2 workers, one fault, timed from the steps.

Every run builds a fresh `Cluster(3)` (the chaos harness's network namespaces with sshd,
`tests/support/netns.py`, through the chaos fixture's `Chaos` class, which stops the job before
the network goes) and starts exactly the chaos test's job (`InplaceRun` of
`tests/chaos/test_chaos_inplace.py`: `hvd-resilient run --launcher inplace --hosts a:2,b:2,c:2`
over `tests/scripts/recipe_job.py`, the AdamW recipe, commits every 4 steps, a durable
checkpoint every 8, `--step-time 0.05`). Once a step >= 20 has ended, and after a random extra
0-0.5 s, one fault:

- `kill_worker`: SIGKILL one (random) worker on host 2;
- `kill_host`: every process on host 1 SIGKILLed (its agent, workers and ssh session; its sshd
  stays): not rank 0's host;
- `kill_coordinator_host`: every process on host 0 SIGKILLed once (its agent coordinates, it
  holds rank 0 and the generation's store): host 1's agent coordinates from the newest record
  on, and the survivors go on in place;
- `partition`: host 2's link down. `cut-off side stopped`: when host 2's workers were all gone
  (psutil, polled), while still cut off; the link is healed once they are and the others have
  stepped at 4 (or `--stop-window` s after the fault), so the job can finish;
- `partition_coordinator`: host 0's link down (it coordinates, holds rank 0 and the
  generation's store): it stops itself without a majority, host 1's agent coordinates, and the
  other two go on in place; healed as `partition` is;
- `freeze_host`: every process on host 2 SIGSTOPped (not its sshd); once the others have
  stepped at 4 the frozen processes are SIGKILLed, so the job can finish;
- `etcd_kill_host0` / `etcd_kill_host`: with `--etcd` (a 3-member etcd, one member in each
  host's namespace), every process on host 0 (rank 0, most likely the leading agent and so the
  generation's store, and an etcd member) / on host 1 killed: the others go on in place.

Per run, from `samples.jsonl` (one line per rank per step: its end time and pid) and
`events.jsonl`:

- `first step`: the fault -> the first step that ends after it in the recovered world (in place:
  at the new size, 5 or 4, in a process that is not a lost one);
- `redone`: steps trained before the fault and trained again after it;
- `kept pids` (in place): every survivor trains on after the fault in the process it was
  launched as, and no worker was started anew;
- `digests equal`: the job ended (exit 0) and every rank of the final world wrote a `done`
  event, all with the same state digests.

A run that does not recover within `--recover-timeout` (or the job's `--timeout`) counts as
failed; its job output's tail is kept in the JSON and printed. Median, p90 and max per
scenario, beside the issue's targets. Every job, process and namespace is removed after each
run, also on Ctrl-C or a failure (Chaos.close), and the run checks that none is left.
Needs root, iproute2 and openssh-server (docs/chaos.md).

    .venv/bin/python bench/inplace_hosts.py --repeats 5 --out bench/results/inplace-hosts.json
    .venv/bin/python bench/inplace_hosts.py --repeats 1 --scenarios kill_worker,partition
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from inplace_recovery import steps  # noqa: E402  (bench/inplace_recovery.py)
from partition import (  # noqa: E402  (bench/partition.py)
    hosts_unavailable,
    run_rows,
    stats,
    torn_down,
    write_results,
)

from tests.chaos.conftest import Chaos  # noqa: E402
from tests.chaos.test_chaos_inplace import COMMIT_EVERY, InplaceRun, kill_once  # noqa: E402
from tests.support.etcd_cluster import EtcdCluster  # noqa: E402

HOSTS, SLOTS = 3, 2
NP = HOSTS * SLOTS
HIT_AFTER_STEP = 20
POLL_S = 0.02
SCENARIOS: dict[str, tuple[int, int]] = {
    # scenario: (the host hit, the world's size once recovered)
    "kill_worker": (2, NP - 1),
    "kill_host": (1, NP - SLOTS),
    "kill_coordinator_host": (0, NP - SLOTS),
    "partition": (2, NP - SLOTS),
    "partition_coordinator": (0, NP - SLOTS),
    "freeze_host": (2, NP - SLOTS),
    # with --etcd (a member in each host's namespace): host 0 holds rank 0, most likely the
    # leading agent and the generation's store, and an etcd member; all lost at once
    "etcd_kill_host0": (0, NP - SLOTS),
    "etcd_kill_host": (1, NP - SLOTS),
}
TARGETS = {"kill_worker": 0.5, "kill_host": 1.5, "kill_coordinator_host": 3.0,
           "partition": 2.0, "partition_coordinator": 2.0, "freeze_host": 2.5,
           "etcd_kill_host0": 1.5, "etcd_kill_host": 1.5}
"""Seconds, fault -> first step in the recovered world (the issue's targets)."""
CUT_OFF_TARGET = 3.0
PARTITIONS = ("partition", "partition_coordinator")
"""partition: the cut-off side's workers all gone within this (s)."""


def _alive(pids: set[int]) -> set[int]:
    """Those still running (a zombie has ended), as the chaos test polls them."""
    out = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
    return out


class GoneWatch:
    """When every process of ``pids`` was first seen gone (time.time()), or None."""

    def __init__(self, pids: set[int]) -> None:
        self.pids = set(pids)
        self.at: float | None = None

    def poll(self) -> bool:
        if self.at is None and not _alive(self.pids):
            self.at = time.time()
        return self.at is not None


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


def run_once(scenario: str, work: Path, a: argparse.Namespace,
             rng: random.Random) -> dict[str, Any]:
    """One run: cluster, job, fault, measurements; always torn down."""
    return torn_down(scenario, work, lambda chaos, name, t_start: _fault_and_measure(
        chaos, scenario, name, a, rng, t_start))


def _fault_and_measure(chaos: Chaos, scenario: str, name: str, a: argparse.Namespace,
                       rng: random.Random, t_start: float) -> dict[str, Any]:
    hit_index, new_size = SCENARIOS[scenario]
    c = chaos.cluster(HOSTS)
    etcd = None
    if scenario.startswith("etcd_"):
        etcd = EtcdCluster(HOSTS, addresses=[h.addr for h in c.hosts],
                           netns=[h.ns for h in c.hosts])
        c.before_close.append(etcd.close)  # after the job, before the network goes
        etcd.start()
    run = InplaceRun(chaos, c, name, max_steps=a.max_steps, etcd=etcd)
    c.adopt(run.job.proc.pid)  # a sweep after a crash of this process ends it too
    end = t_start + a.timeout
    exited: Callable[[], int | None] = run.job.proc.poll

    while not any(s["step"] >= HIT_AFTER_STEP for s in steps(run.run)):
        if exited() is not None:
            raise RuntimeError(f"the job exited ({exited()}) before step {HIT_AFTER_STEP}")
        if time.time() > end:
            raise RuntimeError(f"step {HIT_AFTER_STEP} not reached within {a.timeout:g} s")
        time.sleep(0.05)
    out: dict[str, Any] = {"startup_s": round(time.time() - t_start, 1)}
    out["extra_delay_s"] = round(rng.uniform(0, 0.5), 3)
    time.sleep(out["extra_delay_s"])
    rows = steps(run.run)
    first = {s["pid"] for s in rows}  # the processes that trained so far
    where: dict[int, int] = {}
    for pid in first:
        h = c.host_of_pid(pid)
        if h is not None:
            where[pid] = h.index
    per_host = [sorted(p for p, i in where.items() if i == k) for k in range(HOSTS)]
    if any(len(pids) != SLOTS for pids in per_host):
        raise RuntimeError(f"expected {SLOTS} live workers per host, found {per_host}")
    rank0 = where.get(max((s for s in rows if s["rank"] == 0), key=lambda s: s["t"])["pid"])
    if (hit_index == 0) != (rank0 == hit_index):
        raise RuntimeError(f"rank 0 is on host {rank0}: does not fit {scenario}")
    host = c.hosts[hit_index]
    on_host = set(per_host[hit_index])
    frozen: list[int] = []

    if scenario == "kill_worker":
        victim = rng.choice(sorted(on_host))
        t0 = c.kill_pid(victim)
        lost = {victim}
    elif scenario == "kill_coordinator_host":  # once, as the chaos test does
        t0 = kill_once(c, host)
        lost = on_host
    elif scenario in ("kill_host", "etcd_kill_host0", "etcd_kill_host"):
        t0, killed = c.kill_host(host)
        out["killed"] = len(killed)
        lost = on_host
    elif scenario in PARTITIONS:
        t0 = c.partition(host)
        lost = on_host
    else:  # freeze_host
        t0, frozen = c.freeze_host(host)
        out["frozen"] = len(frozen)
        lost = on_host
    out["fault_at_s"] = round(t0 - t_start, 1)  # after the launch
    watch = GoneWatch(on_host) if scenario in PARTITIONS else None  # the cut-off side

    def recovered_step() -> dict[str, Any] | None:
        after = [s for s in steps(run.run) if s["t"] > t0 and s["pid"] not in lost
                 and s["size"] == new_size]
        return min(after, key=lambda s: s["t"]) if after else None

    give_up = min(end, t0 + a.recover_timeout)
    recovered: dict[str, Any] | None = None
    undone = scenario in (*PARTITIONS, "freeze_host")  # the fault still to be undone
    while time.time() < give_up:
        if watch is not None:
            watch.poll()
        if recovered is None:
            recovered = recovered_step()
        if undone and scenario in PARTITIONS and (
                (recovered is not None and watch is not None and watch.at is not None)
                or time.time() > t0 + a.stop_window):
            out["healed_s"] = round(c.heal(host) - t0, 3)
            undone = False
        if undone and scenario == "freeze_host" and recovered is not None:
            out["frozen_killed_s"] = round(time.time() - t0, 3)
            for pid in frozen:  # SIGKILL ends a stopped process too
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            undone = False
        if recovered is not None and not undone and (watch is None or watch.at is not None
                                                     or time.time() > t0 + a.stop_window):
            break
        if exited() is not None and recovered is None:
            break
        time.sleep(POLL_S)
    if watch is not None:
        out["cut_off_stopped_s"] = _since(watch.at, t0)
    if recovered is None:
        raise RuntimeError(f"did not recover within {give_up - t0:.0f} s of the fault "
                           f"(launcher exit {exited()})")
    rows = steps(run.run)
    last_before = max(s["step"] for s in rows if s["t"] <= t0)
    out["first_step_s"] = round(recovered["t"] - t0, 3)
    out["redone"] = max(0, last_before + 1 - recovered["step"])
    out["recovered_size"] = recovered["size"]

    try:
        out["rc"] = run.job.proc.wait(timeout=max(1.0, end - time.time()))
    except subprocess.TimeoutExpired:
        out["rc"] = None
        out["finish_error"] = f"recovered, but the job did not end within {a.timeout:g} s"
    out["fault_to_end_s"] = round(time.time() - t0, 1)
    evs = run.events()
    rows = steps(run.run)
    survivors = first - lost
    after = {s["pid"] for s in rows if s["t"] > t0 and s["size"] == new_size}
    out["kept_pids"] = survivors <= after and not (after - first)
    out["starts"] = sum(e["event"] == "start" for e in evs)
    if scenario in PARTITIONS:  # the chaos test's check: the old world wrote nothing
        out["cut_off_wrote"] = [[e["event"], round(e["ts"] - t0, 3)] for e in evs
                                if e["ts"] > t0 + 0.5 and e.get("size") == NP and e["event"]
                                in ("commit", "memory_commit", "checkpoint_saved")]
    done: dict[int, Any] = {e["rank"]: e["digests"] for e in evs
                            if e["event"] == "done" and "digests" in e and e["ts"] > t0}
    out["done_ranks"] = sorted(done)
    out["digests_equal"] = (out["rc"] == 0 and sorted(done) == list(range(new_size))
                            and len({json.dumps(d, sort_keys=True) for d in done.values()}) == 1)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "first_step_s" in r]
    out: dict[str, Any] = {
        "runs": len(runs), "recovered": len(ok),
        "finished": sum(r.get("rc") == 0 for r in ok),
        "digests_equal": sum(bool(r.get("digests_equal")) for r in ok),
        "errors": [r["error"] for r in runs if "error" in r],
        "unclean_teardowns": [r["teardown"] for r in runs if r.get("teardown") != "clean"],
    }
    for m in ("first_step_s", "redone", "cut_off_stopped_s"):
        xs = [r[m] for r in ok if r.get(m) is not None]
        if xs:
            out[m] = stats(xs)
        never = sum(m in r and r[m] is None for r in ok)
        if never:
            out[m + "_never"] = never
    kept = [r["kept_pids"] for r in ok if "kept_pids" in r]
    if kept:
        out["kept_pids"] = f"{sum(kept)}/{len(kept)}"
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    def cell(x: dict[str, Any] | None) -> str:
        return f"{x['median']} / {x['p90']} / {x['max']}" if x else "-"

    def target(x: dict[str, Any] | None, limit: float) -> str:
        if not x:
            return f"<= {limit:g}"
        return f"<= {limit:g} ({'met' if x['p90'] <= limit else 'missed'} at p90)"

    lines = [
        "| scenario | recovered | kill -> first step, s (median / p90 / max) | target, s "
        "| redone steps (median / max) | survivors kept their pids | digests equal "
        "| cut-off side stopped, s (median / p90 / max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for sc, s in summary.items():
        d = s.get("redone")
        stop = s.get("cut_off_stopped_s")
        stop_cell = "-"
        if sc in PARTITIONS:
            stop_cell = f"{cell(stop)}, target {target(stop, CUT_OFF_TARGET)}"
        if s.get("cut_off_stopped_s_never"):
            stop_cell += f", never in {s['cut_off_stopped_s_never']}"
        lines.append(
            f"| {sc} | {s['recovered']}/{s['runs']} | {cell(s.get('first_step_s'))} | "
            f"{target(s.get('first_step_s'), TARGETS[sc])} | "
            + (f"{d['median']} / {d['max']}" if d else "-")
            + f" | {s.get('kept_pids', '-')}"
            f" | {s['digests_equal']}/{s['recovered']} | {stop_cell} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs of each scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument("--max-steps", type=int, default=80, help="the job's length (the test's)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="per run, from the launch to the job's end (s)")
    p.add_argument("--recover-timeout", type=float, default=60.0,
                   help="seconds after the fault a run may take to recover")
    p.add_argument("--stop-window", type=float, default=10.0,
                   help="partition: heal by then after the fault even if the cut-off side "
                        "still runs, and stop watching it (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the run folders (logs, events)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "inplace-hosts.json"))
    a = p.parse_args()
    chosen = [s for s in a.scenarios.split(",") if s]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; scenarios: {', '.join(SCENARIOS)}")
    why = hosts_unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    t_start = time.time()
    load_before = os.getloadavg()[0]

    def show_tail(run: str, tail: str) -> None:
        print(f"--- {run}: the job's output, last lines ---\n{tail[-2500:]}\n---", flush=True)

    results, interrupted = run_rows(
        [(sc, lambda work, sc=sc: run_once(sc, work, a, rng)) for sc in chosen], a.repeats,
        "hvd-resilient-inplace-hosts-", a.keep, show_tail)
    summary = {sc: summarize(runs) for sc, runs in results.items()}
    return write_results(
        a.out, results, summary, table(summary),
        {"settings": {"hosts": HOSTS, "slots": SLOTS, "commit_every": COMMIT_EVERY,
                      "hit_after_step": HIT_AFTER_STEP, "max_steps": a.max_steps,
                      "timeout": a.timeout, "recover_timeout": a.recover_timeout,
                      "stop_window": a.stop_window, "seed": a.seed, "repeats": a.repeats},
         "targets": {**TARGETS, "partition_cut_off_stopped": CUT_OFF_TARGET}},
        interrupted=interrupted, t_start=t_start, load_before=load_before)


if __name__ == "__main__":
    raise SystemExit(main())
