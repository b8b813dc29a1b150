"""Real `horovodrun` elastic jobs on this machine (Gloo over loopback).

`localhost` and `127.0.0.1` count as two hosts, both started without ssh; so a killed worker
costs its host a blacklist cooldown, not the whole job.
"""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from tests.support.exactly_once import assert_epoch_ends, assert_exactly_once
from tests.support.jobs import (
    PYTHON,
    events,
    horovodrun_elastic,
    set_hosts,
    wait_for,
    write_discovery,
)
from tests.support.paths import ROOT, SCRIPTS
from tests.support.runs import assert_faults_fired, commits, final_digests, sizes_seen

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
JOB = str(SCRIPTS / "elastic_job.py")
DIGITS = str(ROOT / "examples" / "digits.py")
DIGITS_TRAIN = 1797 - 360  # examples/digits.py: scikit-learn's digits less its test split
# The Gloo timeout also bounds how long survivors wait for a re-added worker to start (Python +
# torch imports), and Horovod aborts them when that wait runs out (seen at 5 s, and at 15 s on
# this 2-core machine at load 8). Failures are detected by hang-up, not by this timeout, so a
# long one costs the tests nothing.
GLOO_TIMEOUT = "45"
# With this Gloo timeout, a survivor that learned of a failure well before it learned by the
# hang-up watch (detect/gloo_watch.py), not by the timeout.
LONG_GLOO_TIMEOUT = 60
DETECTED_BY_HANGUP_S = 20


def start_2_4_2(tmp_path: Path, jobs, name: str, steps_at_each: int, commit_every: int):
    """An elastic job on `localhost:2` that stops once it went 2 -> 4 -> 2: (run, hosts, job);
    the test edits `hosts` to make it so."""
    run = tmp_path / "run"
    run.mkdir()
    hosts, discover = write_discovery(tmp_path, "localhost:2")
    job = jobs.start(
        horovodrun_elastic(discover, 2, 2, 4) + [
            PYTHON, JOB, "--run-dir", str(run), "--expect-sizes", "2,4,2",
            "--steps-at-each", str(steps_at_each), "--commit-every", str(commit_every),
        ],
        name=name,
    )
    return run, hosts, job


def assert_followed_2_4_2_losing_nothing(run: Path) -> None:
    assert sizes_seen(run) == [2, 4, 2]
    digests = final_digests(run)
    assert sorted(digests) == [0, 1], digests
    assert len(set(digests.values())) == 1, f"ranks disagree after resets: {digests}"
    restores = [e for e in events(run / "events.jsonl") if e["event"] == "restore"]
    assert not restores, f"a host change through discovery must cost no work: {restores}"
    assert_exactly_once(run, 2048)


def resets(run: Path) -> list[tuple[int, int]]:
    return [(e["old_size"], e["new_size"]) for e in events(run / "events.jsonl")
            if e["event"] == "reset"]


def test_resize_2_to_4_to_2_follows_discovery_file(tmp_path, jobs):
    run, hosts, job = start_2_4_2(tmp_path, jobs, "resize", steps_at_each=30, commit_every=5)
    wait_for(lambda: any(c["size"] == 2 and c["step"] >= 30 for c in commits(run)), 120,
             "30 steps at size 2", job)
    set_hosts(hosts, "localhost:2,127.0.0.1:2")
    wait_for(lambda: any(c["size"] == 4 for c in commits(run)), 120, "a commit at size 4", job)
    first4 = min(c["step"] for c in commits(run) if c["size"] == 4)
    wait_for(lambda: any(c["size"] == 4 and c["step"] >= first4 + 30 for c in commits(run)),
             120, "30 steps at size 4", job)
    set_hosts(hosts, "localhost:2")
    assert job.wait(180) == 0, job.output()[-3000:]
    assert set(resets(run)) >= {(2, 4), (4, 2)}
    assert_followed_2_4_2_losing_nothing(run)


def test_host_changes_act_at_the_next_step_not_the_next_commit(tmp_path, jobs):
    """With commits far apart (every 100000 steps), the only commits are the ones
    `host_change_pending` asks for: the job still follows 2 -> 4 -> 2 and loses nothing."""
    # 70 steps x 2 ranks x 16 samples > 2048: an epoch completes after the last change
    run, hosts, job = start_2_4_2(tmp_path, jobs, "resize-between-commits", steps_at_each=70,
                                  commit_every=100000)
    wait_for(lambda: any(e["event"] == "watch" for e in events(run / "events.jsonl")), 120,
             "the job training", job)
    set_hosts(hosts, "localhost:2,127.0.0.1:2")
    wait_for(lambda: (2, 4) in resets(run), 120, "a reset to size 4", job)
    set_hosts(hosts, "localhost:2")
    assert job.wait(180) == 0, job.output()[-3000:]
    assert resets(run) == [(2, 4)] * 2 + [(4, 2)] * 2, resets(run)
    changed = [e for e in events(run / "events.jsonl") if e["event"] == "hosts_changed"]
    assert changed and all(e["step"] % 100000 for e in changed), changed
    assert_followed_2_4_2_losing_nothing(run)


def grow_2_to_4_with_standby(tmp_path: Path, jobs, name: str, **env: str):
    """A job through our driver (standby on) on `localhost:2`, 10 steps in, then told by
    discovery that `127.0.0.1:2` joined; it stops 40 steps after reaching size 4, so an epoch
    completes however late the growth comes (2560 samples at size 4 alone): (run, job)."""
    run = tmp_path / "run"
    run.mkdir()
    hosts, discover = write_discovery(tmp_path, "localhost:2")
    cmd = horovodrun_elastic(discover, 2, 2, 4)
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    job = jobs.start(cmd + [PYTHON, JOB, "--run-dir", str(run), "--expect-sizes", "2,4",
                            "--steps-at-each", "40", "--commit-every", "5"],
                     env=jobs.env(HVD_RESILIENT_STANDBY="1", **env), name=name)
    wait_for(lambda: any(c["size"] == 2 and c["step"] >= 10 for c in commits(run)), 120,
             "10 steps at size 2", job)
    set_hosts(hosts, "localhost:2,127.0.0.1:2")
    return run, job


def test_added_host_workers_start_early_and_are_the_ones_that_join(tmp_path, jobs):
    """Standby: the newcomers import while the old world trains; the process that joins is the
    one started early (same pid). Rank 0 is told at once (test_standby_notice.py) and holds the
    reset back until they are warm, the old world training on meanwhile."""
    run, job = grow_2_to_4_with_standby(tmp_path, jobs, "standby")

    def newcomers() -> dict[int, float]:
        out = {}
        for p in job.processes():
            try:
                env = p.environ()
                python = p.name().startswith("python")  # not the shell Horovod starts it with
                if python and env.get("HOROVOD_HOSTNAME", "").startswith("127.0.0.1+"):
                    out[p.pid] = p.create_time()
            except psutil.Error:
                continue
        return out

    early = wait_for(lambda: len(newcomers()) == 2 and newcomers(), 60, "two standby workers", job)
    assert job.wait(240) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    told = min(e["ts"] for e in evs if e["event"] == "hosts_changed")
    joined = {e["pid"] for e in evs if e["event"] == "start" and e["ts"] > told}
    assert joined == set(early), f"joined {joined}, standby {set(early)}: not the same processes"
    # Rank 0 held the reset back while they warmed up: the old world trained on meanwhile.
    (held,) = [e for e in evs if e["event"] == "standby_wait"]
    since = held["ts"] - held["seconds"]
    trained_on = [c for c in commits(run) if c["size"] == 2 and since < c["ts"] < held["ts"]]
    assert held["seconds"] > 0 and len(trained_on) >= 2, (held, len(trained_on))
    assert sizes_seen(run) == [2, 4]
    assert len(set(final_digests(run).values())) == 1


def test_with_a_warm_pool_every_worker_is_forked_from_it(tmp_path, jobs):
    """--warm-pool: the driver's machine runs a pool that imported once; the first workers and
    the newcomers alike are its children (no cold start), and the job grows as without it."""
    run, job = grow_2_to_4_with_standby(tmp_path, jobs, "warm-pool", HVD_RESILIENT_WARM_POOL="1",
                                        HVD_RESILIENT_RUN_DIR=str(tmp_path / "run"))
    wait_for(lambda: any(c["size"] == 4 for c in commits(run)), 120, "a commit at size 4", job)
    starts = [e for e in events(run / "events.jsonl") if e["event"] == "start"]
    pools = {psutil.Process(e["pid"]).ppid() for e in starts}
    assert len(starts) == 4 and len(pools) == 1, starts
    (pool,) = pools
    assert "warm.pool_server" in " ".join(psutil.Process(pool).cmdline())
    assert job.wait(240) == 0, job.output()[-3000:]
    assert not psutil.pid_exists(pool), "the pool outlived its driver"
    evs = events(run / "events.jsonl")
    assert [e for e in evs if e["event"] == "warm_pool_ready"]
    assert not [e for e in evs if e["event"] == "restore"]
    assert sizes_seen(run) == [2, 4]
    assert len(set(final_digests(run).values())) == 1
    assert_exactly_once(run, 2048)


def test_a_standby_that_dies_before_its_release_is_replaced_not_waited_for(tmp_path, jobs):
    """A newcomer killed while it imports (a broken environment on the new host, an OOM kill):
    the driver must not release the dead process into the new world (which would then wait for
    it until the Gloo timeout and fail) but start its slot afresh at the reset."""
    run, job = grow_2_to_4_with_standby(tmp_path, jobs, "standby-dies")

    def a_newcomer() -> psutil.Process | None:
        for p in job.processes():
            try:
                if (p.name().startswith("python")
                        and p.environ().get("HOROVOD_HOSTNAME") == "127.0.0.1+0"):
                    return p
            except psutil.Error:
                continue
        return None

    victim = wait_for(a_newcomer, 60, "the standby of slot 127.0.0.1+0", job, poll=0.01)
    victim.kill()  # while it imports torch: it never says it is ready
    assert job.wait(240) == 0, job.output()[-3000:]
    assert "exited (code" in job.output() and "before its release" in job.output()
    evs = events(run / "events.jsonl")
    assert victim.pid not in {e.get("pid") for e in evs if e["event"] == "start"}
    assert not [e for e in evs if e["event"] == "restore"], "the new world failed"
    assert sizes_seen(run) == [2, 4]
    assert len(set(final_digests(run).values())) == 1
    assert_exactly_once(run, 2048)


@pytest.mark.parametrize("what,hosts,np,fault,sizes", [
    ("worker", "localhost:1,127.0.0.1:1", 2, "kill:rank=1:step=37", [2, 1, 2]),
    ("host", "localhost:2,127.0.0.1:2", 4, "kill:rank=2:step=37,kill:rank=3:step=37",
     [4, 2, 4]),
])
def test_kill_9_survivors_learn_at_once_and_lose_at_most_one_commit(
    tmp_path, jobs, what, hosts, np, fault, sizes
):
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, hosts)
    commit_every = 5
    env = jobs.env(HVD_RESILIENT_FAULT=fault)
    job = jobs.start(
        horovodrun_elastic(discover, np, np // 2, np, "--gloo-timeout-seconds",
                           str(LONG_GLOO_TIMEOUT), "--blacklist-cooldown-range", "2", "4") + [
            PYTHON, JOB, "--run-dir", str(run), "--expect-sizes", ",".join(map(str, sizes)),
            "--commit-every", str(commit_every),
        ],
        env=env, name=f"kill-{what}",
    )
    assert job.wait(360) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    killed_at = min(assert_faults_fired(run, len(fault.split(","))))
    detected = [e for e in evs if e["event"] == "failure_detected"]
    assert detected, "no survivor noticed the failure"
    late = [e for e in detected if e["ts"] - killed_at > DETECTED_BY_HANGUP_S]
    assert not late, f"survivors waited for the {LONG_GLOO_TIMEOUT} s Gloo timeout: {late}"
    restores = [e for e in evs if e["event"] == "restore"]
    assert restores, "the survivors never restored a commit"
    for r in restores:
        assert 0 <= r["lost_steps"] <= commit_every, r
    assert any(e["event"] == "reset" and e["new_size"] == sizes[1] for e in evs)
    assert sizes_seen(run) == sizes, "expected the job to shrink, then grow back after cooldown"
    digests = final_digests(run)
    assert len(set(digests.values())) == 1, digests
    assert_exactly_once(run, 2048)


def test_one_host_job_survives_a_dead_worker_with_slot_hosts(tmp_path, jobs):
    """Plain horovodrun blacklists the only host and ends; per-slot hosts lose one slot."""
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:3")
    commit_every = 5
    cmd = horovodrun_elastic(discover, 3, 2, 3, "--gloo-timeout-seconds", GLOO_TIMEOUT,
                             "--blacklist-cooldown-range", "2", "4")
    cmd[:1] = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver"]
    job = jobs.start(
        cmd + [PYTHON, JOB, "--run-dir", str(run), "--expect-sizes", "3,2,3",
               "--commit-every", str(commit_every)],
        env=jobs.env(HVD_RESILIENT_FAULT="kill:rank=1:step=37"), name="slots",
    )
    assert job.wait(360) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    assert_faults_fired(run, 1)
    for r in [e for e in evs if e["event"] == "restore"]:
        assert 0 <= r["lost_steps"] <= commit_every, r
    assert sizes_seen(run) == [3, 2, 3], "expected one slot lost, then refilled after cooldown"
    assert len(set(final_digests(run).values())) == 1
    assert_exactly_once(run, 2048)


def test_rank_busy_in_python_longer_than_the_gloo_timeout_is_not_a_failure(tmp_path, jobs):
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:1,127.0.0.1:1")
    env = jobs.env(HVD_RESILIENT_FAULT="stall:rank=0:step=20:seconds=6")
    job = jobs.start(
        horovodrun_elastic(discover, 2, 1, 2, "--gloo-timeout-seconds", "3") + [
            PYTHON, JOB, "--run-dir", str(run), "--steps", "40", "--commit-every", "5",
        ],
        env=env, name="stall",
    )
    assert job.wait(240) == 0, job.output()[-3000:]
    evs = events(run / "events.jsonl")
    assert_faults_fired(run, 1)
    alarms = [e for e in evs if e["event"] in ("failure_detected", "restore", "reset")]
    assert not alarms, f"a 6 s stall was taken for a failure: {alarms}"
    assert sizes_seen(run) == [2]
    assert len(set(final_digests(run).values())) == 1


def test_trainer_accuracy_after_elastic_failure_matches_fixed_run(tmp_path, jobs):
    common = ["--epochs", "12", "--batch-size", "32", "--commit-every", "5", "--seed", "1"]
    fixed = tmp_path / "fixed"
    job = jobs.start(
        [str(Path(PYTHON).parent / "horovodrun"), "-np", "2", "--gloo",
         "--network-interface", "lo", PYTHON, DIGITS, "--run-id", "fixed",
         "--run-dir", str(fixed), *common],
        name="fixed",
    )
    assert job.wait(240) == 0, job.output()[-3000:]
    elastic = tmp_path / "elastic"
    elastic.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:1,127.0.0.1:1")
    job = jobs.start(
        horovodrun_elastic(discover, 2, 1, 2, "--gloo-timeout-seconds", GLOO_TIMEOUT,
                           "--blacklist-cooldown-range", "2", "4") + [
            PYTHON, DIGITS, "--run-id", "elastic", "--run-dir", str(elastic), *common],
        env=jobs.env(HVD_RESILIENT_FAULT="kill:rank=1:step=101"), name="elastic",
    )
    assert job.wait(300) == 0, job.output()[-3000:]
    evs = events(elastic / "events.jsonl")
    assert_faults_fired(elastic, 1)
    restores = [e for e in evs if e["event"] == "restore"]
    assert restores, "no failure happened"
    assert len(set(final_digests(elastic).values())) == 1
    # Exactly-once data, from the run's own events: every epoch's count and digest of sample
    # ids is the training set's (1437 digits), the epoch the kill fell in included. It fell
    # mid-epoch: one epoch ended before the first restore and the next one only after it.
    assert_epoch_ends(fixed, DIGITS_TRAIN, 12)
    ends = assert_epoch_ends(elastic, DIGITS_TRAIN, 12)
    before = max(e["epoch"] for e in ends if e["ts"] < restores[0]["ts"])
    assert min(e["epoch"] for e in ends if e["ts"] > restores[-1]["ts"]) == before + 1, ends
    acc_fixed = json.loads((fixed / "result.json").read_text())["accuracy"]
    acc_elastic = json.loads((elastic / "result.json").read_text())["accuracy"]
    assert acc_fixed > 0.9 and acc_elastic > 0.9, (acc_fixed, acc_elastic)
    assert abs(acc_fixed - acc_elastic) < 0.04, (acc_fixed, acc_elastic)


def test_job_follows_hostfile_through_health_filter(tmp_path, jobs):
    """hostfile wrapped in health-filter: a listed host whose port is dead never joins; a host
    removed from the file leaves, and joins again when added back."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))  # "ssh port" of localhost and 127.0.0.1; not of 127.0.0.3
    listener.listen(64)
    port = listener.getsockname()[1]

    def serve() -> None:  # answer every probe, or the backlog fills and probes time out
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        run = tmp_path / "run"
        run.mkdir()
        hosts = tmp_path / "hosts.txt"
        set_hosts(hosts, "localhost:1,127.0.0.1:1,127.0.0.3:1")
        discover = tmp_path / "discover.sh"
        discover.write_text(
            f"#!/bin/sh\nexec {PYTHON} {ROOT}/discovery/health-filter --port {port} "
            f"--timeout 0.5 -- {PYTHON} {ROOT}/discovery/hostfile {hosts}\n"
        )
        discover.chmod(0o755)
        job = jobs.start(
            horovodrun_elastic(discover, 2, 1, 3) + [
                PYTHON, JOB, "--run-dir", str(run), "--expect-sizes", "2,1,2",
                "--commit-every", "5",
            ],
            name="health",
        )
        wait_for(lambda: any(c["size"] == 2 and c["step"] >= 20 for c in commits(run)), 120,
                 "20 steps at size 2", job)
        set_hosts(hosts, "localhost:1,127.0.0.3:1")
        wait_for(lambda: any(c["size"] == 1 for c in commits(run)), 120, "a commit at size 1",
                 job)
        set_hosts(hosts, "localhost:1,127.0.0.1:1,127.0.0.3:1")
        assert job.wait(180) == 0, job.output()[-3000:]
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    assert sizes_seen(run) == [2, 1, 2]
    assert max(e["size"] for e in events(run / "events.jsonl")) == 2, "the dead host joined"
    evs = events(run / "events.jsonl")
    assert not [e for e in evs if e["event"] == "restore"], "a graceful removal lost work"
    assert len(set(final_digests(run).values())) == 1
    assert_exactly_once(run, 2048)
