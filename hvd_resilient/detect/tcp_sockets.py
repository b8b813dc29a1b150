"""This process's TCP sockets: which fds are connected where, which listen.

Failure detection needs to find Horovod's Gloo connections without help from Horovod (it does
not expose them): a connection is identified by its endpoints. Each socket fd of this process
(/proc/self/fd) is asked directly (its name, its peer's, its TCP state), not looked up in
/proc/net/tcp: that table lists every socket of the network namespace, TIME_WAIT ones
included, and a host that ran many jobs holds hundreds (570 on this machine after a benchmark:
10 ms per read idle, 20-70 ms beside busy workers, twice per (re)start, while the whole job
waited in the arming allgather). Linux only; elsewhere every function returns nothing, and
detection falls back to the Gloo timeout.
"""

from __future__ import annotations

import fcntl
import os
import socket
from dataclasses import dataclass

ESTABLISHED = "01"
"""A TCP state as the kernel numbers it (`tcpi_state`), in /proc/net/tcp's two hex digits."""


@dataclass(frozen=True)
class TcpSocket:
    fd: int
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str


def _host(addr: str) -> str:
    """An IPv4 peer of an IPv6 socket is written as the IPv4 address, as the other side
    writes it; a link-local scope is dropped (the other side may name it differently)."""
    addr = addr.split("%", 1)[0]
    return addr[len("::ffff:"):] if addr.startswith("::ffff:") else addr


def _socket_fds() -> list[int]:
    """One fd of this process per socket it holds."""
    out: dict[str, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return []
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.setdefault(target, int(name))
    return list(out.values())


def dup_socket(fd: int) -> socket.socket:
    """A socket object over a duplicate of `fd` (closing it leaves the connection alone).
    With `socket.setdefaulttimeout()` set, Python makes a socket it wraps non-blocking, and
    the flag belongs to the open file, shared with the owner (Gloo, libcurl): put it back."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    sock = socket.socket(fileno=os.dup(fd))
    if fcntl.fcntl(fd, fcntl.F_GETFL) != flags:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)
    return sock


def _describe(fd: int) -> TcpSocket | None:
    """The fd's endpoints and state; None for a socket that is not TCP over IP, or an fd
    closed meanwhile."""
    try:
        sock = dup_socket(fd)
    except OSError:
        return None
    with sock:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or \
                sock.type != socket.SOCK_STREAM:
            return None
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
            local = sock.getsockname()
            try:
                remote = sock.getpeername()
            except OSError:  # listening, or not connected
                remote = ("::" if sock.family == socket.AF_INET6 else "0.0.0.0", 0)
        except OSError:
            return None
    return TcpSocket(fd, (_host(local[0]), local[1]), (_host(remote[0]), remote[1]),
                     f"{state:02X}")


def own_sockets() -> list[TcpSocket]:
    """TCP sockets (v4 and v6) held by this process."""
    return [s for s in map(_describe, _socket_fds()) if s is not None]
