"""discovery/slurm: hostlist expansion, task counts, the scontrol fallback, the executable."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_resilient.discovery.errors import DiscoveryError
from hvd_resilient.discovery.hostlist import MAX_HOSTS, HostlistError, expand_hostlist
from hvd_resilient.discovery.slurm import main, parse_tasks_per_node, slurm_hosts
from tests.support.paths import ROOT

SCRIPT = ROOT / "discovery" / "slurm"

EXPANSIONS = [
    ("node1", ["node1"]),
    ("node1,node2", ["node1", "node2"]),
    ("node[1-3]", ["node1", "node2", "node3"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("node[08-11]", ["node08", "node09", "node10", "node11"]),
    ("node[8-11]", ["node8", "node9", "node10", "node11"]),
    ("node[001-002]", ["node001", "node002"]),
    ("node[5]", ["node5"]),
    ("gpu-[1-2]", ["gpu-1", "gpu-2"]),
    ("node[01-04,07],gpu-[1-2]",
     ["node01", "node02", "node03", "node04", "node07", "gpu-1", "gpu-2"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("r[1-2]n[01-02]-ib", ["r1n01-ib", "r1n02-ib", "r2n01-ib", "r2n02-ib"]),
    ("node[1-2]-ib,login", ["node1-ib", "node2-ib", "login"]),
    ("a[3,1,2]", ["a3", "a1", "a2"]),  # Slurm's order is kept: it pairs with task counts
    ("[1-2]", ["1", "2"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
]

BAD_HOSTLISTS = [
    ("", "empty hostlist"),
    ("node[1-3", "unclosed '['"),
    ("node1-3]", "unmatched ']'"),
    ("node[1-[2]]", "nested '['"),
    ("node[3-1]", "runs backwards"),
    ("node[a-b]", "bad range"),
    ("node[]", "bad range"),
    ("node[1-2:2]", "bad range"),
    ("node[-1]", "bad range"),
    ("a,,b", "empty host expression"),
    ("node[1-99999999]", f"more than {MAX_HOSTS}"),
    ("a[1-300]b[1-300]", f"more than {MAX_HOSTS}"),
]

TASKS = [
    ("4", [4]),
    ("2(x3)", [2, 2, 2]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("8,4(x2),1", [8, 4, 4, 1]),
    ("1(x1)", [1]),
]

BAD_TASKS = ["", "0", "2(x0)", "2x3", "2(3)", "a", "2(x3),", "-1"]


@pytest.mark.parametrize(("expr", "expected"), EXPANSIONS, ids=[e[0] or "empty" for e in
                                                                 EXPANSIONS])
def test_expand_hostlist(expr: str, expected: list[str]) -> None:
    assert expand_hostlist(expr) == expected


@pytest.mark.parametrize(("expr", "fragment"), BAD_HOSTLISTS,
                         ids=[b[0] or "empty" for b in BAD_HOSTLISTS])
def test_expand_hostlist_refuses(expr: str, fragment: str) -> None:
    with pytest.raises(HostlistError) as info:
        expand_hostlist(expr)
    assert fragment in str(info.value)


@pytest.mark.parametrize(("text", "expected"), TASKS)
def test_tasks_per_node(text: str, expected: list[int]) -> None:
    assert parse_tasks_per_node(text) == expected


@pytest.mark.parametrize("text", BAD_TASKS)
def test_tasks_per_node_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        parse_tasks_per_node(text)


def test_hosts_pair_with_task_counts_in_slurm_order() -> None:
    hosts = slurm_hosts("node[01-03],gpu-1", tasks_per_node="2(x3),1", slots=None)
    assert hosts == {"node01": 2, "node02": 2, "node03": 2, "gpu-1": 1}
    hosts = slurm_hosts("b,a", tasks_per_node="1,4", slots=None)
    assert hosts == {"b": 1, "a": 4}


def test_slots_override_task_counts() -> None:
    assert slurm_hosts("n[1-2]", tasks_per_node="7(x2)", slots=4) == {"n1": 4, "n2": 4}
    assert slurm_hosts("n[1-2]", tasks_per_node=None, slots=4) == {"n1": 4, "n2": 4}


@pytest.mark.parametrize(("nodelist", "tasks", "fragment"), [
    ("n[1-3]", "2(x2)", "gives 2 counts for 3 nodes"),
    ("n[1-2]", None, "SLURM_TASKS_PER_NODE is not set"),
    ("n[1-2]", "2(x", "cannot read '2(x'"),
    ("n1,n1", "1(x2)", "lists 'n1' twice"),
    ("a;rm[1-2]", "1(x2)", "contains ';'"),
    ("$(reboot)", "1", "contains '$'"),
    ("host name", "1", "contains ' '"),
    ("node1 node2", "1", "contains ' '"),
    ("-oProxyCommand=x", "1", "contains '='"),
    ("n[1-2", "1(x2)", "scontrol is not available"),
])
def test_slurm_hosts_refuses(nodelist: str, tasks: str | None, fragment: str) -> None:
    with pytest.raises(DiscoveryError) as info:
        slurm_hosts(nodelist, tasks_per_node=tasks, slots=None, scontrol=None)
    assert fragment in str(info.value)


def _fake_scontrol(tmp_path: Path, body: str) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    path = bindir / "scontrol"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_scontrol_fallback_only_when_native_parsing_fails(tmp_path: Path) -> None:
    marker = tmp_path / "called"
    scontrol = _fake_scontrol(
        tmp_path, f'echo "$@" > {marker}\nprintf "weird1\\nweird2\\n"')
    # Native parsing works: scontrol is never run.
    assert slurm_hosts("n[1-2]", tasks_per_node="1(x2)", slots=None,
                       scontrol=str(scontrol)) == {"n1": 1, "n2": 1}
    assert not marker.exists()
    # Native parsing fails: scontrol expands it.
    hosts = slurm_hosts("weird{1..2}[", tasks_per_node="3(x2)", slots=None,
                        scontrol=str(scontrol), timeout=5)
    assert hosts == {"weird1": 3, "weird2": 3}
    assert marker.read_text().split() == ["show", "hostnames", "weird{1..2}["]


def test_scontrol_output_is_validated_too(tmp_path: Path) -> None:
    scontrol = _fake_scontrol(tmp_path, 'printf "ok1\\nbad;host\\n"')
    with pytest.raises(DiscoveryError, match="contains ';'"):
        slurm_hosts("x[", tasks_per_node="1(x2)", slots=None, scontrol=str(scontrol),
                    timeout=5)


def test_scontrol_failure_is_reported(tmp_path: Path) -> None:
    scontrol = _fake_scontrol(tmp_path, 'echo "scontrol: error: Invalid hostlist" >&2\nexit 1')
    with pytest.raises(DiscoveryError, match="Invalid hostlist"):
        slurm_hosts("x[", tasks_per_node="1", slots=None, scontrol=str(scontrol), timeout=5)


def test_main_reads_the_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path), "PATH": "",
           "SLURM_NODELIST": "c[2,1]", "SLURM_TASKS_PER_NODE": "4,2"}
    assert main([], env) == 0
    assert capsys.readouterr().out == "c1:2\nc2:4\n"
    env["SLURM_JOB_NODELIST"] = "d[1-2]"  # preferred over the older SLURM_NODELIST
    env["HVD_RESILIENT_SLURM_SLOTS"] = "8"
    assert main([], env) == 0
    assert capsys.readouterr().out == "d1:8\nd2:8\n"


def test_main_outside_slurm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([], {"XDG_RUNTIME_DIR": str(tmp_path)}) == 2
    assert "SLURM_JOB_NODELIST is not set" in capsys.readouterr().err


def _run(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("HVD_RESILIENT_", "SLURM_"))}
    base["PATH"] = f"{cwd / 'bin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}" \
                   f"{base.get('PATH', '')}"
    base["XDG_RUNTIME_DIR"] = str(cwd)
    base["HVD_RESILIENT_DISCOVERY_DEADLINE"] = "10"  # a loaded machine must not fail these
    base.update(env)
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=20,
                          env=base, cwd=cwd)


def test_executable(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[01-04,07],gpu-[1-2]",
           "SLURM_TASKS_PER_NODE": "2(x3),1(x4)"}
    proc = _run(env, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ("gpu-1:1\ngpu-2:1\nnode01:2\nnode02:2\nnode03:2\nnode04:1\n"
                           "node07:1\n")
    assert proc.stderr == ""
    assert _run(env, tmp_path, "--slots", "4").stdout.count(":4\n") == 7


def test_executable_falls_back_to_scontrol_on_path(tmp_path: Path) -> None:
    _fake_scontrol(tmp_path, 'printf "x1\\nx2\\n"')
    proc = _run({"SLURM_JOB_NODELIST": "x[1-2", "SLURM_TASKS_PER_NODE": "1(x2)"}, tmp_path)
    assert (proc.returncode, proc.stdout) == (0, "x1:1\nx2:1\n"), proc.stderr


def test_executable_refuses_malicious_nodelist(tmp_path: Path) -> None:
    proc = _run({"SLURM_JOB_NODELIST": "a;rm -rf /", "SLURM_TASKS_PER_NODE": "1"}, tmp_path)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith("slurm: nodelist 'a;rm -rf /': hostname 'a;rm -rf /' "
                                  "contains ';'")
