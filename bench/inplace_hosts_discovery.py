"""In place across hosts that a discovery script adds and drops: what the running job pays.

Every run builds a fresh `Cluster(3)` (the chaos harness's network namespaces with sshd) and
starts exactly the chaos test's job (`DiscoveredRun` of
`tests/chaos/test_chaos_inplace_discovery.py`: `hvd-resilient run --launcher inplace --discovery
SCRIPT --max-np 6 --min-np 2` over `tests/scripts/recipe_job.py`, the AdamW recipe, commits every
4 steps, a durable checkpoint every 8, `--step-time 0.05`; the script prints a hosts file). Once a
step >= 20 has ended, and after a random extra 0-0.5 s, the hosts file changes:

- `join_host`: hosts 0 and 1 listed from the start, host 2 added: its agent starts over ssh, its
  two workers import and set up while the others train, and join at their next commit;
- `leave_host`: all three listed, host 1 dropped: the next generation goes on without its
  members, which the others move to at their next commit;
- `leave_coordinator_host`: all three listed, host 0 dropped (its agent coordinates, it holds
  rank 0 and the generation's store): the same, and host 1's agent coordinates after it.

Per run, from `samples.jsonl` (one line per rank per step: its end time, world size and pid):

- `stall`: the longest gap between two step ends of any member that trains on, from the change
  until 5 steps at the new size, less that member's median gap over the 10 steps before the
  change (so one normal step is not counted);
- `first step`: the change -> the first step at the new size. For a join it includes the
  newcomers' start (ssh, imports: seconds, while the others train); for a leave, up to one
  second of the script's polling interval; `ready -> first step` (join): from the newcomer's
  `joined` event's `ready_at` (set up, waiting) to that step;
- `redone`: steps trained before the change and trained again after it (0: nothing lost);
- `digests equal`: the job ended (exit 0), every rank of the final world wrote `done`, all with
  the same state digests; `starts`: workers started (7 would be one restarted).

Median, p90 and max per scenario. Every job, process and namespace is removed after each run,
also on Ctrl-C or a failure. Needs root, iproute2 and openssh-server (docs/chaos.md).

    .venv/bin/python bench/inplace_hosts_discovery.py --repeats 5 \
        --out bench/results/inplace-hosts-discovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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

from hvd_resilient.events import read_events  # noqa: E402
from tests.chaos.conftest import Chaos  # noqa: E402
from tests.chaos.test_chaos_inplace_discovery import DiscoveredRun  # noqa: E402

CHANGE_AFTER_STEP = 20
POLL_S = 0.05
AFTER_STEPS = 5
"""Steps at the new size looked at for the stall."""
SCENARIOS: dict[str, tuple[list[int], list[int]]] = {
    # scenario: (hosts listed at the start, hosts listed after the change)
    "join_host": ([0, 1], [0, 1, 2]),
    "leave_host": ([0, 1, 2], [0, 2]),
    "leave_coordinator_host": ([0, 1, 2], [1, 2]),
}
SLOTS = 2
STALL_TARGET = 0.04
"""The issue's target for the others' stall at a join (s)."""


def run_once(scenario: str, work: Path, a: argparse.Namespace,
             rng: random.Random) -> dict[str, Any]:
    """One run: cluster, job, change, measurements; always torn down."""
    return torn_down(scenario, work, lambda chaos, name, t_start: _change_and_measure(
        chaos, scenario, name, a, rng, t_start))


def _change_and_measure(chaos: Chaos, scenario: str, name: str, a: argparse.Namespace,
                        rng: random.Random, t_start: float) -> dict[str, Any]:
    before, after = SCENARIOS[scenario]
    c = chaos.cluster(3)
    run = DiscoveredRun(chaos, c, name, [c.hosts[i] for i in before], max_steps=a.max_steps)
    c.adopt(run.job.proc.pid)
    end = t_start + a.timeout
    while not any(s["step"] >= CHANGE_AFTER_STEP for s in steps(run.run)):
        if run.job.proc.poll() is not None:
            raise RuntimeError(f"the job exited ({run.job.proc.poll()}) before step "
                               f"{CHANGE_AFTER_STEP}")
        if time.time() > end:
            raise RuntimeError(f"step {CHANGE_AFTER_STEP} not reached within {a.timeout:g} s")
        time.sleep(POLL_S)
    out: dict[str, Any] = {"startup_s": round(time.time() - t_start, 1),
                           "extra_delay_s": round(rng.uniform(0, 0.5), 3)}
    time.sleep(out["extra_delay_s"])
    first = {s["pid"] for s in steps(run.run)}
    gone = {pid for pid in first if (h := c.host_of_pid(pid)) is not None
            and h.index in set(before) - set(after)}
    stay = first - gone
    size = SLOTS * len(after)
    t0 = run.list([c.hosts[i] for i in after])

    def settled() -> list[dict[str, Any]] | None:
        rows = steps(run.run)
        at = [s for s in rows if s["t"] > t0 and s["size"] == size and s["pid"] in stay]
        return rows if len({s["step"] for s in at}) >= AFTER_STEPS else None

    give_up = min(end, t0 + a.recover_timeout)
    rows = None
    while time.time() < give_up and run.job.proc.poll() is None:
        rows = settled()
        if rows is not None:
            break
        time.sleep(POLL_S)
    if rows is None:
        raise RuntimeError(f"no {AFTER_STEPS} steps at size {size} within "
                           f"{give_up - t0:.0f} s of the change (exit {run.job.proc.poll()})")
    at_size = [s for s in rows if s["t"] > t0 and s["size"] == size]
    out["first_step_s"] = round(min(s["t"] for s in at_size) - t0, 3)
    last_before = max(s["step"] for s in rows if s["t"] <= t0)
    out["redone"] = max(0, last_before + 1 - min(s["step"] for s in at_size))
    horizon = max(s["t"] for s in at_size)
    extra = []
    for pid in stay:
        mine = sorted(s["t"] for s in rows if s["pid"] == pid)
        pre = [b - x for x, b in zip(mine, mine[1:], strict=False) if b <= t0][-10:]
        post = [x for x in mine if x > t0 - 1.0 and x <= horizon]
        gaps = [b - x for x, b in zip(post, post[1:], strict=False)]
        if pre and gaps:
            extra.append(max(gaps) - statistics.median(pre))
    out["stall_s"] = round(max(extra), 3) if extra else None
    if scenario == "join_host":
        joined = [e for e in read_events(run.log) if e["event"] == "joined"]
        if joined:
            ready = min(float(e["ready_at"]) for e in joined)
            out["ready_to_first_step_s"] = round(min(s["t"] for s in at_size) - ready, 3)
    try:
        out["rc"] = run.job.proc.wait(timeout=max(1.0, end - time.time()))
    except subprocess.TimeoutExpired:
        out["rc"] = None
    evs = list(read_events(run.log))
    out["starts"] = sum(e["event"] == "start" for e in evs)
    out["left"] = sum(e["event"] == "left_job" for e in evs)
    out["restored"] = sum(e["event"] == "restore" for e in evs)
    done = {e["rank"]: e["digests"] for e in evs if e["event"] == "done" and "digests" in e}
    out["digests_equal"] = (out["rc"] == 0 and sorted(done) == list(range(size))
                            and len({json.dumps(d, sort_keys=True) for d in done.values()}) == 1)
    return out


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "first_step_s" in r]
    out: dict[str, Any] = {
        "runs": len(runs), "changed": len(ok),
        "digests_equal": sum(bool(r.get("digests_equal")) for r in ok),
        "errors": [r["error"] for r in runs if "error" in r],
        "unclean_teardowns": [r["teardown"] for r in runs if r.get("teardown") != "clean"],
    }
    for m in ("stall_s", "first_step_s", "ready_to_first_step_s", "redone"):
        xs = [r[m] for r in ok if r.get(m) is not None]
        if xs:
            out[m] = stats(xs)
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    def cell(x: dict[str, Any] | None) -> str:
        return "-" if not x else f"{x['median']:g} / {x['p90']:g} / {x['max']:g}"

    lines = ["| change (3 netns hosts x 2, AdamW recipe) | the others' stall, s | change -> "
             "first step at the new size, s | ready -> first step, s | redone | runs ok |",
             "| --- | --- | --- | --- | --- | --- |"]
    for sc, s in summary.items():
        lines.append(f"| {sc} | {cell(s.get('stall_s'))} | {cell(s.get('first_step_s'))} | "
                     f"{cell(s.get('ready_to_first_step_s'))} | {cell(s.get('redone'))} | "
                     f"{s['digests_equal']}/{s['runs']} |")
    lines.append("\n(median / p90 / max; stall: the longest gap between two step ends of a "
                 "member that trains on, less its median step before the change)")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs of each scenario")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument("--max-steps", type=int, default=400, help="the job's length")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="per run, from the launch to the job's end (s)")
    p.add_argument("--recover-timeout", type=float, default=60.0,
                   help="seconds after the change a run may take to settle at the new size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the run folders (logs, events)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" /
                                        "inplace-hosts-discovery.json"))
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
    t_start, load_before = time.time(), os.getloadavg()[0]

    def show_tail(run: str, tail: str) -> None:
        print(f"--- {run}: the job's output, last lines ---\n{tail[-2500:]}\n---", flush=True)

    results, interrupted = run_rows(
        [(sc, lambda work, sc=sc: run_once(sc, work, a, rng)) for sc in chosen], a.repeats,
        "hvd-resilient-inplace-hosts-discovery-", a.keep, show_tail)
    summary = {sc: summarize(runs) for sc, runs in results.items()}
    return write_results(
        a.out, results, summary, table(summary),
        {"settings": {"slots": SLOTS, "change_after_step": CHANGE_AFTER_STEP,
                      "max_steps": a.max_steps, "timeout": a.timeout,
                      "recover_timeout": a.recover_timeout, "seed": a.seed,
                      "repeats": a.repeats},
         "targets": {"join_stall_s": STALL_TARGET}},
        interrupted=interrupted, t_start=t_start, load_before=load_before)


if __name__ == "__main__":
    raise SystemExit(main())
