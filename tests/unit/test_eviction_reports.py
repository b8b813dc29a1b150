"""Who may evict whom: the reports silent peers PUT into the driver's store, and what the
driver and the named worker make of them (a real Horovod key-value server, real processes)."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest
from horovod.runner.http.http_server import KVStoreServer, RendezvousServer

from hvd_resilient.backends.horovod import compat, lost_slots
from hvd_resilient.detect import heartbeat
from hvd_resilient.launch.horovod.patches import evict


@pytest.fixture
def store():
    server = KVStoreServer(verbose=0)
    port = server.start_server()
    yield server, ("127.0.0.1", port)
    server.shutdown_server()


def _peer(slot: str, pid: int) -> heartbeat.Peer:
    return heartbeat.Peer(0, ("127.0.0.1", 9), "m", pid, slot)


def test_a_worker_learns_that_it_was_evicted_and_a_refill_of_its_slot_does_not(store):
    _, address = store
    assert lost_slots.evicted(address, "h+1:0", os.getpid()) is False
    lost_slots.report([_peer("h+1:0", os.getpid())], address, "h+0:0")
    assert lost_slots.evicted(address, "h+1:0", os.getpid()) is True
    assert lost_slots.evicted(address, "h+1:0", os.getpid() + 1) is False, "another process"
    assert lost_slots.evicted(address, "h+2:0", os.getpid()) is False
    assert lost_slots.evicted(None, "h+1:0", os.getpid()) is None


def test_a_driver_that_cannot_be_reached_is_asked_again_not_taken_for_a_no():
    """Right after a cut heals the driver's address fails at once for a moment; the answer
    that counts is the one the driver gives once reachable."""
    server = KVStoreServer(verbose=0)
    port = server.start_server()
    address = ("127.0.0.1", port)
    lost_slots.report([_peer("h+1:0", os.getpid())], address, "h+0:0")
    server.shutdown_server()  # the port refuses now: "cannot be asked"
    assert lost_slots.evicted(address, "h+1:0", os.getpid()) is None
    t0 = time.monotonic()
    assert not lost_slots.evicted_within(address, "h+1:0", os.getpid(), 0.3,
                                           until_answer=True)
    assert time.monotonic() - t0 >= 0.3, "gave up before its time"


def test_a_worker_that_hears_no_peer_waits_for_their_verdict_before_naming_them(store):
    """The cut-off side finds its peers silent at the same timeout as they find it; alone,
    it waits for theirs and, named, reports nobody."""
    _, address = store
    tripped: list[str] = []
    me = lost_slots.DriverEvict(address, "h+2:0", tripped.append)
    peers = [_peer("h+0:0", 11), _peer("h+1:0", 12)]
    late = threading.Timer(0.3, lost_slots.report, ([_peer("h+2:0", os.getpid())], address,
                                                      "h+0:0"))
    late.start()
    try:
        assert me.evicted_first(peers, alone=True)
    finally:
        late.join()
    assert not tripped
    # One silent neighbour among several heard: no wait, and it is named at once.
    other = lost_slots.DriverEvict(address, "h+0:0", tripped.append)
    t0 = time.monotonic()
    assert not other.evicted_first([_peer("h+2:0", 13)], alone=False)
    assert time.monotonic() - t0 < lost_slots.ARBITRATION_S / 2
    other([_peer("h+2:0", 13)], "rank 2 silent")
    assert tripped == ["rank 2 silent"]


def test_the_driver_ignores_a_report_from_a_worker_it_already_ended():
    """The majority named C first; C's report on A, a moment later, must not end A too."""
    procs = {name: subprocess.Popen(
        ["bash", "-c", f"env HOROVOD_HOSTNAME={name} HOROVOD_LOCAL_RANK=0 sleep 60; true"])
        for name in ("a+0", "c+0")}
    httpd = SimpleNamespace(cache={}, cache_lock=threading.Lock())
    polls = []
    driver = SimpleNamespace(_rendezvous=SimpleNamespace(_httpd=httpd),
                             finished=lambda: polls.append(1) or len(polls) > 3)
    a, c = procs["a+0"].pid, procs["c+0"].pid
    compat.kv_set(driver, lost_slots.LOST_SCOPE, "c+0:0", f"{c} c a+0:0 {a}".encode())
    compat.kv_set(driver, lost_slots.LOST_SCOPE, "a+0:0", f"{a} a c+0:0 {c}".encode())
    emitted: list[dict] = []
    try:
        evict.watch(driver, lambda host, pid: None,
                    lambda name, **f: emitted.append({"event": name, **f}), poll_s=0.01)
        assert procs["c+0"].wait(10) != 0
        assert procs["a+0"].poll() is None, "the healthy worker was ended on the word of C"
        assert [e["slot"] for e in emitted] == ["c+0:0"]
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_verdict_outlives_the_survivors_new_rendezvous():
    """Horovod clears its store at every rendezvous; the survivors' reset must not erase
    the verdict that the evicted worker asks for when its link comes back."""
    server = RendezvousServer(verbose=0)
    port = server.start()
    try:
        address = ("127.0.0.1", port)
        driver = SimpleNamespace(_rendezvous=server)
        evict.keep_verdicts(driver)
        lost_slots.report([_peer("h+1:0", os.getpid())], address, "h+0:0")
        compat.kv_set(driver, "other", "k", b"v")
        server.init([])  # the reset's new rendezvous
        assert compat.kv_get(driver, "other") == {}
        assert lost_slots.evicted(address, "h+1:0", os.getpid()) is True
    finally:
        server.stop()
