"""50 generations across hosts in one set of processes: threads, descriptors and memory flat.

The cross-host form of `test_fifty_generations_in_one_process_leak_no_thread_fd_or_memory`
(tests/integration/test_inplace.py): `hvd-resilient run --launcher inplace --hosts` on 3
namespaced hosts x 2 workers (one agent per host over ssh), the AdamW recipe
(tests/scripts/recipe_job.py), and 50 `sever:` faults (a collective failure without a death, as
Gloo raises a lost connection) on ranks of all three hosts. `HVD_RESILIENT_FAULT` reaches the
remote workers as every `HVD_RESILIENT_*` variable does: `hvd-resilient run` names it in the
fan-out's `--env-names`, and the fan-out sends its value to each agent on the first line of its
stdin, over ssh; the agent passes its environment on to its workers.

Each fault is answered by a new generation of the same six members, so whatever a process keeps
per generation (a thread, a socket, a store connection, a buffer) shows here 45 times over.
Asserted:

* no worker restarted (6 `start` events), generations 1..50 on every rank, all at size 6;
* every worker and every host's agent (the `inplace_agent` process in its namespace: it hosts
  its workers' store, and host 0's decides every generation), sampled from outside while
  training after generation 5 and again after generation 50 (the job runs on until a stop
  file, so the late sample is of the same live processes): the same threads and descriptors,
  RSS grown < 32 MiB (a worker) or < 16 MiB (an agent);
* every rank's own `reset` events (`threads`, `fds`, `rss_bytes`): the same threads and
  descriptors over generations 1..5 and 46..50, RSS grown < 32 MiB;
* every rank ends with identical digests, and every sample of each completed epoch was used
  exactly once.

Counts are compared as floors, the least seen over a few samples: a descriptor or thread that
lives a moment (the event log opens its file for each line, another thread may be writing one)
only ever adds, and a leak raises the floor with every generation. A rank's `reset` events
from the generations its own fault started are left out of its floor: at those it counts 4
descriptors fewer than its peers, every time, early or late (a peer's collective failed inside
Gloo, and at its reset the previous group's listening socket, epoll and wake-up pipe are still
open; they are closed soon after: sampled from outside, the ranks of a host count the same).
The first few generations may still set things up lazily, so the early sample comes after the
5th.

The faults come in two blocks with a quiet stretch between them, so that the early sample is
taken between generations, as the late one is (checked afterwards against the moment the 6th
fault fired). One JSON line gives the numbers and the wall time.
"""

from __future__ import annotations

import json
import time

import psutil
import pytest

from tests.support.exactly_once import assert_exactly_once
from tests.support.jobs import PYTHON, VENV_BIN, events, wait_for
from tests.support.netns import Cluster, Host
from tests.support.paths import SCRIPTS

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(600)]
JOB = str(SCRIPTS / "recipe_job.py")
N_SAMPLES = 1536  # recipe_job's data set
NP = 6
RECIPE = ["--recipe", "adamw-warmup-cosine", "--recipe-grad-accum", "4",
          "--recipe-clip-grad-norm", "1.0", "--recipe-precision", "bf16"]
AGENT_MODULE = "hvd_resilient.launch.inplace_agent"
EARLY = 5  # the generation the last is compared with
GENERATIONS = 50
WINDOW = 5  # reset events: generations 1..WINDOW against the last WINDOW
FIRST_STEP = 10
QUIET_STEPS = 25  # between the early block of faults and the rest
FAULT_STEPS = [*range(FIRST_STEP, FIRST_STEP + EARLY),
               *range(FIRST_STEP + EARLY + QUIET_STEPS, FIRST_STEP + QUIET_STEPS + GENERATIONS)]
SAMPLES = 3  # outside samples, one at each of that many commits
WORKER_RSS_GROWTH = 32 * 2**20
AGENT_RSS_GROWTH = 16 * 2**20
COUNTS = ("threads", "fds")


class SoakRun:
    def __init__(self, chaos, c: Cluster, name: str, faults: str) -> None:
        self.run = chaos.tmp / name
        self.stop = chaos.tmp / f"{name}-stop"
        hosts = ",".join(f"{h.addr}:2" for h in c.hosts)
        cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "inplace", "--hosts", hosts,
               "--np", str(NP), "--ssh-port", str(c.port), "--run-id", name,
               "--run-dir", str(self.run), "--max-restarts", "0",
               "--checkpoint", f"file://{chaos.tmp}/{name}-ckpt", "--",
               PYTHON, JOB, *RECIPE, "--samples", "--batch-size", "8", "--commit-every", "1",
               "--epochs", "1000", "--max-steps", "100000", "--checkpoint-every", "1000",
               "--no-memory-tier-enabled", "--step-time", "0.05", "--stop-file", str(self.stop)]
        env = c.env(chaos.jobs.env(HVD_RESILIENT_FAULT=faults))
        self.job = chaos.jobs.start(cmd, env=env, name=name)
        self.log = self.run / "events.jsonl"

    def of(self, kind: str) -> list[dict]:
        return [e for e in events(self.log) if e["event"] == kind] if self.log.exists() else []

    def settled_after(self, gen: int) -> bool:
        """Every rank reset into generation ``gen`` and a step was committed after that; fails
        at once on a generation without every member (the wait would only time out)."""
        resets = self.of("reset")
        lost = [e for e in resets if e["new_size"] != NP]
        assert not lost, f"a member was lost: {lost[0]}\n{self.job.output()[-4000:]}"
        resets = [e for e in resets if e["generation"] == gen]
        if len({e["rank"] for e in resets}) < NP:
            return False
        last = max(e["ts"] for e in resets)
        return any(e["ts"] > last for e in self.of("commit"))

    def steady(self, procs: dict[str, psutil.Process]) -> dict[str, dict[str, int]]:
        """Each process's threads and descriptors (the least seen) and RSS (the last), sampled
        at each of the next SAMPLES commits."""
        seen: dict[str, list[dict[str, int]]] = {k: [] for k in procs}
        for _ in range(SAMPLES):
            n = len(self.of("commit"))
            wait_for(lambda n=n: len(self.of("commit")) > n, 60, "a commit", self.job)
            for k, p in procs.items():
                with p.oneshot():
                    seen[k].append({"threads": p.num_threads(), "fds": p.num_fds(),
                                    "rss_bytes": p.memory_info().rss})
        return {k: {**{c: min(s[c] for s in v) for c in COUNTS}, "rss_bytes": v[-1]["rss_bytes"]}
                for k, v in seen.items()}

    def fired_at(self, index: int) -> float:
        """When fault ``index`` of the plan fired (its marker holds the time)."""
        (marker,) = self.run.glob(f".fault-{index}-sever-*")
        return float(marker.read_text())


def agent_of(c: Cluster, h: Host) -> psutil.Process:
    """The in-place agent in host ``h``'s namespace (started there over ssh)."""
    found = []
    for pid in c.pids(h):
        try:
            p = psutil.Process(pid)
            if AGENT_MODULE in p.cmdline():
                found.append(p)
        except psutil.Error:
            continue
    assert len(found) == 1, f"{h}: agents {found}"
    return found[0]


def reset_floors(resets: list[dict], rank: int, gens: range) -> dict[str, int]:
    """A rank's `reset` counts over ``gens`` (the least seen; its own faults' left out), and
    RSS at the last of them."""
    severed = {g + 1 for g, s in enumerate(FAULT_STEPS) if s % NP == rank}  # fault g: gen g+1
    mine = [e for e in resets if e["rank"] == rank and e["generation"] in gens]
    counted = [e for e in mine if e["generation"] not in severed]
    assert counted, (rank, gens)
    return {**{c: min(e[c] for e in counted) for c in COUNTS},
            "rss_bytes": max(mine, key=lambda e: e["generation"])["rss_bytes"]}


def flat(name: str, early: dict[str, int], late: dict[str, int], rss_growth: int) -> None:
    for c in COUNTS:
        assert late[c] == early[c], f"{name}: {c} {early[c]} -> {late[c]} ({early} -> {late})"
    grew = late["rss_bytes"] - early["rss_bytes"]
    assert grew < rss_growth, f"{name}: RSS grew {grew / 2**20:.1f} MiB ({early} -> {late})"


def test_fifty_generations_across_hosts_leak_no_thread_fd_or_memory(chaos):
    c = chaos.cluster(3)
    faults = ",".join(f"sever:rank={s % NP}:step={s}" for s in FAULT_STEPS)
    t0 = time.monotonic()
    run = SoakRun(chaos, c, "inplace-soak", faults)
    wait_for(lambda: len(run.of("start")) >= NP, 120, "every worker started", run.job)
    starts = run.of("start")
    host_of = {e["rank"]: c.host_of_pid(e["pid"]) for e in starts}
    assert sorted(h.index for h in host_of.values() if h) == [0, 0, 1, 1, 2, 2], host_of
    assert {host_of[s % NP].index for s in FAULT_STEPS} == {0, 1, 2}, "faults on every host"
    procs = {f"rank {e['rank']}": psutil.Process(e["pid"]) for e in starts}
    procs |= {f"agent {h.index}": agent_of(c, h) for h in c.hosts}

    wait_for(lambda: run.settled_after(EARLY), 180, f"generation {EARLY} settled", run.job)
    early = run.steady(procs)
    early_taken = time.time()
    wait_for(lambda: run.settled_after(GENERATIONS), 300, f"generation {GENERATIONS} settled",
             run.job)
    late = run.steady(procs)
    run.stop.touch()
    assert run.job.wait(120) == 0, run.job.output()[-4000:]
    wall = round(time.monotonic() - t0, 1)

    evs = events(run.log)
    resets = [e for e in evs if e["event"] == "reset"]
    at_reset = {f"rank {r}": (reset_floors(resets, r, range(1, WINDOW + 1)),
                              reset_floors(resets, r, range(GENERATIONS - WINDOW + 1,
                                                            GENERATIONS + 1)))
                for r in range(NP)}
    print(json.dumps({
        "scenario": "inplace-soak-50", "wall_s": wall,
        "steady": {k: {m: [early[k][m], late[k][m]] for m in early[k]} for k in procs},
        "at_reset": {k: {m: [e[m], la[m]] for m in e} for k, (e, la) in at_reset.items()},
        "hosts": {r: h.index for r, h in host_of.items() if h}}))

    assert len(list(run.run.glob(".fault-*"))) == GENERATIONS, "not every fault fired"
    assert early_taken < run.fired_at(EARLY), "the early sample was not taken between faults"
    starts = [e for e in evs if e["event"] == "start"]
    assert len(starts) == NP, f"a worker was (re)started: {len(starts)} starts"
    assert {e["new_size"] for e in resets} == {NP}, {e["new_size"] for e in resets}
    for rank in range(NP):
        gens = sorted(e["generation"] for e in resets if e["rank"] == rank)
        assert gens == list(range(1, GENERATIONS + 1)), (rank, gens)
    for k in procs:
        flat(k, early[k], late[k], AGENT_RSS_GROWTH if k.startswith("agent")
             else WORKER_RSS_GROWTH)
    for k, (e, la) in at_reset.items():
        flat(f"{k} at reset", e, la, WORKER_RSS_GROWTH)

    done = {e["rank"]: e for e in evs if e["event"] == "done" and "digests" in e}
    assert sorted(done) == list(range(NP)), sorted(done)
    assert len({json.dumps(d["digests"], sort_keys=True) for d in done.values()}) == 1, done
    assert assert_exactly_once(run.run, N_SAMPLES) >= 1
