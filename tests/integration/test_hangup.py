"""A rank that gives up a collective hangs up on its peers, so no survivor waits out the Gloo
timeout on a live rank that will never send (field notes: 1 in 5 random kills on a busy
machine reset after 30.1 s, the Gloo timeout)."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from hvd_resilient.detect import hangup
from tests.support.jobs import PYTHON, events, wait_for, write_discovery
from tests.support.paths import SCRIPTS
from tests.support.runs import assert_faults_fired, final_digests, sizes_seen

GLOO_TIMEOUT_S = 20
DETECT_S = 2.0
"""The abandoning rank's fault to every survivor's failed collective (`failure_detected`):
measured 0.14-0.27 s at load 8; 20.05 s (the Gloo timeout) before."""
RESET_S = GLOO_TIMEOUT_S / 2
"""The fault to the first reset: 0.34-1.7 s, and 4.3 s once (Horovod's re-rendezvous, also
4.8 s after the survivors failed at the timeout before); 24.9 s before."""


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        a = socket.create_connection(srv.getsockname(), timeout=5)
        b, _ = srv.accept()
    return a, b


@pytest.mark.timeout(30)
def test_hang_up_wakes_a_blocked_receive_here_and_ends_the_stream_there():
    mine, theirs = _pair()
    other, other_peer = _pair()
    try:
        got: list[bytes] = []
        mine.settimeout(10)
        reader = threading.Thread(target=lambda: got.append(mine.recv(10)))
        reader.start()
        wait_for(lambda: reader.is_alive(), 5, "the reader to block")  # it is blocked in recv
        t0 = time.monotonic()
        n = hangup.hang_up([(mine.getsockname(), mine.getpeername())])
        reader.join(timeout=5)
        assert n == 1 and got == [b""], (n, got)
        assert time.monotonic() - t0 < 1.0
        theirs.settimeout(5)
        assert theirs.recv(10) == b"", "the peer should see the end of the stream"
        assert mine.fileno() >= 0, "the descriptor stays the owner's to close"
        # a connection not named is untouched
        other.sendall(b"ok")
        other_peer.settimeout(5)
        assert other_peer.recv(2) == b"ok"
        assert hangup.hang_up([]) == 0
        assert hangup.hang_up([(("127.0.0.1", 1), ("127.0.0.1", 2))]) == 0
    finally:
        for s in (mine, theirs, other, other_peer):
            s.close()


@pytest.mark.timeout(30)
def test_a_watch_that_stood_down_names_its_connections_and_reports_no_hang_up():
    """The failure path's order: the watch stands down (the hang-ups that follow are this
    rank's own), then this rank hangs up on what it watched."""
    from hvd_resilient.detect.gloo_watch import GlooWatch

    mine, theirs = _pair()
    watch = GlooWatch()
    try:
        here = (mine.getsockname(), mine.getpeername())
        there = (theirs.getsockname(), theirs.getpeername())
        assert watch.arm(0, [[here], [there]]) == 1
        conns = watch.stand_down()
        assert conns == [here]
        assert hangup.hang_up(conns) == 1
        watch.trip("heartbeats")  # too late: this rank gave up already
        watch.disarm()
        assert watch.detected_at is None and watch.detail == ""
        theirs.settimeout(5)
        assert theirs.recv(10) == b""
    finally:
        watch.disarm()
        mine.close()
        theirs.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_survivors_blocked_on_a_rank_that_gave_up_reset_at_once(tmp_path, jobs):
    """Three one-slot hosts (`hvd-resilient run`'s layout on one machine); at step 35 rank 1
    makes its own Gloo operations fail and keeps its sockets open (tests/scripts/hangup_job.py).
    Nobody dies: the world stays at 3, every process trains to the end, in agreement."""
    run = tmp_path / "run"
    run.mkdir()
    _, discover = write_discovery(tmp_path, "localhost:3")
    cmd = [PYTHON, "-m", "hvd_resilient.launch.horovod.driver", "-np", "3", "--min-np", "2",
           "--max-np", "3", "--host-discovery-script", str(discover),
           "--network-interface", "lo", "--blacklist-cooldown-range", "2", "4",
           "--gloo-timeout-seconds", str(GLOO_TIMEOUT_S),
           PYTHON, str(SCRIPTS / "hangup_job.py"), "--run-dir", str(run), "--steps", "80",
           "--abandon-rank", "1", "--abandon-step", "35", "--heartbeat-timeout", "10"]
    job = jobs.start(cmd, name="abandon")
    assert job.wait(240) == 0, job.output()[-3000:]
    (t_fault,) = assert_faults_fired(run, 1)
    evs = events(run / "events.jsonl")
    failed = {}
    for e in evs:
        if e["event"] == "failure_detected" and e["ts"] > t_fault:
            failed.setdefault(e["rank"], round(e["ts"] - t_fault, 3))
    assert sorted(failed) == [0, 1, 2], f"not every rank's collective failed: {failed}"
    assert max(failed.values()) < DETECT_S, (
        f"the survivors' collectives failed only {failed} s after rank 1 gave up (Gloo timeout "
        f"{GLOO_TIMEOUT_S} s): they waited on a rank that never hung up")
    resets = [e for e in evs if e["event"] == "reset" and e["ts"] > t_fault]
    assert resets and resets[0]["ts"] - t_fault < RESET_S, (
        f"first reset {resets[0]['ts'] - t_fault if resets else None} s after the fault")
    assert "abandoned" in job.output()
    starts = {e["pid"] for e in evs if e["event"] == "start"}
    done = [e for e in evs if e["event"] == "done"]
    assert len(starts) == 3 and {e["pid"] for e in done} == starts, (
        "the rank that gave up must live on (no crash) and train in the next world too")
    assert sizes_seen(run) == [3]
    digests = final_digests(run)
    assert sorted(digests) == [0, 1, 2] and len(set(digests.values())) == 1, digests
