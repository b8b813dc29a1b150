"""Failure detection by hang-up: real TCP connections in this process stand in for Gloo's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

from hvd_resilient.detect import gloo_watch, tcp_sockets
from hvd_resilient.training.faults import FaultPlan
from tests.support.runs import assert_faults_fired


@pytest.fixture
def pair():
    """Two ends of one loopback TCP connection, plus an unrelated connection to ignore."""
    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    other = socket.create_connection(lst.getsockname())
    other_peer, _ = lst.accept()
    lst.close()
    yield a, b, (other, other_peer)
    for s in (a, b, other, other_peer):
        s.close()


def endpoints(s: socket.socket) -> tuple[tuple[str, int], tuple[str, int]]:
    return s.getsockname()[:2], s.getpeername()[:2]


def wait_detected(watch: gloo_watch.GlooWatch, timeout: float = 5.0) -> bool:
    end = time.time() + timeout
    while time.time() < end:
        if watch.detected_at is not None:
            return True
        time.sleep(0.01)
    return False


def test_own_sockets_reports_established_connections_with_their_endpoints(pair):
    a, b, _ = pair
    found = {(s.local, s.remote): s for s in tcp_sockets.own_sockets()}
    assert endpoints(a) in found and endpoints(b) in found
    assert found[endpoints(a)].state == tcp_sockets.ESTABLISHED
    assert found[endpoints(a)].fd == a.fileno()


def test_own_sockets_match_the_kernels_table_and_leave_blocking_mode_alone(pair):
    """Asked fd by fd, the endpoints must read as /proc/net/tcp writes them (an IPv4 peer of
    an IPv6 socket as plain IPv4: the other rank mirrors it so), and asking must not make a
    blocking socket non-blocking when the user set a default timeout (the flag is shared with
    the fd's owner: Gloo, libcurl)."""
    import fcntl

    a, b, _ = pair
    lst6 = socket.create_server(("::", 0), family=socket.AF_INET6, dualstack_ipv6=True)
    c = socket.create_connection(("127.0.0.1", lst6.getsockname()[1]))
    d, _ = lst6.accept()
    fd = os.dup(a.fileno())  # a plain blocking fd, as a C library holds one
    before = fcntl.fcntl(fd, fcntl.F_GETFL)
    socket.setdefaulttimeout(5.0)
    try:
        found = {(s.local, s.remote): s for s in tcp_sockets.own_sockets()}
    finally:
        socket.setdefaulttimeout(None)
        assert fcntl.fcntl(fd, fcntl.F_GETFL) == before
        os.close(fd)
    try:
        assert endpoints(c) in found and found[endpoints(c)].state == tcp_sockets.ESTABLISHED
        mapped = (("127.0.0.1", lst6.getsockname()[1]), c.getsockname()[:2])
        assert mapped in found, "the IPv6 end must read as IPv4, as its peer sees it"
        assert found[(lst6.getsockname()[:2], ("::", 0))].state == "0A"  # listening
        with open("/proc/self/net/tcp") as fh:  # the kernel's own view of the IPv4 pair
            table = fh.read()
        port = f"{a.getsockname()[1]:04X}"
        assert f"0100007F:{port}" in table
    finally:
        for s in (c, d, lst6):
            s.close()


def test_only_connections_mirrored_by_another_rank_are_peers(pair):
    a, b, (other, _) = pair
    # rank 1 holds b's endpoints: a is a peer connection of rank 0; `other` is not
    everyone = [[endpoints(a), endpoints(other)], [endpoints(b)]]
    mine = {(s.local, s.remote) for s in gloo_watch.peer_connections(everyone, 0)}
    assert endpoints(a) in mine
    assert endpoints(other) not in mine


def test_quiet_for_counts_from_the_last_data_a_rank_sent(pair):
    """The heartbeats ask this before they evict a peer: data still arriving means alive."""
    a, b, (other, other_peer) = pair
    watch = gloo_watch.GlooWatch()
    assert watch.arm(0, [[endpoints(a), endpoints(other)], [endpoints(b)]]) == 1
    try:
        assert watch.quiet_for(2) is None, "no connection to rank 2"
        time.sleep(1.2)  # time must pass for the count to grow: nothing to wait for instead
        quiet = watch.quiet_for(1)
        assert quiet is not None and quiet >= 1.0, quiet
        b.sendall(b"x" * 1000)
        a.recv(1000)
        quiet = watch.quiet_for(1)
        assert quiet is not None and quiet < 0.5, quiet
    finally:
        watch.disarm()
    assert watch.quiet_for(1) is None, "disarmed: nothing watched"


def test_hangup_of_a_peer_is_detected_and_our_connections_are_shut(pair):
    a, b, (other, other_peer) = pair
    watch = gloo_watch.GlooWatch()
    # watch a and other (both "peers" here); the far end of a hangs up
    everyone = [[endpoints(a), endpoints(other)], [endpoints(b), endpoints(other_peer)]]
    assert watch.arm(0, everyone) == 2
    b.close()
    assert wait_detected(watch), "hang-up not seen"
    assert "hung up" in watch.detail
    # the kick: the OTHER watched connection is shut, so its far end sees EOF at once
    other_peer.settimeout(5)
    assert other_peer.recv(1) == b""
    watch.disarm()


def test_a_silent_peer_is_not_a_failure(pair):
    a, b, _ = pair
    watch = gloo_watch.GlooWatch()
    assert watch.arm(0, [[endpoints(a)], [endpoints(b)]]) == 1
    b.sendall(b"x")  # traffic without a hang-up, then silence
    stalled = threading.Event()
    assert not stalled.wait(0.5)
    assert watch.detected_at is None
    a.settimeout(5)
    assert a.recv(1) == b"x", "the watcher must not consume the peer's bytes"
    watch.disarm()


def test_the_watch_sleeps_through_traffic_and_stops_at_once_on_disarm(pair, monkeypatch):
    """No poll timeout: the watcher wakes for a hang-up or its stop, never for nothing (each
    wake-up takes the GIL from training), and a disarm still ends it at once."""
    import select

    a, b, _ = pair
    returns: list = []
    watcher: list = []

    class CountingPoll:
        def __init__(self) -> None:
            self.inner = select.poll()
            watcher.append(threading.current_thread())

        def register(self, fd: int, mask: int) -> None:
            self.inner.register(fd, mask)

        def poll(self, *timeout: int) -> list:
            ready = self.inner.poll(*timeout)
            returns.append(ready)
            return ready

    monkeypatch.setattr(gloo_watch, "select",
                        types.SimpleNamespace(poll=CountingPoll, POLLIN=select.POLLIN))
    watch = gloo_watch.GlooWatch()
    assert watch.arm(0, [[endpoints(a)], [endpoints(b)]]) == 1
    for _ in range(5):
        b.sendall(b"x" * 100)  # traffic: no reason to wake
        a.recv(100)
        time.sleep(0.1)
    assert returns == [], f"woke {len(returns)} times without a hang-up"
    watch.disarm()
    assert len(returns) == 1 and not watcher[0].is_alive()
    assert watch.detected_at is None


def test_hangup_after_disarm_is_ignored(pair):
    a, b, _ = pair
    watch = gloo_watch.GlooWatch()
    watch.arm(0, [[endpoints(a)], [endpoints(b)]])
    watch.disarm()
    b.close()
    a.settimeout(5)
    assert a.recv(1) == b""  # the hang-up reached us...
    assert watch.detected_at is None  # ...and nobody acted on it
    a.sendall(b"still usable")  # our end was not shut down by a kick


def test_stall_fault_sleeps_and_does_not_raise(tmp_path):
    plan = FaultPlan.parse("stall:rank=0:step=3:seconds=0.2", str(tmp_path))
    t0 = time.monotonic()
    plan.maybe_fire(0, 3)
    assert time.monotonic() - t0 >= 0.2
    (when,) = assert_faults_fired(tmp_path, 1)
    assert when > 0


def test_driver_watch_calls_lost_after_consecutive_failed_probes():
    from hvd_resilient.backends.horovod import driver_watch

    server = socket.create_server(("127.0.0.1", 0))
    address = server.getsockname()[:2]
    assert driver_watch.reachable(address)
    lost = threading.Event()
    stop = threading.Event()
    t = threading.Thread(target=driver_watch.watch, args=(address, lost.set, stop, 0.05, 3))
    t.start()
    assert not lost.wait(0.5), "a live driver was taken for lost"
    server.close()  # the driver dies: connections are refused from now on
    assert lost.wait(5), "a dead driver was not noticed"
    t.join(5)
    assert driver_watch.driver_address({}) is None
    assert driver_watch.driver_address({"HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
                                        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4444"}) == (
        "10.0.0.1", 4444)


@pytest.mark.parametrize("pidfd", [True, False], ids=["pidfd", "proc"])
def test_driver_watch_finds_a_local_driver_ended_while_its_port_still_answers(pidfd, monkeypatch):
    """A worker on the driver's machine needs no five failed probes: the driver's process
    ending is seen at once, through its pidfd, or in /proc where there are no pidfds. Here the
    port stays open (another process holds it), so only the process check can fire."""
    from hvd_resilient.backends.horovod import driver_watch

    if not pidfd:
        def no_pidfds(pid: int) -> int:
            raise OSError("pidfd_open: not on this kernel")
        monkeypatch.setattr(driver_watch.os, "pidfd_open", no_pidfds)

    server = socket.create_server(("127.0.0.1", 0))
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        env = {driver_watch.DRIVER_ENV: driver_watch.identity(driver.pid)}
        local = driver_watch.local_driver(env)
        assert local == (driver.pid, env[driver_watch.DRIVER_ENV].rsplit("|", 1)[1])
        lost, stop = threading.Event(), threading.Event()
        t = threading.Thread(target=driver_watch.watch,
                             args=(server.getsockname()[:2], lost.set, stop, 30.0, 5),
                             kwargs={"local": local})
        t.start()
        assert not lost.wait(0.5), "a live driver was taken for lost"
        driver.kill()
        driver.wait()
        assert lost.wait(2), "an ended local driver was not noticed"
        t.join(5)
        assert driver_watch.ended((os.getpid(), "0")), "a pid reused by another process"
        assert not driver_watch.ended(driver_watch.local_driver(
            {driver_watch.DRIVER_ENV: driver_watch.identity()}))
    finally:
        driver.kill()
        server.close()
    # Another machine (or namespace), or a driver that did not say: the probes decide.
    elsewhere = "other-boot:1:2:3|" + env[driver_watch.DRIVER_ENV].split("|", 1)[1]
    assert driver_watch.local_driver({driver_watch.DRIVER_ENV: elsewhere}) is None
    assert driver_watch.local_driver({}) is None


def _fake_horovod(tmp_path, name: str) -> str:
    """A folder holding a `horovod.fake` module whose `name(seconds)` sleeps: a call into the
    collective library, by its file's path, that returns when told."""
    lib = tmp_path / "lib"
    (lib / "horovod").mkdir(parents=True)
    (lib / "horovod" / "__init__.py").write_text("")
    (lib / "horovod" / "fake.py").write_text(
        f"import time\n\ndef {name}(seconds):\n    time.sleep(seconds)\n")
    return str(lib)


_STUCK = """
import sys, threading, time
sys.path.insert(0, {lib!r})
from horovod import fake
from hvd_resilient.detect import gloo_watch
stop = threading.Event()
threading.Thread(target=gloo_watch._exit_if_stuck, args=(stop, 0.3, 'failed its collectives but'),
                 daemon=True).start()
{main}
print("survived", flush=True)
"""


@pytest.mark.parametrize("main,stuck", [
    # the kick missed the wait: one call of a collective library that does not return
    ("fake.synchronize(3.0)", True),
    # the main thread works (its own code, not inside a collective): its next collective fails
    ("end = time.time() + 1.0\nwhile time.time() < end: sum(range(1000))", False),
    # the failure was taken up (stand_down sets the stop) before the limit
    ("threading.Timer(0.1, stop.set).start()\nfake.synchronize(1.0)", False),
])
def test_a_rank_still_in_a_collective_after_its_kick_exits(tmp_path, main, stuck):
    """Horovod's Gloo loop sat out the Gloo timeout in a send after every socket was shut (1
    run in 6 of test_hangup.py beside a spinning neighbour): such a rank must exit, not wait."""
    lib = _fake_horovod(tmp_path, "synchronize")
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _STUCK.format(lib=lib, main=main)],
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    if stuck:
        assert done.returncode == 77, done.stderr[-2000:]
        assert "still in" in done.stderr and "fake.py" in done.stderr, done.stderr
        assert "synchronize" in done.stderr, "the stacks are written"
        assert "survived" not in done.stdout and took < 2.9, took
    else:
        assert done.returncode == 0 and "survived" in done.stdout, done.stderr[-2000:]


def test_a_reset_whose_horovod_shutdown_does_not_return_exits(tmp_path):
    """`hvd.shutdown()` joins Horovod's loop; a loop stuck in a Gloo recv held it for the whole
    30 s Gloo timeout (1 of 20 random kills, idle machine): the rank exits instead."""
    lib = _fake_horovod(tmp_path, "shutdown")
    script = (f"import sys\nsys.path.insert(0, {lib!r})\nfrom horovod import fake\n"
              "from hvd_resilient.detect import gloo_watch\n"
              "with gloo_watch.exit_if_stuck('reset:', 0.3):\n    fake.shutdown(0.05)\n"
              "print('quick one returned', flush=True)\n"
              "with gloo_watch.exit_if_stuck('reset:', 0.3):\n    fake.shutdown(5)\n"
              "print('survived', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert "quick one returned" in done.stdout and "survived" not in done.stdout, done.stdout
    assert done.returncode == 77 and "this rank reset: its main thread" in done.stderr, (
        done.stderr[-2000:])
