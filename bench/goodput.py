"""Goodput benchmark (issue #8): useful training per wall second while workers keep dying.

Why: recovery time per fault (`bench/recovery.py`) says little about what a job keeps of its
throughput when faults are routine. Here the tiny transformer of `examples/tiny_lm.py`
(`bench/goodput_job.py`: same model, text, batch and commit cadence under both stacks) trains
for a fixed wall time under a real elastic launcher (hostfile discovery over this machine's
one-slot names, `--network-interface lo`, `--blacklist-cooldown-range 1 2`, Horovod's defaults
otherwise: 30 s Gloo timeout; ours through `hvd_resilient.launch.horovod.driver`, as
`hvd-resilient run` starts it, vanilla through plain `horovodrun`), while this process SIGKILLs
a random live worker every T seconds of training (the same victim sequence for every
config, from `--seed`; workers are found by the pids of their `start` events, so the driver is
never hit). Configs: fault-free (ours), ours at T = 30 and 120, vanilla Horovod Elastic at
T = 30 and 120. The clock starts when the first rank enters training (its first `sync`: start-up
takes from 10 s to a minute here depending on the load, and must not take faults or eat the
duration); at clock = duration the whole job is killed.

Definitions (from the run's `events.jsonl` only):

- committed samples = what the job has committed by the deadline: the sum over rank 0's
  `commit` events of (steps since the previous commit) x world size x per-rank batch (every
  step trains a full global batch). Work done after the last commit is not counted: a
  failure would throw it away.
- samples/s = committed samples / duration; goodput = samples/s / fault-free samples/s
  (medians over repeats).
- goodput, load-matched = samples/s / the run's own samples/s at full size between faults (the
  report's throughput): the machine is shared, and its load moves throughput by tens of percent
  between runs minutes apart; this ratio compares each run with itself.
- A job that ends before the deadline (vanilla Horovod can give up) keeps what it committed;
  the rest of the duration counts as lost.
- "report goodput" is `hvd-resilient report`'s own figure (productive time / wall time by its
  lost-time categories), from `hvd_resilient.report.analyze` on the same log up to the deadline
  (its wall starts at the first `start` event).

Usage: ``.venv/bin/python bench/goodput.py --duration 270`` (five runs of 270 s plus start-up:
about 25-30 minutes here); ``--duration 60 --periods 20`` for a smoke run. Prints a markdown
table, writes ``bench/results/goodput.json`` and ``bench/results/goodput.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recovery import local_names, write_discovery  # noqa: E402

from hvd_resilient.events import read_events  # noqa: E402
from hvd_resilient.report import analyze  # noqa: E402

VENV_BIN = Path(sys.executable).parent
JOB = ROOT / "bench" / "goodput_job.py"
RESULTS = ROOT / "bench" / "results"


@dataclass(frozen=True)
class Config:
    name: str
    stack: str  # "ours" | "vanilla"
    period: float | None  # seconds between faults; None: no faults
    launcher_args: tuple[str, ...] = ()


def configs(periods: list[float], ours_gloo_timeout: int) -> list[Config]:
    ours: tuple[str, ...] = ()
    suffix = ""
    if ours_gloo_timeout:
        ours, suffix = ("--gloo-timeout-seconds", str(ours_gloo_timeout)), \
            f", Gloo timeout {ours_gloo_timeout} s"
    out = [Config(f"fault-free (ours{suffix})", "ours", None, ours)]
    out += [Config(f"ours, T={p:g}s{suffix}", "ours", p, ours) for p in periods]
    return out + [Config(f"vanilla, T={p:g}s", "vanilla", p) for p in periods]


class Job:
    """One `horovodrun` in its own session; `kill()` takes down it and every descendant."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path) -> None:
        with open(cwd / "console.log", "wb") as console:
            self.proc = subprocess.Popen(cmd, env=env, stdout=console, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         cwd=cwd)
        self.seen: dict[int, psutil.Process] = {}

    def remember_children(self) -> None:
        """Horovod's per-worker middlemen start sessions of their own, so a process-group kill
        of the launcher does not reach them: track every descendant while it lives."""
        try:
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def kill(self) -> None:
        self.remember_children()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in self.seen.values():
            try:
                p.kill()  # psutil checks it is still the same process (pid reuse)
            except psutil.Error:
                pass
        psutil.wait_procs(list(self.seen.values()), timeout=10)
        self.proc.wait()


def live_workers(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(pid, rank at start) of every worker that wrote `start` and still runs the job."""
    out = []
    for e in events:
        if e["event"] != "start" or not isinstance(e.get("pid"), int):
            continue
        try:
            p = psutil.Process(e["pid"])
            if p.status() != psutil.STATUS_ZOMBIE and str(JOB) in " ".join(p.cmdline()):
                out.append((e["pid"], e["rank"]))
        except psutil.Error:
            continue
    return sorted(out)


def committed_curve(events: list[dict[str, Any]], t0: float,
                    batch: int) -> list[tuple[float, int, int]]:
    """[(seconds since launch, committed step, committed samples)] at each rank-0 commit.

    A restore always returns to the last commit, so the steps between consecutive commits
    were all trained at the later commit's world size."""
    out: list[tuple[float, int, int]] = []
    step = samples = 0
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["event"] == "commit" and e["rank"] == 0 and e["step"] > step:
            samples += (e["step"] - step) * e["size"] * batch
            step = e["step"]
            out.append((round(e["ts"] - t0, 3), step, samples))
    return out


def training_start(events: list[dict[str, Any]]) -> float | None:
    """When the first rank entered training (its first `sync`): the clock starts here, so a
    start-up that is slow on a loaded machine neither eats the duration nor takes faults."""
    return min((e["ts"] for e in events if e["event"] == "sync"), default=None)


def inject(events: list[dict[str, Any]], victims: random.Random, t0: float) -> dict[str, Any]:
    """SIGKILLs one live worker picked by `victims`; what was done, for the record."""
    live = live_workers(events)
    fault: dict[str, Any] = {"t": round(time.time() - t0, 3), "pid": None, "live": len(live)}
    if live:
        pid, rank = live[victims.randrange(len(live))]
        try:
            os.kill(pid, signal.SIGKILL)
            fault.update(pid=pid, rank=rank)
        except ProcessLookupError:
            pass
    return fault


def job_launch(run: Path, stack: str, launcher_args: list[str], job_args: list[str]
               ) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one job in `run`: `goodput_job.py JOB_ARGS` on this
    machine's one-slot host names under ours (what `hvd-resilient run` starts: Horovod's
    launcher with slot hosts) or plain horovodrun, the same hosts and launcher flags."""
    names = local_names()
    _, discover = write_discovery(run, "\n".join(f"{n}:1" for n in names))
    launcher = ([sys.executable, "-m", "hvd_resilient.launch.horovod.driver"]
                if stack == "ours" else [str(VENV_BIN / "horovodrun")])
    cmd = [
        *launcher, "-np", str(len(names)), "--min-np", "1",
        "--max-np", str(len(names)), "--host-discovery-script", str(discover),
        "--network-interface", "lo", "--blacklist-cooldown-range", "1", "2", *launcher_args,
        sys.executable, str(JOB), "--run-dir", str(run), "--stack", stack, *job_args,
    ]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1")
    env.pop("HVD_RESILIENT_FAULT", None)  # the faults come from the benchmark, not the job
    if stack == "ours":  # as `hvd-resilient run` does: the driver's events join the workers'
        env["HVD_RESILIENT_RUN_DIR"] = str(run)
    return cmd, env


def run_once(cfg: Config, a: argparse.Namespace, work: Path, victims: random.Random
             ) -> dict[str, Any]:
    run = work / f"{cfg.stack}-{cfg.period or 0:g}-{time.time_ns()}"
    run.mkdir(parents=True)
    cmd, env = job_launch(run, cfg.stack, list(cfg.launcher_args),
                          ["--batch-size", str(a.batch_size), "--commit-every",
                           str(a.commit_every)])
    events_path = run / "events.jsonl"
    load_before = os.getloadavg()
    launched = time.time()
    t0 = deadline = None  # training start (the first `sync`); t0 + duration
    next_fault = float("inf")
    faults: list[dict[str, Any]] = []
    job = Job(cmd, env, run)
    ended_at = error = None
    try:
        while deadline is None or time.time() < deadline:
            time.sleep(0.2)
            job.remember_children()
            if job.proc.poll() is not None:
                ended_at = round(time.time() - (t0 or launched), 3)
                break
            if t0 is None:
                t0 = training_start(list(read_events(events_path)))
                if t0 is not None:
                    deadline = t0 + a.duration
                    next_fault = t0 + cfg.period if cfg.period else float("inf")
                elif time.time() > launched + a.startup_timeout:
                    error = f"no rank trained within {a.startup_timeout:g} s of the launch"
                    break
            elif deadline is not None and time.time() >= min(next_fault, deadline):
                if time.time() >= deadline:
                    break
                faults.append(inject(list(read_events(events_path)), victims, t0))
                next_fault += cfg.period or 0
    finally:
        job.kill()
    evs = [e for e in read_events(events_path) if e["ts"] <= (deadline or 0)]
    curve = committed_curve(evs, t0 or launched, a.batch_size)
    last = curve[-1] if curve else (0.0, 0, 0)
    try:
        rep = analyze(evs).to_dict()
    except ValueError:
        rep = {}
    return {
        "config": cfg.name, "run_dir": str(run), "error": error, "load_before": load_before,
        "startup_s": round(t0 - launched, 3) if t0 else None,
        "load_after": os.getloadavg(), "rc": job.proc.returncode, "ended_early_at_s": ended_at,
        "faults": faults, "faults_injected": sum(f["pid"] is not None for f in faults),
        "committed_steps": last[1], "committed_samples": last[2],
        "samples_per_s": round(last[2] / a.duration, 3),
        "full_size_samples_per_s": full_size_rate(rep),
        "report": {k: rep.get(k) for k in ("goodput", "resets", "status", "wall_s",
                                            "productive_s", "lost_s", "steps_lost")}
        | {"failures": len(rep.get("failures", [])),
           "mttr_total_median_s": (rep.get("mttr") or {}).get("total", {}).get("median")},
        "curve": curve,
    }


def full_size_rate(report: dict[str, Any]) -> float | None:
    """The run's own samples/s at its largest world size, between commits that no recovery
    interrupted (the report's throughput): what it would have done with no faults, under the
    load the machine had during that run."""
    sizes = report.get("throughput_by_size") or {}
    if not sizes:
        return None
    return sizes[max(sizes, key=int)].get("samples_per_s")


def median(xs: list[Any]) -> Any:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: list[dict[str, Any]], base_rate: float | None,
              duration: float) -> dict[str, Any]:
    rate = median([r["samples_per_s"] for r in runs])
    return {
        "runs": len(runs),
        "faults_injected": median([sum(f["pid"] is not None and f["t"] < duration
                                       for f in r["faults"]) for r in runs]),
        "resets": median([r["report"]["resets"] for r in runs]),
        "committed_steps": median([r["committed_steps"] for r in runs]),
        "samples_per_s": rate,
        "goodput": round(rate / base_rate, 3) if rate is not None and base_rate else None,
        "goodput_load_matched": median([
            r["samples_per_s"] / r["full_size_samples_per_s"] for r in runs
            if r.get("full_size_samples_per_s")]),
        "report_goodput": median([r["report"]["goodput"] for r in runs]),
        "ended_early": sum(r["ended_early_at_s"] is not None for r in runs),
    }


def num(x: float | None, spec: str = "g") -> str:
    return "-" if x is None else format(x, spec)


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(results: dict[str, Any]) -> str:
    lines = [
        "| config | faults injected | resets | committed steps | samples/s | goodput vs "
        "fault-free | goodput, load-matched | report's goodput | job ended early "
        "| load avg (1 min) before/after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in results["configs"]:
        s = c["summary"]
        loads = ", ".join(f"{r['load_before'][0]:.0f}/{r['load_after'][0]:.0f}"
                          for r in c["runs"])
        lines.append(
            f"| {c['name']} | {num(s['faults_injected'])} | {num(s['resets'])} | "
            f"{num(s['committed_steps'])} | {num(s['samples_per_s'], '.1f')} | "
            f"{pct(s['goodput'])} | {pct(s.get('goodput_load_matched'))} | "
            f"{pct(s['report_goodput'])} | "
            f"{s['ended_early']}/{s['runs']} | {loads} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, Any], out: Path) -> None:
    """Committed samples over time, one line per config (its median run), faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for c in results["configs"]:
        run = c["median_run"]
        curve = [(0.0, 0, 0), *run["curve"]]
        curve.append((results["duration_s"], curve[-1][1], curve[-1][2]))  # held to the end
        ts, samples = [p[0] for p in curve], [p[2] for p in curve]
        (line,) = ax.step(ts, samples, where="post", label=c["name"],
                          linestyle="--" if c["stack"] == "vanilla" else "-")
        for f in run["faults"]:
            if f["pid"] is not None and f["t"] < results["duration_s"]:
                y = max([s for t, s in zip(ts, samples, strict=True) if t <= f["t"]],
                        default=0)
                ax.plot(f["t"], y, "x", color=line.get_color(), markersize=8)
    ax.set_xlabel("seconds of training (from the first sync)")
    ax.set_ylabel("committed samples")
    ax.set_title(f"tiny_lm, {results['workers']} workers on {results['machine']['cpus']} "
                 f"cores: committed progress (x = a worker SIGKILLed)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def summarize_all(results: dict[str, Any]) -> None:
    """Each config's summary and median run; goodput against the fault-free config."""
    base = next((median([r["samples_per_s"] for r in c["runs"]])
                 for c in results["configs"] if c["period_s"] is None), None)
    for c in results["configs"]:
        c["summary"] = summarize(c["runs"], base, results["duration_s"])
        by_rate = sorted(c["runs"], key=lambda r: r["samples_per_s"])
        c["median_run"] = by_rate[len(by_rate) // 2]


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # run the `finally` that kills the job


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=270.0, help="wall seconds per run")
    p.add_argument("--periods", default="30,120", help="seconds between faults, comma-separated")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--only", default="", help="run only configs whose name contains this")
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--commit-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0, help="picks the victims")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="give a run up when no rank trains this long after the launch")
    p.add_argument("--out", type=Path, default=RESULTS / "goodput.json")
    p.add_argument("--plot", type=Path, default=RESULTS / "goodput.png")
    p.add_argument("--keep", action="store_true", help="keep run folders")
    p.add_argument("--ours-gloo-timeout", type=int, default=0, metavar="SECONDS",
                   help="--gloo-timeout-seconds for ours only (0: Horovod's default, 30 s); "
                        "it bounds how long survivors wait for a re-added worker to start")
    p.add_argument("--render", action="store_true",
                   help="run nothing: recompute the summaries in --out, print the table, "
                        "redraw the plot")
    a = p.parse_args()
    if a.render:
        results = json.loads(a.out.read_text())
        summarize_all(results)
        a.out.write_text(json.dumps(results, indent=1) + "\n")
        plot(results, a.plot)
        print(table(results))
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    periods = [float(x) for x in a.periods.split(",") if x]
    work = Path(tempfile.mkdtemp(prefix="hvd-resilient-goodput-"))
    results: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "workers": len(local_names()), "duration_s": a.duration,
        "batch_size": a.batch_size, "commit_every": a.commit_every,
        "load_before": os.getloadavg(), "configs": [],
    }
    try:
        for cfg in configs(periods, a.ours_gloo_timeout):
            if a.only and a.only not in cfg.name:
                continue
            runs = []
            for i in range(a.repeats):
                r = run_once(cfg, a, work, random.Random(a.seed * 1000 + i))
                brief = {k: v for k, v in r.items() if k not in ("curve", "faults")}
                print(f"{cfg.name} #{i + 1}: {json.dumps(brief)}", flush=True)
                runs.append(r)
            results["configs"].append({
                "name": cfg.name, "stack": cfg.stack, "period_s": cfg.period,
                "launcher_args": list(cfg.launcher_args), "runs": runs,
            })
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["load_after"] = os.getloadavg()
    summarize_all(results)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, a.plot)
    print(table(results))
    print(f"load average (1/5/15 min) before {results['load_before']}, after "
          f"{results['load_after']}; wrote {a.out} and {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
