"""The embedded agreement's count of a majority (`launch/inplace/embedded.py`), over a real
store on loopback with real followers' reports: which generation a coordinator counts against,
and how long a successor waits before it counts."""

from __future__ import annotations

import datetime
import time

import pytest
import torch.distributed as dist

from hvd_resilient.launch.inplace.decide import HostReport, Record
from hvd_resilient.launch.inplace.embedded import TAKEOVER_WAIT_S, Coordinating, Following

AGENTS = {0: "127.0.0.1:1", 1: "127.0.0.1:2", 2: "127.0.0.1:3"}


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=5))
    yield store


def follower(server: dist.TCPStore, h: int) -> Following:
    return Following(f"127.0.0.1:{server.port}", h, time.monotonic(), AGENTS[h])


def heard(cluster: Coordinating, *followers: Following) -> set[int]:
    for f in followers:
        f.newest()
        f.send(HostReport())
    return {*cluster.reports(3, time.monotonic()), cluster.host_index}


def test_a_coordinator_counts_by_the_newest_generation_every_agent_has_seen(server):
    """Host 2 dropped in generation 1, which host 1 has not seen yet: until it has, a cut
    leaving host 0 alone is counted against generation 0's three agents (host 1 may hold only
    that one, and would go on with host 2 by it), so host 0 must stop; once host 1 has seen
    generation 1, host 0 alone is half of it and the lower: it goes on."""
    cluster = Coordinating(server, 0, "127.0.0.1")
    one, two = follower(server, 1), follower(server, 2)
    cluster.publish(Record(0, [0, 1, 2], AGENTS[0], AGENTS))
    assert heard(cluster, one, two) == {0, 1, 2}
    cluster.publish(Record(1, [0, 1], AGENTS[0], {0: AGENTS[0], 1: AGENTS[1]}))
    assert cluster.settled().generation == 0
    assert cluster.quorum({0}, time.monotonic()) is False
    assert cluster.quorum({0, 1}, time.monotonic()) is True
    heard(cluster, one)  # host 1 reads generation 1, then says so
    heard(cluster, one)
    assert cluster.settled().generation == 1
    assert cluster.quorum({0}, time.monotonic()) is True


def test_a_successor_waits_for_the_others_reports_then_counts_who_it_hears(server):
    record = Record(4, [0, 1, 2], AGENTS[0], AGENTS)
    now = time.monotonic()
    after_silence = Coordinating(server, 1, "127.0.0.1", after=record, left={0}, now=now)
    assert after_silence.quorum({1}, now) is None  # host 2 may still be on its way
    assert after_silence.quorum({1, 2}, now) is True
    late = Coordinating(server, 1, "127.0.0.1", after=record, left={0}, now=now)
    assert late.quorum({1}, now + TAKEOVER_WAIT_S) is False  # the silent host 0 still counts
    exited = Coordinating(server, 1, "127.0.0.1", after=record, left={0}, exited={0},
                           now=now)
    assert exited.quorum({1}, now + TAKEOVER_WAIT_S) is True  # half of {1, 2}, and the lower
