"""EtcdAgreement against a real 3-member etcd cluster (tests/support/etcd_cluster.py): one
winner per generation, leases that expire on time, a leader that is replaced at once, and a
client that rides out dead members. Timings are printed (run with -s to see them)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from hvd_resilient.launch.inplace.etcd_agreement import (
    AgreementUnavailable,
    EtcdAgreement,
    LeaseLost,
)
from tests.support.etcd_cluster import EtcdCluster, etcd_cluster_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

EXPIRY_MARGIN_S = 1.0
"""etcd looks for expired leases every 0.5 s; the rest is this busy machine's scheduling."""


@pytest.fixture
def etcd_cluster() -> Iterator[EtcdCluster]:
    """A fresh cluster per test (it starts in well under a second): tests kill members."""
    cluster = etcd_cluster_running()
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def agreement(etcd_cluster: EtcdCluster, request: pytest.FixtureRequest
              ) -> Iterator[Callable[..., EtcdAgreement]]:
    """Makes started EtcdAgreement objects for this test's job; closes them all after it."""
    made: list[EtcdAgreement] = []
    job = request.node.name.replace("[", "-").replace("]", "").replace("/", "-")

    def make(host: int, endpoints: list[str] | None = None, **kw: Any) -> EtcdAgreement:
        a = EtcdAgreement(endpoints or etcd_cluster.endpoints, job, host, **kw)
        made.append(a)
        a.start()
        return a

    yield make
    for a in made:
        with contextlib.suppress(AgreementUnavailable):  # the cluster may be dead on purpose
            a.close()


def poll(predicate: Callable[[], Any], timeout: float, what: str) -> float:
    """Seconds until predicate() holds; fails after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.02)  # polling interval, bounded by the deadline
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def race_publish(hosts: list[EtcdAgreement], g: int) -> dict[int, bool]:
    """Every host publishes generation g at the same moment (one thread each, one barrier)."""
    barrier, won = threading.Barrier(len(hosts), timeout=10), {}

    def publish(who: EtcdAgreement) -> None:
        barrier.wait()
        won[who.host] = who.publish(g, f"host{who.host}-gen{g}")

    threads = [threading.Thread(target=publish, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return won


def test_racing_publishers_one_winner_per_generation(agreement) -> None:
    a, b = agreement(0), agreement(1)
    wins = {0: 0, 1: 0}
    for g in range(25):
        won = race_publish([a, b], g)
        assert sorted(won.values()) == [False, True], (g, won)
        winner = next(h for h, ok in won.items() if ok)
        wins[winner] += 1
        assert a.newest() == b.newest() == (g, f"host{winner}-gen{g}")
    print(f"\n25 races: host 0 won {wins[0]}, host 1 won {wins[1]}")


def test_publish_refuses_a_gap_and_an_existing_generation(agreement) -> None:
    a = agreement(0)
    assert a.newest() is None
    assert not a.publish(1, "no gen 0 yet")
    for g in range(4):
        assert a.publish(g, f"r{g}")
    assert not a.publish(5, "skips 4")
    assert not a.publish(3, "3 exists")
    assert a.newest() == (3, "r3")
    assert a.publish(4, "r4")
    assert a.newest() == (4, "r4")


def test_reports_carry_a_moving_revision(agreement) -> None:
    a, b = agreement(0), agreement(1)
    a.put_report("a1")
    b.put_report("b1")
    first = a.reports()
    assert {h: r for h, (r, _) in first.items()} == {0: "a1", 1: "b1"}
    a.put_report("a2")
    second = b.reports()
    assert second[0][0] == "a2" and second[0][1] > first[0][1]
    assert second[1] == first[1]  # b wrote nothing: its revision stands still


def test_a_host_that_stops_renewing_expires(agreement) -> None:
    ttl = 1
    a, b = agreement(0, ttl_s=ttl), agreement(1, ttl_s=ttl)
    a.put_report("a")
    b.put_report("b")
    assert a.lead()
    assert a.renew()
    last_renew = time.monotonic()  # a stops renewing here; b goes on

    def a_gone() -> bool:
        assert b.renew()
        return 0 not in b.reports() and b.leader() is None

    poll(a_gone, ttl + EXPIRY_MARGIN_S + 2, "host 0's lease to expire")
    gone_after = time.monotonic() - last_renew
    print(f"\nlease ttl {ttl} s: host 0 gone from reports and leader {gone_after:.3f} s "
          "after its last renew")
    assert ttl * 0.9 <= gone_after <= ttl + EXPIRY_MARGIN_S
    assert not a.renew()
    assert not a.lead()
    with pytest.raises(LeaseLost):
        a.put_report("late")
    assert set(b.reports()) == {1}
    assert b.lead() and b.leader() == 1
    a.start()  # a fresh lease: the host may rejoin
    a.put_report("back")
    assert b.reports()[0][0] == "back"


def test_leader_is_replaced_at_once_after_close(agreement) -> None:
    a, b = agreement(0), agreement(1)
    assert b.leader() is None
    assert a.lead()
    assert a.lead()  # asking again keeps it
    assert not b.lead()
    assert a.leader() == b.leader() == 0
    a.close()
    assert b.lead()  # no waiting: the revoke removed the key
    assert b.leader() == 1


@pytest.mark.parametrize("victim", ["raft_leader", "follower"])
def test_one_member_killed(etcd_cluster: EtcdCluster, agreement, victim: str) -> None:
    leader = etcd_cluster.raft_leader()
    first = leader if victim == "raft_leader" else (leader + 1) % 3
    endpoints = etcd_cluster.endpoints[first:] + etcd_cluster.endpoints[:first]
    a, b = agreement(0, endpoints), agreement(1, endpoints)
    a.put_report("a")
    assert a.publish(0, "before")
    etcd_cluster.kill(first)  # the member both clients list first
    start = time.monotonic()
    assert a.publish(1, "after")
    latency = time.monotonic() - start
    print(f"\nkilled the {victim} (listed first): first call (publish) took {latency:.3f} s")
    assert latency < a.ttl
    assert a.renew() and b.renew()
    rev = a.reports()[0][1]
    a.put_report("a2")
    text, moved = a.reports()[0]
    assert text == "a2" and moved > rev
    assert b.lead() and a.leader() == 1
    assert b.publish(2, "b") and a.newest() == (2, "b")


def test_all_members_killed(etcd_cluster: EtcdCluster, agreement) -> None:
    a = agreement(0)
    assert a.renew()
    for i in range(3):
        etcd_cluster.kill(i)
    start = time.monotonic()
    with pytest.raises(AgreementUnavailable):
        a.renew()
    took = time.monotonic() - start
    print(f"\nall members killed: renew raised AgreementUnavailable after {took:.3f} s "
          f"(ttl {a.ttl} s)")
    assert a.ttl <= took <= a.ttl + 1.0
