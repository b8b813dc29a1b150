"""A real 3-member etcd cluster on loopback for the agreement tests (Debian's `etcd-server`).

Each member gets its own free peer and client ports (never etcd's defaults 2379/2380, where a
system etcd may listen) and a data folder under one temporary folder (in /dev/shm when it
exists: the members fsync every write, and tmpfs makes that free). Raft runs on short timers
(`HEARTBEAT_MS`, `ELECTION_MS`) so that leases of 1-2 s expire on time; see `MIN_TTL_S`.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from hvd_resilient.die_with_parent import die_with_parent
from tests.support.s3_server import free_ports

HEARTBEAT_MS = 50
ELECTION_MS = 500
MIN_TTL_S = 1
"""The shortest lease etcd 3.4 grants with these timers: its lessor raises any shorter TTL to
ceil(1.5 * election timeout) = ceil(0.75 s) = 1 s (with etcd's defaults, 100/1000 ms, it is
2 s). A lease also outlives its TTL by up to 0.5 s: the leader looks for expired leases every
500 ms."""
RESERVED_PORTS = {2379, 2380}
"""etcd's default ports, where Debian's packaged service would listen: never ours."""


def etcd_binary() -> str:
    """The `etcd` server on PATH; fails, saying how to install it, when absent (a skip would
    hide a missing install step)."""
    found = shutil.which("etcd")
    if found is None:
        raise RuntimeError("etcd not found: apt-get install etcd-server (make install does)")
    return found


def ports(n: int) -> list[int]:
    """`n` distinct free loopback ports, none of etcd's defaults."""
    while True:
        got = free_ports(n)
        if not RESERVED_PORTS & set(got):
            return got


class EtcdCluster:
    """Three `etcd` processes forming one cluster; `kill(i)` SIGKILLs member i, `restart(i)`
    starts it again on its data folder and ports, `close()` ends them all and removes the
    folders (also at interpreter exit, and the kernel kills the members if this process dies:
    call it from a thread that outlives the cluster, the main thread)."""

    def __init__(self, size: int = 3, *, base: str | None = None,
                 addresses: list[str] | None = None, netns: list[str] | None = None) -> None:
        """``addresses``/``netns``: member i listens on addresses[i] inside network namespace
        netns[i] (the multi-host tier's hosts, where each namespace has its own ports);
        default: loopback, free ports."""
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.root = Path(tempfile.mkdtemp(prefix="etcd-test-", dir=base or shm))
        self.binary = etcd_binary()
        self.addresses = addresses or ["127.0.0.1"] * size
        self.netns = netns
        if addresses:
            self.peer_ports, self.client_ports = [2480] * size, [2479] * size
        else:
            got = ports(2 * size)
            self.peer_ports, self.client_ports = got[:size], got[size:]
        self.names = [f"m{i}" for i in range(size)]
        self.token = f"hvd-test-{uuid.uuid4().hex[:8]}"
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        atexit.register(self.close)

    @property
    def endpoints(self) -> list[str]:
        """Every member's client URL, member 0 first."""
        return [f"http://{a}:{p}" for a, p in zip(self.addresses, self.client_ports,
                                                  strict=True)]

    def _args(self, i: int) -> list[str]:
        peers = ",".join(f"{n}=http://{a}:{p}" for n, a, p in
                         zip(self.names, self.addresses, self.peer_ports, strict=True))
        peer, client = f"http://{self.addresses[i]}:{self.peer_ports[i]}", self.endpoints[i]
        inside = ["ip", "netns", "exec", self.netns[i]] if self.netns else []
        return [*inside,
            self.binary, "--name", self.names[i], "--data-dir", str(self.root / self.names[i]),
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--initial-cluster", peers, "--initial-cluster-token", self.token,
            "--initial-cluster-state", "new",  # ignored once the data folder exists
            "--heartbeat-interval", str(HEARTBEAT_MS), "--election-timeout", str(ELECTION_MS),
            "--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
        ]

    def _spawn(self, i: int) -> None:
        with open(self.root / f"{self.names[i]}.log", "ab") as log:  # handed to the child
            self.procs[i] = subprocess.Popen(
                self._args(i), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )

    def start(self, timeout: float = 30.0) -> EtcdCluster:
        """Starts every member and returns once each reports itself healthy."""
        for i in range(len(self.names)):
            self._spawn(i)
        for i in range(len(self.names)):
            self.wait_healthy(i, timeout)
        return self

    def healthy(self, i: int) -> bool:
        """Member i answers `/health` with health true (it sees a raft leader)."""
        try:
            with urllib.request.urlopen(self.endpoints[i] + "/health", timeout=0.5) as r:
                return bool(json.load(r).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wait_healthy(self, i: int, timeout: float = 30.0) -> None:
        """Polls member i's health until true; fails with its log tail after `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            proc = self.procs[i]
            if proc is None or proc.poll() is not None:
                raise RuntimeError(f"etcd {self.names[i]} exited:\n{self.log_tail(i)}")
            if self.healthy(i):
                return
            time.sleep(0.05)  # polling interval, bounded by the deadline
        raise RuntimeError(f"etcd {self.names[i]} not healthy in {timeout}s:\n{self.log_tail(i)}")

    def kill(self, i: int, timeout: float = 10.0) -> None:
        """SIGKILLs member i and reaps it: no goodbye to its peers, its sockets closed."""
        proc, self.procs[i] = self.procs[i], None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout)

    def restart(self, i: int, timeout: float = 30.0) -> None:
        """Starts a killed member again on its data folder and ports."""
        if self.procs[i] is None:
            self._spawn(i)
        self.wait_healthy(i, timeout)

    def raft_leader(self, timeout: float = 10.0) -> int:
        """The index of the member that is Raft leader now, as the live members report it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ids, leaders = {}, set()
            for i, proc in enumerate(self.procs):
                if proc is None:
                    continue
                with contextlib.suppress(OSError, ValueError, KeyError):
                    status = self._status(i)
                    ids[status["header"]["member_id"]] = i
                    leaders.add(status["leader"])
            if len(leaders) == 1 and (leader := leaders.pop()) in ids:
                return ids[leader]
            time.sleep(0.05)  # polling interval, bounded by the deadline
        raise RuntimeError(f"no agreed etcd Raft leader within {timeout}s")

    def _status(self, i: int) -> dict[str, Any]:
        request = urllib.request.Request(self.endpoints[i] + "/v3/maintenance/status",
                                         data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=0.5) as r:
            return dict(json.load(r))

    def log_tail(self, i: int, lines: int = 20) -> str:
        path = self.root / f"{self.names[i]}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def close(self) -> None:
        """Kills every member still running and removes the data folders; idempotent."""
        for i in range(len(self.procs)):
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self.kill(i)
        shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.close)


def etcd_cluster_running(size: int = 3) -> EtcdCluster:
    """A started cluster; the test file's fixture wraps it (and calls `close()`)."""
    cluster = EtcdCluster(size)
    try:
        return cluster.start()
    except BaseException:
        cluster.close()
        raise
