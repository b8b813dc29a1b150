"""kill -9 of the process that launched the job: how long does the job outlive it?

Side by side, on each launcher, with examples/digits.py training on 2 ranks (one machine):

- `ours`: `hvd-resilient run --launcher L` is SIGKILLed; its guard (`launch/job_guard.py`)
  ends every process that carries the job's token. Measured: kill -> no process of the job
  left (the token scanned in /proc every 10 ms).
- `plain`: the plain launcher (`horovodrun`, `mpirun`, `torchrun --standalone`) is
  SIGKILLed, as an OOM killer or a lost shell would. Measured the same way (every process that
  carries the run's marker), capped at `--cap` seconds: "still running" past it.
- `relaunch` (ours, in place): the supervisor SIGKILLed and the same command started at once;
  kill -> the relaunch's first commit (lease epoch 2), and whether any event of epoch 1 came
  after it.

    .venv/bin/python bench/supervisor_kill.py --repeats 3 --out bench/results/supervisor_kill.json
"""

from __future__ import annotations

import argparse
import json
import os
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

ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = Path(sys.executable).parent
DIGITS = str(ROOT / "examples" / "digits.py")
MARK = "HVD_RESILIENT_BENCH_MARK"
LAUNCHERS = ("horovod", "mpi", "torchrun", "inplace")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _marked(mark: str) -> list[int]:
    me, out = os.getpid(), []
    needle = f"{MARK}={mark}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    out.append(int(name))
        except OSError:
            continue
    return out


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


TRAIN = [sys.executable, DIGITS, "--epochs", "1000", "--commit-every", "5",
         "--checkpoint-every", "40"]


def _train_args(run: Path) -> list[str]:
    """The training command of a plain launch (`hvd-resilient run` passes the rest itself)."""
    return [*TRAIN, "--run-id", "b", "--run-dir", str(run / "run"), "--checkpoint-url",
            f"file://{run}/ckpt"]


def _command(stack: str, launcher: str, run: Path) -> list[str]:
    if stack == "ours":
        extra = {"horovod": ["--network-interface", "lo"], "mpi": [], "inplace": [],
                 "torchrun": ["--rdzv-endpoint", f"127.0.0.1:{_port()}"]}[launcher]
        return [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", launcher, "--np", "2",
                "--run-id", "b", "--run-dir", str(run / "run"), "--checkpoint",
                f"file://{run}/ckpt", *extra, "--", *TRAIN]
    if launcher == "horovod":
        return [str(VENV_BIN / "horovodrun"), "-np", "2", "--gloo", "--network-interface",
                "lo", *_train_args(run)]
    if launcher == "mpi":
        return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2",
                "-x", MARK, "-x", "PYTHONPATH", *_train_args(run)]
    return [str(VENV_BIN / "torchrun"), "--standalone", "--nproc-per-node", "2",
            *_train_args(run)[1:]]  # torchrun runs the script with its own python


def _start(cmd: list[str], run: Path, mark: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PATH=f"{VENV_BIN}:{os.environ['PATH']}",
               **{MARK: mark})
    log = open(run / f"console-{mark[:6]}.log", "wb")  # noqa: SIM115 - the child's
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def _wait_training(events: Path, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        evs = _events(events)
        if len({e["rank"] for e in evs if e["event"] == "start"}) >= 2 and any(
                e["event"] in ("commit", "memory_commit") and e["step"] >= 10 for e in evs):
            return True
        time.sleep(0.1)
    return False


def _cleanup(mark: str) -> None:
    for pid in _marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def outlive(stack: str, launcher: str, work: Path, cap: float) -> dict[str, Any]:
    run = work / f"{stack}-{launcher}-{time.time_ns()}"
    run.mkdir(parents=True)
    mark = uuid.uuid4().hex
    proc = _start(_command(stack, launcher, run), run, mark)
    try:
        if not _wait_training(run / "run" / "events.jsonl", proc, 120):
            return {"stack": stack, "launcher": launcher, "error": "never trained"}
        job = _marked(mark)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        left = [p for p in _marked(mark) if p != proc.pid]
        while left and time.monotonic() - t0 < cap:
            time.sleep(0.01)
            left = _marked(mark)
        gone = time.monotonic() - t0
        ckpts = len(list((run / "ckpt").glob("step-*")))
        time.sleep(1.0)  # what the survivors did meanwhile: still checkpointing?
        return {"stack": stack, "launcher": launcher, "processes": len(job),
                "gone_s": None if left else round(gone, 3), "left_after_cap": len(left),
                "checkpoints_still_written": len(list((run / "ckpt").glob("step-*"))) != ckpts}
    finally:
        if proc.poll() is None:
            proc.kill()
        _cleanup(mark)


def relaunch(work: Path) -> dict[str, Any]:
    run = work / f"relaunch-{time.time_ns()}"
    run.mkdir(parents=True)
    marks = [uuid.uuid4().hex, uuid.uuid4().hex]
    events = run / "run" / "events.jsonl"
    first = _start(_command("ours", "inplace", run), run, marks[0])
    second = None
    try:
        if not _wait_training(events, first, 120):
            return {"error": "never trained"}
        t0, wall0 = time.monotonic(), time.time()
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = _start(_command("ours", "inplace", run), run, marks[1])
        deadline = time.monotonic() + 120
        step = None
        while time.monotonic() < deadline and step is None:
            step = next((e for e in _events(events) if e.get("lease_epoch") == 2
                         and e["event"] in ("commit", "memory_commit")), None)
            time.sleep(0.02)
        if step is None:
            return {"error": "the relaunch never committed"}
        evs = _events(events)
        late = [e for e in evs if e.get("lease_epoch") == 1 and e["rank"] >= 0
                and e["ts"] > step["ts"]]
        return {"first_commit_s": round(step["ts"] - wall0, 3),
                "measured_after_s": round(time.monotonic() - t0, 3),
                "old_epoch_events_after": len(late)}
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
        for m in marks:
            _cleanup(m)


def _summary(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} / {max(values):.2f} s"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cap", type=float, default=30.0)
    p.add_argument("--launchers", default=",".join(LAUNCHERS))
    p.add_argument("--out", default="")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hvdr-supkill-"))
    rows: list[dict[str, Any]] = []
    for launcher in args.launchers.split(","):
        for stack in ("ours", "plain") if launcher != "inplace" else ("ours",):
            for _ in range(args.repeats):
                r = outlive(stack, launcher, work, args.cap)
                print(json.dumps(r), flush=True)
                rows.append(r)
    relaunches = []
    for _ in range(args.repeats):
        r = relaunch(work)
        print(json.dumps({"relaunch": r}), flush=True)
        relaunches.append(r)
    print("\n| launcher | stack | runs | job gone after the kill: median / max | "
          "still running after the cap | checkpoints written after the kill |")
    print("| --- | --- | --- | --- | --- | --- |")
    for launcher in args.launchers.split(","):
        for stack in ("ours", "plain"):
            rs = [r for r in rows if r["launcher"] == launcher and r["stack"] == stack
                  and "error" not in r]
            if not rs:
                continue
            gone = [r["gone_s"] for r in rs if r["gone_s"] is not None]
            print(f"| {launcher} | {stack} | {len(rs)} | {_summary(gone)} | "
                  f"{sum(1 for r in rs if r['gone_s'] is None)} | "
                  f"{sum(1 for r in rs if r['checkpoints_still_written'])} |")
    ok = [r for r in relaunches if "error" not in r]
    print(f"\nrelaunch at once (inplace): {len(ok)}/{len(relaunches)} ran; kill -> first "
          f"commit of epoch 2: {_summary([r['first_commit_s'] for r in ok])}; epoch-1 events "
          f"after it: {sum(r['old_epoch_events_after'] for r in ok)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"),
                                              "runs": rows, "relaunch": relaunches}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
