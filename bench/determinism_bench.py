"""What `--deterministic` costs: default vs deterministic reductions, side by side (not a test).

Every run is launched as a user launches it, three workers on this machine:
`hvd-resilient run --backend horovod` (discovery, three one-slot hosts of 127.0.0.1) and
`--backend torchrun`; `bench/determinism_job.py` trains with `Trainer`, deterministic mode
through HVD_RESILIENT_DETERMINISTIC=1 (what `--deterministic` sets). Workloads: the digits MLP
(4 parameter tensors) at two widths and the tiny transformer of `examples/tiny_lm.py` (28
tensors, many small ones: where reducing each tensor alone costs most). The two modes of a
workload run back to back, in alternating order from repeat to repeat, so that the load of
this shared machine hits both alike.

Throughput: rank 0's `progress` events (samples/s over each `--log-every` window of the
workload) after the first window (warm-up), median per run, then median over the repeats.
Also recorded: each run's final parameter digest (deterministic runs of a workload should all
agree; default runs usually do not) and the load average before and after.

Usage: ``.venv/bin/python bench/determinism_bench.py --repeats 3`` (about 20-30 minutes on the
2-core machine); prints a markdown table and writes ``bench/results/determinism.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
JOB = str(ROOT / "bench" / "determinism_job.py")

WORKLOADS: dict[str, list[str]] = {
    "digits-64": ["--model", "digits", "--hidden", "64", "--max-steps", "300",
                  "--log-every", "20"],
    "digits-2048": ["--model", "digits", "--hidden", "2048", "--max-steps", "200",
                    "--log-every", "20"],
    "tinylm-64x2": ["--model", "tinylm", "--dim", "64", "--layers", "2", "--max-steps", "36",
                    "--log-every", "6"],
}
"""Steps sized for 10-30 s of training each on the shared 2-core machine."""
MODES = {"default": {}, "deterministic": {"HVD_RESILIENT_DETERMINISTIC": "1"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_args(backend: str, tmp: Path) -> list[str]:
    if backend == "horovod":
        discover = tmp / "discover.sh"
        if not discover.exists():
            discover.write_text("#!/bin/sh\necho 127.0.0.1:3\n")
            discover.chmod(0o755)
        return ["--backend", "horovod", "--discovery", str(discover), "--np", "3",
                "--min-np", "3", "--max-np", "3", "--network-interface", "lo"]
    return ["--backend", "torchrun", "--np", "3", "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}"]


def run_once(backend: str, workload: str, mode: str, tmp: Path) -> dict[str, Any]:
    run = tmp / f"{backend}-{workload}-{mode}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", **MODES[mode])
    if mode == "default":  # nothing inherited may turn it on
        env.pop("HVD_RESILIENT_DETERMINISTIC", None)
        env.pop("HOROVOD_FUSION_THRESHOLD", None)
    cmd = [str(VENV_BIN / "hvd-resilient"), "run", *launch_args(backend, tmp), "--run-id", "b",
           "--run-dir", str(run), "--max-restarts", "0", "--", sys.executable, JOB,
           *WORKLOADS[workload], "--epochs", "100000", "--checkpoint-every", "1000000",
           "--seed", "7"]
    load_before = os.getloadavg()[0]
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.time() - t0
    if p.returncode != 0:
        raise SystemExit(f"{backend} {workload} {mode} failed ({p.returncode}):\n"
                         f"{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    evs = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    rates = [e["samples_per_s"] for e in evs if e["event"] == "progress" and e["rank"] == 0]
    done = {e["params_sha256"] for e in evs if e["event"] == "done"}
    model = json.loads((run / "model.json").read_text())
    shutil.rmtree(run, ignore_errors=True)
    return {"backend": backend, "workload": workload, "mode": mode, "wall_s": round(wall, 1),
            "samples_per_s": statistics.median(rates[1:] or rates), "windows": len(rates),
            "params_sha256": sorted(done), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2), **model}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["backend"], r["workload"]) for r in runs},
                  key=lambda k: (k[0], list(WORKLOADS).index(k[1])))
    for backend, workload in keys:
        mine = [r for r in runs if r["backend"] == backend and r["workload"] == workload]
        row: dict[str, Any] = {"backend": backend, "workload": workload,
                               "tensors": mine[0]["tensors"], "params": mine[0]["params"]}
        for mode in MODES:
            rs = [r for r in mine if r["mode"] == mode]
            row[mode] = round(statistics.median(r["samples_per_s"] for r in rs), 1)
            row[f"{mode}_runs"] = len(rs)
            digests = {d for r in rs for d in r["params_sha256"]}
            row[f"{mode}_distinct_digests"] = len(digests)
        row["cost_pct"] = round(100 * (1 - row["deterministic"] / row["default"]), 1)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| backend | workload | tensors | params | default samples/s | deterministic "
           "samples/s | cost | distinct final digests (default / deterministic) |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(
            f"| {r['backend']} | {r['workload']} | {r['tensors']} | {r['params']:,} | "
            f"{r['default']:.0f} | {r['deterministic']:.0f} | {r['cost_pct']:+.1f}% | "
            f"{r['default_distinct_digests']} of {r['default_runs']} / "
            f"{r['deterministic_distinct_digests']} of {r['deterministic_runs']} |")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backends", default="horovod,torchrun")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "determinism.json"))
    args = p.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    workloads = [w for w in args.workloads.split(",") if w]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="determinism-bench-") as tmp:
        for i in range(args.repeats):
            for backend in backends:
                for workload in workloads:
                    order = list(MODES) if i % 2 == 0 else list(reversed(MODES))
                    for mode in order:
                        r = run_once(backend, workload, mode, Path(tmp))
                        runs.append(r)
                        print(f"[{i + 1}/{args.repeats}] {backend} {workload} {mode}: "
                              f"{r['samples_per_s']:.0f} samples/s, digest "
                              f"{r['params_sha256'][0][:12]}, load {r['load_before']}"
                              f"->{r['load_after']}", file=sys.stderr, flush=True)
    rows = summarize(runs)
    print(table(rows))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.node(),
        "cpus": os.cpu_count(), "repeats": args.repeats, "workers": 3,
        "rows": rows, "runs": runs,
    }, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
