"""Hang up on the peers: shut down this process's connections to them, so that their pending
operations on it fail at once instead of at their timeout.

A rank that gives up a collective (its own operation failed) is still alive, and its sockets
stay open until its collective library tears its group down, which may be never: a background
loop blocked in a receive from a peer that is itself blocked in a receive from us holds the
group, and both wait out the whole Gloo timeout (30 s by default; seen 1 in 5 random kills on a
busy machine, docs/architecture.md). `shutdown(2)` on a socket sends the peer its end of stream
at once, and wakes any thread of this process blocked on that socket, whoever owns the file
descriptor; the descriptor stays valid, so the library that owns it closes it as it always
would. Closing our own copy would do neither while another copy is open.

Works for any Gloo group (Horovod's, torch.distributed's): the caller names the connections by
their endpoints, as seen from this process (how `detect/gloo_watch.py` finds
the Gloo ones), and only sockets of this process with exactly those endpoints are touched.
Linux; stdlib only.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable

from hvd_resilient.detect import tcp_sockets

Endpoint = tuple[str, int]
Conn = tuple[Endpoint, Endpoint]
"""(local, remote) as this process sees the connection."""


def _norm(addr: object) -> Endpoint | None:
    if not addr:
        return None
    host, port = addr[0], addr[1]  # type: ignore[index]
    host = str(host)
    if host.startswith("::ffff:"):
        host = host[len("::ffff:"):]
    return host, int(port)


def hang_up(connections: Iterable[Conn]) -> int:
    """Shuts down (both directions) this process's TCP sockets with these endpoints; returns
    how many. Never raises: a socket already closed or reused is skipped (its endpoints are
    checked again on our own duplicate of the descriptor before anything is done to it).
    The sockets are found as the watch finds them (`tcp_sockets`, fd by fd), not from
    /proc/net/tcp, whose whole-namespace table cost 10-70 ms here in every survivor's failure
    path."""
    wanted = {(_norm(local), _norm(remote)) for local, remote in connections}
    if not wanted:
        return 0
    done = 0
    for found in tcp_sockets.own_sockets():
        key = (_norm(found.local), _norm(found.remote))
        if key not in wanted:
            continue
        try:
            sock = tcp_sockets.dup_socket(found.fd)
        except OSError:
            continue
        with sock:
            try:  # the fd may have been closed and reused since the listing: check again
                same = (_norm(sock.getsockname()), _norm(sock.getpeername())) == key
            except OSError:
                same = False
            if same:  # one socket may have several descriptors: once is enough
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                wanted.discard(key)
                done += 1
    return done
