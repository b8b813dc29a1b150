"""Starting real launcher jobs (horovodrun, mpirun, torchrun) in tests, and always stopping them.

Every job gets a unique marker in its environment; cleanup kills the launcher's process group
and then any process that still carries the marker (workers that a launcher started in
sessions of their own survive a killpg).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil

from hvd_resilient.events import read_events
from tests.support.paths import ROOT

VENV_BIN = Path(sys.executable).parent
PYTHON = sys.executable
MARKER = "HVD_RESILIENT_TEST_JOB"


def free_port() -> int:
    """A TCP port free on loopback now (for a rendezvous endpoint)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def events(path: Path) -> list[dict[str, Any]]:
    return list(read_events(path))


class Job:
    def __init__(self, proc: subprocess.Popen, marker: str, log: Path) -> None:
        self.proc = proc
        self.marker = marker
        self.log = log

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"job did not finish within {timeout}s; last output:\n{self.output()[-4000:]}"
            ) from None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def processes(self) -> list[psutil.Process]:
        return marked_processes(self.marker)

    def kill_all(self) -> None:
        """SIGKILL to every process of the job at once (a whole job lost). One already gone
        is skipped: the supervisor's job guard ends the rest of the job the moment the
        supervisor dies (`launch/job_guard.py`), so a process listed a moment ago may have
        been ended by it before its turn here."""
        for p in self.processes():
            try:
                p.send_signal(signal.SIGKILL)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue


def launchers_of(supervisor_pid: int) -> list[psutil.Process]:
    """The children of `hvd-resilient run` that are its launch: not its job guard
    (`launch/job_guard.py`), not its warm pool."""
    return [k for k in psutil.Process(supervisor_pid).children()
            if not any(m in " ".join(k.cmdline())
                       for m in ("hvd_resilient.launch.job_guard", "warm.pool_server"))]


def marked_processes(marker: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(MARKER) == marker:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, job: Job | None = None,
             poll: float = 0.1) -> Any:
    """Polls until predicate() is truthy; fails naming what it waited for."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if job is not None and job.proc.poll() is not None:
            raise AssertionError(
                f"job exited ({job.proc.returncode}) while waiting for {what}:\n"
                f"{job.output()[-4000:]}"
            )
        time.sleep(poll)
    tail = job.output()[-4000:] if job else ""
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{tail}")


class JobRunner:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.jobs: list[Job] = []
        self.extra_env: dict[str, str] = {}  # added to every job's environment

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["PATH"] = f"{VENV_BIN}:{env.get('PATH', '')}"
        env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
        env["PYTHONUNBUFFERED"] = "1"
        env.update(self.extra_env)
        env.update(extra)
        return env

    def start(self, cmd: Iterable[str], *, env: dict[str, str] | None = None,
              cwd: Path | None = None, name: str = "job") -> Job:
        marker = uuid.uuid4().hex
        full_env = dict(env or self.env())
        full_env[MARKER] = marker
        log = self.tmp / f"{name}-{len(self.jobs)}.log"
        fh = open(log, "wb")
        proc = subprocess.Popen(
            list(cmd), env=full_env, cwd=cwd or self.tmp, stdout=fh, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True,
        )
        fh.close()
        job = Job(proc, marker, log)
        self.jobs.append(job)
        return job

    def cleanup(self) -> None:
        for job in self.jobs:
            if job.proc.poll() is None:
                try:
                    os.killpg(job.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    job.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
            left = job.processes()
            trackers = [p for p in left if _is_resource_tracker(p)]
            _kill([p for p in left if p not in trackers])
            # A multiprocessing resource tracker (horovodrun starts one) unlinks the named
            # semaphores its dead users left in /dev/shm once the last of them is gone;
            # killed first, it leaks them (hundreds a day of test runs).
            _, stuck = psutil.wait_procs(trackers, timeout=10)
            _kill(stuck)
            psutil.wait_procs(job.processes(), timeout=10)
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait(timeout=10)


def kill_job(job: Job) -> None:
    """SIGKILL to every process of a horovodrun job at once (the whole job lost), but the
    multiprocessing resource trackers: no part of training, they unlink the semaphores their
    dead users left in /dev/shm, which leak when they die with them."""
    procs = [p for p in job.processes() if not _is_resource_tracker(p)]
    assert len(procs) >= 3, "expected horovodrun and two workers"
    _kill(procs)
    job.wait(30)


def _kill(procs: list[psutil.Process]) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def _is_resource_tracker(p: psutil.Process) -> bool:
    try:
        return "multiprocessing.resource_tracker" in " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def write_discovery(tmp: Path, hosts: str) -> tuple[Path, Path]:
    """A hosts file and an executable discovery script that prints it."""
    hosts_file = tmp / "hosts.txt"
    set_hosts(hosts_file, hosts)
    script = tmp / "discover.sh"
    script.write_text(f"#!/bin/sh\nexec {PYTHON} {ROOT}/discovery/hostfile {hosts_file}\n")
    script.chmod(0o755)
    return hosts_file, script


def set_hosts(hosts_file: Path, hosts: str) -> None:
    tmp = hosts_file.with_suffix(".tmp")
    tmp.write_text(hosts.replace(",", "\n") + "\n")
    os.replace(tmp, hosts_file)


def horovodrun_elastic(discovery: Path, np: int, min_np: int, max_np: int,
                       *extra: str) -> list[str]:
    return [
        str(VENV_BIN / "horovodrun"), "-np", str(np), "--min-np", str(min_np),
        "--max-np", str(max_np), "--host-discovery-script", str(discovery),
        "--network-interface", "lo", *extra,
    ]


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, default=str)
