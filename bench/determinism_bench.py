"""What `--deterministic` costs: default vs deterministic reductions, side by side (not a test).

Every run is launched as a user launches it, three workers on this machine:
`hvd-resilient run --launcher horovod` (discovery, three one-slot hosts of 127.0.0.1) and
`--launcher torchrun`; `bench/determinism_job.py` trains with `Trainer`, deterministic mode
through HVD_RESILIENT_DETERMINISTIC=1 (what `--deterministic` sets). Modes:

- `default`: Horovod's tensor fusion / DDP's buckets, as they come;
- `deterministic`: the backend's fixed-order reduction (Horovod: one grouped allreduce in
  parameter order per step, fused alone; DDP: one flat buffer in parameter order);
- `fusion-off` (Horovod only): `HOROVOD_FUSION_THRESHOLD=0` with Horovod's own optimizer, every
  tensor reduced alone: what a loop gets that uses `hvd.DistributedOptimizer` itself, and
  what `--deterministic` did first.

Workloads: the digits MLP (4 parameter tensors) at two widths and the tiny transformer of
`examples/tiny_lm.py` (28 tensors, most of them small: where reducing each tensor alone costs
most). The modes of a workload run back to back, in rotating order from repeat to repeat, so
that the load of this shared machine hits them alike.

Throughput: the global batch over the median time between consecutive steps of rank 0 (the
first 10 steps left out as warm-up; the median ignores the odd step that a commit or a burst
of load from other processes stretches), median over the repeats. Also recorded: each run's
final parameter digest (the deterministic runs of a workload should all agree; default runs
usually do not) and the load average before and after.

Usage: ``.venv/bin/python bench/determinism_bench.py --repeats 3`` (about 30-40 minutes on the
shared 2-core machine); prints a markdown table and writes ``bench/results/determinism.json``.
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
WARMUP_STEPS = 10

WORKLOADS: dict[str, list[str]] = {
    "digits-64": ["--model", "digits", "--hidden", "64", "--max-steps", "200"],
    "digits-2048": ["--model", "digits", "--hidden", "2048", "--max-steps", "150"],
    "tinylm-64x2": ["--model", "tinylm", "--dim", "64", "--layers", "2", "--max-steps", "40"],
}
"""Steps sized for 5-30 s of training each on the shared 2-core machine."""
MODES: dict[str, dict[str, str]] = {
    "default": {},
    "deterministic": {"HVD_RESILIENT_DETERMINISTIC": "1"},
    "fusion-off": {"HOROVOD_FUSION_THRESHOLD": "0"},
}
BACKEND_MODES = {"horovod": ("default", "deterministic", "fusion-off"),
                 "torchrun": ("default", "deterministic")}


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
        return ["--launcher", "horovod", "--discovery", str(discover), "--np", "3",
                "--min-np", "3", "--max-np", "3", "--network-interface", "lo"]
    return ["--launcher", "torchrun", "--np", "3", "--rdzv-endpoint",
            f"127.0.0.1:{free_port()}"]


def run_once(backend: str, workload: str, mode: str, tmp: Path) -> dict[str, Any]:
    run = tmp / f"{backend}-{workload}-{mode}-{time.monotonic_ns()}"
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}")
    for name in ("HVD_RESILIENT_DETERMINISTIC", "HOROVOD_FUSION_THRESHOLD",
                 "HOROVOD_DISABLE_GROUP_FUSION"):
        env.pop(name, None)  # nothing inherited may change the mode
    env.update(MODES[mode])
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
    done = {e["params_sha256"] for e in evs if e["event"] == "done"}
    job = json.loads((run / "model.json").read_text())
    shutil.rmtree(run, ignore_errors=True)
    step_s = statistics.median(job["step_seconds"][WARMUP_STEPS:])
    return {"backend": backend, "workload": workload, "mode": mode, "wall_s": round(wall, 1),
            "step_ms": round(1000 * step_s, 2),
            "samples_per_s": round(job["batch_size"] * job["world_size"] / step_s, 1),
            "tensors": job["tensors"], "params": job["params"],
            "params_sha256": sorted(done), "load_before": round(load_before, 2),
            "load_after": round(os.getloadavg()[0], 2)}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(r["backend"], r["workload"]) for r in runs},
                  key=lambda k: (k[0], list(WORKLOADS).index(k[1])))
    for backend, workload in keys:
        mine = [r for r in runs if r["backend"] == backend and r["workload"] == workload]
        row: dict[str, Any] = {"backend": backend, "workload": workload,
                               "tensors": mine[0]["tensors"], "params": mine[0]["params"]}
        for mode in BACKEND_MODES[backend]:
            rs = [r for r in mine if r["mode"] == mode]
            if not rs:
                continue
            row[mode] = {
                "samples_per_s": round(statistics.median(r["samples_per_s"] for r in rs), 1),
                "step_ms": round(statistics.median(r["step_ms"] for r in rs), 2),
                "runs": len(rs),
                "distinct_digests": len({d for r in rs for d in r["params_sha256"]}),
            }
            if mode != "default" and "default" in row:
                base = row["default"]["samples_per_s"]
                row[mode]["cost_pct"] = round(100 * (1 - row[mode]["samples_per_s"] / base), 1)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| backend | workload | tensors | params | default | deterministic | fusion off "
           "(Horovod's optimizer) | distinct final digests (default / deterministic / "
           "fusion off) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(m: dict[str, Any] | None) -> str:
        if m is None:
            return "-"
        cost = f" ({-m['cost_pct']:+.0f}%)" if "cost_pct" in m else ""
        return f"{m['samples_per_s']:.0f} samples/s, {m['step_ms']:.1f} ms/step{cost}"

    for r in rows:
        modes = [r.get(m) for m in MODES]
        digests = " / ".join(f"{m['distinct_digests']} of {m['runs']}" if m else "-"
                             for m in modes)
        out.append(f"| {r['backend']} | {r['workload']} | {r['tensors']} | {r['params']:,} | "
                   + " | ".join(cell(m) for m in modes) + f" | {digests} |")
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(complete: bool) -> None:  # after every run: a crash keeps what was measured
        out.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": platform.node(),
            "cpus": os.cpu_count(), "repeats": args.repeats, "workers": 3,
            "complete": complete, "warmup_steps": WARMUP_STEPS, "workloads": WORKLOADS,
            "rows": summarize(runs), "runs": runs,
        }, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="determinism-bench-") as tmp:
        for i in range(args.repeats):
            for backend in backends:
                for workload in workloads:
                    modes = list(BACKEND_MODES[backend])
                    k = i % len(modes)  # rotate: each mode goes first as often as the others
                    for mode in modes[k:] + modes[:k]:
                        r = run_once(backend, workload, mode, Path(tmp))
                        runs.append(r)
                        save(complete=False)
                        print(f"[{i + 1}/{args.repeats}] {backend} {workload} {mode}: "
                              f"{r['samples_per_s']:.0f} samples/s ({r['step_ms']} ms/step), "
                              f"digest {r['params_sha256'][0][:12]}, load "
                              f"{r['load_before']}->{r['load_after']}", file=sys.stderr,
                              flush=True)
    save(complete=True)
    print(table(summarize(runs)))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
