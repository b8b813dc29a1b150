"""In place across hosts: `hvd-resilient run --launcher inplace --hosts` on 3 namespaced hosts x 2
workers (one agent per host over ssh), the AdamW recipe (tests/scripts/recipe_job.py).

A worker killed, or a whole host's processes killed: the survivors go on in their own
processes (no worker restarted), in a generation without the lost ones, every remaining rank
identical in every component, the work redone at most one commit interval, each sample of every
completed epoch used exactly once; the same when the coordinating host is lost (the next agent
coordinates). The timings go to stdout (kill -> the survivors' first commit).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import psutil
import pytest

from hvd_resilient.backends.inplace.membership import host_of
from tests.support.etcd_cluster import EtcdCluster
from tests.support.exactly_once import assert_exactly_once
from tests.support.jobs import PYTHON, VENV_BIN, events, wait_for
from tests.support.netns import Cluster, Host
from tests.support.paths import SCRIPTS

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]
JOB = str(SCRIPTS / "recipe_job.py")
N_SAMPLES = 1536  # recipe_job's data set
COMMIT_EVERY = 4
RECIPE = ["--recipe", "adamw-warmup-cosine", "--recipe-grad-accum", "4",
          "--recipe-clip-grad-norm", "1.0", "--recipe-precision", "bf16"]


class InplaceRun:
    def __init__(self, chaos, c: Cluster, name: str, *, max_steps: int = 80,
                 restarts: int = 0, etcd: EtcdCluster | None = None,
                 extra: tuple[str, ...] = ()) -> None:
        self.c, self.run = c, chaos.tmp / name
        hosts = ",".join(f"{h.addr}:2" for h in c.hosts)
        cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "inplace", "--hosts", hosts,
               "--np", str(2 * len(c.hosts)), "--ssh-port", str(c.port), "--run-id", name,
               "--run-dir", str(self.run), "--max-restarts", str(restarts),
               "--checkpoint", f"file://{chaos.tmp}/{name}-ckpt",
               *(["--etcd", ",".join(etcd.endpoints)] if etcd else []), *extra, "--",
               PYTHON, JOB, *RECIPE, "--samples", "--batch-size", "8", "--commit-every",
               str(COMMIT_EVERY), "--epochs", "1000", "--max-steps", str(max_steps),
               "--checkpoint-every", "8", "--no-memory-tier-enabled", "--step-time", "0.05"]
        self.job = chaos.jobs.start(cmd, env=c.env(chaos.jobs.env()), name=name)
        self.log = self.run / "events.jsonl"

    def events(self) -> list[dict]:
        return events(self.log) if self.log.exists() else []

    def of(self, kind: str) -> list[dict]:
        return [e for e in self.events() if e["event"] == kind]

    def wait_commits(self, n: int) -> None:
        wait_for(lambda: len(self.of("commit")) >= n, 150, f"{n} commits", self.job)

    def pid_on(self, h: Host) -> int:
        """A training worker on host ``h`` (one that wrote `start`)."""
        mine = set(self.c.pids(h))
        pids = [e["pid"] for e in self.of("start") if e["pid"] in mine]
        assert pids, f"no worker of this run on {h}"
        return pids[0]

    def host_of_rank0(self) -> Host:
        pid = [e["pid"] for e in self.of("start") if e["rank"] == 0][-1]
        host = self.c.host_of_pid(pid)
        assert host is not None
        return host

    def first_commit_after(self, t: float) -> float:
        later = [e["ts"] for e in self.of("commit") if e["ts"] > t]
        assert later, "no commit after the fault"
        return round(min(later) - t, 3)


def kill_once(c: Cluster, h: Host) -> float:
    """SIGKILLs every process of host ``h`` seen now (its agent, workers, ssh session; not its
    sshd), once: `Cluster.kill_host` kills on until the namespace is empty, and would also
    kill the ssh session of a relaunch that comes within that time."""
    pids = c.pids(h)
    t = time.time()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return t


def assert_survivors_went_on(run: InplaceRun, size: int) -> None:
    evs = run.events()
    starts = [e for e in evs if e["event"] == "start"]
    assert len(starts) == 6, f"a worker was (re)started: {len(starts)} starts"
    resets = [e for e in evs if e["event"] == "reset"]
    assert resets and {e["new_size"] for e in resets} == {size}, resets
    done = {e["rank"]: e for e in evs if e["event"] == "done" and "digests" in e}
    assert sorted(done) == list(range(size)), sorted(done)
    first = done[0]["digests"]
    differ = {r: d["digests"] for r, d in done.items() if d["digests"] != first}
    assert not differ, f"ranks differ from rank 0: {differ}"
    restores = [e for e in evs if e["event"] == "restore"]
    assert restores and all(0 <= e["lost_steps"] <= COMMIT_EVERY for e in restores), restores
    assert assert_exactly_once(run.run, N_SAMPLES) >= 1


@pytest.mark.ci_chaos
def test_a_worker_killed_on_another_host_costs_one_generation(chaos):
    c = chaos.cluster(3)
    run = InplaceRun(chaos, c, "inplace-kill-worker")
    run.wait_commits(3)
    victim = run.pid_on(c.hosts[2])
    t = c.kill_pid(victim)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    assert_survivors_went_on(run, 5)
    print(json.dumps({"scenario": "kill-worker", "first_commit_s": run.first_commit_after(t)}))


@pytest.mark.ci_chaos
def test_a_whole_host_killed_costs_its_members_and_nothing_else(chaos):
    """Every process in the namespace dies (the agent, its workers, the ssh session): the
    coordinator hears its agent's connection close and drops its members at once."""
    c = chaos.cluster(3)
    run = InplaceRun(chaos, c, "inplace-kill-host")
    run.wait_commits(3)
    host = c.hosts[1]
    assert host != run.host_of_rank0()
    workers = [e["pid"] for e in run.of("start") if e["pid"] in set(c.pids(host))]
    t, killed = c.kill_host(host)
    assert killed and len(workers) == 2, (killed, workers)  # a worker may die with its agent
    assert not _alive(workers)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    assert_survivors_went_on(run, 4)
    print(json.dumps({"scenario": "kill-host", "first_commit_s": run.first_commit_after(t)}))


@pytest.mark.ci_chaos
def test_the_coordinating_host_lost_the_next_agent_coordinates_and_the_others_go_on(chaos):
    """Without etcd host 0's agent decides every generation. Every process of host 0 killed
    (rank 0, the coordinating agent, the generation's store): the other agents see its
    connection close, host 1's agent coordinates from the newest record on its own store, and
    the survivors go on in their processes (no relaunch)."""
    c = chaos.cluster(3)
    run = InplaceRun(chaos, c, "inplace-kill-coordinator")
    run.wait_commits(3)
    assert run.host_of_rank0() == c.hosts[0]
    t = kill_once(c, c.hosts[0])
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    out = run.job.output()
    assert "host 1 coordinates from generation" in out, out[-4000:]
    assert_survivors_went_on(run, 4)
    print(json.dumps({"scenario": "kill-coordinator", "first_commit_s":
                      run.first_commit_after(t)}))


@pytest.mark.ci_chaos
def test_with_etcd_the_host_holding_rank0_and_the_store_is_lost_and_the_others_go_on(
        chaos, etcd_on_hosts):
    """Host 0 holds rank 0, most likely the leading agent and so generation 0's store, and an
    etcd member: all killed. The other agents see the leader's connection close, revoke its
    lease, one of them leads and publishes the next generation on its own store; the
    survivors go on in their processes (no relaunch)."""
    c = chaos.cluster(3)
    etcd = etcd_on_hosts(c)
    run = InplaceRun(chaos, c, "inplace-etcd-kill-host0", etcd=etcd)
    run.wait_commits(3)
    assert run.host_of_rank0() == c.hosts[0]
    t, _ = c.kill_host(c.hosts[0])
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    assert_survivors_went_on(run, 4)
    print(json.dumps({"scenario": "etcd-kill-host0", "first_commit_s":
                      run.first_commit_after(t)}))


def test_with_etcd_one_member_killed_changes_nothing(chaos, etcd_on_hosts):
    c = chaos.cluster(3)
    etcd = etcd_on_hosts(c)
    run = InplaceRun(chaos, c, "inplace-etcd-member", etcd=etcd)
    run.wait_commits(3)
    t = time.time()
    etcd.kill(etcd.raft_leader())
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    assert not [e for e in run.of("reset") if e["ts"] > t], "a generation changed"
    assert len(run.of("start")) == 6


def test_with_etcd_gone_the_job_trains_on_until_a_member_must_change(chaos, etcd_on_hosts):
    """etcd lost entirely: every worker trains on; a worker killed then needs a generation
    nobody can agree on, so each agent ends its workers with one line (restartable)."""
    c = chaos.cluster(3)
    etcd = etcd_on_hosts(c)
    run = InplaceRun(chaos, c, "inplace-etcd-gone", etcd=etcd, max_steps=100000)
    run.wait_commits(3)
    for i in range(3):
        etcd.kill(i)
    before = len(run.of("commit"))
    wait_for(lambda: len(run.of("commit")) >= before + 3, 60, "commits without etcd", run.job)
    c.kill_pid(run.pid_on(c.hosts[2]))
    code = run.job.wait(120)
    out = run.job.output()
    assert code != 0, out[-3000:]
    assert "etcd is unreachable" in out, out[-3000:]


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p)
            and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_host_cut_off_stops_its_workers_and_the_others_go_on(chaos):
    """Link down: the coordinator stops hearing the host (1 s), the survivors' heartbeats find
    its members silent, and the next generation goes on without them; the cut-off agent hears
    no beat for 1.4 s, cannot reach the successor either, and ends its own workers, which
    never write after the fault."""
    c = chaos.cluster(3)
    run = InplaceRun(chaos, c, "inplace-partition")
    run.wait_commits(3)
    host = c.hosts[2]
    cut_pids = [e["pid"] for e in run.of("start") if e["pid"] in set(c.pids(host))]
    t = c.partition(host)
    wait_for(lambda: not _alive(cut_pids), 10, "the cut-off side's workers ended", run.job)
    stopped_at = time.time()
    c.heal(host)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    old_world = [e for e in run.events() if e["ts"] > t + 0.5 and e.get("size") == 6
                 and e["event"] in ("commit", "memory_commit", "checkpoint_saved")]
    assert not old_world, f"the old world wrote after the fault: {old_world}"
    commits = [e for e in run.of("commit") if e["ts"] > t + 0.5]  # one may be in flight
    assert commits and all(e["size"] == 4 for e in commits), commits[:3]
    print(json.dumps({"scenario": "partition", "first_commit_s": run.first_commit_after(t),
                      "cut_off_stopped_s": round(stopped_at - t, 3)}))


@pytest.mark.ci_chaos
def test_the_coordinating_host_cut_off_stops_itself_and_the_majority_goes_on(chaos):
    """Host 0's link down: it holds rank 0, the coordinating agent and the generation's store.
    Hearing one host of three it stops its own workers (1 s); the others stop hearing its beat
    (1.4 s), host 1's agent hears host 2's, a majority, and coordinates from the newest record
    on its own store: the survivors go on in their processes, and the cut-off side writes
    nothing after the fault."""
    c = chaos.cluster(3)
    run = InplaceRun(chaos, c, "inplace-partition-coordinator")
    run.wait_commits(3)
    host = c.hosts[0]
    assert run.host_of_rank0() == host
    cut_pids = [e["pid"] for e in run.of("start") if e["pid"] in set(c.pids(host))]
    t = c.partition(host)
    wait_for(lambda: not _alive(cut_pids), 10, "the cut-off side's workers ended", run.job)
    stopped_at = time.time()
    wait_for(lambda: any(e["size"] == 4 for e in run.of("commit") if e["ts"] > t), 30,
             "a commit at 4 without the cut-off host", run.job)
    c.heal(host)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    out = run.job.output()
    assert "cut off from the job's majority" in out, out[-4000:]
    assert "host 1 coordinates from generation" in out, out[-4000:]
    old_world = [e for e in run.events() if e["ts"] > t + 0.5 and e.get("size") == 6
                 and e["event"] in ("commit", "memory_commit", "checkpoint_saved")]
    assert not old_world, f"the old world wrote after the fault: {old_world}"
    assert_survivors_went_on(run, 4)
    print(json.dumps({"scenario": "partition-coordinator",
                      "first_commit_s": run.first_commit_after(t),
                      "cut_off_stopped_s": round(stopped_at - t, 3)}))


def test_two_hosts_cut_apart_the_half_holding_host_0_goes_on_and_the_other_stops(chaos):
    """Two hosts, the link between them down: each side is half of the last generation. The
    tie goes to the half holding the lowest host on both sides alike, so host 0's agent (the
    coordinator) trains on with its two workers and host 1's agent stops its own; never two
    worlds, never none."""
    c = chaos.cluster(2)
    run = InplaceRun(chaos, c, "inplace-two-hosts-cut")
    run.wait_commits(3)
    host = c.hosts[1]
    cut_pids = [e["pid"] for e in run.of("start") if e["pid"] in set(c.pids(host))]
    assert len(cut_pids) == 2, cut_pids
    t = c.partition(host)
    wait_for(lambda: not _alive(cut_pids), 10, "host 1's workers ended", run.job)
    wait_for(lambda: any(e["size"] == 2 for e in run.of("commit") if e["ts"] > t), 30,
             "a commit at 2 on host 0", run.job)
    c.heal(host)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    out = run.job.output()
    assert "cut off from the job's majority (hearing hosts [1] of [0, 1])" in out, out[-4000:]
    commits = [e for e in run.of("commit") if e["ts"] > t + 0.5]
    assert commits and all(e["size"] == 2 for e in commits), commits[:3]
    assert len(run.of("start")) == 4
    done = {e["rank"]: e for e in run.of("done") if "digests" in e}
    assert sorted(done) == [0, 1] and done[0]["digests"] == done[1]["digests"], done


def test_a_frozen_host_is_evicted_and_the_others_go_on(chaos):
    """Every process of host 2 SIGSTOPped (a paused VM: its kernel still ACKs, nothing hangs
    up): the survivors' heartbeats find its members silent (1.5 s), the coordinator stops
    hearing its agent (1 s), and the next generation goes on without them."""
    c = chaos.cluster(3)
    run = InplaceRun(chaos, c, "inplace-freeze")
    run.wait_commits(3)
    t, frozen = c.freeze_host(c.hosts[2])
    wait_for(lambda: any(e["size"] == 4 for e in run.of("commit") if e["ts"] > t), 30,
             "a commit at 4 without the frozen host", run.job)
    for pid in frozen:  # SIGKILL ends a stopped process too: the job can finish
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    commits = [e for e in run.of("commit") if e["ts"] > t + 0.5]  # one may be in flight
    assert commits and all(e["size"] == 4 for e in commits), commits[:3]
    done = {e["rank"]: e for e in run.of("done") if "digests" in e}
    assert sorted(done) == list(range(4)), sorted(done)
    assert len({json.dumps(d["digests"], sort_keys=True) for d in done.values()}) == 1, done
    print(json.dumps({"scenario": "freeze", "first_commit_s": run.first_commit_after(t)}))


def test_a_standby_on_another_host_takes_a_whole_lost_hosts_place(chaos):
    """--standby 1 on each host: every process of host 2 killed, and the generation that
    answers it takes the standbys of hosts 0 and 1 in the lost members' places (no import, the
    state sent by the sync): back at 6 at once, with no worker started after the launch."""
    c = chaos.cluster(3)
    run = InplaceRun(chaos, c, "inplace-standby-hosts", extra=("--standby", "1"))
    run.wait_commits(3)
    t = kill_once(c, c.hosts[2])
    assert run.job.wait(240) == 0, run.job.output()[-4000:]
    starts = run.of("start")
    assert len(starts) == 9 and all(e["ts"] < t for e in starts), "a worker started later"
    resets = [e for e in run.of("reset") if e["rank"] == 0]
    assert [e["new_size"] for e in resets] == [6], resets
    joined = run.of("joined")
    assert len(joined) == 2 and {host_of(e["member"]) for e in joined} == {0, 1}, joined
    done = {e["rank"]: e for e in run.of("done") if "digests" in e}
    assert sorted(done) == list(range(6)), sorted(done)
    assert len({json.dumps(d["digests"], sort_keys=True) for d in done.values()}) == 1, done
    assert assert_exactly_once(run.run, N_SAMPLES) >= 1
    print(json.dumps({"scenario": "standby-hosts", "first_commit_s": run.first_commit_after(t)}))
