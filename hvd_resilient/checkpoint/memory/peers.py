"""Reading another host's memory tier: a small HTTP server per host serves its segments, so
a host that lost its own (a replacement host, a host whose memory was cleared) resumes from a
peer's copy instead of the durable store.

Why HTTP on a thread of a training process rather than a daemon per host: nothing new to
start, supervise or clean up; every restart starts a server again before the peers look, and
the files it serves outlive it in ``/dev/shm``. It binds the address the job already uses to
reach its peers (never every interface) and serves only segment files by exact name; the
same trust as the job's Gloo connections, which are not authenticated either.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import re
import threading
from typing import Any

from hvd_resilient.checkpoint.host_buffers import allocate
from hvd_resilient.checkpoint.memory.segments import (
    SegmentDir,
    SegmentError,
    SegmentInfo,
    check_name,
    files_from,
    stem,
)

_PATH = re.compile(r"^/([A-Za-z0-9][A-Za-z0-9._-]{0,127})/([A-Za-z0-9][A-Za-z0-9._-]{0,127})/"
                   r"(step-\d{10}\.(?:json|index|data))$")
_CHUNK = 8 << 20


class _Handler(http.server.BaseHTTPRequestHandler):
    root = ""

    def do_GET(self) -> None:  # noqa: N802 - the http.server name
        m = _PATH.match(self.path)
        if not m:
            self.send_error(404)
            return
        path = os.path.join(self.root, *m.groups())
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, after the headers
        except OSError:
            self.send_error(404)
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            while chunk := f.read(_CHUNK):
                self.wfile.write(chunk)

    def do_PUT(self) -> None:  # noqa: N802 - the http.server name
        """A peer's copy of its own segment file (the sharded tier's replication): written
        under a temporary name and renamed, so a manifest, sent last, appears whole."""
        m = _PATH.match(self.path)
        n = int(self.headers.get("Content-Length", "-1"))
        if not m or n < 0:
            self.send_error(400)
            return
        path = os.path.join(self.root, *m.groups())
        tmp = f"{path}.put{threading.get_ident()}.tmp"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                left = n
                while left:
                    chunk = self.rfile.read(min(left, _CHUNK))
                    if not chunk:
                        raise OSError("short body")
                    f.write(chunk)
                    left -= len(chunk)
            os.replace(tmp, path)
            if path.endswith(".json"):  # a new copy is complete: older ones beyond two go
                run_key, owner, _ = m.groups()
                held = SegmentDir(self.root, run_key, owner)
                for step in held.steps()[2:]:
                    held.drop(step)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self.send_error(500)
            return
        self.send_response(204)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass  # the job's own events say what was fetched


POLL_S = 0.02
"""How often the server's loop looks for a shutdown request (a select timeout: no work)."""


class SegmentServer:
    """Serves ``root`` (every run's segments on this host) at ``address``."""

    def __init__(self, root: str, host: str) -> None:
        handler = type("Handler", (_Handler,), {"root": root})
        self._server = http.server.ThreadingHTTPServer((host, 0), handler)
        self._server.daemon_threads = True
        self.address: tuple[str, int] = (host, self._server.server_address[1])
        # shutdown() waits for the loop's next poll: at the default 0.5 s, every worker that
        # left the job (a peer died, torchrun stopped the round) spent 0-0.5 s in close()
        # before it could exit, and torchrun starts the next round only once all have.
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": POLL_S},
                                        name="memory-tier-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _get(conn: http.client.HTTPConnection, path: str, limit: int) -> memoryview:
    conn.request("GET", path)
    resp = conn.getresponse()
    if resp.status != 200:
        resp.read()
        raise SegmentError(f"peer answered {resp.status} for {path}")
    n = int(resp.getheader("Content-Length", "-1"))
    if not 0 <= n <= limit:
        raise SegmentError(f"peer sent {n} bytes for {path}, expected at most {limit}")
    buf = memoryview(allocate(n, populate=True))[:n] if n else memoryview(bytearray())
    got = 0
    while got < n:
        k = resp.readinto(buf[got:])
        if not k:
            raise SegmentError(f"peer closed {path} after {got} of {n} bytes")
        got += k
    return buf


def fetch(address: tuple[str, int], run_id: str, owner: str, step: int,
          timeout: float = 30.0) -> tuple[SegmentInfo, dict[str, Any]]:
    """A peer's segment, verified, in this process's memory.

    Raises:
        SegmentError: unreachable peer, missing segment, or a copy that does not verify.
    """
    base = f"/{check_name(run_id, 'run id')}/{check_name(owner, 'owner')}/{stem(step)}"
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        info = SegmentInfo.from_json(bytes(_get(conn, base + ".json", 1 << 24)))
        if info.step != step or info.run_id != run_id or info.owner != owner:
            raise SegmentError(f"peer's manifest describes {info.run_id}/{info.owner} step "
                               f"{info.step}")
        index = _get(conn, base + ".index", info.index_bytes)
        data = _get(conn, base + ".data", info.data_bytes)
        return info, files_from(info, data, index)
    except (OSError, http.client.HTTPException) as e:
        raise SegmentError(f"peer {address[0]}:{address[1]} unreachable for step {step} "
                           f"({type(e).__name__}: {e})") from None
    finally:
        conn.close()


def push(address: tuple[str, int], run_id: str, owner: str, step: int, folder: str,
         timeout: float = 60.0) -> None:
    """Copies this host's segment of ``step`` to a peer: data and index first, the manifest
    last, so the peer never holds a manifest without its bytes.

    Raises:
        SegmentError: the peer is unreachable or refused a file.
    """
    base = f"/{check_name(run_id, 'run id')}/{check_name(owner, 'owner')}/{stem(step)}"
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        for suffix in (".data", ".index", ".json"):
            path = os.path.join(folder, stem(step) + suffix)
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                conn.request("PUT", base + suffix, body=f,
                             headers={"Content-Length": str(size)})
                resp = conn.getresponse()
                resp.read()
            if resp.status != 204:
                raise SegmentError(f"peer answered {resp.status} for {base}{suffix}")
    except (OSError, http.client.HTTPException) as e:
        raise SegmentError(f"peer {address[0]}:{address[1]} did not take step {step} "
                           f"({type(e).__name__}: {e})") from None
    finally:
        conn.close()
