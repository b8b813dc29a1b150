"""Learn of a dead peer at once, not at the Gloo timeout, and make every survivor learn it too.

When a worker process dies (SIGKILL, an exception, an abort, a whole host's processes killed),
its kernel closes its TCP connections, so every survivor's Gloo connection to it reports a hang-up
within milliseconds. Gloo itself only notices on the connection an operation is waiting on; a
survivor waiting on a live peer sits out the whole Gloo timeout (30 s by default). This watcher
polls the hang-up condition of every Gloo connection of this process from a thread, and on the
first one shuts all of this process's Gloo connections down: the operation it is blocked in fails
at once (Horovod turns that into `HorovodInternalError`, torch.distributed raises a
RuntimeError), and the peers it was connected to see
hang-ups of their own, so the news crosses the whole job in one hop.

Gloo closes its listening sockets once its mesh is connected, and neither Horovod nor
torch.distributed exposes the connections, so they are found by their endpoints
(`tcp_sockets`): after every (re)initialisation each rank publishes its established
connections (its `offer`, through `detect.Detectors`), and a connection whose mirror image
another rank holds joins two workers of this job. The driver, the rendezvous store, the object
store and anything else outside the job are never touched.

A kick that does not end the wait: once this rank failed its own collectives, its main thread
must see them fail. Horovod's Gloo loop was seen to sit out the whole Gloo timeout in a send
(`unbound_buffer.cc`: "Timed out waiting 20000ms for send operation") after every socket of
this process had been shut down, 1 run in 6 of `test_hangup.py` beside a spinning neighbour.
So after a kick, a main thread that stays `KICKED_WAIT_S` inside one call of Horovod's or
torch.distributed's code, and has not taken up the failure (`stand_down`/`disarm`), is stuck in
a wait no socket ends: this process writes every thread's stack and exits with HUNG_EXIT_CODE,
the one thing every launcher already handles (a dead worker), instead of holding the job to the
Gloo timeout. A main thread that computes, loads data or runs any other code is left alone:
its next collective fails at once.

What it cannot tell apart: a host that vanishes without closing its connections (power loss,
network partition, a kernel that stops answering) sends no hang-up; the heartbeats
(`silent_peers`) find those. A slow rank or a slow link is never taken for a failure, because
nothing hangs up.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from hvd_resilient.detect import tcp_sockets
from hvd_resilient.detect.wakeup import Stop
from hvd_resilient.errors import HUNG_EXIT_CODE, exit_now

logger = logging.getLogger(__name__)

_HANGUP = select.POLLHUP | select.POLLERR | getattr(select, "POLLRDHUP", 0x2000)
# Before acting on a hang-up, wait this long for a disarm: a peer that leaves on purpose (a reset
# or the end of training reached it a moment before us) hangs up too, and must not count.
GRACE_S = 0.05
SHUTDOWN_WAIT_S = 1.0
"""How long Horovod's `shutdown` may take in a reset before its loop is taken to be stuck: 28 ms
at most over 463 resets of the random-kill benchmark (median 0.7 ms), idle and beside a
spinning neighbour. A stuck loop (1 kill in 40, 12-05) sat in a ring allreduce of its cache
coordination, waiting on a live peer's recv, for the whole Gloo timeout."""
KICKED_WAIT_S = 1.0
"""After a kick, how long the main thread may stay in one collective call before the kick is
taken to have missed its wait. The failure normally reaches it in milliseconds."""


Conn = tuple[tuple[str, int], tuple[str, int]]  # (local, remote) as this process sees it


def local_connections() -> list[Conn]:
    """This process's established TCP connections: what the ranks exchange after each init."""
    return sorted(
        (s.local, s.remote) for s in tcp_sockets.own_sockets()
        if s.state == tcp_sockets.ESTABLISHED
    )


def peer_connections(everyone: list[list[Conn]], me: int) -> list[tcp_sockets.TcpSocket]:
    """Connections of this process whose other end is held by another rank of the job."""
    return [s for s, _ in _owned_by(everyone, me)]


def _owned_by(everyone: list[list[Conn]], me: int) -> list[tuple[tcp_sockets.TcpSocket, int]]:
    """This process's connections to other ranks, each with the rank at its other end."""
    mirrored = {(remote, local): r for r, conns in enumerate(everyone) if r != me
                for local, remote in conns}
    return [
        (s, mirrored[(s.local, s.remote)]) for s in tcp_sockets.own_sockets()
        if s.state == tcp_sockets.ESTABLISHED and (s.local, s.remote) in mirrored
    ]


_TCP_INFO_LAST_DATA_RECV = 52
"""Offset of `tcpi_last_data_recv` (u32, milliseconds) in Linux's `struct tcp_info`."""


def quiet_seconds(sock: socket.socket) -> float | None:
    """How long ago data last arrived on a TCP socket (the kernel's count; None: unknown)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, AttributeError):
        return None
    if len(info) < _TCP_INFO_LAST_DATA_RECV + 4:
        return None
    (ms,) = struct.unpack_from("I", info, _TCP_INFO_LAST_DATA_RECV)
    return ms / 1000.0


class GlooWatch:
    """Armed after every (re)initialisation, disarmed before every deliberate teardown; a
    `detect.Detector` (what it offers the others: this process's connections)."""

    name = "connections"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed = False
        self._socks: list[socket.socket] = []
        self._conns: list[Conn] = []
        self._ranks: list[int] = []  # the rank at the other end of each watched socket
        self._thread: threading.Thread | None = None
        self._stop: Stop | threading.Event = threading.Event()
        self.detected_at: float | None = None
        self.detail = ""

    def offer(self, rank: int) -> list[Conn]:
        return local_connections()

    def arm(self, me: int, everyone: list[list[Conn]]) -> int:
        """`everyone` is every rank's `local_connections()` (an allgather). Returns the number
        of connections watched; 0 means detection falls back to the Gloo timeout."""
        self.disarm()
        socks, watched, ranks = [], [], []
        for c, rank in _owned_by(everyone, me):
            try:
                socks.append(tcp_sockets.dup_socket(c.fd))
            except OSError:
                continue
            watched.append((c.local, c.remote))
            ranks.append(rank)
        with self._lock:
            self._socks = socks
            self._conns = watched
            self._ranks = ranks
            self._armed = True
            self.detected_at = None
            self.detail = ""
            self._stop = stop = Stop() if socks else threading.Event()
        if isinstance(stop, Stop):
            self._thread = threading.Thread(
                target=self._watch, args=(socks, stop), name="hvd-resilient-peer-watch",
                daemon=True,
            )
            self._thread.start()
        return len(socks)

    def disarm(self) -> None:
        with self._lock:
            self._armed = False
            self._stop.set()
            socks, self._socks = self._socks, []
            self._conns, self._ranks = [], []
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self._thread = None
        for s in socks:
            try:
                s.close()
            except OSError:
                pass

    def quiet_for(self, rank: int) -> float | None:
        """Seconds since data last arrived from `rank` over the watched connections (None:
        none to it). A peer whose heartbeats go missing while its data keeps arriving is alive:
        a link saturated by a big collective drops the small datagrams first."""
        with self._lock:
            socks = [s for s, r in zip(self._socks, self._ranks, strict=True) if r == rank]
            quiet = [q for q in map(quiet_seconds, socks) if q is not None]
        return min(quiet) if quiet else None

    def stand_down(self) -> list[Conn]:
        """This rank gave up its collectives: the watch stops reporting (the hang-ups that follow
        may be the echo of this rank's own, `hangup.hang_up`, not a peer's death) and returns the
        connections it watched, for the caller to hang up on. What it detected before stays in
        `detected_at`; `disarm()` still follows."""
        with self._lock:
            self._armed = False
            self._stop.set()
            return list(self._conns)

    def _watch(self, socks: list[socket.socket], stop: Stop) -> None:
        try:
            self._watch_until(socks, stop)
        finally:
            stop.close()

    def _watch_until(self, socks: list[socket.socket], stop: Stop) -> None:
        """Blocks until a connection hangs up or `stop` is set, with no timeout: no wake-up
        (and no GIL taken from training) while nothing happens (`wakeup.py`)."""
        poller = select.poll()
        by_fd: dict[int, socket.socket] = {}
        for s in socks:
            poller.register(s.fileno(), _HANGUP)
            by_fd[s.fileno()] = s
        poller.register(stop.fileno(), select.POLLIN)
        while not stop.is_set():
            try:
                ready = [(fd, ev) for fd, ev in poller.poll() if fd in by_fd]
            except (OSError, ValueError):
                return
            if not ready:
                continue
            seen = time.time()
            fd, _ = ready[0]
            try:
                peer: Any = by_fd[fd].getpeername()
            except OSError:
                peer = "?"
            if stop.wait(GRACE_S):
                return
            with self._lock:
                if not self._armed or stop.is_set():
                    return
                self.detected_at = seen
                self.detail = f"connection to {peer} hung up"
                logger.warning("%s: a peer is gone; failing this rank's collectives so the job "
                            "resets now", self.detail)
                self._kick(socks)
                self._expect_failure(stop)
            return

    def trip(self, detail: str) -> None:
        """Another detector (the heartbeats) found a peer gone: fail the collectives as a
        hang-up would."""
        with self._lock:
            if not self._armed or self.detected_at is not None:
                return
            self.detected_at = time.time()
            self.detail = detail
            self._kick(self._socks)
            self._expect_failure(self._stop)

    def _expect_failure(self, stop: Stop | threading.Event) -> None:
        """After a kick: the main thread must take up the failure (`stand_down` or `disarm`
        set `stop`) or show that it is still working; see the module's docstring."""
        _start_deadline(stop, KICKED_WAIT_S, "failed its collectives but")

    @staticmethod
    def _kick(socks: list[socket.socket]) -> None:
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


COLLECTIVE_CODE = (f"{os.sep}horovod{os.sep}", f"{os.sep}torch{os.sep}distributed{os.sep}")
"""Where a main thread waiting in a collective is, in Python terms (Horovod's `synchronize`
spins in C under one Python frame; torch.distributed's waits block under one)."""


def _main_thread_place() -> tuple[int, int, str] | None:
    """The main thread's innermost Python frame (identity, last instruction, file); None when
    it has none."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return None
    return id(frame), frame.f_lasti, frame.f_code.co_filename


@contextlib.contextmanager
def exit_if_stuck(what: str, limit_s: float = SHUTDOWN_WAIT_S) -> Iterator[None]:
    """Around one call into the collective library that must return soon after a failure
    (Horovod's `shutdown`, which joins its background loop): if the main thread is still in it
    after `limit_s`, the loop is stuck in a wait that no hang-up ended (seen: a Gloo recv held
    `hvd.shutdown()` for the whole 30 s Gloo timeout, 1 of 20 random kills on an idle
    machine), and this process exits as a dead worker instead of holding the job."""
    done = threading.Event()
    _start_deadline(done, limit_s, what)
    try:
        yield
    finally:
        done.set()


def _start_deadline(stop: Stop | threading.Event, limit_s: float, what: str) -> None:
    threading.Thread(target=_exit_if_stuck, args=(stop, limit_s, what), daemon=True,
                     name="hvd-resilient-deadline").start()


def _exit_if_stuck(stop: Stop | threading.Event, limit_s: float, what: str,
                   poll_s: float = 0.1) -> None:
    """Returns once `stop` is set; exits the process if first the main thread sits `limit_s`
    on one instruction of a collective library's code (one call that has not returned).
    CPU time cannot tell that apart from work: Horovod's `synchronize` spins."""
    place, since = _main_thread_place(), time.monotonic()
    while not stop.wait(poll_s):
        now_place = _main_thread_place()
        if now_place != place:
            place, since = now_place, time.monotonic()
            continue
        if place is None or not any(c in place[2] for c in COLLECTIVE_CODE):
            continue
        if time.monotonic() - since >= limit_s and not stop.is_set():
            logger.error("this rank %s its main thread is still in %s after %.1f s (a wait "
                         "no hang-up ends); exiting (code %d) so the job resets now, not at "
                         "the Gloo timeout; stacks follow", what, place[2], limit_s,
                         HUNG_EXIT_CODE)
            import faulthandler

            faulthandler.dump_traceback(all_threads=True)
            _dump_native_stacks()
            exit_now(HUNG_EXIT_CODE)


NATIVE_STACKS_ENV = "HVD_RESILIENT_NATIVE_STACKS"


def _dump_native_stacks(timeout_s: float = 20.0) -> None:
    """With `HVD_RESILIENT_NATIVE_STACKS=1` and gdb installed, also write every thread's C/C++
    stack: the Python stacks end at the call into Horovod, and where its loop waits is what
    tells a stuck collective library apart from a slow one. Off by default: attaching a
    debugger costs seconds the stuck rank's peers wait for."""
    if os.environ.get(NATIVE_STACKS_ENV, "") not in ("1", "true", "yes"):
        return
    import shutil
    import subprocess

    gdb = shutil.which("gdb")
    if gdb is None:
        logger.error("%s is set but gdb is not installed; no native stacks", NATIVE_STACKS_ENV)
        return
    sys.stderr.flush()
    try:
        subprocess.run([gdb, "-p", str(os.getpid()), "-batch", "-nx",
                        "-ex", "thread apply all bt"], stdin=subprocess.DEVNULL,
                       stdout=sys.stderr, stderr=subprocess.STDOUT, timeout=timeout_s,
                       check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        logger.error("native stacks not written (%s)", e)
