"""discovery/hostfile: the parser (table-driven) and the executable."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_resilient.discovery.errors import DiscoveryError, TransientDiscoveryError
from hvd_resilient.discovery.hostfile import main, parse_hostfile, read_hostfile
from tests.support.paths import ROOT

SCRIPT = ROOT / "discovery" / "hostfile"

PARSES = [
    ("host:slots", "node1:4\n", {"node1": 4}),
    ("open mpi style", "node1 slots=4\n", {"node1": 4}),
    ("max_slots ignored", "node1 slots=2 max_slots=8\nnode2 max-slots=4 slots=3\n",
     {"node1": 2, "node2": 3}),
    ("spaces around =", "node1 slots = 4\n", {"node1": 4}),
    ("bare host gets default", "node1\n", {"node1": 1}),
    ("comments and blanks", "# fleet\n\n  node1:2   # big one\n\t\n#node9:4\n", {"node1": 2}),
    ("no trailing newline", "node1:2", {"node1": 2}),
    ("crlf", "node1:2\r\nnode2:3\r\n", {"node1": 2, "node2": 3}),
    ("ipv4", "10.0.0.1:8\n10.0.0.2 slots=8\n", {"10.0.0.1": 8, "10.0.0.2": 8}),
    ("fqdn and underscore", "ip-10-0-0-1.ec2.internal:1\nhost_a:2\n",
     {"ip-10-0-0-1.ec2.internal": 1, "host_a": 2}),
    ("duplicates summed", "node1:2\nnode1 slots=3\n", {"node1": 5}),
    ("machinefile: one line per process", "node1\nnode1\nnode1\nnode2\n",
     {"node1": 3, "node2": 1}),
    ("leading zeros", "node1:08\n", {"node1": 8}),
]

ERRORS = [
    ("zero slots", "node1:2\nnode2:4\nnode3:0\n", "line 3: slots must be a positive integer, "
                                                  "got '0'"),
    ("negative slots", "node1 slots=-1\n", "line 1: slots must be a positive integer, got '-1'"),
    ("empty slots", "node1:\n", "line 1: slots must be a positive integer, got ''"),
    ("word slots", "node1:four\n", "got 'four'"),
    ("float slots", "node1 slots=1.5\n", "got '1.5'"),
    ("missing host", ":4\n", "line 1: missing hostname before ':'"),
    ("bare number after host", "node1 4\n", "unexpected '4' after host 'node1'"),
    ("unknown key", "node1 slots=2 gpus=2\n", "unknown key 'gpus'"),
    ("slots twice", "node1 slots=2 slots=3\n", "slots= given twice"),
    ("bad max_slots", "node1 max_slots=x\n", "got 'x'"),
    ("host:slots plus key", "node1:2 slots=2\n", "unexpected 'slots=2' after 'node1:2'"),
    ("injection ;", "a;rm -rf /\n", "contains ';'"),
    ("injection $()", "$(reboot)\n", "contains '$'"),
    ("injection backtick", "`reboot`:1\n", "contains '`'"),
    ("space in name", "host name\n", "unexpected 'name' after host 'host'"),
    ("ssh option", "-oProxyCommand=x\n", "hostname '-oProxyCommand=x' contains '='"),
    ("leading dash", "-node1:2\n", "starts with '-'"),
    ("quote", "'node1':2\n", "contains \"'\""),
    ("slash", "node/1:2\n", "contains '/'"),
    ("ipv6", "fe80::1:2\n", "IPv6"),
    ("bad ipv4", "10.0.0.300:1\n", "not a valid IPv4 address"),
    ("empty file", "", "no hosts listed"),
    ("only comments", "# nothing yet\n\n", "no hosts listed"),
]


@pytest.mark.parametrize(("text", "expected"), [p[1:] for p in PARSES],
                         ids=[p[0] for p in PARSES])
def test_parses(text: str, expected: dict[str, int]) -> None:
    assert parse_hostfile(text) == expected


@pytest.mark.parametrize(("text", "fragment"), [e[1:] for e in ERRORS],
                         ids=[e[0] for e in ERRORS])
def test_refuses(text: str, fragment: str) -> None:
    with pytest.raises(DiscoveryError) as info:
        parse_hostfile(text, source="/etc/hosts.train")
    assert fragment in str(info.value)
    assert str(info.value).endswith("(/etc/hosts.train)") or "no hosts listed" in fragment


def test_default_slots_apply_to_bare_hosts_only() -> None:
    assert parse_hostfile("a\nb:2\nc slots=3\n", default_slots=8) == {"a": 8, "b": 2, "c": 3}


def test_duplicates_can_be_refused() -> None:
    with pytest.raises(DiscoveryError, match="line 3: host 'a' already listed on line 1"):
        parse_hostfile("a:1\nb:1\na:1\n", on_duplicate="error")


def test_read_missing_file_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match="does not exist"):
        read_hostfile(str(tmp_path / "nope"))


def test_read_directory_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(DiscoveryError, match="cannot read hostfile"):
        read_hostfile(str(tmp_path))


def test_read_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_bytes(b"node1:1\n\xff\xfe\n")
    with pytest.raises(DiscoveryError, match="not UTF-8"):
        read_hostfile(str(path))


def test_read_file_that_keeps_changing_is_transient(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "hosts"
    path.write_text("node1:1\n")
    real_stat = os.stat
    calls = {"n": 0}

    def moving_stat(p, *a, **kw):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        st = real_stat(p, *a, **kw)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + calls["n"] * 1000))
        return real_stat(p, *a, **kw)

    monkeypatch.setattr(os, "stat", moving_stat)
    with pytest.raises(TransientDiscoveryError, match="kept changing"):
        read_hostfile(str(path))


def test_main_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hosts"
    path.write_text("b slots=2\na\n")
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "HVD_RESILIENT_HOSTFILE": str(path),
           "HVD_RESILIENT_HOSTFILE_DEFAULT_SLOTS": "4"}
    assert main([], env) == 0
    assert capsys.readouterr().out == "a:4\nb:2\n"


# ---- the executable ----------------------------------------------------------------------

def _run(*args: str, env: dict[str, str] | None = None, cwd: Path,
         python_flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HVD_RESILIENT_")}
    base["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{base.get('PATH', '')}"
    base["XDG_RUNTIME_DIR"] = str(cwd)
    base["HVD_RESILIENT_DISCOVERY_DEADLINE"] = "10"  # a loaded machine must not fail these
    base.update(env or {})
    cmd = [sys.executable, *python_flags, str(SCRIPT)] if python_flags else [str(SCRIPT)]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=20,
                          env=base, cwd=cwd)


def test_executable_reads_a_file_edited_while_running(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node2:4\nnode1:4\n")
    first = _run(str(hosts), cwd=tmp_path)
    assert (first.returncode, first.stdout, first.stderr) == (0, "node1:4\nnode2:4\n", "")
    again = _run(str(hosts), cwd=tmp_path)
    assert again.stdout == first.stdout  # same input, same output
    # An operator adds a host: write a new file and rename it over the old one.
    new = tmp_path / "hosts.new"
    new.write_text("node2:4\nnode1:4\nnode3 slots=2\n")
    os.replace(new, hosts)
    assert _run(str(hosts), cwd=tmp_path).stdout == "node1:4\nnode2:4\nnode3:2\n"


def test_executable_reports_a_bad_line_and_exits_2(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node1:4\nnode2:4\nnode3:0\n")
    proc = _run(cwd=tmp_path, env={"HVD_RESILIENT_HOSTFILE": str(hosts)})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (f"hostfile: line 3: slots must be a positive integer, got '0' "
                           f"({hosts})\n")


def test_executable_refuses_injection_even_with_a_cached_answer(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("node1:1\n")
    assert _run(str(hosts), cwd=tmp_path).returncode == 0
    hosts.write_text("node1:1\n$(reboot):1\n")
    proc = _run(str(hosts), cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "contains '$'" in proc.stderr


def test_executable_works_without_an_installed_package(tmp_path: Path) -> None:
    # -I -S: no site-packages and no PYTHONPATH, so only the script's own fallback (the repo
    # root next to discovery/) can make hvd_resilient importable; cwd is elsewhere.
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=2\n")
    start = time.monotonic()
    proc = _run(str(hosts), cwd=tmp_path, python_flags=("-I", "-S"))
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "node1:2\n", "")
    assert time.monotonic() - start < 2


def test_executable_needs_a_path(tmp_path: Path) -> None:
    proc = _run(cwd=tmp_path)
    assert proc.returncode == 2
    assert "HVD_RESILIENT_HOSTFILE" in proc.stderr and proc.stderr.count("\n") == 1
