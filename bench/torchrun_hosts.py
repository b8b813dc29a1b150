"""torchrun across hosts: our restart path and plain torchrun, 3 namespaced hosts x 2 workers.

The side-by-side of issue #52 for the two torchrun stacks; the in-place path on the same hosts,
job and faults is `bench/inplace_hosts.py` (its `kill_worker`, `kill_host` and
`kill_coordinator_host` rows answer these).

Every run builds a fresh `Cluster(3)` (the chaos harness's network namespaces with sshd,
`tests/support/netns.py`, through the chaos fixture's `Chaos` class, which stops the jobs
before the network goes) and starts one torchrun agent per host, inside the host's namespace
(`ip netns exec NS ...`: the agent and its workers are that host's processes), all on one
c10d rendezvous whose store host 0's agent holds:

    --nnodes 2:3 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST0:29400
    --rdzv-id RUN --rdzv-conf last_call_timeout=1 --max-restarts 3 --local-addr HOST_ADDR

- `ours-torchrun`: exactly the command `hvd-resilient run --launcher torchrun --nnodes 2:3`
  starts on each node (`launchers/torchrun.py`'s `torchrun_command`: torchrun through
  `hvd_resilient.launch.warm.torchrun`, workers forked from the agent with their imports done,
  each round's group keyed under the rendezvous round) over `tests/scripts/recipe_job.py`,
  the AdamW recipe of `bench/inplace_hosts.py` (commits every 4 steps, a durable checkpoint
  every 8, `--step-time 0.05`, 80 steps) with the memory tier on, one tier folder per host
  (`HVD_RESILIENT_MEMORY_TIER_DIR`): every restarted round resumes from the newest commit in
  memory (its host's copy, else a peer's), else the durable checkpoint.
- `plain-torchrun`: plain `torchrun` with the same flags over `bench/torchrun_vanilla_job.py`,
  DDP as the PyTorch docs write it (`init_process_group("gloo")` from torchrun's environment,
  rank 0 saves a checkpoint file every 20 steps, a restarted round loads it), `--steps 80
  --step-time 0.05`.

`--local-addr` (each host's own address) is there for the namespaces only: every namespace
resolves the machine's one hostname to its own address, so without it node rank 0's agent
would advertise a name that the other hosts resolve to themselves. `GLOO_SOCKET_IFNAME` names
the hosts' interface for the same reason.

The start: host 0's agent (the store) first; hosts 1 and 2 together once it waits in the
rendezvous (its "Rendezvous'ing worker group" line), so that the first round has all three
(`startup_groups`: 1 each). Started all at once on the loaded machine, the agents' imports
ended seconds apart and rounds of 4 formed and re-formed within the 1 s last call, and torch
2.13 then hung: a node that was group rank 0 in one round (host 1, in a round host 0 rejoined
too late for) creates a shared TCPStore of its own and keeps handing its workers that store's
address in every later round (`DynamicRendezvousHandler.next_rendezvous` caches
`_bootstrap_store_info` and rebuilds it only for a rank 0 without a store), while the other
nodes' workers use host 0's: the round of 6 waited in `TCPStore.get` until it was killed. The
same torch code runs both stacks' agents. A start that still does not train at full size
within `--startup-timeout` s, or whose agent exits first (agents of one round waiting on each
other's rendezvous keys until the store's 60 s timeout was seen too), is recorded
(`startup_failures`, `failed_starts`) and tried again on a fresh cluster, up to
`--startup-tries` starts; the fault is never injected into a start that went wrong.

Once a step >= 20 has ended, and after a random extra 0-0.5 s, one fault (the faults of
`bench/inplace_hosts.py`):

- `kill_worker`: SIGKILL one (random) worker on host 2; torchrun restarts every worker, all
  three agents rejoin: the recovered world has 6 ranks;
- `kill_host`: every process of host 1 SIGKILLed (its agent and workers; its sshd stays,
  `Cluster.kill_host`): the other two agents form a round of 4;
- `kill_store_host`: every process of host 0 SIGKILLed: its agent holds the c10d rendezvous'
  store, and torch 2.13's agents and workers use that one store for the whole job
  (`TORCHELASTIC_USE_AGENT_STORE`). The documented single point of failure: recorded as it
  goes, recovered (a round of 4 on hosts 1 and 2) or not within `--recover-timeout`, and
  when and how the other agents ended.

Per run, from `samples.jsonl` (one line per rank per step: its end time, world size and
pid; both jobs write it) and `events.jsonl`, with the definitions of `bench/inplace_hosts.py`:

- `first step`: the fault -> the first step that ends after it in the recovered world: under
  torchrun every worker of the new round is a new process, so the first step after the fault
  of a process that had not trained before it (not on a lost host), at whatever size the
  round formed (recorded: `recovered_size`);
- `redone`: steps trained before the fault and trained again after it;
- `finished`: every surviving agent exited 0 and every rank of the final world wrote `done`;
  for ours also `digests equal` (the `done` events' state digests; the plain job writes none).

A run that does not recover within `--recover-timeout` s of the fault (or the job's
`--timeout` from the launch) counts as not recovered; its agents' exit codes and the time
they exited after the fault are kept, with their logs' tails, in the JSON. Median, p90 and max
per row. Rows take turns within each repeat (the machine's load drifts over all alike). Every
job, process, memory tier folder and namespace is removed after each run, also on Ctrl-C or a
failure (Chaos.close), and the run checks that none is left. Needs root, iproute2 and
openssh-server (docs/chaos.md).

All rows, 5 repeats (the lead's run, on a quiet machine; one repeat of the six rows took 5
minutes at a load of 4-11 and 19 minutes at 20-30, so about 25-30 minutes in all on a quiet
machine, more for every start tried again):

    .venv/bin/python bench/torchrun_hosts.py --repeats 5 --out bench/results/torchrun-hosts.json

One row, for development: ``--repeats 1 --stacks ours-torchrun --scenarios kill_worker``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from inplace_recovery import steps  # noqa: E402  (bench/inplace_recovery.py)
from partition import (  # noqa: E402  (bench/partition.py)
    hosts_unavailable,
    run_rows,
    stats,
    teardown,
    write_results,
)

from hvd_resilient.events import read_events  # noqa: E402
from hvd_resilient.launch.launchers.torchrun import torchrun_command  # noqa: E402
from tests.chaos.conftest import Chaos  # noqa: E402
from tests.chaos.test_chaos_inplace import COMMIT_EVERY, RECIPE  # noqa: E402
from tests.support.jobs import PYTHON, VENV_BIN, Job  # noqa: E402
from tests.support.netns import Cluster  # noqa: E402

HOSTS, SLOTS = 3, 2
NP = HOSTS * SLOTS
NNODES = f"{HOSTS - 1}:{HOSTS}"
RDZV_PORT = 29400
MAX_RESTARTS = 3
HIT_AFTER_STEP = 20
CHECKPOINT_EVERY = 8  # ours' durable checkpoint (inplace_hosts' job)
VANILLA_CKPT_EVERY = 20  # bench/torchrun_vanilla_job.py's checkpoint file
STEP_TIME = 0.05
POLL_S = 0.02
JOB = ROOT / "tests" / "scripts" / "recipe_job.py"
VANILLA = ROOT / "bench" / "torchrun_vanilla_job.py"
JOINING = "Rendezvous'ing worker group"
"""torchrun's log line once its rendezvous handler (on host 0: the store) is up and it joins."""


class StartupFailed(RuntimeError):
    """The job did not train at full size before the fault: the run is tried again."""
STACKS = ("ours-torchrun", "plain-torchrun")
SCENARIOS: dict[str, tuple[int, int]] = {
    # scenario: (the host hit, the world's size once recovered)
    "kill_worker": (2, NP),
    "kill_host": (1, NP - SLOTS),
    "kill_store_host": (0, NP - SLOTS),
}
IN_PLACE = {  # bench/results/inplace-hosts{,-coordinator}.log, median / p90 / max of 5
    "kill_worker": "0.137 / 0.154 / 0.154",
    "kill_host": "0.125 / 0.161 / 0.161",
    "kill_store_host": "0.140 / 0.163 / 0.163 (kill_coordinator_host)",
}


def agent_command(stack: str, c: Cluster, index: int, name: str, run: Path,
                  ckpt: str, max_steps: int) -> list[str]:
    """Host ``index``'s torchrun agent, run inside its namespace."""
    endpoint = f"{c.hosts[0].addr}:{RDZV_PORT}"
    addr = c.hosts[index].addr
    if stack == "ours-torchrun":
        train = [PYTHON, str(JOB), *RECIPE, "--samples", "--batch-size", "8",
                 "--commit-every", str(COMMIT_EVERY), "--epochs", "1000",
                 "--max-steps", str(max_steps), "--checkpoint-every", str(CHECKPOINT_EVERY),
                 "--step-time", str(STEP_TIME), "--run-id", name, "--run-dir", str(run),
                 "--checkpoint-url", ckpt]
        cmd = torchrun_command(SLOTS, NNODES, endpoint, MAX_RESTARTS, name, train)
        script = cmd.index(str(JOB))
        cmd[script:script] = ["--local-addr", addr]  # torchrun's, before the script
    else:
        cmd = [str(VENV_BIN / "torchrun"), "--nnodes", NNODES, "--nproc-per-node", str(SLOTS),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", name,
               "--rdzv-conf", "last_call_timeout=1", "--max-restarts", str(MAX_RESTARTS),
               "--local-addr", addr, str(VANILLA), "--run-dir", str(run),
               "--steps", str(max_steps), "--step-time", str(STEP_TIME)]
    return ["ip", "netns", "exec", c.hosts[index].ns, *cmd]


def _step_time(rows: list[dict[str, Any]], t0: float) -> float | None:
    """The step time before the fault: the median gap between one worker's last step ends
    before it (the machine's pace: a recovery's first step takes at least one step)."""
    gaps = []
    for pid in {s["pid"] for s in rows if s["t"] <= t0}:
        mine = sorted(s["t"] for s in rows if s["pid"] == pid and s["t"] <= t0)[-6:]
        gaps += [b - a for a, b in zip(mine, mine[1:], strict=False)]
    return round(statistics.median(gaps), 3) if gaps else None


def _alive(pids: set[int]) -> set[int]:
    """Those still running (a zombie has ended)."""
    out = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
    return out


def _events(run: Path) -> list[dict[str, Any]]:
    path = run / "events.jsonl"
    return list(read_events(path)) if path.exists() else []


def run_once(stack: str, scenario: str, work: Path, a: argparse.Namespace,
             rng: random.Random) -> dict[str, Any]:
    """One run; a start that never trained at full size is recorded and tried again, up to
    `--startup-tries` in all."""
    failed: list[dict[str, Any]] = []
    for _ in range(a.startup_tries):
        out = attempt(stack, scenario, work, a, rng)
        if not out.get("startup_failed"):
            break
        failed.append(out)
    earlier = failed[:-1] if failed and failed[-1] is out else failed
    if earlier:  # the failed starts before the one reported (each with its agents' tails)
        out["startup_failures"] = earlier
    return out


def attempt(stack: str, scenario: str, work: Path, a: argparse.Namespace,
            rng: random.Random) -> dict[str, Any]:
    """One try: cluster, agents, fault, measurements; always torn down."""
    name = f"{stack}-{scenario.replace('_', '-')}-{time.time_ns()}"
    tmp = work / name
    tmp.mkdir(parents=True)
    chaos = Chaos(tmp)
    shm_root = Path("/dev/shm" if Path("/dev/shm").is_dir() else tempfile.gettempdir())
    tiers = [shm_root / f"hvd_resilient-bench-{uuid.uuid4().hex}-h{i}" for i in range(HOSTS)]
    out: dict[str, Any] = {"stack": stack, "scenario": scenario,
                           "load_before": round(os.getloadavg()[0], 2)}
    t_start = time.time()
    agents: list[Job] = []
    try:
        out.update(_fault_and_measure(chaos, stack, scenario, name, tmp, tiers, agents, a,
                                      rng, t_start))
    except (AssertionError, RuntimeError, subprocess.SubprocessError, OSError,
            psutil.Error) as e:
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        out["startup_failed"] = isinstance(e, StartupFailed)
    finally:
        # the agents' logs as the run left them (the teardown's SIGTERM adds its tracebacks)
        tails = {f"host{i}": job.output()[-3000:] for i, job in enumerate(agents)}
        out["teardown"] = teardown(chaos)
        for d in tiers:
            shutil.rmtree(d, ignore_errors=True)
        out["run_s"] = round(time.time() - t_start, 1)
        if agents and ("error" in out or not out.get("finished")):
            out["output_tail"] = tails
    return out


def _fault_and_measure(chaos: Chaos, stack: str, scenario: str, name: str, tmp: Path,
                       tiers: list[Path], agents: list[Job], a: argparse.Namespace,
                       rng: random.Random, t_start: float) -> dict[str, Any]:
    hit_index, new_size = SCENARIOS[scenario]
    c = chaos.cluster(HOSTS)
    run = tmp / "run"
    run.mkdir()
    ckpt = f"file://{tmp}/ckpt"
    end = t_start + a.timeout

    def start(i: int) -> Job:
        env = c.env(chaos.jobs.env(HVD_RESILIENT_MEMORY_TIER_DIR=str(tiers[i]),
                                   GLOO_SOCKET_IFNAME=c.iface, LOGLEVEL="INFO"))
        job = chaos.jobs.start(agent_command(stack, c, i, name, run, ckpt, a.max_steps),
                               env=env, cwd=tmp, name=f"host{i}")
        c.adopt(job.proc.pid)  # a sweep after a crash of this process ends it too
        return job

    # Host 0 (the store) first; hosts 1 and 2 together once it waits in the rendezvous: both
    # then connect at once and the first round has all three (see the module doc).
    agents.append(start(0))
    while JOINING not in agents[0].output():
        if agents[0].proc.poll() is not None or time.time() > end:
            raise StartupFailed("host 0's agent did not come up")
        time.sleep(0.05)
    agents.extend([start(1), start(2)])
    startup_end = min(end, time.time() + a.startup_timeout)

    def exited() -> list[int | None]:
        return [job.proc.poll() for job in agents]

    while not any(s["step"] >= HIT_AFTER_STEP and s["size"] == NP for s in steps(run)):
        if any(rc is not None for rc in exited()):
            raise StartupFailed(f"an agent exited ({exited()}) before step {HIT_AFTER_STEP}")
        if time.time() > startup_end:
            raise StartupFailed(f"step {HIT_AFTER_STEP} not reached at size {NP} within "
                                f"{a.startup_timeout:g} s of the last agent's start (worker "
                                f"groups started: "
                                f"{_groups_started(agents, list(range(HOSTS)))})")
        time.sleep(0.05)
    out: dict[str, Any] = {"startup_s": round(time.time() - t_start, 1)}
    out["extra_delay_s"] = round(rng.uniform(0, 0.5), 3)
    time.sleep(out["extra_delay_s"])
    rows = steps(run)
    first = {s["pid"] for s in rows}  # the processes that trained so far
    out["startup_groups"] = _groups_started(agents, list(range(HOSTS)))  # 1 each: no churn
    where: dict[int, int] = {}
    for pid in _alive(first):  # this round's workers (an earlier round's are gone)
        h = c.host_of_pid(pid)
        if h is not None:
            where[pid] = h.index
    per_host = [sorted(p for p, i in where.items() if i == k) for k in range(HOSTS)]
    if any(len(pids) != SLOTS for pids in per_host):
        raise RuntimeError(f"expected {SLOTS} live workers per host, found {per_host}")
    host = c.hosts[hit_index]
    on_host = set(per_host[hit_index])
    agent_pids = {job.proc.pid for job in agents}
    if scenario == "kill_worker":
        victim = rng.choice(sorted(on_host))
        t0 = c.kill_pid(victim)
        lost = {victim}
        lost_agents: set[int] = set()
    else:  # kill_host, kill_store_host: the agent, its workers (the sshd stays)
        t0, killed = c.kill_host(host)
        out["killed"] = len(killed)
        lost = on_host
        lost_agents = {hit_index}
        if not agent_pids & set(killed):
            raise RuntimeError(f"host {hit_index}'s agent was not among the killed")
    out["fault_at_s"] = round(t0 - t_start, 1)  # after the launch
    survivors = [i for i in range(HOSTS) if i not in lost_agents]
    exit_at: dict[int, float] = {}

    def recovered_step() -> dict[str, Any] | None:
        after = [s for s in steps(run) if s["t"] > t0 and s["pid"] not in first
                 and s["pid"] not in lost]
        return min(after, key=lambda s: s["t"]) if after else None

    def note_exits() -> None:
        for i in survivors:
            if i not in exit_at and agents[i].proc.poll() is not None:
                exit_at[i] = time.time()

    give_up = min(end, t0 + a.recover_timeout)
    recovered: dict[str, Any] | None = None
    while time.time() < give_up:
        note_exits()
        recovered = recovered_step()
        if recovered is not None or len(exit_at) == len(survivors):
            break
        time.sleep(POLL_S)
    rows = steps(run)
    last_before = max(s["step"] for s in rows if s["t"] <= t0)
    out["last_step_before"] = last_before
    out["step_s_before"] = _step_time(rows, t0)
    out["recovered"] = recovered is not None
    if recovered is not None:
        out["first_step_s"] = round(recovered["t"] - t0, 3)
        out["redone"] = max(0, last_before + 1 - recovered["step"])
        out["recovered_size"] = recovered["size"]
        out["expected_size"] = new_size
        while time.time() < end and len(exit_at) < len(survivors):
            note_exits()
            time.sleep(0.1)
    else:
        out["outcome"] = ("every surviving agent exited" if len(exit_at) == len(survivors)
                          else f"no step in a new process within {give_up - t0:.0f} s")
    note_exits()
    out["agents_rc"] = {f"host{i}": agents[i].proc.poll() for i in survivors}
    out["agents_exited_s"] = {f"host{i}": round(exit_at[i] - t0, 3) for i in sorted(exit_at)}
    out["fault_to_end_s"] = round(time.time() - t0, 1)
    out["groups_started"] = _groups_started(agents, survivors)
    # a restarted round's group that read the dead round's addresses (plain torchrun)
    out["gloo_connect_failed_lines"] = sum(
        agents[i].output().count("connectFullMesh failed") for i in survivors)
    evs = _events(run)
    final = recovered["size"] if recovered is not None else new_size
    done = [e for e in evs if e["event"] == "done" and e["ts"] > t0 and e.get("size") == final]
    out["done_ranks"] = sorted({e["rank"] for e in done})
    out["finished"] = (recovered is not None
                       and all(agents[i].proc.poll() == 0 for i in survivors)
                       and out["done_ranks"] == list(range(final)))
    if stack == "ours-torchrun":
        resumes = [e for e in evs if e["event"] == "resume" and e["ts"] > t0]
        out["resumed_from"] = sorted({str(e.get("source")) for e in resumes})
        # the Trainer's `done` carries the state digests (recipe_job's own has none)
        digests = {e["rank"]: e["digests"] for e in done if e.get("digests") is not None}
        out["digests_equal"] = (out["finished"] and sorted(digests) == list(range(final))
                                and len({json.dumps(d, sort_keys=True)
                                         for d in digests.values()}) == 1)
    return out


def _groups_started(agents: list[Job], survivors: list[int]) -> dict[str, int]:
    """How often each surviving agent started its worker group, the first included
    (torchrun's INFO log)."""
    return {f"host{i}": agents[i].output().count("Starting worker group") for i in survivors}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("recovered")]
    out: dict[str, Any] = {
        "runs": len(runs), "recovered": len(ok),
        "finished": sum(bool(r.get("finished")) for r in runs),
        "errors": [r["error"] for r in runs if "error" in r],
        "failed_starts": sum(len(r.get("startup_failures", [])) + bool(r.get("startup_failed"))
                             for r in runs),
        "unclean_teardowns": [r["teardown"] for r in runs if r.get("teardown") != "clean"],
        "not_recovered": [r.get("outcome") for r in runs
                          if "error" not in r and not r.get("recovered")],
    }
    if any("digests_equal" in r for r in runs):
        out["digests_equal"] = sum(bool(r.get("digests_equal")) for r in runs)
    for m in ("first_step_s", "redone", "step_s_before"):
        xs = [r[m] for r in (runs if m == "step_s_before" else ok) if r.get(m) is not None]
        if xs:
            out[m] = stats(xs)
    sizes = sorted({r["recovered_size"] for r in ok})
    if sizes:
        out["recovered_sizes"] = sizes
    return out


def table(summary: dict[str, dict[str, Any]]) -> str:
    def cell(x: dict[str, Any] | None) -> str:
        return f"{x['median']} / {x['p90']} / {x['max']}" if x else "-"

    lines = [
        "| stack | fault | recovered | fault -> first step, s (median / p90 / max) "
        "| redone steps (median / max) | world after | finished | step before the fault, s "
        "(median) | in place (inplace_hosts) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row, s in summary.items():
        stack, sc = row.split(":")
        d = s.get("redone")
        fin = f"{s['finished']}/{s['runs']}"
        if "digests_equal" in s:
            fin += f" (digests equal {s['digests_equal']})"
        lines.append(
            f"| {stack} | {sc} | {s['recovered']}/{s['runs']} | {cell(s.get('first_step_s'))} "
            f"| " + (f"{d['median']} / {d['max']}" if d else "-")
            + f" | {','.join(map(str, s.get('recovered_sizes', []))) or '-'} | {fin} "
            f"| {s['step_s_before']['median'] if 'step_s_before' in s else '-'} "
            f"| {IN_PLACE[sc]} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="runs of each row")
    p.add_argument("--stacks", default=",".join(STACKS),
                   help=f"comma-separated subset of {', '.join(STACKS)}")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help=f"comma-separated subset of {', '.join(SCENARIOS)}")
    p.add_argument("--max-steps", type=int, default=80, help="the job's length")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="per run, from the launch to the job's end (s)")
    p.add_argument("--startup-timeout", type=float, default=180.0,
                   help="from the last agent's start to step 20 at full size (s); else the "
                        "start is recorded and tried again")
    p.add_argument("--startup-tries", type=int, default=2,
                   help="starts of a run in all (a failed start is kept in its record)")
    p.add_argument("--recover-timeout", type=float, default=60.0,
                   help="seconds after the fault a run may take to recover")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the run folders (logs, events)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "torchrun-hosts.json"))
    a = p.parse_args()
    stacks = [s for s in a.stacks.split(",") if s]
    chosen = [s for s in a.scenarios.split(",") if s]
    if set(stacks) - set(STACKS) or set(chosen) - set(SCENARIOS):
        p.error(f"stacks: {', '.join(STACKS)}; scenarios: {', '.join(SCENARIOS)}")
    why = hosts_unavailable()
    if why:
        print(why, file=sys.stderr)
        return 2
    rng = random.Random(a.seed)
    t_start = time.time()
    load_before = os.getloadavg()[0]

    def show_tail(run: str, tail: dict[str, str]) -> None:
        for host, text in tail.items():
            print(f"--- {run}: {host}'s agent, last lines ---\n{text[-1500:]}\n---", flush=True)

    results, interrupted = run_rows(
        [(f"{stack}:{sc}", lambda work, stack=stack, sc=sc: run_once(stack, sc, work, a, rng))
         for sc in chosen for stack in stacks], a.repeats, "hvd-resilient-torchrun-hosts-",
        a.keep, show_tail)
    summary = {row: summarize(runs) for row, runs in results.items()}
    return write_results(a.out, results, summary, table(summary), {
        "settings": {"hosts": HOSTS, "slots": SLOTS, "nnodes": NNODES,
                     "max_restarts": MAX_RESTARTS, "commit_every": COMMIT_EVERY,
                     "checkpoint_every": CHECKPOINT_EVERY,
                     "vanilla_checkpoint_every": VANILLA_CKPT_EVERY,
                     "hit_after_step": HIT_AFTER_STEP, "max_steps": a.max_steps,
                     "step_time": STEP_TIME, "timeout": a.timeout,
                     "recover_timeout": a.recover_timeout, "seed": a.seed,
                     "repeats": a.repeats},
        "in_place": IN_PLACE}, interrupted=interrupted, t_start=t_start,
        load_before=load_before, needs_digests=False)


if __name__ == "__main__":
    raise SystemExit(main())
