"""`--launcher inplace --discovery`: what the fan-out does with each answer of a real discovery
script (`launch/inplace/fanout_discovery.py`), on a fan-out whose agents are recorded, not
started (the whole path, with agents over ssh on namespaced hosts, is
tests/chaos/test_chaos_inplace_discovery.py)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hvd_resilient.errors import CUT_OFF_EXIT_CODE, ConfigError, LaunchError
from hvd_resilient.launch.cli import build_parser, resolve
from hvd_resilient.launch.inplace import fanout
from hvd_resilient.launch.inplace.fanout_discovery import Discovered, first_hosts, trim
from hvd_resilient.launch.inplace.launched import job_code


class Agent:
    """What `Discovered` reads of a launched agent; ``code``: its exit code once it ended."""

    def __init__(self, index: int, host: str, slots: int) -> None:
        self.index, self.host, self.slots = index, host, slots
        self.local, self.removed, self.address = True, False, f"{host}:{1000 + index}"
        self.name = f"host {index} ({host})"
        self.words: list[bytes] = []
        self.code: int | None = None
        self.proc = self

    def poll(self) -> int | None:
        return self.code

    def send(self, data: bytes) -> None:
        self.words.append(data)


class Fanout:
    def __init__(self, script: Path, max_np: int | None, hosts: list[tuple[str, int]]) -> None:
        self.a = argparse.Namespace(discovery=str(script), discovery_interval=1.0,
                                    max_np=max_np, etcd=None, end_grace=30.0)
        self.agents = [Agent(i, h, n) for i, (h, n) in enumerate(hosts)]
        self.told: list[str] = []
        self.started: list[tuple[int, str | None, tuple[str, int]]] = []

    def start_agent(self, index: int, coordinator: str | None, *,
                    late: tuple[str, int] | None = None) -> Any:
        assert late is not None
        self.started.append((index, coordinator, late))
        self.agents.append(Agent(index, *late))
        return self.agents[-1]


@pytest.fixture
def script(tmp_path: Path):
    listed = tmp_path / "hosts.txt"
    path = tmp_path / "discover.sh"
    path.write_text(f"#!/bin/sh\ncat {listed}\n")
    path.chmod(0o755)

    def lists(text: str) -> Path:
        listed.write_text(text)
        return path
    return lists


def discovered(script_path: Path, max_np: int | None = None) -> tuple[Fanout, Discovered]:
    f = Fanout(script_path, max_np, first_hosts(str(script_path), max_np))
    return f, Discovered(f, None)  # type: ignore[arg-type]


def test_the_first_answer_trimmed_to_max_np_in_its_order(script):
    path = script("h1:2\nh2:2\nh3:2\n")
    assert first_hosts(str(path), None) == [("h1", 2), ("h2", 2), ("h3", 2)]
    assert first_hosts(str(path), 5) == [("h1", 2), ("h2", 2), ("h3", 1)]
    assert trim([("a", 4)], 0) == []
    with pytest.raises(LaunchError, match="printed no hosts"):
        first_hosts(str(script("\n")), None)
    with pytest.raises(LaunchError, match="line 1 'a b' is not a host"):
        first_hosts(str(script("a b\n")), None)


def test_a_listed_host_joins_late_told_every_agents_store_and_waits_for_room(script, capsys):
    f, d = discovered(script("h1:2\nh2:2\n"), max_np=5)
    script("h1:2\nh2:2\nh3:2\nh4:2\n")
    d.look()
    # h3 gets the one slot left under --max-np; h4 waits (said once)
    assert f.started == [(2, "h1:1000,h2:1001", ("h3", 1))]
    d.look()
    assert len(f.started) == 1
    assert capsys.readouterr().err.count("h4 waits: --max-np 5 slots are taken") == 1
    # h2 dropped: told to leave; its slots count until its agent has exited
    script("h1:2\nh3:2\nh4:2\n")
    d.look()
    assert f.agents[1].removed and f.agents[1].words == [b"LEAVE\n"]
    assert len(f.started) == 1
    f.agents[1].code = CUT_OFF_EXIT_CODE
    d._reap(0.0)
    d.look()
    assert f.started[-1] == (3, "h1:1000,h3:1002", ("h4", 2))


def test_a_host_whose_agent_ended_is_started_again_only_once_dropped_and_listed(script):
    f, d = discovered(script("h1:2\nh2:2\n"))
    f.agents[1].code = -9  # lost while listed
    d._reap(0.0)
    assert d.ending_at is None  # a host lost is no end of the job
    d.look()
    assert f.started == []
    script("h1:2\n")
    d.look()
    script("h1:2\nh2:2\n")
    d.look()
    assert f.started == [(2, "h1:1000", ("h2", 2))]


def test_no_hosts_or_a_failing_script_changes_nothing(script, tmp_path, capsys):
    f, d = discovered(script("h1:2\nh2:2\n"))
    script("")
    d.look()
    d.look()
    assert not any(a.removed for a in f.agents)
    d.script = str(tmp_path / "missing.sh")
    d.look()
    err = capsys.readouterr().err
    assert err.count("printed no hosts; the hosts stay as they are") == 1
    assert "could not run" in err and not any(a.removed for a in f.agents)


def test_the_jobs_code_leaves_out_hosts_told_to_leave_and_cut_off_ones():
    assert job_code([CUT_OFF_EXIT_CODE, 0]) == 0
    assert job_code([CUT_OFF_EXIT_CODE, 1, 137]) == 1
    assert job_code([137, CUT_OFF_EXIT_CODE]) == CUT_OFF_EXIT_CODE
    assert job_code([]) == 1


def test_the_launcher_passes_discovery_and_max_np_and_refuses_them_with_hosts(script):
    path = script("h1:2\n")

    def command(*flags: str) -> list[str]:
        opts, launcher = resolve(build_parser().parse_args(
            ["--launcher", "inplace", *flags, "--", "python", "t.py"]))
        cmd: list[str] = launcher.command(opts, ["A"])
        return cmd

    # --np not given: its default (2) does not refuse --min-np 4 (the hosts' slots are the size)
    cmd = command("--discovery", str(path), "--max-np", "16", "--min-np", "4")
    assert cmd[:3] == [sys.executable, "-m", "hvd_resilient.launch.inplace.fanout"]
    assert cmd[3:7] == ["--discovery", str(path), "--max-np", "16"] and "--hosts" not in cmd
    assert cmd[cmd.index("--min-np") + 1] == "4"
    with pytest.raises(ConfigError, match="give --hosts or --discovery, not both"):
        command("--discovery", str(path), "--hosts", "h1:2")
    with pytest.raises(ConfigError, match="--max-np caps the hosts a discovery script adds"):
        command("--hosts", "h1:2,h2:2", "--max-np", "4")


def test_the_fanout_refuses_a_loopback_name_among_the_first_hosts(script):
    r = subprocess.run([sys.executable, "-m", fanout.__name__, "--discovery",
                        str(script("localhost:2\nh2:2\n")), "--", "true"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].endswith(
        "lists localhost, which means each host itself; list this machine by an address the "
        "other hosts reach"), r.stderr


def test_one_agents_own_failure_is_no_end_of_the_job_most_agents_ending_is(script):
    f, d = discovered(script("h1:2\nh2:2\nh3:2\n"))
    f.agents[1].code = 1  # one follower's own failure: its host only
    d._reap(0.0)
    assert d.ending_at is None
    f.agents[0].code = f.agents[2].code = 1  # the coordinator's end reaches every agent
    d._reap(1.0)
    assert d.ending_at == 1.0 + f.a.end_grace
    f, d = discovered(script("h1:2\nh2:2\nh3:2\n"))
    f.agents[2].code = 0  # finished: the job is over
    d._reap(0.0)
    assert d.ending_at is not None
