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

The memory tier rows (`torchrun_kill_memory`, `mpi_kill_memory`: every worker restarts) run
ours with the tier on and again with `--no-memory-tier-enabled` ("durable only", the behaviour
before it) in the vanilla row's place (`--vanilla-repeats` runs, in turn with ours: the
machine's load drifts over both alike). They report where each run resumed from (checked:
memory, or durable / scratch with the tier off), the steps redone and the restart step by step
(`measure_restart`); every run has its own memory tier folder under /dev/shm, removed
afterwards. ``python bench/recovery.py --only torchrun_kill_memory,mpi_kill_memory --repeats 5
--vanilla-repeats 5 --out bench/results/recovery-memory.json``.

Two more rows of that table end the launcher too (`run_relaunched`; the run holds at the fault
step, a `hang` fault of rank 0, and the benchmark kills at that moment; times from the kill):

- `horovodrun_driver_killed_memory`: `hvd-resilient run --launcher horovod` (elastic, a
  discovery script) whose horovodrun driver is SIGKILLed, together with Horovod's middlemen,
  so that its workers get no signal, as on hosts reached over ssh (`kill_driver`); they find
  the driver gone and exit, and the supervisor relaunches the driver. Killed alone, the
  driver's local middlemen SIGTERM their workers, which stop with a final durable checkpoint
  (the tier is not needed then; tests/integration/test_memory_tier.py).
- `torchrun_host_lost_memory`: two torchrun agents (one worker each, c10d rendezvous on
  loopback, each with its own memory tier folder: two hosts on one machine, not network
  namespaces); everything is SIGKILLed, the second node's folder is removed (a replaced host)
  and both are started again: the copy comes from the peer (`resume` with `source: peer`).

``python bench/recovery.py --only horovodrun_driver_killed_memory,torchrun_host_lost_memory
--repeats 5 --vanilla-repeats 5 --out bench/results/recovery-memory-relaunch.json``.

Ours runs Horovod's launcher through `hvd_resilient.launch.horovod.driver` (slot hosts), as
`hvd-resilient run` does. Vanilla runs plain `horovodrun` with Horovod's defaults (30 s Gloo
timeout) except on one host, where plain Horovod ends the job on the first failure: there it gets
its best setup (one-slot host names and `--gloo-timeout-seconds 3`, as measured in the field
notes).

The tail (issue #31): `random_kill_1host` SIGKILLs a random worker of three one-slot hosts (what
`hvd-resilient run` makes of `localhost:3`) at a random moment, from outside (not at a step
boundary as the injected faults do: mid-collective too), `--random-kills` runs (default 20);
`random_kill_1host_busy` does the same beside a neighbour process spinning on one core. They
report the median, p90 and max of every time and the count of runs whose first step came more
than 2 s after the kill: ``python bench/recovery.py --only random_kill_1host,random_kill_1host_busy
--out bench/results/recovery-random.json`` (a minute or so a run here).

Usage: ``python bench/recovery.py --repeats 5 --vanilla-repeats 3`` (about 25 minutes here,
and the two random-kill rows 40 runs more); prints a markdown table and writes
``bench/results/recovery.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
JOB = ROOT / "bench" / "recovery_job.py"
sys.path.insert(0, str(ROOT))

from hvd_resilient.events import ckpt_step, read_events  # noqa: E402
from tests.support.jobs import Job, JobRunner  # noqa: E402

FAULT_STEP = 105
DIGITS_ARGS = ["--checkpoint-every", "20", "--epochs", "6"]
# The memory tier rows (issue #18): commits every 10 steps, no durable checkpoint before the
# end, a kill at step 153 of 184 (digits: 23 steps an epoch at 2 workers); a progress event
# every 10 steps (the first step trained after the restart, with or without the tier).
MEMORY_ARGS = ["--commit-every", "10", "--checkpoint-every", "1000", "--epochs", "8",
               "--log-every", "10"]
MEMORY_OFF = "--no-memory-tier-enabled"


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
    train_args: list[str] = field(default_factory=list)  # torchrun, mpi: instead of DIGITS_ARGS
    durable_only: bool = False  # the second stack is ours with the memory tier off, not vanilla
    resume_from: str = "memory"  # durable_only: where ours must resume from (expected_source)
    busy: int = 0  # processes spinning on a core beside the job (a busy neighbour)
    run_args: list[str] = field(default_factory=list)  # `hvd-resilient run` flags, for ours
    watch: bool = False  # ours: the hosts file watched (HVD_RESILIENT_DISCOVERY_WATCH)


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
                 change_to="localhost:2\n127.0.0.1:2", steps=1200),
        # The newcomers' machine runs a warm pool (here the launch machine's, --warm-pool):
        # "once a warm standby exists".
        Scenario("host_added_pool", "host added via discovery, a warm pool on its machine",
                 "localhost:2", 2, 2, 4, change_to="localhost:2\n127.0.0.1:2", steps=1200,
                 env={"HVD_RESILIENT_WARM_POOL": "1"}),
        # ... and the hosts file watched (--discovery-watch): no wait for the once-a-second poll.
        Scenario("host_added_pool_watch", "host added via discovery, a warm pool on its "
                 "machine, the hosts file watched", "localhost:2", 2, 2, 4,
                 change_to="localhost:2\n127.0.0.1:2", steps=1200,
                 env={"HVD_RESILIENT_WARM_POOL": "1"}, watch=True, vanilla=False),
        Scenario("host_removed_watch", "host removed via discovery, the hosts file watched",
                 "localhost:2\n127.0.0.1:2", 4, 2, 4, change_to="localhost:2", watch=True,
                 vanilla=False),
        Scenario("host_added_cold", "host added via discovery, standby workers off",
                 "localhost:2", 2, 2, 4, change_to="localhost:2\n127.0.0.1:2", steps=1200,
                 env={"HVD_RESILIENT_STANDBY": "0"}, vanilla=False),
        # The tail: a random worker killed at a random moment, --random-kills runs each.
        Scenario("random_kill_1host", "kill -9 a random worker at a random moment, 1 host x 3",
                 "localhost:3", 3, 2, 3, kind="random_kill", vanilla=False),
        Scenario("random_kill_1host_busy", "kill -9 a random worker at a random moment, 1 host "
                 "x 3, a neighbour spinning on one core", "localhost:3", 3, 2, 3,
                 kind="random_kill", vanilla=False, busy=1),
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
        # Every worker restarts (issue #18): the memory tier (ours) against the same job with
        # it off (`durable only`, the behaviour before it), in the vanilla row's place.
        Scenario("torchrun_kill_memory",
                 "torchrun, kill -9 one worker (2 workers), commit every 10, no durable "
                 "checkpoint yet", "", 2, 2, 2, fault="kill:rank=1:step=153", kind="torchrun",
                 train_args=MEMORY_ARGS, durable_only=True,
                 env={"LOGLEVEL": "INFO"}),  # the agent logs its restart: where the time goes
        Scenario("mpi_kill_memory",
                 "mpirun under hvd-resilient run, kill -9 one rank (2 ranks), commit every 10, "
                 "no durable checkpoint yet", "", 2, 2, 2, fault="kill:rank=1:step=153",
                 kind="mpi", train_args=MEMORY_ARGS, durable_only=True),
        # The launcher dies too (`run_relaunched`): the run holds at step 153 (rank 0 hangs)
        # and is killed there from outside.
        Scenario("horovodrun_driver_killed_memory",
                 "hvd-resilient run --launcher horovod (elastic, 2 workers), driver kill -9, "
                 "workers get no signal (as over ssh), commit every 10, no durable "
                 "checkpoint yet", "localhost:2", 2, 2, 2, fault="hang:rank=0:step=153",
                 kind="horovod_driver", train_args=MEMORY_ARGS, durable_only=True),
        Scenario("horovodrun_driver_killed_memory_pool",
                 "the same with --warm-pool: the supervisor's pool forks the relaunched "
                 "driver's workers", "localhost:2", 2, 2, 2, fault="hang:rank=0:step=153",
                 kind="horovod_driver", train_args=MEMORY_ARGS, durable_only=True,
                 run_args=["--warm-pool"]),
        Scenario("torchrun_host_lost_memory",
                 "torchrun, 2 nodes x 1 worker on loopback, all kill -9, node 1's memory "
                 "wiped (host replaced), commit every 10, no durable checkpoint yet", "",
                 2, 2, 2, fault="hang:rank=0:step=153", kind="torchrun_nodes",
                 train_args=MEMORY_ARGS, durable_only=True, resume_from="peer",
                 env={"LOGLEVEL": "INFO"}),
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digits_args(sc: Scenario, stack: str) -> list[str]:
    """examples/digits.py's flags: durable checkpoints every 20 steps unless the scenario says
    otherwise; the memory tier off for the `durable` stack."""
    return [*(sc.train_args or DIGITS_ARGS), "--seed", "5",
            *([MEMORY_OFF] if stack == "durable" else [])]


def torchrun_cmd(sc: Scenario, stack: str, run: Path, nodes: int = 1,
                 endpoint: str = "") -> list[str]:
    """Ours (and durable): exactly what `hvd-resilient run --launcher torchrun` starts, on
    examples/digits.py; with `nodes`, one node's agent (sc.np workers over all nodes) of a
    rendezvous at `endpoint`. Vanilla: plain DDP (`torchrun_vanilla_job.py`)."""
    from hvd_resilient.launch.launchers.torchrun import torchrun_command

    if stack != "vanilla":
        train = [sys.executable, str(ROOT / "examples" / "digits.py"), "--run-id", run.name,
                 "--run-dir", str(run), "--checkpoint-url", f"file://{run}/ckpt",
                 *digits_args(sc, stack)]
    else:
        train = [sys.executable, str(ROOT / "bench" / "torchrun_vanilla_job.py"),
                 "--run-dir", str(run)]
    return torchrun_command(sc.np // nodes, str(nodes),
                            endpoint or f"127.0.0.1:{free_port()}", 3, run.name, train)


def mpi_cmd(sc: Scenario, stack: str, run: Path) -> list[str]:
    """What an HPC user runs: `hvd-resilient run --launcher mpi` (mpirun, relaunched by the
    supervisor from the newest commit in memory, or durable checkpoint) on
    examples/digits.py."""
    return supervised_cmd(sc, stack, run, ["--launcher", "mpi"],
                          ("--recovery-progress-timeout-seconds", "3"))


def supervised_cmd(sc: Scenario, stack: str, run: Path, launcher: list[str],
                   train: tuple[str, ...] = ()) -> list[str]:
    """`hvd-resilient run` with `launcher`'s flags on examples/digits.py (and `train`)."""
    return [str(VENV_BIN / "hvd-resilient"), "run", *launcher, "--np", str(sc.np),
            "--run-id", run.name, "--run-dir", str(run), "--max-restarts", "2", "--",
            sys.executable, str(ROOT / "examples" / "digits.py"), *digits_args(sc, stack),
            *train]


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


def memory_tier_dir() -> Path:
    """A memory tier folder of a run's own (never the machine's /dev/shm/hvd_resilient): the
    caller removes it."""
    return Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir(),
                f"hvd_resilient-bench-{uuid.uuid4().hex}")


def run_once(sc: Scenario, stack: str, work: Path, timeout: float) -> dict[str, Any]:
    run = work / f"{sc.name}-{stack}-{time.time_ns()}"
    run.mkdir(parents=True)
    if sc.kind in RELAUNCHED:
        return run_relaunched(sc, stack, run, timeout)
    hosts, discover = write_discovery(
        run, sc.vanilla_hosts if stack == "vanilla" and sc.vanilla_hosts else sc.hosts)
    # ours: what `hvd-resilient run` starts (Horovod's launcher with slot hosts)
    launcher = ([sys.executable, "-m", "hvd_resilient.launch.horovod.driver"] if stack != "vanilla"
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
        cmd = mpi_cmd(sc, stack, run)
    if stack == "vanilla" and sc.vanilla_timeout:
        timeout = min(timeout, sc.vanilla_timeout)
    shm = memory_tier_dir()  # removed below
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{VENV_BIN}:{os.environ.get('PATH', '')}", HVD_RESILIENT_FAULT=sc.fault,
               HVD_RESILIENT_MEMORY_TIER_DIR=str(shm),
               **(sc.env if stack != "vanilla" else {}))
    if stack != "vanilla":  # as `hvd-resilient run` sets it: the driver's events in the log too
        env["HVD_RESILIENT_RUN_DIR"] = str(run)
    if sc.watch and stack != "vanilla":
        env["HVD_RESILIENT_DISCOVERY_WATCH"] = str(hosts)
    events_path = run / "events.jsonl"
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             stdin=subprocess.DEVNULL, start_new_session=True)
            for _ in range(sc.busy)]
    with open(run / "console.log", "wb") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=run)
    t_change = None
    killed: dict[str, Any] = {}
    try:
        if sc.kind == "random_kill":
            t_change = kill_random_worker(events_path, sc.np, timeout, proc, killed)
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
        for b in busy:
            b.kill()
            b.wait()
        shutil.rmtree(shm, ignore_errors=True)
    evs = list(read_events(events_path))
    if sc.durable_only:  # every worker restarts: where it resumed from, how much it redid
        result = measure_restart(evs, run, stack, sc.kind, expected=expected_source(sc, stack))
    elif sc.kind == "torchrun":  # a new round's processes, then its first step
        result = measure(evs, run, t_change, reset_event="start",
                         first_event="resume" if stack == "ours" else "enter")
    elif sc.kind == "mpi":  # the job ends (reset: mpirun's exit), the relaunch resumes
        result = measure(evs, run, t_change, reset_event="launcher_exit", first_event="resume")
    else:
        result = measure(evs, run, t_change)
    result.update(rc=rc, run_dir=str(run), **killed)
    return result


def kill_random_worker(events_path: Path, np: int, timeout: float, proc: subprocess.Popen,
                       out: dict[str, Any]) -> float | None:
    """Once the job committed step 20 at full size: waits 0-2 s (a random moment of a step,
    collectives included), then SIGKILLs the process of a random rank. Returns when it did
    (None: the job never got there), and notes which rank and process in `out`."""
    def started() -> bool:
        return any(e["event"] == "commit" and e["step"] >= 20 and e["size"] == np
                   for e in read_events(events_path))
    if not wait_until(started, timeout, proc):
        return None
    time.sleep(random.uniform(0.0, 2.0))  # the randomness of the moment, not a wait for anything
    rank = random.randrange(np)
    pids = [e["pid"] for e in read_events(events_path) if e["event"] == "start"
            and e["rank"] == rank]
    t_kill = time.time()
    try:
        os.kill(pids[-1], signal.SIGKILL)
    except (IndexError, ProcessLookupError):
        return None
    out.update(killed_rank=rank, killed_pid=pids[-1])
    return t_kill


RELAUNCHED = ("horovod_driver", "torchrun_nodes")


def run_relaunched(sc: Scenario, stack: str, run: Path, timeout: float) -> dict[str, Any]:
    """A row where the launcher dies with the workers (`horovod_driver`: horovodrun's driver
    under `hvd-resilient run`, which relaunches it; `torchrun_nodes`: two torchrun agents,
    started again by this function as a scheduler would). The run holds at the fault step
    (sc.fault: a hang), and is killed from outside the moment its fault marker appears: the
    times are from that kill. Every process the run started, in whatever session, is ended
    before this returns (a marker in their environment, `tests.support.jobs`), and so are the
    memory tier folders (one a node)."""
    jobs = JobRunner(run)
    shms = [memory_tier_dir() for _ in range(2 if sc.kind == "torchrun_nodes" else 1)]
    env = [jobs.env(HVD_RESILIENT_FAULT=sc.fault, HVD_RESILIENT_MEMORY_TIER_DIR=str(shm),
                    **sc.env) for shm in shms]
    end = time.time() + timeout

    def nodes() -> list[Job]:  # one agent a node, a fresh rendezvous each launch
        cmd = torchrun_cmd(sc, stack, run, len(shms), f"127.0.0.1:{free_port()}")
        return [jobs.start(cmd, env=e, name=f"node{i}") for i, e in enumerate(env)]

    t_kill = t_relaunch = None
    try:
        if sc.kind == "horovod_driver":
            _, discover = write_discovery(run, sc.hosts)
            launched = [jobs.start(supervised_cmd(
                sc, stack, run, ["--launcher", "horovod", "--discovery", str(discover),
                                 "--min-np", str(sc.min_np), "--max-np", str(sc.max_np),
                                 "--network-interface", "lo",
                                 *(sc.run_args if stack == "ours" else [])]),
                       env=env[0], name="console")]
        else:
            launched = nodes()
        if wait_until(lambda: any(run.glob(".fault-*")), timeout, launched[0].proc):
            t_kill = time.time()
            if sc.kind == "horovod_driver":
                kill_driver(launched[0])
            else:  # every process of both nodes; the second node's memory is gone with it
                kill([p for job in launched for p in job.processes()])
                for job in launched:
                    job.proc.kill()  # the agent (already, unless it was not listed)
                    job.proc.wait()
                shutil.rmtree(shms[1], ignore_errors=True)
                t_relaunch = time.time()
                launched = nodes()
        rc: list[int | None] = []
        for job in launched:
            try:
                rc.append(job.proc.wait(timeout=max(1.0, end - time.time())))
            except subprocess.TimeoutExpired:
                rc.append(None)
    finally:
        jobs.cleanup()
        for shm in shms:
            shutil.rmtree(shm, ignore_errors=True)
    result = measure_restart(
        list(read_events(run / "events.jsonl")), run, stack, sc.kind, t_fault=t_kill,
        consoles=[job.log for job in jobs.jobs], expected=expected_source(sc, stack))
    if t_relaunch is not None:  # the new agents were started (their workers: relaunch_s)
        result["agents_started_s"] = round(t_relaunch - t_kill, 3)
    result.update(rc=rc if len(rc) > 1 else rc[0], run_dir=str(run))
    return result


def kill_driver(job: Job) -> None:
    """SIGKILLs horovodrun's driver (the one child of `hvd-resilient run`'s supervisor) and,
    first, every process the driver forked: Horovod's middlemen, which SIGTERM their local
    workers when the driver dies (a local worker then stops with a final durable checkpoint,
    and the tier is not needed). Without them the workers get no signal, as on a host reached
    over ssh, and those on the driver's machine find it gone in /proc (driver_watch) and exit,
    their commits kept in the memory tier. The supervisor's warm pool (--warm-pool) is its
    other child, and lives on."""
    for driver in psutil.Process(job.proc.pid).children():
        if "warm.pool_server" not in " ".join(driver.cmdline()):
            kill([*driver.children(), driver])


def kill(procs: list[psutil.Process]) -> None:
    """SIGKILL, in this order (psutil checks that each is still the process listed)."""
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


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


def agent_log_times(console: Path, year: int) -> list[tuple[float, str]]:
    """torchrun's agent log lines that mark a restart (`LOGLEVEL=INFO`), as (time, what): the
    agent saw the worker group fail, and it started the new round's workers."""
    out = []
    try:
        text = console.read_text(errors="replace")
    except OSError:
        return out
    for m in AGENT_LINE.finditer(text):
        mmdd, hms, frac, what = m.groups()
        t = time.mktime(time.strptime(f"{year}{mmdd} {hms}", "%Y%m%d %H:%M:%S"))
        out.append((t + float("0." + frac), what))
    return out


AGENT_LINE = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d)\.(\d+) \d+ \S+\] \[default\] "
                        r"(Worker group FAILED|Starting worker group)", re.M)
EXPECTED_SOURCE = {"ours": ("memory",), "durable": ("durable", "scratch")}


def expected_source(sc: Scenario, stack: str) -> tuple[str, ...]:
    """Where a restart row's run must resume from: ours from sc.resume_from (memory, or a
    peer's copy), durable only from the last durable checkpoint, or from scratch."""
    return (sc.resume_from,) if stack == "ours" else EXPECTED_SOURCE[stack]


def measure_restart(evs: list[dict[str, Any]], run: Path, stack: str, kind: str, *,
                    t_fault: float | None = None, consoles: list[Path] | None = None,
                    expected: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A restart of every worker (torchrun's new round, or mpirun or horovodrun's driver
    relaunched by the supervisor, or torchrun's agents started again), timed from the fault
    marker (or `t_fault`, when the fault came from outside) to:

    - launcher: the launcher knew (torchrun's agent logged the failed worker group; mpirun or
      the driver exited: `launcher_exit`);
    - relaunch: the new workers were started (the agent forked them: its log in `consoles`,
      by default the run's console.log; the supervisor's `launch`);
    - start: the first `start` of the new round (the workers initialized, before the resume);
    - first step: the `resume` event (the commit or checkpoint is loaded and the next step is
      the first one trained); with nothing to resume from (no durable checkpoint yet, memory
      tier off) there is no `resume`: the round's last `start` instead (training begins right
      after it, from step 0);
    - first trained: the first progress or commit of the new round past the step it resumed
      from (at most commit/log interval steps trained);
    - caught up: the first one past the fault step (what the fault cost in all).

    The resume source is checked: `expected`, by default memory for ours, durable (or
    scratch, while there is no durable checkpoint) for the memory tier off; anything else is
    an `error` (main fails)."""
    fired = list(run.glob(".fault-*"))
    if not fired:
        return {"error": "the fault never happened"}
    t0 = t_fault or min(float(p.read_text().split()[0]) for p in fired)
    fault_step = min(int(p.name.rsplit("-s", 1)[1]) for p in fired)
    after = [e for e in evs if e["ts"] >= t0]
    starts = [e["ts"] for e in after if e["event"] == "start" and e["rank"] >= 0]
    if not starts:
        return {"error": "no restart after the fault"}
    round_ = [e for e in after if e["ts"] >= starts[0]]
    if kind in ("mpi", "horovod_driver"):
        t_launcher = next((e["ts"] for e in after if e["event"] == "launcher_exit"), None)
        t_relaunch = next((e["ts"] for e in after if e["event"] == "launch"), None)
    else:
        agent = sorted((t, w) for c in consoles or [run / "console.log"]
                       for t, w in agent_log_times(c, time.localtime(t0).tm_year)
                       if t >= t0 - 0.001)  # the log has milliseconds
        t_launcher = next((t for t, w in agent if w.startswith("Worker")), None)
        t_relaunch = next((t for t, w in agent if w.startswith("Starting")), None)
    trained = [e for e in round_ if e["event"] in ("progress", "commit", "memory_commit")]
    resumes = [e for e in round_ if e["event"] == "resume"]
    fetched_by = None  # source peer: the ranks that fetched the copy
    if resumes:
        r = resumes[0]
        source, from_step, t_first = r["source"], r["from_step"], r["ts"]
        durable_step, fetched_by = r.get("durable_step"), r.get("fetched_by")
    else:  # the round's starts up to its first step (never a later round's)
        first_trained = min([e["ts"] for e in trained] + [math.inf])
        source, from_step, durable_step = "scratch", 0, -1
        t_first = max(e["ts"] for e in round_ if e["event"] == "start" and e["rank"] >= 0
                      and e["ts"] < first_trained)
    expected = expected or EXPECTED_SOURCE[stack]
    wrong = None if source in expected else (
        f"resumed from {source} (step {from_step}), expected {' or '.join(expected)}")

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 3)

    def trained_past(step: int) -> float | None:
        return min((e["ts"] for e in trained if e["ts"] >= t_first
                    and (ckpt_step(e) or 0) > step), default=None)

    return {
        "source": source, "fault_step": fault_step, "from_step": from_step,
        "durable_step": durable_step, "steps_redone": fault_step - from_step,
        "launcher_s": since(t_launcher), "relaunch_s": since(t_relaunch),
        "reset_s": since(starts[0]), "first_step_s": since(t_first),
        "relaunch_to_first_step_s": (round(t_first - t_relaunch, 3)
                                     if t_relaunch is not None else None),
        "first_trained_s": since(trained_past(from_step)),
        "caught_up_s": since(trained_past(fault_step)),
        "finished": any(e["event"] == "done" for e in evs),
        **({"fetched_by": fetched_by} if fetched_by else {}),
        **({"error": wrong} if wrong else {}),
    }


METRICS = ("detect_s", "reset_s", "first_step_s", "stalled_s", "new_size_commit_s",
           "lost_steps", "steps_redone", "launcher_s", "relaunch_s",
           "relaunch_to_first_step_s", "first_trained_s", "caught_up_s")


TAIL_METRICS = ("detect_s", "reset_s", "first_step_s", "stalled_s")
SLOW_S = 2.0
"""A run whose first step came later than this after the fault counts as slow (issue #31)."""


def p90(xs: list[float]) -> float:
    """The nearest-rank 90th percentile (of 20 runs: the 18th)."""
    ordered = sorted(xs)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": len(runs), "finished": sum(bool(r.get("finished"))
                                                                for r in runs)}
    for m in METRICS:
        xs = [r[m] for r in runs if r.get(m) is not None]
        out[m] = round(statistics.median(xs), 3) if xs else None
        if xs and len(xs) > 1:
            out[m + "_range"] = [min(xs), max(xs)]
        if xs and m in TAIL_METRICS:
            out[m + "_p90"] = p90(xs)
            out[m + "_max"] = max(xs)
    firsts = [r.get("first_step_s") for r in runs]
    # a run that never reached a first step is slow too
    out["runs_over_2s"] = sum(1 for x in firsts if x is None or x > SLOW_S)
    sources = sorted({r["source"] for r in runs if "source" in r})
    if sources:
        out["sources"] = sources
    return out


def fmt(v: Any, unit: str = " s") -> str:
    return "-" if v is None else f"{v}{unit}"


def spread(s: dict[str, Any], m: str, unit: str = " s") -> str:
    """The median, and min-max over the runs."""
    v, r = s.get(m), s.get(m + "_range")
    if v is None or not r:
        return fmt(v, unit)
    return f"{v}{unit} ({r[0]}-{r[1]})"


def restart_table(results: dict[str, Any]) -> str:
    """The scenarios where every worker restarts, ours (memory tier) against durable only
    (the same job with `--no-memory-tier-enabled`, as before the tier): medians, min-max in
    brackets; times from the kill (see measure_restart), relaunch to first step aside."""
    lines = [
        "| scenario | stack | runs (finished) | resumed from | steps redone | launcher knew "
        "| workers relaunched | first start | first step | relaunch to first step "
        "| first trained step | past the fault step | past the fault vs durable only |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for sc in results["scenarios"]:
        if not sc.get("durable_only"):
            continue
        ours, dur = sc["ours"], sc.get("durable")
        for stack, s in (("ours (memory tier)", ours), ("durable only", dur)):
            if s is None:
                continue
            ratio = "-"
            if s is ours and dur and s["caught_up_s"] and dur["caught_up_s"]:
                ratio = f"{s['caught_up_s'] / dur['caught_up_s']:.2f}x"
            lines.append(
                f"| {sc['title']} | {stack} | {s['runs']} ({s['finished']}) | "
                f"{', '.join(s.get('sources', [])) or '-'} | "
                f"{spread(s, 'steps_redone', '')} | {spread(s, 'launcher_s')} | "
                f"{spread(s, 'relaunch_s')} | {spread(s, 'reset_s')} | "
                f"{spread(s, 'first_step_s')} | {spread(s, 'relaunch_to_first_step_s')} | "
                f"{spread(s, 'first_trained_s')} | {spread(s, 'caught_up_s')} | {ratio} |"
            )
    return "\n".join(lines)


def table(results: dict[str, Any]) -> str:
    if all(sc.get("durable_only") for sc in results["scenarios"]):
        return restart_table(results)
    lines = [
        "| scenario | stack | runs (finished) | detect | reset | first step | first step p90 "
        "/ max | runs > 2 s | training stalled | new-size commit | steps lost "
        "| first step vs vanilla |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for sc in results["scenarios"]:
        if sc.get("durable_only"):
            continue
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
                f"{fmt(s.get('first_step_s_p90'))} / {fmt(s.get('first_step_s_max'))} | "
                f"{s.get('runs_over_2s', '-')} | "
                f"{fmt(s.get('stalled_s'))} | {fmt(s['new_size_commit_s'])} | "
                f"{fmt(s['lost_steps'], '')} | {ratio} |"
            )
    if any(sc.get("durable_only") for sc in results["scenarios"]):
        lines += ["", restart_table(results)]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--vanilla-repeats", type=int, default=3,
                   help="also the repeats of the durable-only runs (memory tier off)")
    p.add_argument("--only", default="", help="comma-separated scenario names: " + ", ".join(
        sc.name for sc in scenarios()))
    p.add_argument("--vanilla-skip", default="",
                   help="comma-separated scenario names to run without their vanilla runs")
    p.add_argument("--random-kills", type=int, default=20,
                   help="runs of each random-kill scenario (instead of --repeats)")
    p.add_argument("--timeout", type=float, default=240.0, help="per run")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "recovery.json"))
    p.add_argument("--keep", action="store_true", help="keep run folders")
    a = p.parse_args()
    only = {s for s in a.only.split(",") if s}
    unknown = only - {sc.name for sc in scenarios()}
    if unknown:
        p.error(f"--only: no scenario {', '.join(sorted(unknown))} (see --help)")
    skip = {s for s in a.vanilla_skip.split(",") if s}
    work = Path(tempfile.mkdtemp(prefix="hvd-resilient-recovery-"))
    failed: list[str] = []  # restart scenarios that resumed from the wrong place
    t_start = time.time()
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
            if sc.durable_only:
                entry.update(durable_only=True, train_args=sc.train_args)
            second = "durable" if sc.durable_only else "vanilla"
            plan = [(stack, n) for stack, n in (
                ("ours", a.random_kills if sc.kind == "random_kill" else a.repeats),
                (second, a.vanilla_repeats if sc.vanilla and sc.name not in skip else 0)) if n]
            if sc.durable_only:  # ours and durable only in turn: the load drifts over both
                order = [st for i in range(max(n for _, n in plan)) for st, n in plan if i < n]
            else:
                order = [st for st, n in plan for _ in range(n)]
            runs: dict[str, list[dict[str, Any]]] = {st: [] for st, _ in plan}
            for stack in order:
                r = run_once(sc, stack, work, a.timeout)
                runs[stack].append(r)
                i = len(runs[stack])
                print(f"{sc.name} {stack} #{i}: {json.dumps(r)}", flush=True)
                if sc.durable_only and "error" in r:
                    failed.append(f"{sc.name} {stack} #{i}: {r['error']}")
            for stack, rs in runs.items():
                entry[stack] = summarize(rs)
                entry[stack + "_runs"] = rs
            results["scenarios"].append(entry)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    results["load_after"] = os.getloadavg()[0]
    results["wall_s"] = round(time.time() - t_start, 1)
    if failed:
        results["failed"] = failed
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    print(f"\nwall time {results['wall_s']} s")
    for line in failed:
        print(f"FAILED {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
