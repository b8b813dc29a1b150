"""Failures that send no hang-up, on a 3-host x 1-slot cluster: a frozen worker, a frozen host.

Under `hvd-resilient run` (the project's driver ends what the workers report). A SIGSTOPped
process keeps its connections (its kernel still ACKs), so only the heartbeats can
tell. Each scenario checks what ElasticRun.check checks (exit 0, sizes, exactly once, equal
parameters, at most one commit lost), that the survivors learned of it well before the Gloo
timeout (which would otherwise be what ends their wait), and that nothing frozen is left.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.support.elastic_run import ElasticRun

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(300)]

GLOO_TIMEOUT_S = 15  # the chaos runs' --gloo-timeout-seconds (tests/support/elastic_run.py)


def _stopped(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_STOPPED:
                out.append(pid)
        except psutil.Error:
            pass
    return out


@pytest.mark.ci_chaos
def test_a_frozen_worker_is_evicted_and_killed_and_its_host_readmitted(chaos):
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "freeze-worker", expect_sizes=[3, 2, 3], supervised=0)
    run.wait_commit(3, min_step=20)
    victim = run.pid_of_rank(1)
    host = c.host_of_pid(victim)
    assert host is not None and host != run.host_of_rank(0)
    run.marks["fault"] = time.time()
    os.kill(victim, signal.SIGSTOP)
    numbers = run.check([3, 2, 3])
    numbers.update(run.timings())
    run.report(numbers)
    assert numbers["failure_detected_first_s"] < GLOO_TIMEOUT_S, numbers
    assert any(e["event"] == "peer_silent" for e in run.events())
    assert not psutil.pid_exists(victim) or not _stopped([victim]), "the frozen worker lives on"


@pytest.mark.ci_chaos
def test_a_frozen_host_is_evicted_its_workers_killed_over_ssh(chaos):
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "freeze-host", expect_sizes=[3, 2, 3], supervised=0)
    run.wait_commit(3, min_step=20)
    host = run.host_of_rank(2)
    assert host != run.host_of_rank(0)
    worker = run.pid_of_rank(2)
    run.marks["fault"], frozen = c.freeze_host(host)
    assert worker in frozen
    numbers = run.check([3, 2, 3])
    numbers.update(run.timings())
    run.report(numbers)
    assert numbers["failure_detected_first_s"] < GLOO_TIMEOUT_S, numbers
    assert any(e["event"] == "slot_evicted" and e["how"] == "ssh" for e in run.events())
    assert not _stopped([worker]), "the frozen worker was not killed over ssh"


def test_a_partitioned_host_is_evicted_in_seconds_and_stops_itself(chaos):
    """Link down: nothing arrives, nothing is refused. The survivors' heartbeats evict the host
    and the driver ends its ssh session at once (plain horovodrun waits for ServerAlive, 6-8 s);
    the cut-off worker finds every peer and the driver silent and exits without writing."""
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "partition-ours", expect_sizes=[3, 2, 3], supervised=0)
    run.wait_commit(3, min_step=20)
    host = run.host_of_rank(2)
    assert host != run.host_of_rank(0)
    cut_pid = run.pid_of_rank(2)
    run.marks["fault"] = c.partition(host)
    run.wait(lambda: [e for e in run.of("reset") if e["new_size"] == 2], 120, "the reset to 2")
    run.marks["heal"] = c.heal(host)
    numbers = run.check([3, 2, 3])
    numbers.update(run.timings())
    run.report(numbers)
    assert numbers["failure_detected_first_s"] < GLOO_TIMEOUT_S, numbers
    evs = run.events()
    t0 = run.marks["fault"]
    restarted = min(e["ts"] for e in evs if e["event"] == "start" and e["ts"] > t0)
    # Until a new worker starts, rank 2 can only be the cut-off one: the world has 2 ranks.
    late = [e for e in evs if e["rank"] == 2 and t0 + 0.5 < e["ts"] < restarted]
    assert not late, f"the cut-off worker wrote after it was evicted: {late}"
    assert not psutil.pid_exists(cut_pid) or _status(cut_pid) == "gone", "it trains on"


def _status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.Error:
        return "gone"


@pytest.mark.ci_chaos
def test_a_host_whose_link_goes_down_for_good_is_dropped_and_stops_itself(chaos):
    """Power-off style: the link goes down and never comes back. The survivors evict the host
    in seconds and finish at 2 (the health filter keeps the unreachable host out of
    discovery, so it is never readmitted); the cut-off worker exits by itself, while still
    cut off, without writing a line beside the survivors."""
    c = chaos.cluster(3)
    run = ElasticRun(chaos, c, "link-down", expect_sizes=[3, 2], steps_at_each=60,
                     health_filter=True, supervised=0)
    run.wait_commit(3, min_step=20)
    host = run.host_of_rank(2)
    assert host != run.host_of_rank(0)
    cut_pid = run.pid_of_rank(2)
    t0 = run.marks["fault"] = c.partition(host)
    run.wait(lambda: not psutil.pid_exists(cut_pid) or _status(cut_pid) == "zombie", 60,
             "the cut-off worker to exit by itself")
    numbers = run.check([3, 2])
    numbers.update(run.timings())
    run.report(numbers)
    assert numbers["failure_detected_first_s"] < GLOO_TIMEOUT_S, numbers
    evs = run.events()
    assert not [e for e in evs if e["rank"] == 2 and e["ts"] > t0 + 0.5], \
        "the cut-off worker wrote after it was evicted"
    assert not [e for e in evs if e["event"] == "start" and e["ts"] > t0], "the host rejoined"
