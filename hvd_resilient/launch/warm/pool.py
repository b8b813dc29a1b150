"""A worker forked from a warm process on its machine: a join without the cold start.

A standby worker hides its cold start (Python, torch, Horovod, the script's libraries: 15-20 s
on these two busy cores) behind the old world's training, but the new world still waits for
it. A warm pool (`pool_server.py`) is a process on the machine that has done those
imports once and forks a standby for each launch that asks: the newcomer is ready in a tenth
of a second. `hvd-resilient run --warm-pool` starts one on the launch machine; a host that
joins later has one when it starts it at boot (docs/architecture.md).

This is the launch side, standard library only (it runs before any import worth hiding): it
hands the pool its command, environment, folder and standard streams, and then stands in for
the forked worker until it ends: signals sent to it are passed on, and it exits as the worker
did. Horovod's driver, which watches and kills this process, cannot tell the difference; the
pool kills the worker if this process dies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import tempfile
from collections.abc import Mapping

SOCKET_ENV = "HVD_RESILIENT_WARM_POOL_SOCKET"
"""The pool the launching driver started (its machine); a host's own pool is at
`default_socket()`."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
HEADER_MAX = 1 << 20


def default_socket() -> str:
    """Where a machine's own pool listens (one per user)."""
    return os.path.join(tempfile.gettempdir(), f"hvd-resilient-{os.getuid()}", "warm-pool.sock")


def this_python() -> list[str]:
    """The interpreter and its environment (a venv shares the base interpreter's binary)."""
    return [os.path.realpath(sys.executable), sys.prefix]


def candidates(env: Mapping[str, str]) -> list[str]:
    paths = [p for p in (env.get(SOCKET_ENV, ""), default_socket()) if p]
    return [p for p in dict.fromkeys(paths) if os.path.exists(p)]


def send(sock: socket.socket, message: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode() + b"\n"
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.sendall(data)


def read_line(sock: socket.socket, *, fds: int = 0,
              pending: bytearray | None = None) -> tuple[dict | None, list[int]]:
    """One JSON message, and the file descriptors that came with its first bytes; None when
    the peer closed first or sent something else (the descriptors are still handed back, for
    the caller to close). Where more messages follow on the connection, `pending` keeps what
    one read brought beyond the first line, for the next: a worker that exits at once sends
    its pid and its exit code back to back, and the two arrive in one read (both were once
    taken as one bad message, and the launch then ran the worker a second time, cold)."""
    buf, got = bytes(pending or b""), list[int]()
    if pending:
        pending.clear()
    while b"\n" not in buf:
        if fds and not got and not buf:
            chunk, got, _, _ = socket.recv_fds(sock, 65536, fds)
        else:
            chunk = sock.recv(65536)
        if not chunk:
            return None, got
        buf += chunk
        if len(buf) > HEADER_MAX:
            return None, got
    line, _, rest = buf.partition(b"\n")
    if pending is not None:
        pending.extend(rest)
    try:
        message = json.loads(line)
    except ValueError:
        return None, got
    return (message if isinstance(message, dict) else None), got


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end, as the kernel tells it."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    return pid, uid


def network_namespace(pid: int | str = "self") -> str:
    """The network namespace of a process ("" when it cannot be read): a Unix socket in a
    shared folder reaches across namespaces (network-namespace hosts, containers sharing a
    volume), and a worker forked there would run with the wrong host's network."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return ""


def connect(path: str) -> socket.socket | None:
    """A connection to the pool at `path`, only if this user runs it: the request carries the
    whole environment, credentials included."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        if peer(s)[1] == os.getuid():
            return s
    except OSError:
        pass
    s.close()
    return None


def alive(path: str) -> bool:
    """Whether a pool of this user listens at `path` (a ping: it forks nothing)."""
    s = connect(path) if path and os.path.exists(path) else None
    if s is None:
        return False
    with s:
        try:
            send(s, {"ping": True})
        except OSError:
            return False
    return True


def run_in_pool(cmd: list[str], mode: str = "standby") -> None:
    """Has a pool on this machine fork the worker for `cmd` and exits as it does; returns
    when there is none, or it would not take this command (another Python), so that the
    caller starts cold. ``mode``: "standby" (it waits for the Horovod driver's go at its
    first init) or "script" (it runs at once: an mpirun rank, `warm/mpirun.py`)."""
    for path in candidates(os.environ):
        sock = connect(path)
        if sock is None:
            continue  # a pool that is gone left its socket
        pending = bytearray()
        with sock:
            try:
                send(sock, {"argv": cmd, "env": dict(os.environ), "cwd": os.getcwd(),
                            "python": this_python(), "mode": mode}, [0, 1, 2])
                reply, _ = read_line(sock, pending=pending)
            except OSError:  # a closed standard stream, a pool gone mid-way
                continue
            if reply is not None and isinstance(reply.get("exit"), int):
                _exit_as(reply["exit"])  # the worker ran and ended before the pool told its pid
            if reply is None or "pid" not in reply:
                continue
            _stand_in(sock, int(reply["pid"]), pending)


def _stand_in(sock: socket.socket, pid: int, pending: bytearray) -> None:
    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    message, _ = read_line(sock, pending=pending)
    _exit_as(message.get("exit") if message else None)


def _exit_as(code: object) -> None:
    """Ends this stand-in as its worker ended: its exit code, or the signal that killed it."""
    if not isinstance(code, int):
        print("hvd-resilient: the warm pool went away before the worker ended",
              file=sys.stderr, flush=True)
        sys.exit(1)
    if code < 0:  # killed by a signal: so is its stand-in, as Horovod expects
        if -code in FORWARDED:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)
