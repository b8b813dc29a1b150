"""Peer heartbeats: a frozen or cut-off peer is found in seconds, not at the Gloo timeout.

A process stopped by SIGSTOP (or a paused VM) keeps its connections: its kernel still ACKs, so
nothing hangs up. A host that loses power or its network sends nothing at all. Both leave every
peer blocked in a collective until the Gloo timeout. So each worker runs one small thread that
sends a UDP ping to a few peers every `interval_s`: the ranks within two places of it on the
ring (every peer in a world of up to five), so the traffic per worker stays constant at any
scale and every rank is watched by up to four others. A peer silent for `timeout_s` is
reported through `on_lost`, once per arming.

Every ping is answered by the receiving thread at once, whoever sent it. A peer counts as
alive when its thread runs, not when its main thread has got round to arming: after a reset
the ranks arm one by one, and a healthy rank that took longer than `timeout_s` between the
allgather and its own `arm` (a newcomer importing beside it on a busy machine) would
otherwise look silent to the ranks that armed first (measured: evicted, and the job ended).
The thread therefore starts with the object, before the first arming.

The thread watches itself too: if its own loop was held up longer than twice `timeout_s` (this
process was the frozen one), its peers have given up on it, so it reports `on_self_frozen`
instead of blaming them. If every watched peer falls silent at once, either they all froze or
this host is cut off; `is_cut_off` (a probe of the launcher's driver or store) decides, and a
cut-off worker reports `on_cut_off` so that it stops instead of training on beside the others.

What it cannot tell apart: a peer on another machine starved of CPU for longer than
`timeout_s` looks frozen. A peer that shares this process's kernel, process table and network
(`this_view()`, whatever host name the launcher gave it: `localhost` and `127.0.0.1` are one
machine) is looked up in /proc instead: one that runs or uses CPU is starved, and it is spared.
One that sleeps without using any CPU across two verdicts is deadlocked, not starved (seen: a
rank whose Horovod loop died while its main thread enqueued a gradient, every thread blocked
and the GIL held; spared for ever, it hung the job until its outer limit), and it is evicted
at about twice the timeout. Under heavy CPU oversubscription (containers at load 13-36 on 2
cores) raise `recovery.heartbeat_timeout_seconds`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

INTERVAL_S = 0.2
PING, PONG = b"p", b"r"
"""First byte of a datagram; the rest is the sender's pid. A pong is never answered."""
RING_REACH = 2
"""Each rank watches the ranks up to this many places away on each side."""
_SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; Python names it from 3.13
_STAMP_SPACE = socket.CMSG_SPACE(16)  # one struct timespec


@dataclass(frozen=True)
class Peer:
    """What a rank tells the others about itself at every (re)start (one allgather)."""

    rank: int
    address: tuple[str, int]
    """Where its heartbeat socket listens."""
    machine: str
    pid: int
    slot: str = ""
    """The launcher's name for its place ("host+0:0" under Horovod): what the driver ends."""
    view: str = ""
    """`this_view()` of its process: which kernel, process table and network it shares."""


def watched(me: int, world: int, reach: int = RING_REACH) -> list[int]:
    """The ranks `me` exchanges heartbeats with: symmetric, so whoever watches a rank also
    hears from it."""
    out = []
    for k in range(1, reach + 1):
        for r in ((me + k) % world, (me - k) % world):
            if r != me and r not in out:
                out.append(r)
    return sorted(out)


class Heartbeat:
    """One socket and one thread per process, for its whole life. `arm` after every (re)start
    names the peers and starts judging them; `disarm` stops judging but keeps sending, so a
    rank that is done (or resetting) is never taken for a silent one by a peer still busy."""

    def __init__(self, timeout_s: float, *, on_lost: Callable[[list[Peer], float], None],
                 on_self_frozen: Callable[[float], None],
                 on_cut_off: Callable[[list[Peer]], None],
                 is_cut_off: Callable[[], bool], interval_s: float = INTERVAL_S,
                 machine: str = "",
                 quiet_for: Callable[[int], float | None] = lambda rank: None,
                 on_gone: Callable[[list[Peer]], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_gone = on_gone
        """Given: a watched peer on this machine whose process has ended is reported at the next
        ping (0.2 s), not after `timeout_s` of silence. For launchers that learn of a dead rank
        late or never (mpirun: the survivors sat 1.6 s in an MPI collective that never fails);
        a rank that ends normally leaves only after everyone disarmed (the run's last meeting)."""
        self.quiet_for = quiet_for
        """Seconds since data last came from a rank over the job's own connections (the Gloo
        watch's count; None: unknown)."""
        self.machine = machine
        """This process's machine as peers name it (for peers that do not say their view)."""
        self.view = this_view()
        self.interval_s = interval_s
        self.on_lost, self.on_self_frozen = on_lost, on_self_frozen
        self.on_cut_off, self.is_cut_off = on_cut_off, is_cut_off
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.setblocking(False)
        with contextlib.suppress(OSError):  # arrival stamps: the thread reads in batches
            self.sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
        self._lock = threading.Lock()
        self._peers: list[Peer] = []
        self._last: dict[int, float] = {}
        self._cpu_seen: dict[int, int] = {}
        """CPU ticks of each silent peer of this machine at its last verdict."""
        self._judging = False
        self._token = str(os.getpid()).encode()
        self._closed = False
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            self._thread = threading.Thread(target=self._run, name="hvd-resilient-heartbeat",
                                            daemon=True)
            self._thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def arm(self, me: int, everyone: list[Peer]) -> int:
        """Watches this rank's ring neighbours among `everyone` (one `Peer` per rank, in rank
        order); returns how many (0: heartbeats off)."""
        if self.timeout_s <= 0:
            return 0
        peers = [everyone[r] for r in watched(me, len(everyone))]
        now = time.monotonic()
        with self._lock:
            self._peers = peers
            self._last = {p.pid: now for p in peers}
            self._cpu_seen = {}
            self._judging = bool(peers)
        return len(peers)

    def watching(self) -> int:
        """How many peers the last `arm` named."""
        with self._lock:
            return len(self._peers)

    def close(self) -> None:
        """Stops the thread and closes the socket (a worker keeps both for its life; tests
        and short-lived users do not)."""
        self._closed = True
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 1)
        self.sock.close()

    def disarm(self) -> None:
        with self._lock:
            self._judging = False

    def _run(self) -> None:
        tick = next_ping = time.monotonic()
        while not self._closed:
            if time.monotonic() >= next_ping:
                # Once per interval, not once per wake-up (it also wakes to judge): pinging
                # again at each datagram that arrived once made the peers' answers a storm
                # (4,000 datagrams a second per process, measured: CPU taken from training,
                # and a throttled link filled until every connection on it stalled).
                next_ping = time.monotonic() + self.interval_s
                with self._lock:
                    peers = list(self._peers)
                    gone = self._gone() if self._judging and self.on_gone else []
                    if gone:
                        self._judging = False
                if gone and self.on_gone:
                    self.on_gone(gone)
                    continue
                for p in peers:
                    try:
                        self.sock.sendto(PING + self._token, p.address)
                    except OSError:
                        pass  # unreachable now: the silence will say so
            # Asleep until the next ping or the first moment a watched peer could cross the
            # timeout, never woken by a datagram: each wake-up takes the GIL from training, and
            # on busy cores the training thread then waits for this one to be scheduled again
            # (a wake-up per datagram, ~25 a second, cost 5-10% of the step rate measured
            # with three workers on two cores, bench/step_overhead.py). What arrived meanwhile
            # waits in the socket, each datagram stamped by the kernel on arrival.
            time.sleep(max(0.0, min(next_ping, self._next_verdict()) - time.monotonic()))
            with self._lock:
                # Everything queued is drained, and judged, only now: this thread may have
                # waited for the GIL after its sleep, and what the peers sent meanwhile is in
                # the socket; judging before reading it blamed them for this process's stall.
                now = time.monotonic()
                gap, tick = now - tick, now
                self._drain(now)
                if not self._judging:
                    continue
                if gap > 2 * self.timeout_s:  # this process did not run: the peers gave up
                    # on it. Twice the timeout: a starved process that still got evicted is
                    # killed by its evictor anyway; this is the backstop for a frozen one that
                    # nobody could reach, and it must not end a process that was merely slow.
                    self._judging = False
                    verdict: tuple = ("frozen", gap)
                else:
                    silent = [p for p in self._peers if now - self._last[p.pid] > self.timeout_s]
                    if not silent or self._falling_silent_together(silent, now):
                        continue
                    self._judging = False
                    verdict = ("silent", silent, max(now - self._last[p.pid] for p in silent),
                               len(silent) == len(self._peers))
            if verdict[0] == "silent":
                spared = self._spare_the_living(verdict)
                if spared is None:
                    continue
                verdict = spared
            if verdict[0] == "frozen":
                self.on_self_frozen(gap)
            elif verdict[3] and self.is_cut_off():
                self.on_cut_off(verdict[1])
            else:
                self.on_lost(verdict[1], verdict[2])

    def _gone(self) -> list[Peer]:
        """Watched peers of this machine whose process has ended (gone, or a zombie)."""
        return [p for p in self._peers if same_host(p, self.machine, self.view)
                and process_state(p.pid) in ENDED]

    def _falling_silent_together(self, silent: list[Peer], now: float) -> bool:
        """True when the peers not yet silent for the timeout have been silent for nearly as
        long: they stopped together with the others (this host's link went down), and were last
        heard up to a ping interval apart. Judged on the first to cross the timeout alone, the
        cut-off side named that one peer lost, never asked whether it was itself cut off, and
        trained on beside the others until the link came back (1 partition in 5 in
        bench/partition.py). They are judged together one or two ticks later."""
        if len(silent) == len(self._peers):
            return False
        together = self.timeout_s - 2 * self.interval_s
        return all(now - self._last[p.pid] > together for p in self._peers)

    def _spare_the_living(self, verdict: tuple) -> tuple | None:
        """Silent peers that are alive are judged again later instead of evicted:
        - one on this machine that is runnable, or used CPU since its last verdict, is starved
          of CPU (its heartbeat thread did not get to run); the first verdict only takes its
          count, so one asleep and using none is evicted at the second (`_working_here`);
        - one whose data kept arriving over the job's connections (within half the timeout): its
          heartbeats were lost on a link that a big transfer saturates (a drop-tail queue
          drops the small datagrams of the other flows), or its heartbeat thread starved.
        A stopped one (state T) sends no new data: its last bytes in flight arrive, then it
        stays silent."""
        starved: list[Peer] = []
        busy: list[Peer] = []
        silent: list[Peer] = []
        for p in verdict[1]:
            if same_host(p, self.machine, self.view) and self._working_here(p.pid):
                starved.append(p)
                continue
            quiet = self.quiet_for(p.rank)
            # Data within half the timeout: after the heartbeats stopped, not with them. At a
            # partition both stop at once, and the last data (a step's allreduce just after
            # the last ping) is a little younger than the silence: under the full timeout it
            # spared the cut-off peer once (reset at 3.0 s instead of 1.5 s) or split the
            # verdict so that the cut-off side blamed one peer instead of exiting. A link
            # that a big transfer saturates delivers data all the time (quiet near 0).
            (busy if quiet is not None and quiet < self.timeout_s / 2 else silent).append(p)
        if silent:
            return ("silent", silent, verdict[2], verdict[3] and len(silent) == len(verdict[1]))
        with self._lock:
            now = time.monotonic()
            for p in verdict[1]:
                self._last[p.pid] = now
            self._judging = True
        if starved:
            logger.warning("ranks %s silent but running on this machine (starved of CPU?); not "
                        "evicted", [p.rank for p in starved])
        if busy:
            logger.warning("ranks %s missed their heartbeats but their data keeps arriving (a "
                        "saturated link?); not evicted", [p.rank for p in busy])
        return None

    def _working_here(self, pid: int) -> bool:
        """True for a process of this machine that may yet answer: runnable (R: waiting for a
        core), or its CPU time (every thread's, utime + stime) moved since its last verdict, or
        this is its first verdict. False for one that ended, is stopped, or sleeps (S, D)
        through a whole timeout without a tick of CPU: every thread is blocked, and its
        heartbeat thread with them, so it will not answer however long it is spared."""
        fields = process_stat(pid)
        if not fields or fields[0] in (*ENDED, *STOPPED):
            return False
        try:
            ticks = int(fields[11]) + int(fields[12])  # proc(5) fields 14 and 15
        except (IndexError, ValueError):
            return True  # unreadable counts: spared, as before this check
        before = self._cpu_seen.get(pid)
        self._cpu_seen[pid] = ticks
        return fields[0] == "R" or before is None or ticks != before

    def _next_verdict(self) -> float:
        """The first moment after now at which a watched peer could cross the timeout (inf:
        none): the silence of a peer is judged then, not up to a ping interval later."""
        with self._lock:
            if not self._judging:
                return float("inf")
            now = time.monotonic()
            later = [t + self.timeout_s for t in self._last.values() if t + self.timeout_s > now]
        return min(later, default=float("inf"))

    def _drain(self, now: float) -> None:
        by_token = {str(p.pid).encode(): p.pid for p in self._peers}
        wall = time.time()
        while True:
            try:
                data, ancillary, _, sender = self.sock.recvmsg(64, _STAMP_SPACE)
            except OSError:  # BlockingIOError: nothing more to read
                return
            if data[:1] == PING:
                try:
                    self.sock.sendto(PONG + self._token, sender)
                except OSError:
                    pass
            pid = by_token.get(data[1:])
            if pid is not None:
                self._last[pid] = max(self._last.get(pid, 0.0),
                                      now - self._age(ancillary, wall))

    def _age(self, ancillary: list[tuple[int, int, bytes]], wall: float) -> float:
        """How long ago the kernel received a datagram. Bounded by two ping intervals (a peer
        is never judged older than that for a datagram it sent, whatever the wall clock did
        meanwhile); 0 when the kernel gave no stamp."""
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) >= 16:
                sec, nsec = struct.unpack_from("qq", data)
                return min(max(0.0, wall - (sec + nsec / 1e9)), 2 * self.interval_s)
        return 0.0


STOPPED = ("T", "t")
"""Process states of a stopped process (SIGSTOP, a debugger)."""
ENDED = ("", "Z", "X")
"""What /proc says of a process that has ended: nothing (gone), a zombie, or dead."""


def process_stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (the state letter first, then as
    proc(5) numbers them from 3); [] when it cannot be read (gone, or not this machine's)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_state(pid: int) -> str:
    """The process's state letter from /proc (R, S, D, T, Z, ...); "" when it cannot be read
    (gone, or not this machine's /proc)."""
    fields = process_stat(pid)
    return fields[0] if fields else ""


def this_view() -> str:
    """Which kernel (boot id), process table, network and host name (their namespaces) this
    process sees. Two processes with the same view can look each other up in /proc and cannot
    be cut apart by a network fault; host names alone cannot tell that (aliases name one
    machine; network-namespace hosts and containers share one kernel). A process in its own
    UTS namespace presents itself as another host and is taken for one. "" when unreadable."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return ":".join([boot, *(str(os.stat(f"/proc/self/ns/{ns}").st_ino)
                                 for ns in ("pid", "net", "uts"))])
    except OSError:
        return ""


def same_host(p: Peer, machine: str, view: str) -> bool:
    """True when `p`'s pid means a process of this process's /proc and network: by view when
    both are known, else by host name."""
    if p.view and view:
        return p.view == view
    return bool(machine) and p.machine == machine


def probe(address: tuple[str, int], timeout: float = 0.5) -> bool:
    """True when a TCP connection to `address` opens (the driver or store is reachable)."""
    try:
        socket.create_connection(address, timeout=timeout).close()
        return True
    except OSError:
        return False
