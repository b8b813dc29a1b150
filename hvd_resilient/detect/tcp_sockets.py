"""This process's TCP sockets, read from /proc: which fds are connected where, which listen.

Failure detection needs to find Horovod's Gloo connections without help from Horovod (it does
not expose them): a connection is identified by its endpoints, and the endpoints come from the
kernel's tables. Linux only; elsewhere every function returns nothing, and detection falls back
to the Gloo timeout.
"""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

ESTABLISHED = "01"


@dataclass(frozen=True)
class TcpSocket:
    fd: int
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str


def _addr(hex_addr: str) -> tuple[str, int]:
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        ip = socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(host, 16)))
    else:  # IPv6: four little-endian 32-bit words
        words = struct.unpack("<4I", raw)
        ip = socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))
        if ip.startswith("::ffff:"):
            ip = ip[len("::ffff:"):]
    return ip, int(port, 16)


def _inodes() -> dict[int, int]:
    """socket inode -> one fd of this process holding it."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.setdefault(int(target[8:-1]), int(name))
    return out


def own_sockets() -> list[TcpSocket]:
    """TCP sockets (v4 and v6) held by this process."""
    inodes = _inodes()
    found: list[TcpSocket] = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as fh:
                lines = fh.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10:
                continue
            fd = inodes.get(int(cols[9]))
            if fd is not None:
                found.append(TcpSocket(fd, _addr(cols[1]), _addr(cols[2]), cols[3]))
    return found
