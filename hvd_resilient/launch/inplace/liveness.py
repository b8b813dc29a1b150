"""The fast half of telling a dead host: one TCP connection from each agent to the one that
decides, held for the agent's life and never read.

An agent that dies, however it dies (SIGKILL, the OOM killer, its host's processes all killed),
has its connections closed by the kernel, and the peer sees EOF at once; so the deciding agent
drops a dead host's members in milliseconds instead of after a timeout or a lease's TTL, and an
agent that follows sees its leader die as fast. A host that goes silent without its kernel
saying so (power lost, link down, frozen) keeps its connection open: that is left to the slow
half (a report that stops moving, a lease that expires).
"""

from __future__ import annotations

import logging
import select
import socket

logger = logging.getLogger(__name__)


class Listener:
    """The deciding agent's side: accepts every other agent's connection and reports which
    host's closed."""

    def __init__(self, address: str) -> None:
        self.sock = socket.create_server((address, 0))
        self.sock.setblocking(False)
        self.address = f"{address}:{self.sock.getsockname()[1]}"
        self.links: dict[socket.socket, int | None] = {}

    def closed(self) -> list[int]:
        """Hosts whose agent's connection closed since the last call (never blocks)."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                break
            self.links[conn] = None
        if not self.links:
            return []
        gone: list[int] = []
        readable, _, _ = select.select(list(self.links), [], [], 0)
        for conn in readable:
            try:
                data = conn.recv(64)
            except OSError:
                data = b""
            if data:
                self.links[conn] = int(data.split(b"\n")[0])
                continue
            h = self.links.pop(conn)
            conn.close()
            if h is not None:
                gone.append(h)
        return gone

    def close(self) -> None:
        for conn in self.links:
            conn.close()
        self.sock.close()


class Link:
    """An agent's connection to the deciding agent's `Listener` (``host:port``)."""

    def __init__(self, address: str, host_index: int, timeout_s: float) -> None:
        host, _, port = address.rpartition(":")
        self.address = address
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.sendall(f"{host_index}\n".encode())
        self.sock.setblocking(False)

    def closed(self) -> bool:
        """True once the other side's connection closed (it died); never blocks."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return False
        try:
            return self.sock.recv(64) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def close(self) -> None:
        self.sock.close()
