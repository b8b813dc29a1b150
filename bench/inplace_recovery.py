"""In-place recovery on torch.distributed against the restart paths: same job, same fault.

Every row runs 4 Gloo workers on this machine training `tests/scripts/recipe_job.py` (AdamW with
weight decay, warmup + cosine, clipping; commits every 5 steps) and, once 20 steps are done and
after a random extra 0-0.5 s, hits one random worker from outside (mid-step, mid-collective):

- `inplace_kill` / `inplace_freeze`: `hvd-resilient run --launcher inplace` (the in-place agent),
  SIGKILL / SIGSTOP;
- `inplace_join`: the agent with `--replace`, SIGKILL: the same recovery, then the replacement
  it starts joins; timed from the moment it was up (its `joined` event's `ready_at`) to the
  first step at 4 again (`join_first_step_s`), and each survivor's longest gap between two
  step ends around the join (`join_stall_s`: the commit, the move, the sync, one step);
- `inplace_standby_kill`: the agent with `--standby 1` (a fifth worker set up and waiting),
  SIGKILL: timed to the first step back at 4, the standby in the lost one's place;
- `torchrun_kill`: ours under torchrun, exactly what `hvd-resilient run --launcher torchrun`
  starts (warm forks, the memory tier): every worker restarts and resumes from the tier;
- `inplace_fsdp_kill` / `torchrun_fsdp_kill`: the same two with `--fsdp` (FSDP2, the model
  sharded over the 4 workers): in place the survivors re-shard it over 3 and reload every old
  rank's shards of the last commit from the memory tier; under torchrun every worker restarts
  and reassembles them;
- `vanilla_torchrun_kill`: plain `torchrun` and DDP as the PyTorch docs write it
  (`bench/torchrun_vanilla_job.py`, a checkpoint file every 20 steps).

Times are from the signal to the first step that ends after it in a recovered world (at the
new size in place; back at full size with a standby; in a new process after a restart), read
from the steps' own records (`samples.jsonl`: one line per rank per step, with its time and
pid). `redone`: steps trained before the signal and trained again after it. `kept pids`: every
survivor trains on in the process it was launched as. Median, p90 and max over the runs; a run
that does not recover within its timeout counts as failed.

    python bench/inplace_recovery.py --repeats 5 --vanilla-repeats 3 \
        --out bench/results/inplace.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
JOB = ROOT / "tests" / "scripts" / "recipe_job.py"
VANILLA = ROOT / "bench" / "torchrun_vanilla_job.py"
NP = 4
HIT_AFTER_STEP = 20
ROWS = {
    "inplace_kill": ("inplace", signal.SIGKILL),
    "inplace_freeze": ("inplace", signal.SIGSTOP),
    "inplace_join": ("inplace-replace", signal.SIGKILL),
    "inplace_standby_kill": ("inplace-standby", signal.SIGKILL),
    "torchrun_kill": ("torchrun", signal.SIGKILL),
    "inplace_fsdp_kill": ("inplace-fsdp", signal.SIGKILL),
    "torchrun_fsdp_kill": ("torchrun-fsdp", signal.SIGKILL),
    "vanilla_torchrun_kill": ("vanilla", signal.SIGKILL),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(stack: str, run: Path) -> list[str]:
    sharded = stack.endswith("-fsdp")
    stack = stack.removesuffix("-fsdp")
    train = [sys.executable, str(JOB), *(["--fsdp"] if sharded else []),
             "--recipe", "adamw-warmup-cosine",
             "--recipe-clip-grad-norm", "1.0", "--samples", "--run-id", run.name,
             "--run-dir", str(run), "--batch-size", "8", "--commit-every", "5",
             "--epochs", "1000", "--max-steps", "2000", "--checkpoint-every", "1000",
             "--step-time", "0.02"]
    ckpt = f"file://{run}/ckpt"
    if stack == "inplace-replace":  # the agent itself: `run` has no --replace (yet)
        return [sys.executable, "-m", "hvd_resilient.launch.inplace_agent", "--nproc", str(NP),
                "--replace", "--", *train, "--checkpoint-url", ckpt]
    if stack in ("inplace", "inplace-standby"):
        standby = ["--standby", "1"] if stack == "inplace-standby" else []
        return [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "inplace", "--np",
                str(NP), *standby, "--run-id", run.name, "--run-dir", str(run), "--checkpoint",
                ckpt, "--max-restarts", "0", "--", *train]
    from hvd_resilient.launch.launchers.torchrun import torchrun_command

    if stack == "vanilla":
        return [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", str(NP),
                "--max-restarts", "3", str(VANILLA), "--run-dir", str(run), "--steps", "2000"]
    return torchrun_command(NP, "1", f"127.0.0.1:{free_port()}", 3, run.name,
                            [*train, "--checkpoint-url", ckpt])


def steps(run: Path) -> list[dict[str, Any]]:
    path = run / "samples.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def run_once(row: str, work: Path, timeout: float, recover_timeout: float,
             rng: random.Random) -> dict[str, Any]:
    stack, sig = ROWS[row]
    run = work / f"{row}-{time.time_ns()}"
    run.mkdir(parents=True)
    shm = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir(),
               f"hvd_resilient-bench-{uuid.uuid4().hex}")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}",
               HVD_RESILIENT_MEMORY_TIER_DIR=str(shm))
    out: dict[str, Any] = {"row": row}
    with open(run / "console.log", "wb") as log:
        proc = subprocess.Popen(command(stack, run), env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=run)
    try:
        deadline = time.monotonic() + timeout
        while not any(s["step"] >= HIT_AFTER_STEP for s in steps(run)):
            if proc.poll() is not None or time.monotonic() > deadline:
                out["error"] = "never reached the step to hit at"
                return out
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 0.5))
        first = {s["pid"] for s in steps(run)}  # the processes that trained so far
        victim = rng.choice(sorted(first))
        t_hit = time.time()
        os.kill(victim, sig)
        recovered = None
        give_up = min(deadline, time.monotonic() + recover_timeout)
        while time.monotonic() < give_up:
            # in place: the first step at the new size; else (a restart, or a standby in the
            # lost one's place, back at full size) the first step of a process new to training
            shrinks = stack.startswith("inplace") and stack != "inplace-standby"
            after = [s for s in steps(run) if s["t"] > t_hit and s["pid"] != victim
                     and (s["size"] == NP - 1 if shrinks else s["pid"] not in first)]
            if after:
                recovered = min(after, key=lambda s: s["t"])
                break
            if proc.poll() is not None:
                break
            time.sleep(0.02)
        if recovered is None:
            out["error"] = f"did not recover (launcher exit {proc.poll()})"
            return out
        before = [s for s in steps(run) if s["t"] <= t_hit]
        last_before = max(s["step"] for s in before)
        out["first_step_s"] = round(recovered["t"] - t_hit, 3)
        out["redone"] = max(0, last_before + 1 - recovered["step"])
        if stack in ("inplace", "inplace-fsdp", "inplace-standby"):
            time.sleep(0.5)  # a few steps of every survivor
            now = {s["pid"] for s in steps(run) if s["t"] > recovered["t"] - 1e-3}
            out["kept_pids"] = (first - {victim}) <= now
        if stack == "inplace-replace":
            out.update(measure_join(run, first - {victim}, give_up, proc))
        return out  # finishing is the tests' business: the run is ended here
    finally:
        with_children = []
        try:
            with_children = [psutil.Process(proc.pid),
                             *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.Error:
            pass
        for p in with_children:
            try:
                p.kill()
            except psutil.Error:
                pass
        proc.wait()
        shutil.rmtree(shm, ignore_errors=True)
        if "error" in out:  # the why of a failed run, kept in the JSON (its folder is removed)
            text = (run / "console.log").read_text(errors="replace")
            out["console_tail"] = text[-4000:]


def measure_join(run: Path, survivors: set[int], give_up: float,
                 proc: subprocess.Popen) -> dict[str, Any]:
    def joined() -> dict[str, Any] | None:
        path = run / "events.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            e = json.loads(line)
            if e["event"] == "joined":
                return e
        return None

    while time.monotonic() < give_up and proc.poll() is None:
        j = joined()
        back = [s for s in steps(run) if s["size"] == NP] if j else []
        if j and back and max(s["t"] for s in back) > j["ready_at"] and any(
                s["t"] > j["ready_at"] and s["pid"] in survivors for s in back):
            time.sleep(0.5)  # a few steps at the new size
            rows = steps(run)
            at_np = [s for s in rows if s["size"] == NP and s["t"] > j["ready_at"]]
            stall = 0.0
            for pid in survivors:
                mine = sorted(s["t"] for s in rows if s["pid"] == pid
                              and s["t"] > j["ready_at"] - 2.0)
                gaps = [b - a for a, b in zip(mine, mine[1:], strict=False)]
                stall = max(stall, max(gaps, default=0.0))
            return {"join_first_step_s": round(min(s["t"] for s in at_np) - j["ready_at"], 3),
                    "join_stall_s": round(stall, 3)}
        time.sleep(0.05)
    return {"join_error": "the replacement never joined"}


def p90(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "first_step_s" in r]
    out: dict[str, Any] = {"runs": len(runs), "recovered": len(ok),
                           "errors": [r["error"] for r in runs if "error" in r]}
    for m in ("first_step_s", "redone", "join_first_step_s", "join_stall_s"):
        xs = [r[m] for r in ok if m in r]
        if xs:
            out[m] = {"median": round(statistics.median(xs), 3), "p90": p90(xs), "max": max(xs)}
    kept = [r["kept_pids"] for r in ok if "kept_pids" in r]
    if kept:
        out["kept_pids"] = f"{sum(kept)}/{len(kept)}"
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vanilla-repeats", type=int, default=3,
                   help="plain torchrun's restart hangs here: fewer runs of a minute each")
    p.add_argument("--only", default=",".join(ROWS), help="comma-separated rows")
    p.add_argument("--timeout", type=float, default=180.0, help="per run")
    p.add_argument("--recover-timeout", type=float, default=60.0,
                   help="seconds after the signal a run may take to recover")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "inplace.json"))
    a = p.parse_args()
    rows = [r for r in a.only.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        p.error(f"unknown rows {sorted(unknown)}; rows: {', '.join(ROWS)}")
    rng = random.Random(a.seed)
    work = Path(tempfile.mkdtemp(prefix="hvdr-inplace-bench-"))
    results: dict[str, Any] = {}
    try:
        for i in range(a.repeats):  # rows in turn: the machine's load drifts over all alike
            for row in rows:
                if ROWS[row][0] == "vanilla" and i >= a.vanilla_repeats:
                    continue
                r = run_once(row, work, a.timeout, a.recover_timeout, rng)
                print(f"{row} #{i + 1}: {r}", flush=True)
                results.setdefault(row, []).append(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {row: summarize(runs) for row, runs in results.items()}
    print("\n| row | recovered | kill -> first step, s (median / p90 / max) | redone steps "
          "(median / max) | survivors kept their pids | join: ready -> first step, s | "
          "join: survivors' stall, s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")

    def cell(x: dict[str, Any] | None) -> str:
        return f"{x['median']} / {x['p90']} / {x['max']}" if x else "-"

    for row, s in summary.items():
        d = s.get("redone")
        print(f"| {row} | {s['recovered']}/{s['runs']} | {cell(s.get('first_step_s'))} | "
              + (f"{d['median']} / {d['max']}" if d else "-") + f" | {s.get('kept_pids', '-')} | "
              f"{cell(s.get('join_first_step_s'))} | {cell(s.get('join_stall_s'))} |")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    Path(a.out).write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": platform.node(),
        "cpus": os.cpu_count(), "np": NP, "summary": summary, "runs": results}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
