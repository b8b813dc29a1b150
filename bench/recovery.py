"""Recovery benchmark: this project against vanilla Horovod Elastic, same model, same fault.

Every scenario runs `bench/recovery_job.py` under a real `horovodrun` (elastic, hostfile
discovery, `--network-interface lo`, `--blacklist-cooldown-range 1 2`, commits every 10 steps,
faults at step 105) with `--stack ours` and `--stack vanilla`, and reads the run's event log
(never the console). Times are from the fault (the moment the injector fired, or the moment the
discovery file changed) to:

- detect: the first `failure_detected` of a survivor, `peer_silent` (heartbeats) or
  `hang_detected` (progress watchdog) (ours only: vanilla does not say);
- reset: the first `reset_callback` of the new world (`hvd.init()` done again);
- first step: the first `enter` (training function entered, state synced) after the fault;
  under torchrun the first `resume` (durable checkpoint loaded) of the restarted round;
- training stalled: from the fault, or for a host change from the commit that acted on it
  (training goes on until then), to that first step: the time nobody trained;
- new-size commit (scale-up): the first commit at the new world size;
- lost: steps trained before the fault and trained again after it.

Ours runs Horovod's launcher through `hvd_resilient.launch.horovod.driver` (slot hosts), as
`hvd-resilient run` does. Vanilla runs plain `horovodrun` with Horovod's defaults (30 s Gloo
timeout) except on one host, where plain Horovod ends the job on the first failure: there it gets
its best setup (one-slot host names and `--gloo-timeout-seconds 3`, as measured in the field
notes).

Usage: ``python bench/recovery.py --repeats 5 --vanilla-repeats 3`` (about 25 minutes here);
prints a markdown table and writes ``bench/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
JOB = ROOT / "bench" / "recovery_job.py"
sys.path.insert(0, str(ROOT))

from hvd_resilient.events import read_events  # noqa: E402

FAULT_STEP = 105


def local_names() -> list[str]:
    """Three names for this machine that Horovod launches without ssh (one slot each)."""
    names = ["localhost", "127.0.0.1"]
    host = socket.gethostname()
    try:
        if socket.gethostbyname(host).startswith("127."):
            names.append(host)
    except OSError:
        pass
    return names


@dataclass
class Scenario:
    name: str
    title: str
    hosts: str  # discovery output at start
    np: int
    min_np: int
    max_np: int
    fault: str = ""  # HVD_RESILIENT_FAULT
    change_to: str = ""  # discovery output once rank 0 committed step 100
    vanilla_args: list[str] = field(default_factory=list)
    vanilla_hosts: str = ""  # when vanilla needs another layout to survive at all
    kind: str = "horovod"  # or "torchrun"
    steps: int = 200  # the job stops here; long enough for the change to land
    env: dict[str, str] = field(default_factory=dict)  # for ours
    vanilla: bool = True  # False: a variant of ours whose vanilla row is another scenario's
    vanilla_timeout: float | None = None  # vanilla hangs for good here: stop it after this


def scenarios() -> list[Scenario]:
    one = local_names()
    return [
        Scenario("kill_worker_2x2", "kill -9 one worker, 2 hosts x 2", "localhost:2\n127.0.0.1:2",
                 4, 2, 4, fault=f"kill:rank=3:step={FAULT_STEP}"),
        Scenario("kill_worker_1host", "kill -9 one worker, 1 host x 3",
                 "localhost:3", 3, 2, 3, fault=f"kill:rank=1:step={FAULT_STEP}",
                 vanilla_args=["--gloo-timeout-seconds", "3"],
                 vanilla_hosts="\n".join(f"{n}:1" for n in one[:3])),
        Scenario("host_lost", "a whole host lost (both its workers killed)",
                 "localhost:2\n127.0.0.1:2", 4, 2, 4,
                 fault=f"kill:rank=2:step={FAULT_STEP},kill:rank=3:step={FAULT_STEP}"),
        Scenario("host_removed", "host removed via discovery", "localhost:2\n127.0.0.1:2",
                 4, 2, 4, change_to="localhost:2"),
        Scenario("host_removed_fast_poll",
                 "host removed via discovery, discovery polled every 0.25 s",
                 "localhost:2\n127.0.0.1:2", 4, 2, 4, change_to="localhost:2",
                 env={"HVD_RESILIENT_DISCOVERY_INTERVAL": "0.25"}, vanilla=False),
        Scenario("host_added", "host added via discovery", "localhost:2", 2, 2, 4,
                 change_to="localhost:2\n127.0.0.1:2", steps=400),
        Scenario("host_added_cold", "host added via discovery, standby workers off",
                 "localhost:2", 2, 2, 4, change_to="localhost:2\n127.0.0.1:2", steps=400,
                 env={"HVD_RESILIENT_STANDBY": "0"}, vanilla=False),
        Scenario("torchrun_kill", "torchrun, kill -9 one worker (2 workers)", "", 2, 2, 2,
                 fault="kill:rank=1:step=70", kind="torchrun"),
        # Failures that send no hang-up. Vanilla gets Horovod's default 30 s Gloo timeout
        # (one-slot host names so that one host is not the whole job) and 150 s to recover.
        Scenario("freeze_worker_1host", "one worker SIGSTOPped, 1 host x 3", "localhost:3",
                 3, 2, 3, fault=f"freeze:rank=1:step={FAULT_STEP}",
                 vanilla_hosts="\n".join(f"{n}:1" for n in one[:3]), vanilla_timeout=150.0),
        Scenario("hang_worker_1host", "one worker hung in a step (progress timeout 3 s)",
                 "localhost:3", 3, 2, 3, fault=f"hang:rank=1:step={FAULT_STEP}",
                 vanilla_hosts="\n".join(f"{n}:1" for n in one[:3]), vanilla_timeout=150.0),
        Scenario("torchrun_freeze", "torchrun, one worker SIGSTOPped (2 workers)", "", 2, 2, 2,
                 fault="freeze:rank=1:step=70", kind="torchrun"),
        Scenario("mpi_hang", "mpirun under hvd-resilient run, one rank hung (timeout 3 s)", "",
                 2, 2, 2, fault="hang:rank=1:step=70", kind="mpi", vanilla=False),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(sc: Scenario, stack: str, run: Path) -> list[str]:
    """Ours: exactly what `hvd-resilient run --backend torchrun` starts, on examples/digits.py
    with durable checkpoints every 20 steps. Vanilla: plain DDP (`torchrun_vanilla_job.py`)."""
    from hvd_resilient.launch.commands import torchrun_command

    if stack == "ours":
        train = [sys.executable, str(ROOT / "examples" / "digits.py"), "--run-id", run.name,
                 "--run-dir", str(run), "--checkpoint-url", f"file://{run}/ckpt",
                 "--checkpoint-every", "20", "--epochs", "6", "--seed", "5"]
    else:
        train = [sys.executable, str(ROOT / "bench" / "torchrun_vanilla_job.py"),
                 "--run-dir", str(run)]
    return torchrun_command(sc.np, "1", f"127.0.0.1:{free_port()}", 3, run.name, train)


def mpi_cmd(sc: Scenario, run: Path) -> list[str]:
    """What an HPC user runs: `hvd-resilient run --backend mpi` (mpirun, relaunched by the
    supervisor from the newest durable checkpoint) on examples/digits.py."""
    return [str(VENV_BIN / "hvd-resilient"), "run", "--backend", "mpi", "--np", str(sc.np),
            "--run-id", run.name, "--run-dir", str(run), "--max-restarts", "2", "--",
            sys.executable, str(ROOT / "examples" / "digits.py"), "--checkpoint-every", "20",
            "--epochs", "6", "--seed", "5", "--recovery-progress-timeout-seconds", "3"]


def wait_until(pred: Callable[[], bool], timeout: float, proc: subprocess.Popen) -> bool:
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def write_discovery(run: Path, hosts_text: str) -> tuple[Path, Path]:
    """`run/hosts.txt` holding `hosts_text` and `run/discover.sh`, a discovery script that
    prints it through `discovery/hostfile`: (hosts file, script). Edit the hosts file (with an
    atomic `os.replace`) to add or remove hosts while the job runs."""
    hosts = run / "hosts.txt"
    hosts.write_text(hosts_text + "\n")
    discover = run / "discover.sh"
    discover.write_text(f"#!/bin/sh\nexec {sys.executable} {ROOT}/discovery/hostfile {hosts}\n")
    discover.chmod(0o755)
    return hosts, discover


def run_once(sc: Scenario, stack: str, work: Path, timeout: float) -> dict[str, Any]:
    run = work / f"{sc.name}-{stack}-{time.time_ns()}"
    run.mkdir(parents=True)
    hosts, discover = write_discovery(
        run, sc.vanilla_hosts if stack == "vanilla" and sc.vanilla_hosts else sc.hosts)
    # ours: what `hvd-resilient run` starts (Horovod's launcher with slot hosts)
    launcher = ([sys.executable, "-m", "hvd_resilient.launch.horovod.driver"] if stack == "ours"
                else [str(VENV_BIN / "horovodrun")])
    cmd = [
        *launcher, "-np", str(sc.np), "--min-np", str(sc.min_np),
        "--max-np", str(sc.max_np), "--host-discovery-script", str(discover),
        "--network-interface", "lo", "--blacklist-cooldown-range", "1", "2",
        *(sc.vanilla_args if stack == "vanilla" else []),
        sys.executable, str(JOB), "--run-dir", str(run), "--stack", stack,
        "--steps", str(sc.steps), "--commit-every", "10",
    ]
    if sc.kind == "torchrun":
        cmd = torchrun_cmd(sc, stack, run)
        # a plain torchrun restart hangs (field notes): give it a minute, not the full timeout
        timeout = min(timeout, 90.0) if stack == "vanilla" else timeout
    elif sc.kind == "mpi":
        cmd = mpi_cmd(sc, run)
    if stack == "vanilla" and sc.vanilla_timeout:
        timeout = min(timeout, sc.vanilla_timeout)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", HVD_RESILIENT_FAULT=sc.fault,
               **(sc.env if stack == "ours" else {}))
    events_path = run / "events.jsonl"
    with open(run / "console.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=run)
    t_change = None
    try:
        if sc.change_to:
            def committed_100() -> bool:
                return any(e["event"] == "commit" and e["step"] >= 100
                           for e in read_events(events_path))
            if wait_until(committed_100, timeout, proc):
                tmp = hosts.with_suffix(".tmp")
                tmp.write_text(sc.change_to + "\n")
                t_change = time.time()
                os.replace(tmp, hosts)
        rc = proc.wait(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if sc.kind == "torchrun":  # a new round's processes, then its first step
        result = measure(list(read_events(events_path)), run, t_change, reset_event="start",
                         first_event="resume" if stack == "ours" else "enter")
    elif sc.kind == "mpi":  # the job ends (reset: mpirun's exit), the relaunch resumes
        result = measure(list(read_events(events_path)), run, t_change,
                         reset_event="launcher_exit", first_event="resume")
    else:
        result = measure(list(read_events(events_path)), run, t_change)
    result.update(rc=rc, run_dir=str(run))
    return result


def measure(evs: list[dict[str, Any]], run: Path, t_change: float | None,
            reset_event: str = "reset_callback", first_event: str = "enter") -> dict[str, Any]:
    fired = list(run.glob(".fault-*"))  # .fault-<i>-<kind>-r<rank>-s<step>, holding the time
    marks = [float(p.read_text().split()[0]) for p in fired]
    fault_steps = [int(p.name.rsplit("-s", 1)[1]) for p in fired]
    t0 = min(marks) if marks else t_change
    if t0 is None:
        return {"error": "the fault never happened"}
    after = [e for e in evs if e["ts"] >= t0]

    def first(name: str, pred: Callable[[dict], bool] = lambda e: True) -> float | None:
        ts = [e["ts"] for e in after if e["event"] == name and pred(e)]
        return round(min(ts) - t0, 3) if ts else None

    enters = [e for e in after if e["event"] == first_event]
    size_before = max((e["size"] for e in evs if e["ts"] < t0), default=0)
    out: dict[str, Any] = {
        "detect_s": min((t for t in (first("failure_detected"), first("hang_detected"),
                                     first("peer_silent")) if t is not None), default=None),
        "reset_s": first(reset_event),
        "first_step_s": round(enters[0]["ts"] - t0, 3) if enters else None,
    }
    if enters:  # the world stood still from the fault, or from the commit that acted on the
        # change (a host change lets training go on until then), to its first step
        stopped = max([t0] + [e["ts"] for e in evs
                              if e["event"] == "commit" and e["ts"] < enters[0]["ts"]])
        out["stalled_s"] = round(enters[0]["ts"] - stopped, 3)
    if enters:
        before = [e["step"] for e in evs if e["ts"] < enters[0]["ts"]] + fault_steps
        at = enters[0].get("at_step", enters[0].get("from_step"))
        out["lost_steps"] = max(before) - at if before else None
        out["new_size"] = enters[0]["size"]
        grown = [e for e in after if e["event"] == "commit" and e["size"] > size_before]
        out["new_size_commit_s"] = round(grown[0]["ts"] - t0, 3) if grown else None
    out["finished"] = any(e["event"] == "done" for e in evs)
    return out


METRICS = ("detect_s", "reset_s", "first_step_s", "stalled_s", "new_size_commit_s",
           "lost_steps")


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(runs), "finished": sum(bool(r.get("finished"))
                                                                for r in runs)}
    for m in METRICS:
        xs = [r[m] for r in runs if r.get(m) is not None]
        out[m] = round(statistics.median(xs), 3) if xs else None
    return out


def fmt(v: Any, unit: str = " s") -> str:
    return "-" if v is None else f"{v}{unit}"


def table(results: dict[str, Any]) -> str:
    lines = [
        "| scenario | stack | runs (finished) | detect | reset | first step | training stalled "
        "| new-size commit | steps lost | first step vs vanilla |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for sc in results["scenarios"]:
        ours, van = sc["ours"], sc.get("vanilla")
        for stack, s in (("ours", ours), ("vanilla", van)):
            if s is None:
                continue
            ratio = "-"
            if stack == "ours" and van and s["first_step_s"] and van["first_step_s"]:
                ratio = f"{s['first_step_s'] / van['first_step_s']:.2f}x"
            elif stack == "ours" and van and van["finished"] == 0:
                ratio = "vanilla never recovered"
            lines.append(
                f"| {sc['title']} | {stack} | {s['runs']} ({s['finished']}) | "
                f"{fmt(s['detect_s'])} | {fmt(s['reset_s'])} | {fmt(s['first_step_s'])} | "
                f"{fmt(s.get('stalled_s'))} | {fmt(s['new_size_commit_s'])} | "
                f"{fmt(s['lost_steps'], '')} | {ratio} |"
            )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vanilla-repeats", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated scenario names")
    p.add_argument("--vanilla-skip", default="",
                   help="comma-separated scenario names to run without their vanilla runs")
    p.add_argument("--timeout", type=float, default=240.0, help="per run")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "recovery.json"))
    p.add_argument("--keep", action="store_true", help="keep run folders")
    a = p.parse_args()
    only = {s for s in a.only.split(",") if s}
    skip = {s for s in a.vanilla_skip.split(",") if s}
    work = Path(tempfile.mkdtemp(prefix="hvd-resilient-recovery-"))
    results: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_before": os.getloadavg()[0], "scenarios": [],
    }
    try:
        for sc in scenarios():
            if only and sc.name not in only:
                continue
            entry: dict[str, Any] = {"name": sc.name, "title": sc.title,
                                     "vanilla_args": sc.vanilla_args}
            for stack, n in (("ours", a.repeats),
                             ("vanilla", a.vanilla_repeats
                              if sc.vanilla and sc.name not in skip else 0)):
                if n == 0:
                    continue
                runs = []
                for i in range(n):
                    r = run_once(sc, stack, work, a.timeout)
                    print(f"{sc.name} {stack} #{i + 1}: {json.dumps(r)}", flush=True)
                    runs.append(r)
                entry[stack] = summarize(runs)
                entry[stack + "_runs"] = runs
            results["scenarios"].append(entry)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["load_after"] = os.getloadavg()[0]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
