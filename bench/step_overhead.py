"""Per-step cost of ours against plain Horovod Elastic, with no fault at all.

Why: the goodput benchmark's fault-free runs of ours trained at 548 samples/s where vanilla's
runs with one fault trained at 602 between faults (12-03). A resilient trainer must not tax
the steps of a job that never fails. Here `bench/goodput_job.py` (the tiny transformer of
`examples/tiny_lm.py`, AdamW, commit every 10 steps) trains `--steps` steps and ends, under
the same launchers as the goodput benchmark (one-slot host names of this machine, ours through
`hvd_resilient.launch.horovod.driver` as `hvd-resilient run` starts it, vanilla through
`horovodrun`), in turns: ours, ours without the per-step host check
(`host_check_every=0`), vanilla, the order rotated at each repeat (this VM's speed drifts by
tens of per cent within minutes: whoever ran first in every repeat was slowest in one run of
this script). The rate is rank 0's steps per second between its commit at a fifth of the run
(start-up and warm-up excluded) and its last commit; "paired" is each run's rate over the
vanilla run of the same repeat, the median of those.

Usage: ``.venv/bin/python bench/step_overhead.py --repeats 3`` (9 runs of about 100 s on two
cores). Prints a markdown table and writes ``bench/results/step_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

from goodput import job_launch  # noqa: E402
from recovery import local_names  # noqa: E402

from hvd_resilient.events import read_events  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CONFIGS = (("ours", "ours", 1), ("ours, no host check", "ours", 0), ("vanilla", "vanilla", 1))


def run_once(stack: str, host_check_every: int, steps: int, work: Path) -> dict[str, Any]:
    run = work / f"{stack}-{host_check_every}-{time.time_ns()}"
    run.mkdir(parents=True)
    cmd, env = job_launch(run, stack, [], ["--commit-every", "10", "--max-steps", str(steps),
                                           "--host-check-every", str(host_check_every)])
    load_before = os.getloadavg()[0]
    t0 = time.time()
    with open(run / "console.log", "wb") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, timeout=30 * 60).returncode
    commits = [e["ts"] for e in read_events(run / "events.jsonl")
               if e["event"] == "commit" and e.get("rank") == 0]
    first = len(commits) // 5
    rate = ((len(commits) - 1 - first) * 10 / (commits[-1] - commits[first])
            if len(commits) > first + 1 else None)
    return {"rc": rc, "wall_s": round(time.time() - t0, 2), "workers": len(local_names()),
            "commits": len(commits), "steps_per_s": round(rate, 3) if rate else None,
            "load_before": load_before}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["steps_per_s"] for r in runs if r["steps_per_s"]]
    return {"runs": len(runs), "finished": sum(r["rc"] == 0 for r in runs),
            "median": statistics.median(rates) if rates else None,
            "min": min(rates, default=None), "max": max(rates, default=None)}


def table(results: dict[str, Any]) -> str:
    base = results["configs"]["vanilla"]["summary"]["median"]
    lines = ["| stack | runs (finished) | steps/s: median / min / max | median vs vanilla "
             "| paired vs vanilla (median) |", "| --- | --- | --- | --- | --- |"]
    for name, c in results["configs"].items():
        s = c["summary"]
        ratio = f"{s['median'] / base:.2f}" if s["median"] and base else "-"
        paired = f"{s['paired']:.2f}" if s["paired"] else "-"
        lines.append(f"| {name} | {s['runs']} ({s['finished']}) | {s['median']:.2f} / "
                     f"{s['min']:.2f} / {s['max']:.2f} | {ratio} | {paired} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "step_overhead.json")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvd-resilient-overhead-"))
    results: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv), "steps": a.steps,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "configs": {name: {"stack": stack, "host_check_every": every, "runs": []}
                    for name, stack, every in CONFIGS},
    }
    try:
        for i in range(a.repeats):  # in turns: the machine's drift is shared by every stack
            for name, stack, every in CONFIGS[i % 3:] + CONFIGS[:i % 3]:
                r = run_once(stack, every, a.steps, work)
                r["repeat"] = i
                print(f"{name} #{i + 1}: {json.dumps(r)}", flush=True)
                results["configs"][name]["runs"].append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    vanilla = {r["repeat"]: r["steps_per_s"] for r in results["configs"]["vanilla"]["runs"]}
    for c in results["configs"].values():
        c["summary"] = summarize(c["runs"])
        paired = [r["steps_per_s"] / vanilla[r["repeat"]] for r in c["runs"]
                  if r["steps_per_s"] and vanilla.get(r["repeat"])]
        c["summary"]["paired"] = statistics.median(paired) if paired else None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
