"""A second fault inside the reset of the first: does the job still recover?

The random-kill tail (bench/recovery.py) ends, now and then, with a survivor whose
`hvd.shutdown()` is stuck in a Gloo wait; it exits 77 after 3 s (`gloo_watch.exit_if_stuck`),
and in 2 of 40 runs on 12-05 the job never recovered from that. This script makes the second
fault on purpose, in the same job (`bench/recovery_job.py` under the patched driver, one host x
3, min 2, cooldown 1-2 s): once the job committed step 20 at size 3, rank 0 is SIGKILLed, and
as soon as a survivor reports the failure, rank 1 is hit again:

- `kill`: SIGKILLed `--delay` seconds later (it dies inside its reset);
- `stop`: SIGSTOPped at once and SIGKILLed `--delay` seconds later (it hangs inside its reset,
  as a stuck `hvd.shutdown()` does, then goes).

Reports, per mode, how many runs recovered (a step after the second fault, and the job's
`done`), and the time from the second fault to the first step after it.

    .venv/bin/python bench/fault_in_reset.py --repeats 3 --out bench/results/fault_in_reset.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery as rec  # noqa: E402 - the recovery bench's job, discovery and helpers

MODES = ("kill", "stop")


def run_once(mode: str, delay: float, work: Path, timeout: float) -> dict[str, Any]:
    run = work / f"{mode}-{time.time_ns()}"
    run.mkdir(parents=True)
    _, discover = rec.write_discovery(run, "localhost:3")
    cmd = [sys.executable, "-m", "hvd_resilient.launch.horovod.driver", "-np", "3",
           "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(discover),
           "--network-interface", "lo", "--blacklist-cooldown-range", "1", "2",
           sys.executable, str(rec.JOB), "--run-dir", str(run), "--stack", "ours",
           "--steps", "300", "--commit-every", "10"]
    env = dict(os.environ, PYTHONPATH=str(rec.ROOT),
               PATH=f"{rec.VENV_BIN}:{os.environ.get('PATH', '')}",
               HVD_RESILIENT_RUN_DIR=str(run), HVD_RESILIENT_MEMORY_TIER_DIR=str(run / "shm"))
    events = run / "events.jsonl"
    with open(run / "console.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return _faults(proc, events, mode, delay, timeout) | {"run_dir": str(run)}
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _faults(proc: subprocess.Popen, events: Path, mode: str, delay: float,
            timeout: float) -> dict[str, Any]:
    def evs() -> list[dict[str, Any]]:
        return list(rec.read_events(events))

    if not rec.wait_until(lambda: any(e["event"] == "commit" and e["step"] >= 20
                                      and e["size"] == 3 for e in evs()), timeout, proc):
        return {"error": "never committed step 20 at size 3"}
    pids = {e["rank"]: e["pid"] for e in evs() if e["event"] == "start"}
    os.kill(pids[0], signal.SIGKILL)
    if not rec.wait_until(lambda: any(e["event"] == "failure_detected" for e in evs()), 20,
                          proc):
        return {"error": "no survivor reported the first fault"}
    if mode == "stop":
        os.kill(pids[1], signal.SIGSTOP)
    time.sleep(delay)  # the second fault's moment inside the reset, not a wait for anything
    os.kill(pids[1], signal.SIGKILL)
    second = time.time()
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        rc = None
    after = [e["ts"] for e in evs() if e["event"] == "enter" and e["ts"] > second]
    return {"rc": rc, "done": any(e["event"] == "done" for e in evs()),
            "first_step_s": round(after[0] - second, 3) if after else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delay", type=float, default=3.0, help="seconds from the first fault's "
                   "report to the second fault (3: a stuck shutdown's exit)")
    p.add_argument("--timeout", type=float, default=150.0, help="per run")
    p.add_argument("--out", default=str(rec.ROOT / "bench" / "results" / "fault_in_reset.json"))
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvd-resilient-fault-in-reset-"))
    out: dict[str, Any] = {"command": " ".join(["python", *sys.argv]), "delay_s": a.delay,
                           "modes": {}}
    print("| second fault in the reset | runs | recovered (done) | second fault -> first step |")
    print("| --- | --- | --- | --- |")
    for mode in MODES:
        runs = [run_once(mode, a.delay, work, a.timeout) for _ in range(a.repeats)]
        for r in runs:
            print(mode, json.dumps(r), file=sys.stderr, flush=True)
        ok = [r for r in runs if r.get("done")]
        steps = [r["first_step_s"] for r in ok if r.get("first_step_s") is not None]
        when = f"{statistics.median(steps):.2f} / {max(steps):.2f} s" if steps else "-"
        print(f"| {mode} | {len(runs)} | {len(ok)} | {when} |", flush=True)
        out["modes"][mode] = runs
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"run folders kept in {work}")


if __name__ == "__main__":
    main()
