"""In place across hosts that a discovery script adds and drops while the job trains:
`hvd-resilient run --launcher inplace --discovery SCRIPT` on 3 namespaced hosts (one agent per
host over ssh), the AdamW recipe (tests/scripts/recipe_job.py). The script is a user's own
kind: it prints a hosts file the test edits, as a cluster manager would.

- A host listed later joins: its agent starts (``--late``), its two workers set up while the
  others train and join at their next commit with the state sent from a peer, and nobody
  redoes a step.
- A listed host dropped leaves the same way: a generation without its members, which the others
  move to at their next commit; its workers exit when they find themselves left out, nothing
  is restored or redone, no worker is restarted.
- The same with etcd agreeing on the generations (a member in each host's namespace): the late
  agent needs no other agent's address.
- The host dropped is the coordinating one (host 0, rank 0 and the store): it decides the
  generation without itself, waits for the group to form, and exits; host 1's agent
  coordinates from there.

Every rank of the final world holds the same state (digests of every component), each sample
of every completed epoch is used exactly once. The timings go to stdout (the change -> the
others' first commit in the new world).
"""

from __future__ import annotations

import json
import time

import pytest

from tests.support.etcd_cluster import EtcdCluster
from tests.support.exactly_once import assert_exactly_once
from tests.support.jobs import PYTHON, VENV_BIN, events, wait_for
from tests.support.netns import Cluster, Host
from tests.support.paths import SCRIPTS

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]
JOB = str(SCRIPTS / "recipe_job.py")
N_SAMPLES = 1536  # recipe_job's data set
RECIPE = ["--recipe", "adamw-warmup-cosine", "--recipe-grad-accum", "4",
          "--recipe-clip-grad-norm", "1.0", "--recipe-precision", "bf16"]


class DiscoveredRun:
    """A run whose hosts are what ``hosts.txt`` lists, read by a discovery script."""

    def __init__(self, chaos, c: Cluster, name: str, listed: list[Host], *,
                 max_steps: int, etcd: EtcdCluster | None = None) -> None:
        self.c, self.run = c, chaos.tmp / name
        self.hostsfile = chaos.tmp / f"{name}-hosts.txt"
        self.list(listed)
        script = chaos.tmp / f"{name}-discover.sh"
        script.write_text(f"#!/bin/sh\ncat {self.hostsfile}\n")
        script.chmod(0o755)
        cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "inplace",
               "--discovery", str(script), "--max-np", "6", "--min-np", "2",
               "--ssh-port", str(c.port), "--run-id", name, "--run-dir", str(self.run),
               "--max-restarts", "0", "--checkpoint", f"file://{chaos.tmp}/{name}-ckpt",
               *(["--etcd", ",".join(etcd.endpoints)] if etcd else []), "--",
               PYTHON, JOB, *RECIPE, "--samples", "--batch-size", "8", "--commit-every", "4",
               "--epochs", "1000", "--max-steps", str(max_steps), "--checkpoint-every", "8",
               "--no-memory-tier-enabled", "--step-time", "0.05"]
        self.job = chaos.jobs.start(cmd, env=c.env(chaos.jobs.env()), name=name)
        self.log = self.run / "events.jsonl"

    def list(self, hosts: list[Host]) -> float:
        """The hosts file now names ``hosts`` (2 slots each); written whole, then renamed."""
        tmp = self.hostsfile.with_suffix(".new")
        tmp.write_text("".join(f"{h.addr}:2\n" for h in hosts))
        tmp.rename(self.hostsfile)
        return time.time()

    def of(self, kind: str) -> list[dict]:
        return [e for e in events(self.log) if e["event"] == kind] if self.log.exists() else []

    def wait_commits(self, n: int) -> None:
        wait_for(lambda: len(self.of("commit")) >= n, 150, f"{n} commits", self.job)

    def wait_size(self, size: int, after: float) -> float:
        """The first commit after ``after`` in a world of ``size`` ranks: its delay."""
        def found() -> float | None:
            ts = [e["ts"] for e in self.of("commit") if e["ts"] > after
                  and e.get("size", e.get("world_size")) == size]
            return min(ts) if ts else None
        t: float = wait_for(found, 120, f"a commit at size {size}", self.job)
        return round(t - after, 3)

    def workers_on(self, h: Host) -> set[int]:
        mine = set(self.c.pids(h))
        return {e["pid"] for e in self.of("start") if e["pid"] in mine}


def assert_final_world(run: DiscoveredRun, size: int, starts: int, *,
                       restored: bool = False) -> None:
    evs = events(run.log)
    started = [e for e in evs if e["event"] == "start"]
    assert len(started) == starts, f"a worker was (re)started: {len(started)} starts"
    if not restored:
        assert not [e for e in evs if e["event"] == "restore"], "a change restored a commit"
    done = {e["rank"]: e for e in evs if e["event"] == "done" and "digests" in e}
    assert sorted(done) == list(range(size)), sorted(done)
    first = done[0]["digests"]
    differ = {r: d["digests"] for r, d in done.items() if d["digests"] != first}
    assert not differ, f"ranks differ from rank 0: {differ}"
    assert assert_exactly_once(run.run, N_SAMPLES) >= 1


def join_then_leave(chaos, name: str, etcd_on_hosts=None, max_steps: int = 250) -> None:
    """A cold join across hosts takes 6-12 s (ssh, imports): the job must still train then."""
    c = chaos.cluster(3)
    h0, h1, h2 = c.hosts
    etcd = etcd_on_hosts(c) if etcd_on_hosts else None
    run = DiscoveredRun(chaos, c, name, [h0, h1], max_steps=max_steps, etcd=etcd)
    run.wait_commits(3)
    t = run.list([h0, h1, h2])
    joined = run.wait_size(6, t)
    assert run.workers_on(h2), "host 2's workers never started"
    leaving = run.workers_on(h1)
    assert len(leaving) == 2, leaving
    t = run.list([h0, h2])
    left = run.wait_size(4, t)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    assert not set(c.pids(h1)) & leaving, "host 1's workers did not exit"
    assert "host 1" in run.job.output() and "leave" in run.job.output()
    assert_final_world(run, 4, starts=6)
    assert len([e for e in events(run.log) if e["event"] == "left_job"]) == 2
    print(json.dumps({"scenario": name, "join_first_commit_s": joined,
                      "leave_first_commit_s": left}))


@pytest.mark.ci_chaos
def test_a_host_listed_joins_and_a_host_dropped_leaves_at_a_commit(chaos):
    join_then_leave(chaos, "inplace-discovery")


def test_with_etcd_a_host_listed_joins_and_a_host_dropped_leaves(chaos, etcd_on_hosts):
    join_then_leave(chaos, "inplace-discovery-etcd", etcd_on_hosts, max_steps=400)


def test_the_coordinating_host_dropped_leaves_and_host_1_coordinates(chaos):
    c = chaos.cluster(3)
    h0, h1, h2 = c.hosts
    run = DiscoveredRun(chaos, c, "inplace-discovery-h0", [h0, h1, h2], max_steps=200)
    run.wait_commits(3)
    t = run.list([h1, h2])
    left = run.wait_size(4, t)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    assert "host 1 coordinates from generation" in run.job.output(), run.job.output()[-4000:]
    assert_final_world(run, 4, starts=6)
    print(json.dumps({"scenario": "discovery-coordinator", "leave_first_commit_s": left}))


def test_a_host_dropped_while_a_worker_dies_elsewhere_leaves_and_the_rest_goes_on(chaos):
    """Host 1 is dropped at the moment a worker of host 2 is killed: host 1's workers may
    first answer the fault with the others, so the generation that leaves them out may come
    after a failure instead of at a commit. Either way they leave (exit 0, `left_job`), are not
    evicted, and the three left train on from the last commit."""
    c = chaos.cluster(3)
    h0, h1, h2 = c.hosts
    run = DiscoveredRun(chaos, c, "inplace-discovery-fault", [h0, h1, h2], max_steps=200)
    run.wait_commits(3)
    leaving = run.workers_on(h1)
    victim = sorted(run.workers_on(h2))[0]
    t = run.list([h0, h2])
    c.kill_pid(victim)
    after = run.wait_size(3, t)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    assert not set(c.pids(h1)) & leaving, "host 1's workers did not exit"
    assert_final_world(run, 3, starts=6, restored=True)
    evs = events(run.log)
    left = [e for e in evs if e["event"] == "left_job"]
    assert sorted(e["slot"] for e in left) == ["1000000", "1000001"], left  # host 1's members
    out = run.job.output()
    assert "without writing" not in out and "(code 77)" not in out, out[-4000:]  # no eviction
    print(json.dumps({"scenario": "discovery-leave-in-a-fault", "first_commit_at_3_s": after,
                      "left_at_size": sorted({e["size"] for e in left})}))

