"""PyTorch's DDP tutorial script, a worker SIGKILLed: how long until it trains again?

The script is pytorch/examples' distributed/ddp-tutorial-series/multigpu_torchrun.py,
unchanged but for tests/thirdparty/pytorch_ddp_tutorial/cpu.patch (Gloo, CPU): it keeps its
own snapshot.pt (rank 0 saves it every `save_every` epochs, every rank loads it at start).
3 workers on one machine, side by side:

- `ours`: `hvd-resilient run --launcher torchrun --np 3 -- python multigpu_torchrun.py ...`
- `plain`: `torchrun --standalone --nproc-per-node 3 --max-restarts 3 multigpu_torchrun.py ...`
- `inplace`: `hvd-resilient run --launcher inplace --np 3 -- python multigpu_torchrun.py ...`,
  the script with tests/thirdparty/pytorch_ddp_tutorial/inplace.patch applied after cpu.patch
  (the adapter lines of docs/inplace-ddp.md): the two survivors go on in their own processes.

Once rank 0 has saved a snapshot, rank 1's process is SIGKILLed. For `ours` and `plain` the
step marker is the test probe (tests/support/probe/sitecustomize.py, on PYTHONPATH; the script
is not changed): each worker appends a `group` mark when its process group has formed and a
`step` mark at its first optimizer step, with torchrun's restart count. Measured: kill -> every
rank of a restarted round has taken its first step (training again), and kill -> the group
formed; "never" when that has not happened within --cap seconds (the job is then ended). For
`inplace` there is no restarted round: the markers are the adapter's events in the run's
events.jsonl, kill -> both survivors' `first_step` (written by an optimizer step post-hook at
the first step after the DDP wrappers moved to the new generation) and kill -> both survivors'
`reset` (written once the new generation's group has formed); the probe's marks after the kill
are kept beside them as a cross-check (`probe_trained_again_s`). Ours and inplace are then left
to finish: the exit code, whether the job resumed (a restart loaded the snapshot; in place: the
survivors restored their last commit in memory), whether every rank's final parameters are
equal (the probe's digests at destroy_process_group(); in place also the `done` events'
digests), and whether the survivors (launch ranks 0 and 2) took their first step after the
kill in the processes they were launched as (`survivors_kept_pids`).

`--save-seconds N`: also times the script's own `torch.save(snapshot, "snapshot.pt")` (no temp
file, no rename) N times: the window in which a kill of rank 0 tears the snapshot.

    .venv/bin/python bench/thirdparty_torchrun.py --repeats 3 --cap 60 \\
        --out bench/results/thirdparty_torchrun.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

# the run's processes found by a marker in their environment, as the supervisor benchmark does
from supervisor_kill import MARK, _marked, _port  # noqa: E402

from hvd_resilient.events import read_events  # noqa: E402

VENV_BIN = Path(sys.executable).parent
TUTORIAL = ROOT / "tests" / "thirdparty" / "pytorch_ddp_tutorial"
PROBE = ROOT / "tests" / "support" / "probe"
NP = 3


def _prepare(dest: Path, patches: tuple[str, ...] = ("cpu.patch",)) -> Path:
    """The script as a user would have it: the upstream copy with ``patches`` applied, in
    order (cpu.patch; for `inplace`, inplace.patch after it)."""
    shutil.copytree(TUTORIAL, dest, ignore=shutil.ignore_patterns("*.patch", "LICENSE*"))
    for patch in patches:
        subprocess.run(["patch", "-p1", "--forward", "--batch", "-i", str(TUTORIAL / patch)],
                       cwd=dest, check=True, capture_output=True, timeout=30)
    return dest


def _marks(probe: Path) -> list[dict[str, Any]]:
    try:
        lines = (probe / "marks.jsonl").read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.strip()]


def _events(run: Path) -> list[dict[str, Any]]:
    """The in-place run's events.jsonl (a torn last line skipped)."""
    return list(read_events(run / "run" / "events.jsonl"))


def _end(proc: subprocess.Popen[bytes], mark: str) -> None:
    """The job and every process of it, whatever state it is in."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in _marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _command(stack: str, run: Path, epochs: int, save_every: int) -> list[str]:
    script = ["multigpu_torchrun.py", str(epochs), str(save_every)]
    if stack == "ours":
        return [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "torchrun",
                "--np", str(NP), "--rdzv-endpoint", f"127.0.0.1:{_port()}",
                "--run-id", run.name, "--run-dir", str(run / "run"), "--",
                sys.executable, *script]
    if stack == "inplace":
        return [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "inplace",
                "--np", str(NP), "--run-id", run.name, "--run-dir", str(run / "run"), "--",
                sys.executable, *script]
    return [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", str(NP),
            "--max-restarts", "3", *script]


def one(stack: str, work: Path, cap: float, epochs: int, save_every: int) -> dict[str, Any]:
    run = work / f"{stack}-{uuid.uuid4().hex[:6]}"
    script_dir = _prepare(run / "script", ("cpu.patch", "inplace.patch")
                          if stack == "inplace" else ("cpu.patch",))
    probe = run / "probe"
    probe.mkdir(parents=True)
    mark = uuid.uuid4().hex
    env = dict(os.environ, PYTHONUNBUFFERED="1", HVDR_TEST_PROBE_DIR=str(probe), **{MARK: mark})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROBE), str(ROOT),
                                                     env.get("PYTHONPATH", "")) if p)
    env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
    log = run / "console.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(_command(stack, run, epochs, save_every), env=env,
                                cwd=script_dir, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    out: dict[str, Any] = {"stack": stack}
    try:
        saved = f"Epoch {2 * save_every} | Training snapshot saved"
        deadline = time.monotonic() + 120
        while saved not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                return {**out, "error": "no snapshot saved", "tail": log.read_text()[-2000:]}
            time.sleep(0.02)
        if stack == "inplace":
            return {**out, **_inplace(proc, run, probe, cap)}
        launched = {m["rank"]: m["pid"] for m in _marks(probe)
                    if m["mark"] == "group" and m["restart"] == 0}
        os.kill(launched[1], signal.SIGKILL)
        t_kill = time.time()
        stepped: dict[int, float] = {}
        formed: dict[int, float] = {}
        step_pids: set[int] = set()
        while time.time() - t_kill < cap and len(stepped) < NP:
            for m in _marks(probe):
                if m["restart"] >= 1 and m["ts"] >= t_kill:
                    target = stepped if m["mark"] == "step" else formed
                    target.setdefault(m["rank"], m["ts"])
                    if m["mark"] == "step":
                        step_pids.add(m["pid"])
            if proc.poll() is not None and len(stepped) < NP:
                break
            time.sleep(0.02)
        text = log.read_text(errors="replace")
        out.update(
            trained_again_s=round(max(stepped.values()) - t_kill, 3)
            if len(stepped) == NP else None,
            group_formed_s=round(max(formed.values()) - t_kill, 3)
            if len(formed) == NP else None,
            restart_rounds=max((m["restart"] for m in _marks(probe)), default=0),
            connect_refused=text.count("Connection refused"),
            torchrun_restarts=text.count("will restart worker group"),
            # the launch's ranks 0 and 2 among the processes that trained again
            survivors_kept_pids=({launched[0], launched[2]} <= step_pids)
            if len(stepped) == NP else None,
        )
        if stack == "ours" and out["trained_again_s"] is not None:
            try:
                out["exit_code"] = proc.wait(timeout=cap + 60)
            except subprocess.TimeoutExpired:
                out["exit_code"] = None
            text = log.read_text(errors="replace")
            digests = {json.loads(f.read_text())["digest"] for f in probe.glob("rank*.json")}
            out.update(snapshot_loaded="Resuming training from snapshot" in text,
                       ranks_reported=len(list(probe.glob("rank*.json"))),
                       ranks_equal=len(digests) == 1)
        else:
            out.update(exit_code=proc.poll(), snapshot_loaded="Resuming training from snapshot"
                       in text)
        return out
    finally:
        _end(proc, mark)


def _inplace(proc: subprocess.Popen[bytes], run: Path, probe: Path,
             cap: float) -> dict[str, Any]:
    """The `inplace` stack, from rank 0's snapshot on: rank 1 killed, its events measured."""
    launched = {e["rank"]: e["pid"] for e in _events(run) if e["event"] == "start"}
    os.kill(launched[1], signal.SIGKILL)
    t_kill = time.time()
    survivors = {launched[r] for r in launched if r != 1}
    stepped: dict[int, float] = {}  # pid -> ts of its first_step after the kill
    formed: dict[int, float] = {}  # pid -> ts of its reset after the kill
    while time.time() - t_kill < cap and len(stepped) < NP - 1:
        for e in _events(run):
            if e["ts"] >= t_kill and e["event"] == "first_step":
                stepped.setdefault(e["pid"], e["ts"])
            elif e["ts"] >= t_kill and e["event"] == "reset":
                formed.setdefault(e["rank"], e["ts"])
        if proc.poll() is not None and len(stepped) < NP - 1:
            break
        time.sleep(0.02)
    probe_steps = [m["ts"] for m in _marks(probe) if m["mark"] == "step" and m["ts"] >= t_kill]
    out: dict[str, Any] = dict(
        trained_again_s=round(max(stepped.values()) - t_kill, 3)
        if len(stepped) == NP - 1 else None,
        group_formed_s=round(max(formed.values()) - t_kill, 3)
        if len(formed) == NP - 1 else None,
        probe_trained_again_s=round(max(probe_steps) - t_kill, 3)
        if len(probe_steps) == NP - 1 else None,
        survivors_kept_pids=set(stepped) == survivors if len(stepped) == NP - 1 else None,
    )
    evs = _events(run)
    failed = [e["ts"] for e in evs if e["event"] == "failure_detected" and e["ts"] >= t_kill]
    out["detected_s"] = round(max(failed) - t_kill, 3) if failed else None
    if out["trained_again_s"] is None:
        return {**out, "exit_code": proc.poll(), "snapshot_loaded": False}
    try:
        out["exit_code"] = proc.wait(timeout=cap + 120)
    except subprocess.TimeoutExpired:
        out["exit_code"] = None
    evs = _events(run)
    text = (run / "console.log").read_text(errors="replace")
    done = [e for e in evs if e["event"] == "done"]
    probed = {}
    for f in probe.glob("rank*.json"):
        rec = json.loads(f.read_text())
        probed[rec["rank"]] = rec["digest"]
    final = [d for r, d in probed.items() if r < NP - 1]  # the final world's ranks 0 and 1
    out.update(
        snapshot_loaded="Resuming training from snapshot" in text,
        restored=sum(1 for e in evs if e["event"] == "restore" and e["ts"] >= t_kill)
        == NP - 1,
        starts=sum(1 for e in evs if e["event"] == "start"),
        reset_sizes=sorted({e.get("new_size") for e in evs if e["event"] == "reset"}),
        ranks_reported=len(final),
        ranks_equal=len(final) == NP - 1 and len(set(final)) == 1 and len(done) == NP - 1
        and len({json.dumps(e.get("digests"), sort_keys=True) for e in done}) == 1,
    )
    return out


SAVE = """
import sys, time, torch
model = torch.nn.Linear(20, 1)
times = []
for _ in range(int(sys.argv[1])):
    t = time.perf_counter()
    torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": 3}, "snapshot.pt")
    times.append(time.perf_counter() - t)
print(sorted(times)[len(times) // 2], max(times))
"""


def save_window(work: Path, n: int) -> dict[str, float]:
    r = subprocess.run([sys.executable, "-c", SAVE, str(n)], cwd=work, capture_output=True,
                       text=True, timeout=120, check=True)
    median, top = map(float, r.stdout.split())
    return {"saves": n, "median_ms": round(median * 1e3, 3), "max_ms": round(top * 1e3, 3)}


def _summary(values: list[float], cap: float) -> str:
    return f"{statistics.median(values):.2f} / {max(values):.2f} s" if values else \
        f"never within {cap:g} s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cap", type=float, default=60.0)
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--stacks", default="ours,plain,inplace")
    p.add_argument("--save-seconds", type=int, default=200, metavar="N")
    p.add_argument("--out", default="")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvdr-thirdparty-"))
    rows = []
    for stack in args.stacks.split(","):
        for _ in range(args.repeats):
            r = one(stack, work, args.cap, args.epochs, args.save_every)
            print(json.dumps(r), flush=True)
            rows.append(r)
    window = save_window(work, args.save_seconds) if args.save_seconds else {}
    print(f"\n| stack | runs | kill -> every rank trains again: median / max | kill -> group "
          f"formed: median / max | trained again within {args.cap:g} s | exit 0, resumed "
          "(snapshot loaded; inplace: commit restored), ranks equal | survivors kept their "
          "PIDs | exit codes (None: running at the cap) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for stack in args.stacks.split(","):
        rs = [r for r in rows if r["stack"] == stack and "error" not in r]
        again = [r["trained_again_s"] for r in rs if r["trained_again_s"] is not None]
        formed = [r["group_formed_s"] for r in rs if r["group_formed_s"] is not None]
        whole = sum(1 for r in rs if r.get("exit_code") == 0 and r.get("ranks_equal")
                    and r.get("restored" if stack == "inplace" else "snapshot_loaded"))
        kept = sum(1 for r in rs if r.get("survivors_kept_pids"))
        print(f"| {stack} | {len(rs)} | {_summary(again, args.cap)} | "
              f"{_summary(formed, args.cap)} | {len(again)} of {len(rs)} | {whole} of "
              f"{len(rs)} | {kept} of {len(again)} | "
              f"{', '.join(str(r.get('exit_code')) for r in rs)} |")
    if window:
        print(f"\nthe script's torch.save of snapshot.pt: median {window['median_ms']} ms, max "
              f"{window['max_ms']} ms over {window['saves']} saves")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip()
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                              "commit": commit, "cap_s": args.cap,
                                              "runs": rows, "save_window": window}, indent=1))
    print(f"consoles and probes: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
