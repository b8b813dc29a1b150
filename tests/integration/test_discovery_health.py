"""discovery/health-filter: probing, parsing the wrapped command's output, the executable."""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hvd_resilient.discovery.errors import DiscoveryError
from hvd_resilient.discovery.health import parse_host_lines, probe_hosts, probe_one
from tests.support.paths import ROOT

SCRIPT = ROOT / "discovery" / "health-filter"
HOSTFILE = ROOT / "discovery" / "hostfile"


@pytest.fixture
def listener() -> Iterator[int]:
    """A port that accepts on 127.0.0.1 only: 127.0.0.2 (also loopback) refuses it."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield sock.getsockname()[1]


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_probe_one(listener: int) -> None:
    assert probe_one("127.0.0.1", listener, 1.0) is None
    assert probe_one("127.0.0.2", listener, 1.0) == f"connection refused on port {listener}"
    # .invalid never resolves (RFC 6761); how fast the resolver says so is up to the machine.
    assert probe_one("no-such-host.invalid", listener, 1.0) is not None


def test_probe_hosts_in_parallel(listener: int) -> None:
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.1"]
    results = probe_hosts(hosts, listener, 0.5)
    assert results == {"127.0.0.1": None,
                       "127.0.0.2": f"connection refused on port {listener}",
                       "127.0.0.3": f"connection refused on port {listener}"}
    assert probe_hosts([], listener, 0.5) == {}


def test_probe_hosts_bounded_by_wait(listener: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import hvd_resilient.discovery.health as health

    release = threading.Event()

    def hanging(host: str, port: int, timeout: float) -> str | None:
        if host == "slow":
            release.wait(10)  # a probe thread stuck in name resolution
        return None

    monkeypatch.setattr(health, "probe_one", hanging)
    start = time.monotonic()
    try:
        results = probe_hosts(["fast", "slow"], listener, 0.2, wait=0.3)
    finally:
        release.set()
    assert time.monotonic() - start < 1.5
    assert results == {"fast": None, "slow": "no answer within 0.2 s"}


@pytest.mark.parametrize(("text", "kwargs", "expected"), [
    ("a:1\nb:2\n", {}, {"a": 1, "b": 2}),
    ("\n a:1 \n\n", {}, {"a": 1}),
    ("", {}, {}),
    ("a\nb:2\n", {"default_slots": 4}, {"a": 4, "b": 2}),
])
def test_parse_host_lines(text: str, kwargs: dict[str, int], expected: dict[str, int]) -> None:
    assert parse_host_lines(text, **kwargs) == expected


@pytest.mark.parametrize(("text", "fragment"), [
    ("a\n", "has no ':slots'; pass --default-slots"),
    ("a:0\n", "line 1: slots must be a positive integer"),
    ("a:1\na:2\n", "lists 'a' twice"),
    ("a;reboot:1\n", "contains ';'"),
    ("$(reboot):1\n", "contains '$'"),
    ("-oProxyCommand=x:1\n", "contains '='"),
    ("host name:1\n", "contains ' '"),
    ("a:1:2\n", "got '1:2'"),
])
def test_parse_host_lines_refuses(text: str, fragment: str) -> None:
    with pytest.raises(DiscoveryError) as info:
        parse_host_lines(text)
    assert fragment in str(info.value)


# ---- the executable ----------------------------------------------------------------------

def _run(tmp_path: Path, *args: str, env: dict[str, str] | None = None,
         deadline: str | None = "10") -> tuple[subprocess.CompletedProcess[str], float]:
    """Run the executable; ``deadline=None`` keeps the script's own 1.8 s budget (the timing
    tests), otherwise a generous one so a loaded machine cannot fail functional tests."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("HVD_RESILIENT_")}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    base["XDG_RUNTIME_DIR"] = str(tmp_path)
    if deadline:
        base["HVD_RESILIENT_DISCOVERY_DEADLINE"] = deadline
    base.update(env or {})
    start = time.monotonic()
    proc = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=20,
                          env=base, cwd=tmp_path)
    return proc, time.monotonic() - start


def _hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts"
    path.write_text(text)
    return path


def test_dead_host_is_dropped(listener: int, tmp_path: Path) -> None:
    hosts = _hostfile(tmp_path, "127.0.0.1:4\n127.0.0.2:4\n")
    proc, elapsed = _run(tmp_path, "--port", str(listener), "--", str(HOSTFILE), str(hosts),
                         deadline=None)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "127.0.0.1:4\n"
    assert proc.stderr == (f"health-filter: dropped 127.0.0.2: connection refused on port "
                           f"{listener}\n")
    assert elapsed < 2
    quiet, _ = _run(tmp_path, "--port", str(listener), "--quiet", "--", str(HOSTFILE),
                    str(hosts))
    assert (quiet.stdout, quiet.stderr) == ("127.0.0.1:4\n", "")


def test_closed_port_drops_everything(tmp_path: Path) -> None:
    hosts = _hostfile(tmp_path, "127.0.0.1:1\n")
    proc, _ = _run(tmp_path, "--port", str(_closed_port()), "--quiet", "--", str(HOSTFILE),
                   str(hosts))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")


def test_command_from_environment(listener: int, tmp_path: Path) -> None:
    # horovodrun runs the discovery script without arguments: configure it all by env.
    hosts = _hostfile(tmp_path, "127.0.0.2:1\n127.0.0.1:2\n")
    env = {"HVD_RESILIENT_HEALTH_COMMAND": f"{shlex.quote(str(HOSTFILE))} "
                                           f"{shlex.quote(str(hosts))}",
           "HVD_RESILIENT_HEALTH_PORT": str(listener), "HVD_RESILIENT_HEALTH_QUIET": "1"}
    proc, _ = _run(tmp_path, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "127.0.0.1:2\n", "")


def test_wrapped_command_bad_input_is_exit_2_with_its_reason(listener: int,
                                                             tmp_path: Path) -> None:
    hosts = _hostfile(tmp_path, "127.0.0.1:1\nnode3:0\n")
    proc, _ = _run(tmp_path, "--port", str(listener), "--", str(HOSTFILE), str(hosts))
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (f"health-filter: wrapped command {HOSTFILE} exited 2: hostfile: "
                           f"line 2: slots must be a positive integer, got '0' ({hosts})\n")


def test_wrapped_command_failure_is_nonzero_with_its_reason(listener: int,
                                                            tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--port", str(listener), "--", "sh", "-c",
                   "echo 'first line' >&2; echo 'API exploded' >&2; exit 1")
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == "health-filter: wrapped command sh exited 1: API exploded\n"


def test_wrapped_command_missing(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--", str(tmp_path / "nope"))
    assert proc.returncode == 2 and "cannot run wrapped command" in proc.stderr


def test_wrapped_command_that_hangs_is_cut_off(listener: int, tmp_path: Path) -> None:
    proc, elapsed = _run(tmp_path, "--port", str(listener), "--", "sleep", "30",
                         deadline=None)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "gave no answer within" in proc.stderr
    assert elapsed < 2.5


def test_wrapped_command_bad_output_is_refused(listener: int, tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--port", str(listener), "--", "echo", "$(reboot):1")
    assert proc.returncode == 2 and "contains '$'" in proc.stderr and proc.stdout == ""


def test_no_command(tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--port", "22")
    assert proc.returncode == 2 and "HVD_RESILIENT_HEALTH_COMMAND" in proc.stderr


def test_child_gets_its_share_of_the_deadline(listener: int, tmp_path: Path) -> None:
    proc, _ = _run(tmp_path, "--port", str(listener), "--", "sh", "-c",
                   'echo "127.0.0.1:1"; echo "child deadline $HVD_RESILIENT_DISCOVERY_DEADLINE"'
                   " >&2", deadline=None)
    assert proc.returncode == 0 and proc.stdout == "127.0.0.1:1\n"
    seconds = float(proc.stderr.rsplit(" ", 1)[1])
    assert 0.1 <= seconds < 1.8
