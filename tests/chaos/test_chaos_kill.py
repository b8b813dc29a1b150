"""Processes die on a 3-host x 1-slot cluster: one worker, a whole host, the rank-0 host.

Every scenario checks the same things (ElasticRun.check): the job ends with 0, rank 0's
commits show the expected world sizes, every sample of each completed epoch was used exactly
once, all ranks end with identical parameters, and no restore lost more than one commit
interval. The timings go to stdout and, with HVD_CHAOS_REPORT=FILE, to FILE.
"""

from __future__ import annotations

import pytest

from tests.support.elastic_run import ElasticRun

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]


def test_sigkilled_worker_shrinks_the_job_and_its_host_is_readmitted(chaos):
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "kill-worker", expect_sizes=[3, 2, 3], supervised=0)
    run.wait_commit(3, min_step=20)
    victim = run.pid_of_rank(1)
    host = c.host_of_pid(victim)
    assert host is not None and host != run.host_of_rank(0), "rank 1 must run on its own host"
    run.marks["fault"] = c.kill_pid(victim)
    numbers = run.check([3, 2, 3])
    numbers.update(run.timings())
    run.report(numbers)
    assert numbers["restores"] >= 1


def test_whole_host_killed_shrinks_the_job_and_the_host_is_readmitted(chaos):
    """Every process in the namespace dies (its ssh sessions too); sshd stays, like a host
    that rebooted quickly."""
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "kill-host", expect_sizes=[3, 2, 3], supervised=0)
    run.wait_commit(3, min_step=20)
    host = run.host_of_rank(2)
    assert host != run.host_of_rank(0)
    assert run.pid_of_rank(2) in c.pids(host)
    run.marks["fault"], killed = c.kill_host(host)
    assert len(killed) >= 2, f"expected the worker and its ssh session, killed {killed}"
    numbers = run.check([3, 2, 3])
    numbers.update(run.timings())
    numbers["killed_processes"] = len(killed)
    run.report(numbers)


@pytest.mark.ci_chaos
def test_rank0_host_killed_state_comes_from_a_survivor(chaos):
    """Rank 0 holds the state every reset broadcasts; when its host dies, the survivors must
    restore their own last commit and one of them becomes rank 0. A readmitted host is put
    last, so the new rank 0 keeps its rank. The sizes seen are committed state, so the new
    rank 0 knows the whole history: 3, 2, 3."""
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "kill-rank0-host", expect_sizes=[3, 2, 3], supervised=0)
    before = run.wait_commit(3, min_step=20)
    host0 = run.host_of_rank(0)
    run.marks["fault"], _ = c.kill_host(host0)
    numbers = run.check([3, 2, 3])
    numbers.update(run.timings())
    run.report(numbers)
    restores = run.of("restore")
    assert restores, "the survivors never restored a commit"
    assert all(r["to_step"] >= before["step"] for r in restores), restores
    late_starts = [e for e in run.of("start") if e["ts"] > run.marks["fault"]]
    assert all(e["rank"] != 0 for e in late_starts), f"a new worker became rank 0: {late_starts}"
    done0 = [e for e in run.of("done") if e["rank"] == 0]
    assert done0 and done0[0]["sizes"] == [3, 2, 3], done0


def test_dead_host_left_in_discovery_ends_the_whole_job(chaos):
    """Characterises Horovod 0.28.1, not hvd_resilient: a host that died with its sshd but
    is still listed comes back after the blacklist cooldown; its ssh fails at once, yet the
    survivors have already reset to 3 and wait in the Gloo rendezvous for it, time out, and
    abort (std::terminate, not a catchable HorovodInternalError). Every worker has then failed
    and the driver stops the job. If this test starts failing, Horovod changed: update
    docs/chaos.md."""
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "dead-host", expect_sizes=[3, 2], steps_at_each=100000)
    run.wait_commit(3, min_step=20)
    host = run.host_of_rank(2)
    run.marks["fault"], _ = c.kill_host(host, keep_sshd=False)
    code = run.job.wait(180)
    out = run.job.output()
    numbers = run.timings()
    numbers["exit_code"] = code
    numbers["job_end_s"] = round(max(e["ts"] for e in run.events()) - run.marks["fault"], 2)
    run.report(numbers)
    assert code != 0, "the job survived a dead host left in discovery: Horovod changed"
    assert "Connection refused" in out and "Wait timeout" in out, out[-3000:]
    assert "failure count == 3 -> stop running" in out, out[-3000:]
    assert numbers["resets"][:1] == [(3, 2)], numbers


@pytest.mark.ci_chaos
def test_dead_host_dropped_by_health_filter_job_finishes_without_it(chaos):
    """The mitigation: discovery/health-filter probes each host's ssh port, so the dead host
    leaves the discovery answer and is never readmitted."""
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "dead-host-filtered", expect_sizes=[3, 2], steps_at_each=60,
                     health_filter=True)
    run.wait_commit(3, min_step=20)
    host = run.host_of_rank(2)
    run.marks["fault"], _ = c.kill_host(host, keep_sshd=False)
    numbers = run.check([3, 2])
    numbers.update(run.timings())
    run.report(numbers)
    assert all(e["size"] <= 2 for e in run.of("commit") if e["ts"] > run.marks["fault"])
    assert not [e for e in run.of("start") if e["ts"] > run.marks["fault"]], "dead host rejoined"
