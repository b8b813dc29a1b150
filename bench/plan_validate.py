"""Does `hvd-resilient plan` predict what `bench/goodput.py` measured? (issue #20)

The planner is run on each configuration of `bench/results/goodput.json` as that benchmark ran
it: 3 one-slot workers on this machine, a worker SIGKILLed every T seconds of training (the
benchmark's own fault times, no Poisson arrivals), a commit every 10 steps, no durable
checkpoints and nothing that relaunches a job that ended (the benchmark starts the driver
directly), the clock from the first step to the deadline, where the job is killed (work since
the last commit is lost).

Inputs are measured, and none comes from the runs being predicted:

- recovery, join, rejoin, commit and step costs from the event logs of separate calibration
  runs of the same configurations (``bench/goodput.py --only ... --keep``; their folders are
  arguments here, and what they measured is stored in the output JSON, so ``--render`` redoes
  the table without them), pooled with this stack's kill runs of `bench/recovery.py`
  (the planner's defaults: `hvd_resilient/report/plan/measured.py`, generated from the
  benchmarks by `bench/plan_constants.py`);
- vanilla Horovod's give-up probability from the recovery benchmark (3 of 11 kill runs never
  recovered), and a second failure during its 30 s wait ends the job (Horovod's driver stops
  when every worker of a rendezvous round has failed);
- detection (fault -> noticed) from the recovery benchmark: an event log cannot show it.

Measured ETTR of a row = the report's productive time of each run (`hvd-resilient report` on
the log up to the deadline: wall minus restart, recovery, rollback, start-up, checkpoint and
commit time) / the benchmark's duration, median over the runs: the same quantity the planner
predicts (time, not samples: on 2 cores throughput does not follow the world size, see
docs/benchmarks.md). Predicted = the median over seeds (the benchmark reports medians), with
the 10-90 % range; the mean is in the JSON. The benchmark's samples-based columns are shown
beside it.

Usage: ``.venv/bin/python bench/plan_validate.py --calibration RUN_OURS RUN_VANILLA``
(seconds; prints the markdown table, writes ``bench/results/plan_validate.json``);
``--render`` recomputes from the stored calibration.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hvd_resilient.report.plan.calibrate import calibrate  # noqa: E402
from hvd_resilient.report.plan.model import CLASSES, Inputs, Job, Value  # noqa: E402
from hvd_resilient.report.plan.simulate import plan_strategy  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BOUND_PP = 3.0
POOLED = ("ours_recover_s", "vanilla_recover_s", "ours_join_stall_s", "vanilla_join_stall_s")
"""Inputs whose calibration samples join the recovery benchmark's (the defaults')."""
FROM_RUN = ("ours_rejoin_s", "commit_s", "step_s")
"""Inputs taken from the calibration runs alone (the recovery benchmark has another job)."""


JITTER = """The benchmark fires every T seconds of wall time, but where a fault lands in the
commit cycle depends on the step times and on how long the previous recovery, rejoin and join
took, which vary from fault to fault by more than a commit interval (2.4 s here; measured join
stalls 0.55-1.87 s, rejoins 14.8-15.3 s). The planner's timings are exact, so a strictly
periodic schedule would hit the same phase of the cycle every time; each fault is moved by a
uniform fraction of one commit interval instead."""


def measured_ettr(run: dict[str, Any], duration: float) -> float:
    return float(run["report"]["productive_s"]) / duration


def calibration(folders: list[str]) -> dict[str, Any]:
    """What the calibration runs measured, by stack, as plain JSON (values + samples)."""
    out: dict[str, Any] = {}
    for folder in folders:
        cal = calibrate(folder)
        entry = out.setdefault(cal.stack, {"runs": [], "values": {}})
        entry["runs"].append({"folder": cal.source, "observed": cal.observed,
                              "notes": cal.notes})
        for name, v in cal.measured.items():
            slot = entry["values"].setdefault(name, {"samples": [], "sources": []})
            slot["samples"] += list(v.samples or (v.value,))
            slot["sources"].append(v.source)
    return out


def inputs_for(stack: str, cal: dict[str, Any]) -> Inputs:
    """The planner's defaults, with the calibration runs' samples pooled in (POOLED) or used
    alone (FROM_RUN); every failure rate 0 (the faults are the benchmark's)."""
    base = Inputs.defaults()
    measured: dict[str, Value] = {}
    runs = {s: c["values"] for s, c in cal.items()}
    mine = runs.get(stack, {})
    ours = runs.get("ours", {})
    for name in POOLED:
        if name in mine:
            pooled = tuple(base.samples(name)) + tuple(mine[name]["samples"])
            measured[name] = Value(statistics.median(pooled),
                                   f"pooled: defaults + {len(mine[name]['samples'])} from "
                                   "calibration runs", pooled)
    for name in FROM_RUN:
        src = mine.get(name) or ours.get(name)
        if src:
            xs = src["samples"]
            v = statistics.fmean(xs) if name == "commit_s" else statistics.median(xs)
            measured[name] = Value(v, "; ".join(src["sources"]), tuple(xs))
    if "ours_rejoin_s" in ours:
        # same launcher flags (--blacklist-cooldown-range 1 2) and the same worker start: the
        # delay before a killed worker is back is Horovod's, whatever the stack
        xs = ours["ours_rejoin_s"]["samples"]
        measured["vanilla_rejoin_s"] = Value(statistics.median(xs), "ours' calibration run "
                                             "(same launcher flags)", tuple(xs))
    overrides = {f"rate_{c}": 0.0 for c in CLASSES}
    if stack == "vanilla-horovod":
        # vanilla's commits carry no duration, so its measured ETTR counts them as training
        overrides["commit_s"] = 0.0
    return Inputs.defaults(overrides, measured)


def predict(cfg: dict[str, Any], duration: float, workers: int, commit_every: int,
            cal: dict[str, Any], seeds: int) -> dict[str, Any]:
    stack = "ours" if cfg["stack"] == "ours" else "vanilla-horovod"
    inp = inputs_for(stack, cal)
    period = cfg["period_s"]
    every = commit_every * inp["step_s"]
    base = np.arange(period, duration, period) if period else np.zeros(0)
    # where a fault lands in the commit cycle: see JITTER
    rng = np.random.default_rng(0)
    faults = tuple(tuple(base + rng.uniform(0.0, every, len(base))) for _ in range(seeds))
    job = Job(gpus=workers, gpus_per_host=1, horizon_s=duration, seeds=seeds,
              include_startup=False, final_commit=False, capacity="time",
              fault_times=faults)
    r = plan_strategy(stack, job, inp, commit_every_s=every,
                      checkpoint_every_s=duration * 1e6, restartable=False)
    xs = np.array(r.ettr_by_seed)
    return {"median": float(np.median(xs)), "mean": float(xs.mean()),
            "p10": float(np.percentile(xs, 10)), "p90": float(np.percentile(xs, 90)),
            "lost_by_cause": r.lost_by_cause, "step_s": inp["step_s"],
            "inputs": {d["name"]: {"value": d["value"], "source": d["source"],
                                   "samples": d["samples"]}
                       for d in inp.describe() if not d["name"].startswith("rate_")}}


def rows(goodput: dict[str, Any], cal: dict[str, Any], seeds: int) -> list[dict[str, Any]]:
    duration = float(goodput["duration_s"])
    out = []
    for cfg in goodput["configs"]:
        s = cfg["summary"]
        meas = statistics.median(measured_ettr(r, duration) for r in cfg["runs"])
        pred = predict(cfg, duration, int(goodput["workers"]), int(goodput["commit_every"]),
                       cal, seeds)
        out.append({
            "config": cfg["name"], "stack": cfg["stack"], "period_s": cfg["period_s"],
            "runs": len(cfg["runs"]),
            "measured_ettr": meas,
            "measured_ettr_runs": [measured_ettr(r, duration) for r in cfg["runs"]],
            "predicted": pred,
            "diff_pp": 100 * (pred["median"] - meas),
            "within_bound": abs(100 * (pred["median"] - meas)) <= BOUND_PP,
            "goodput_vs_fault_free": s.get("goodput"),
            "goodput_load_matched": s.get("goodput_load_matched"),
            "report_goodput": s.get("report_goodput"),
        })
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(res: dict[str, Any]) -> str:
    lines = [
        "| config | runs | measured ETTR (runs) | predicted ETTR, median (10-90 %) | "
        "difference | within 3 pp | bench: goodput vs fault-free | load-matched | "
        "report's goodput |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        p = r["predicted"]
        runs = ", ".join(pct(x) for x in r["measured_ettr_runs"])
        lines.append(
            f"| {r['config']} | {r['runs']} | {pct(r['measured_ettr'])} ({runs}) | "
            f"{pct(p['median'])} ({pct(p['p10'])}-{pct(p['p90'])}) | {r['diff_pp']:+.1f} pp | "
            f"{'yes' if r['within_bound'] else 'no'} | {pct(r['goodput_vs_fault_free'])} | "
            f"{pct(r['goodput_load_matched'])} | {pct(r['report_goodput'])} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", nargs="*", default=[], metavar="RUN_FOLDER",
                   help="run folders of calibration runs (bench/goodput.py --keep)")
    p.add_argument("--goodput", type=Path, default=RESULTS / "goodput.json")
    p.add_argument("--seeds", type=int, default=400)
    p.add_argument("--out", type=Path, default=RESULTS / "plan_validate.json")
    p.add_argument("--render", action="store_true",
                   help="use the calibration stored in --out instead of run folders")
    a = p.parse_args()
    goodput = json.loads(a.goodput.read_text())
    if a.render:
        prev = json.loads(a.out.read_text())
        cal, command = prev["calibration"], prev["command"]
    else:
        if not a.calibration:
            p.error("--calibration RUN_FOLDER ... (or --render)")
        cal, command = calibration(a.calibration), "python " + " ".join(sys.argv)
    res = {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                 capture_output=True, text=True).stdout.strip(),
        "goodput_json": str(a.goodput.relative_to(ROOT) if a.goodput.is_absolute()
                            and ROOT in a.goodput.parents else a.goodput),
        "bound_pp": BOUND_PP, "seeds": a.seeds, "calibration": cal,
        "rows": rows(goodput, cal, a.seeds),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(table(res))
    ok = sum(r["within_bound"] for r in res["rows"])
    print(f"\n{ok} of {len(res['rows'])} rows within {BOUND_PP:g} pp; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
