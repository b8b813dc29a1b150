"""One job per run across hosts, whatever dies of the launch: `hvd-resilient run --launcher
inplace --hosts` on 3 namespaced hosts x 2 workers (one agent per host over ssh, the AdamW
recipe of tests/scripts/recipe_job.py), and its launch side killed or stopped mid-training.

- `hvd-resilient run` SIGKILLed (the OOM killer, `kill -9`): its job guard ends the fan-out and
  its ssh clients; each remote sshd then closes its session, the agent reads EOF on its control
  stdin and ends its workers. Every agent and worker on every host is gone within
  `GONE_WITHIN_S` (0.1-0.5 s here), and nothing of the old job writes to the run's events or
  checkpoints afterwards.
- The same run launched again at once (same --run-id, --run-dir, --checkpoint): it waits for the
  dead job's lease, resumes from the newest durable checkpoint and finishes; never more than one
  job's workers (6) on the hosts at any time, each sample of every completed epoch used once.
- The fan-out alone SIGKILLed: its ssh clients (sessions of their own) outlive it, but their
  stdin closes with it, so the agents end their workers the same way; `hvd-resilient run`
  relaunches, and the relaunch resumes and finishes, one job at a time.
- SIGTERM to `hvd-resilient run`: every host's workers get the stop (a `TERM` line to each
  agent), each rank writes `preempted` after one final checkpoint, everything exits, and the
  run exits 75 (`errors.PREEMPTED_EXIT_CODE`, docs/architecture.md) without a restart.

Why each launch runs in a PID namespace of its own (`Launch`): the namespaced hosts share this
machine's kernel, so the job guard's /proc scan (`launch/job_guard.py`: every process carrying
the job's token) would reach the "remote" workers and kill them itself, which it cannot on real
hosts, and the path under test (ssh closing, the agent reading EOF) would never be exercised.
In its own PID namespace (with its own /proc) the launch sees its own processes only, as on a
real launch machine; the hosts' processes stay in the root namespace, where the test counts
them (`Cluster.pids`). The namespace's init waits for every process left in it, so the launch's
`Job` ends only when nothing of the launch side is left.

The timings go to stdout (kill -> every host empty, SIGTERM -> exit).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time

import psutil
import pytest

from hvd_resilient.checkpoint.manager import CheckpointManager
from hvd_resilient.errors import PREEMPTED_EXIT_CODE
from hvd_resilient.run_lease import read_record
from tests.support.exactly_once import assert_exactly_once
from tests.support.jobs import PYTHON, VENV_BIN, Job, events, launchers_of, wait_for
from tests.support.netns import Cluster
from tests.support.paths import SCRIPTS

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]
JOB = str(SCRIPTS / "recipe_job.py")
N_SAMPLES = 1536  # recipe_job's data set
NP = 6  # 3 hosts x 2 slots
RECIPE = ["--recipe", "adamw-warmup-cosine", "--recipe-grad-accum", "4",
          "--recipe-clip-grad-norm", "1.0", "--recipe-precision", "bf16"]
CHECKPOINT_EVERY = 8
GONE_WITHIN_S = 15.0
"""How long every agent and worker of the old job may take to go once the launch is killed."""
INIT = """\
import os, subprocess, sys
code = subprocess.call(sys.argv[1:])
while True:  # every orphan of the namespace: the launch side has ended when none is left
    try:
        os.wait()
    except ChildProcessError:
        break
sys.exit(code if code >= 0 else 128 - code)
"""
"""PID 1 of a launch's namespace: runs `hvd-resilient run`, reaps whatever it leaves behind
(its guard, an orphaned fan-out or ssh client), then exits with its code."""


class Launch:
    """One `hvd-resilient run --launcher inplace --hosts` of run ``name`` on the cluster, in a
    PID namespace of its own (module doc). Launching the same name again relaunches the run."""

    def __init__(self, chaos, c: Cluster, name: str, *, max_steps: int,
                 restarts: int = 0) -> None:
        self.c, self.run, self.ckpt = c, chaos.tmp / name, chaos.tmp / f"{name}-ckpt"
        hosts = ",".join(f"{h.addr}:2" for h in c.hosts)
        cmd = [str(VENV_BIN / "hvd-resilient"), "run", "--launcher", "inplace", "--hosts", hosts,
               "--np", str(NP), "--ssh-port", str(c.port), "--run-id", name,
               "--run-dir", str(self.run), "--max-restarts", str(restarts),
               "--checkpoint", f"file://{self.ckpt}", "--",
               PYTHON, JOB, *RECIPE, "--samples", "--batch-size", "8", "--commit-every", "4",
               "--epochs", "1000", "--max-steps", str(max_steps),
               "--checkpoint-every", str(CHECKPOINT_EVERY), "--no-memory-tier-enabled",
               "--step-time", "0.05"]
        unshare = shutil.which("unshare")
        assert unshare, "unshare (util-linux) is needed to give the launch its own PIDs"
        self.job: Job = chaos.jobs.start(
            [unshare, "--pid", "--fork", "--mount-proc", "--kill-child", PYTHON, "-c", INIT,
             *cmd], env=c.env(chaos.jobs.env()), name=name)
        self.log = self.run / "events.jsonl"

    def events(self) -> list[dict]:
        return events(self.log) if self.log.exists() else []

    def of(self, kind: str, epoch: int | None = None) -> list[dict]:
        return [e for e in self.events() if e["event"] == kind
                and (epoch is None or e.get("lease_epoch") == epoch)]

    def wait_checkpoint(self) -> None:
        """Training, with a durable checkpoint to resume from."""
        wait_for(lambda: self.of("checkpoint_saved"), 180, "a durable checkpoint", self.job)

    def supervisor(self) -> psutil.Process:
        def find() -> psutil.Process | None:
            for p in psutil.Process(self.job.proc.pid).children(recursive=True):
                try:
                    cmd = p.cmdline()
                except psutil.Error:
                    continue
                if len(cmd) > 2 and cmd[1].endswith("hvd-resilient") and cmd[2] == "run":
                    return p
            return None
        found: psutil.Process = wait_for(find, 10, "`hvd-resilient run`", self.job)
        return found

    def checkpoints(self) -> dict[int, float]:
        """The run's durable checkpoints now: step -> when its manifest was created."""
        return {i.step: i.created for i in CheckpointManager(f"file://{self.ckpt}").list()}


def host_processes(c: Cluster) -> set[int]:
    """Every process on every host but its sshd listener: agents, workers, ssh sessions."""
    return {pid for h in c.hosts for pid in c.pids(h)}


def alive(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.add(pid)
        except psutil.NoSuchProcess:
            continue
    return out


class WorkerCount:
    """Samples the training workers on the cluster's hosts every 0.1 s while it runs (a
    worker: `python recipe_job.py` in one of the hosts' namespaces; an agent's command line
    holds it too, after --); `most` is the largest count seen, which one job at a time keeps
    at NP."""

    def __init__(self, c: Cluster) -> None:
        self.hosts = {h.inode for h in c.hosts}
        self.most = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="worker-count")

    def __enter__(self) -> WorkerCount:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def count(self) -> int:
        n = 0
        for p in psutil.process_iter(["cmdline"]):
            try:
                if (p.info["cmdline"] or [])[1:2] != [JOB]:  # not an agent (JOB after --)
                    continue
                if (os.stat(f"/proc/{p.pid}/ns/net").st_ino in self.hosts
                        and p.status() != psutil.STATUS_ZOMBIE):
                    n += 1
            except (psutil.Error, OSError):
                continue
        return n

    def _run(self) -> None:
        while not self._stop.is_set():
            self.most = max(self.most, self.count())
            self._stop.wait(0.1)  # sampling pace, not synchronisation


def kill(run: Launch, victim: psutil.Process) -> tuple[float, set[int]]:
    """SIGKILLs ``victim``; returns when, and every process the hosts held just before."""
    old = host_processes(run.c)
    assert len(old) >= 3 + NP, f"expected an agent and 2 workers on each host: {old}"
    t = time.time()
    victim.kill()
    return t, old


def wait_gone(old: set[int]) -> float:
    """Waits until none of ``old`` is left (`GONE_WITHIN_S` at most); returns when."""
    try:
        wait_for(lambda: not alive(old), GONE_WITHIN_S, "the old job's processes gone")
    except AssertionError:
        raise AssertionError(f"left on the hosts after {GONE_WITHIN_S:g} s: "
                             f"{[describe(pid) for pid in alive(old)]}") from None
    return time.time()


def describe(pid: int) -> str:
    try:
        return f"{pid} {' '.join(psutil.Process(pid).cmdline())[:120]}"
    except psutil.Error:
        return f"{pid} (gone)"


def assert_nothing_written_after(run: Launch, gone: float, epoch: int,
                                 before: dict[int, float]) -> None:
    """No event of the old job's ranks after its processes were all seen gone, and every
    checkpoint published since is one the relaunch (lease ``epoch`` + 1) says it saved."""
    late = [e for e in run.events()
            if e.get("lease_epoch") == epoch and e["rank"] >= 0 and e["ts"] > gone]
    assert not late, f"the old job wrote after it was gone: {late[:3]}"
    saved_by_new = {e["ckpt_step"] for e in run.of("checkpoint_saved", epoch + 1)}
    new = {s for s, created in run.checkpoints().items() if s not in before and created > gone}
    assert new <= saved_by_new, (new, saved_by_new)


def assert_finished_from(run: Launch, resumed_from: int) -> None:
    """The relaunch resumed from ``resumed_from`` (a durable checkpoint, step > 0), every rank
    ended identical, and each sample of every completed epoch was used exactly once."""
    (resume,) = run.of("resume")
    assert resume["source"] == "durable" and resume["from_step"] == resumed_from > 0, resume
    done = {e["rank"]: e["digests"] for e in run.of("done") if "digests" in e}
    assert sorted(done) == list(range(NP)), sorted(done)
    assert all(d == done[0] for d in done.values()), f"ranks differ: {done}"
    assert assert_exactly_once(run.run, N_SAMPLES) >= 1


@pytest.mark.ci_chaos
def test_run_sigkilled_ends_every_agent_and_worker_on_every_host(chaos):
    """The most common way a launch dies without a word: `hvd-resilient run` SIGKILLed."""
    c = chaos.cluster(3)
    run = Launch(chaos, c, "inplace-run-killed", max_steps=100000)
    run.wait_checkpoint()
    t, old = kill(run, run.supervisor())
    gone = wait_gone(old)
    # the launch side (guard, fan-out, ssh clients) is gone too, and the hosts hold nothing
    code = run.job.wait(GONE_WITHIN_S)
    assert code == 128 + signal.SIGKILL, run.job.output()[-3000:]
    left = {h.ns: c.pids(h) for h in c.hosts}
    assert not any(left.values()), f"processes left on the hosts: {left}"
    (ended,) = run.of("job_ended_with_supervisor")  # the guard ended the launch side
    assert ended["processes"] >= 1, ended  # the fan-out and its ssh clients
    late = [e for e in run.events() if e["rank"] >= 0 and e["ts"] > gone]
    assert not late, f"the old job wrote after it was gone: {late[:3]}"
    assert all(created <= gone for created in run.checkpoints().values()), run.checkpoints()
    print(json.dumps({"scenario": "run-sigkilled", "all_gone_s": round(gone - t, 3),
                      "guard_ended": ended["processes"]}))


def test_run_sigkilled_then_relaunched_resumes_with_one_job_at_a_time(chaos):
    """Relaunched at once, as a scheduler would, while the old job's processes end: the
    relaunch (in a PID namespace of its own too, so it cannot look the dead holder's pid up, as
    from another machine) finds the run's lease renewed within its TTL and waits until it is
    not (`run_lease.py`: about 4-5 s here), then resumes from the newest checkpoint the old job
    published."""
    c = chaos.cluster(3)
    name = "inplace-run-relaunched"
    with WorkerCount(c) as workers:
        run = Launch(chaos, c, name, max_steps=80)
        run.wait_checkpoint()
        epoch = run.of("lease_taken")[0]["lease_epoch"]
        t, old = kill(run, run.supervisor())
        again = Launch(chaos, c, name, max_steps=80)
        gone = wait_gone(old)
        before = run.checkpoints()
        assert again.job.wait(240) == 0, again.job.output()[-4000:]
    assert run.job.wait(GONE_WITHIN_S) == 128 + signal.SIGKILL
    assert workers.most == NP, f"{workers.most} workers at once on the hosts"
    lease = read_record(run.run / "lease.json")
    assert lease is not None and lease.epoch == epoch + 1, lease
    assert_nothing_written_after(again, gone, epoch, before)
    assert_finished_from(again, max(before))
    (taken,) = again.of("lease_taken", epoch + 1)
    print(json.dumps({"scenario": "run-sigkilled-relaunched", "all_gone_s": round(gone - t, 3),
                      "relaunch_took_lease_s": round(taken["ts"] - t, 3),
                      "resumed_from": max(before)}))


def test_fanout_sigkilled_its_agents_end_and_the_run_relaunches_one_job_at_a_time(chaos):
    """The fan-out alone SIGKILLed under a live `hvd-resilient run --max-restarts 1`: no guard
    acts (the supervisor lives), so the agents' EOF alone must end the old workers before the
    relaunch's start."""
    c = chaos.cluster(3)
    with WorkerCount(c) as workers:
        run = Launch(chaos, c, "inplace-fanout-killed", max_steps=80, restarts=1)
        run.wait_checkpoint()
        (fanout,) = launchers_of(run.supervisor().pid)
        assert "inplace.fanout" in " ".join(fanout.cmdline()), fanout.cmdline()
        old_workers = {e["pid"] for e in run.of("start")}
        t, old = kill(run, fanout)
        gone = wait_gone(old)
        before = run.checkpoints()
        assert run.job.wait(240) == 0, run.job.output()[-4000:]
    assert workers.most == NP, f"{workers.most} workers at once on the hosts"
    (restart,) = run.of("restart")
    assert restart["exit_code"] == -signal.SIGKILL, restart
    relaunched = min(e["ts"] for e in run.of("start") if e["pid"] not in old_workers)
    late = [e for e in run.events() if e["rank"] >= 0 and gone < e["ts"] < relaunched]
    assert not late, f"the old job wrote after it was gone: {late[:3]}"
    lines = [json.loads(x) for x in (run.run / "samples.jsonl").read_text().splitlines()]
    assert not [x for x in lines if x["pid"] in old_workers and x["t"] > gone]
    assert_finished_from(run, max(before))
    print(json.dumps({"scenario": "fanout-sigkilled", "all_gone_s": round(gone - t, 3),
                      "relaunch_started_s": round(relaunched - t, 3),
                      "resumed_from": max(before)}))


def test_sigterm_stops_every_hosts_workers_at_a_final_checkpoint_and_exits_75(chaos):
    """A stop, not a failure: the fan-out sends every agent a `TERM` line, each passes SIGTERM
    to its workers, and the ranks agree on one step for the final checkpoint."""
    c = chaos.cluster(3)
    run = Launch(chaos, c, "inplace-sigterm", max_steps=100000)
    run.wait_checkpoint()
    hosts_of = {e["rank"]: c.host_of_pid(e["pid"]) for e in run.of("start")}
    assert sorted(hosts_of) == list(range(NP)), hosts_of
    t = time.time()
    run.supervisor().send_signal(signal.SIGTERM)
    code = run.job.wait(120)
    ended = time.time()
    out = run.job.output()
    assert code == PREEMPTED_EXIT_CODE, out[-4000:]
    assert "stopped by a signal to the supervisor (exit 75" in out, out[-4000:]
    left = {h.ns: c.pids(h) for h in c.hosts}
    assert not any(left.values()), f"processes left on the hosts: {left}"
    preempted = {e["rank"]: e for e in run.of("preempted")}
    assert sorted(preempted) == list(range(NP)), f"ranks that stopped: {sorted(preempted)}"
    assert sorted(h.index if h else -1 for h in hosts_of.values()) == [0, 0, 1, 1, 2, 2], \
        hosts_of
    (step,) = {e["step"] for e in preempted.values()}
    final = [e for e in run.of("checkpoint_saved") if e["ckpt_step"] == step and e["ts"] > t]
    assert final, f"no final checkpoint at step {step}"
    assert max(run.checkpoints()) == step
    assert not run.of("restart") and not run.of("job_ended_with_supervisor")
    print(json.dumps({"scenario": "sigterm", "exit_s": round(ended - t, 3),
                      "all_preempted_s": round(max(e["ts"] for e in preempted.values()) - t, 3),
                      "final_checkpoint_step": step}))
