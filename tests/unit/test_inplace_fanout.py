"""`--launcher inplace --hosts`: the fan-out (`launch/inplace/fanout.py`) run for real, against a
fake agent (`tests/scripts/fake_inplace_agent.py`, through the fan-out's test hook) on two hosts
that are both this machine, so that no ssh is involved; and the launcher's command line."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import psutil
import pytest

from hvd_resilient.errors import ConfigError
from hvd_resilient.launch.cli import build_parser, resolve
from hvd_resilient.launch.inplace import fanout, launched
from tests.support.jobs import wait_for
from tests.support.paths import ROOT

HOSTS = "127.0.0.1:2,localhost:1"
SECRET = "s3cr3t-not-on-any-command-line"
WAIT_S = 30.0


class Lines:
    """A stream's lines as they come, read by a thread: every wait on them has a timeout."""

    def __init__(self, stream: IO[str]) -> None:
        self.seen: list[str] = []
        self._q: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, *wanted: str) -> None:
        missing = set(wanted) - set(self.seen)
        while missing:
            line = self._q.get(timeout=WAIT_S)
            assert line is not None, f"output ended without {missing}: {self.seen}"
            self.seen.append(line)
            missing.discard(line)

    def rest(self) -> list[str]:
        """Every line, once the stream has ended."""
        self._thread.join(timeout=WAIT_S)
        while not self._q.empty():
            line = self._q.get_nowait()
            if line is not None:
                self.seen.append(line)
        return self.seen


@dataclasses.dataclass
class Run:
    proc: subprocess.Popen[str]
    out: Lines
    err: Lines
    records: Path
    marker: str
    cmd: list[str]

    def record(self, index: int) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.records / f"agent-{index}.json").read_text())
        return data

    def finish(self) -> int:
        return self.proc.wait(timeout=WAIT_S)


def _ours(marker: str) -> list[psutil.Process]:
    """The processes of one test: the marker is a word of the worker command they all carry."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        if marker in (p.info["cmdline"] or []):
            found.append(p)
    return found


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    runs: list[Run] = []

    def _start(*extra: str, mode: str = "") -> Run:
        marker = str(tmp_path / f"marker-{len(runs)}")
        env = {**os.environ, fanout.AGENT_MODULE_ENV: "tests.scripts.fake_inplace_agent",
               "FAKE_AGENT_RECORDS": str(tmp_path), "FAKE_AGENT_MODE": mode,
               "HVD_RESILIENT_FAKE_SECRET": SECRET, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "hvd_resilient.launch.inplace.fanout", "--hosts", HOSTS,
               "--min-np", "2", "--standby", "1", "--env-names", "HVD_RESILIENT_FAKE_SECRET",
               *extra, "--", "true", marker]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stderr is not None
        runs.append(Run(proc, Lines(proc.stdout), Lines(proc.stderr), tmp_path, marker, cmd))
        return runs[-1]

    yield _start
    for run in runs:
        for p in _ours(run.marker):
            p.kill()
        run.proc.wait(timeout=WAIT_S)


def test_host0_starts_first_and_the_others_get_its_address_and_the_env_on_stdin(start):
    run = start()
    run.out.wait_for("fake agent 0 ready", "fake agent 1 ready")
    # to the group, as `hvd-resilient run` sends it: the agents, in sessions of their own,
    # get it only as a line (the fake would die of the signal itself, and record nothing)
    os.killpg(run.proc.pid, signal.SIGTERM)
    assert run.finish() == 143  # host 0's (host 1 exits 153)
    first, second = run.record(0), run.record(1)
    assert first["printed_ns"] < second["started_ns"]
    argv0, argv1 = first["argv"][1:], second["argv"][1:]
    assert "--coordinator" not in argv0
    assert argv1[argv1.index("--coordinator") + 1] == first["address"]
    assert first["address"].startswith("127.0.0.1:")
    for argv, index, host, slots in ((argv0, 0, "127.0.0.1", 2), (argv1, 1, "localhost", 1)):
        assert argv[:8] == ["--nproc", str(slots), "--min-np", "2", "--standby", "1",
                            "--host-index", str(index)]
        assert argv[8:] == ["--hosts-count", "2", "--job-nproc", "3", "--address", host, *(
            ["--coordinator", first["address"]] if index else []), "--control-stdin", "--",
            "true", run.marker]
    for rec in (first, second):
        assert rec["env"]["HVD_RESILIENT_FAKE_SECRET"] == SECRET
        assert rec["env"]["PYTHONPATH"] == str(ROOT) and rec["env"]["PATH"]
        assert not any(SECRET in word for word in rec["argv"])
        assert rec["words"] == ["TERM"]
    assert not any(SECRET in word for word in run.cmd)  # names only: --env-names
    out = run.out.rest()
    assert not any(line.startswith(launched.COORDINATOR_LINE) for line in out), out
    assert run.err.rest() == []
    assert _ours(run.marker) == []


def test_int_reaches_every_agent_as_int(start):
    run = start()
    run.out.wait_for("fake agent 0 ready", "fake agent 1 ready")
    run.proc.send_signal(signal.SIGINT)
    assert run.finish() == 130
    assert run.record(0)["words"] == run.record(1)["words"] == ["INT"]


def test_a_sigkilled_fanout_leaves_no_agent_each_ends_on_eof(start):
    """SIGKILL runs no handler and sends no word; the agents, in sessions of their own, are not
    killed with the fan-out either. The kernel closes their stdin, and EOF ends each (across
    hosts sshd forwards the same EOF, and nothing else ends a remote agent:
    tests/chaos/test_chaos_inplace_launch.py)."""
    run = start()
    run.out.wait_for("fake agent 0 ready", "fake agent 1 ready")
    run.proc.kill()
    assert run.finish() == -signal.SIGKILL
    wait_for(lambda: run.record(0)["eof"] and run.record(1)["eof"], WAIT_S, "EOF on both")
    assert run.record(0)["words"] == run.record(1)["words"] == []
    wait_for(lambda: not _ours(run.marker), WAIT_S, "both agents gone")


def test_the_exit_code_is_host0s_and_a_host_left_running_gets_eof(start):
    run = start("--end-grace", "0.2", mode="exit")
    run.out.wait_for("fake agent 0 ready", "fake agent 1 ready")
    assert run.finish() == 7
    assert run.record(1)["eof"] and run.record(1)["words"] == []
    err = run.err.rest()
    assert len(err) == 1 and "host 1 (localhost): agent still running 0.2 s after" in err[0]
    assert _ours(run.marker) == []


@pytest.mark.parametrize("mode, says", [
    ("silent", "printed no coordinator address within 1 s"),
    ("die", "exited with code 3 before printing its address"),
])
def test_a_coordinator_without_an_address_is_one_line_exit_1_and_nothing_left(start, mode,
                                                                               says):
    run = start("--start-timeout", "1", mode=mode)
    assert run.finish() == 1
    err = run.err.rest()
    assert err == [f"hvd-resilient: error: in-place agent of host 0 (127.0.0.1), the "
                   f"coordinator, {says}; check its output above, and that `{sys.executable} "
                   f"-m tests.scripts.fake_inplace_agent` runs here; nothing else was started"]
    assert not (run.records / "agent-1.json").exists()
    if mode == "silent":
        assert run.record(0)["eof"]  # ended through its stdin
    assert _ours(run.marker) == []


def test_a_stop_before_the_coordinator_printed_its_address_is_no_failure_to_start(start):
    run = start(mode="silent")
    run.out.wait_for("fake agent 0 silent")  # its output before the address is passed on
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 143
    assert run.record(0)["words"] == ["TERM"]
    assert not (run.records / "agent-1.json").exists()
    assert run.err.rest() == []
    assert _ours(run.marker) == []


def test_a_remote_agent_runs_over_ssh_in_this_directory_every_word_quoted(monkeypatch,
                                                                          tmp_path):
    odd = tmp_path / "a dir; with 'quotes'"
    odd.mkdir()
    monkeypatch.chdir(odd)
    monkeypatch.setattr(fanout, "require", lambda exe, hint: f"/usr/bin/{exe}")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    args = ["--nproc", "2", "--", "python", "t.py", "$HOME"]
    cmd = fanout.agent_command("h2", args, local=False, ssh_port=2222)
    n = 6 + len(launched.SSH_ALIVE)
    assert cmd[:n] == ["/usr/bin/ssh", "-p", "2222", "-o", "BatchMode=yes", *launched.SSH_ALIVE,
                       "h2"]
    assert shlex.split(cmd[n]) == ["cd", str(odd), "&&", "exec", sys.executable, "-m",
                                   fanout.AGENT_MODULE, *args]
    assert fanout.agent_command("h2", args, local=True, ssh_port=22) == [
        sys.executable, "-m", fanout.AGENT_MODULE, *args]
    monkeypatch.setenv("PYTHONPATH", "/src dir")  # the agent's own imports: before its stdin
    assert shlex.split(fanout.agent_command("h2", args, local=False, ssh_port=22)[n])[3:6] == [
        "exec", "env", "PYTHONPATH=/src dir"]


def command(*argv: str) -> tuple[Any, Any]:
    return resolve(build_parser().parse_args([*argv, "--", "python", "t.py"]))


def test_the_launcher_with_hosts_builds_the_fanout_and_refuses_np_over_the_slots():
    opts, launcher = command("--launcher", "inplace", "--hosts", "a:2,b:2", "--ssh-port", "2222",
                             "--min-np", "3", "--np", "4", "--replace")
    cmd = launcher.command(opts, ["HVD_RESILIENT_X", "AWS_SECRET_ACCESS_KEY"])
    assert cmd[:3] == [sys.executable, "-m", "hvd_resilient.launch.inplace.fanout"]
    assert cmd[3:] == ["--hosts", "a:2,b:2", "--ssh-port", "2222", "--min-np", "3",
                       "--replace", "--env-names", "AWS_SECRET_ACCESS_KEY,HVD_RESILIENT_X",
                       "--die-with-parent", "--", sys.executable, "t.py"]
    opts, launcher = command("--launcher", "inplace", "--hosts", "a:2,b:2")  # --np not given
    assert "--min-np" not in launcher.command(opts, [])
    with pytest.raises(ConfigError) as e:
        launcher.check(dataclasses.replace(opts, np=5))
    assert str(e.value) == "run: --np 5 is more than the 4 slots in --hosts a:2,b:2"
    with pytest.raises(ConfigError, match=r"^run: --np 5 is more than the 4 slots"):
        command("--launcher", "inplace", "--hosts", "a:2,b:2", "--np", "5")
    opts, launcher = command("--launcher", "inplace", "--np", "3")  # one machine: as before
    assert "-m hvd_resilient.launch.inplace_agent --nproc 3 --min-np 1 --" in " ".join(
        launcher.command(opts, []))


def test_with_etcd_no_agent_is_given_a_coordinator_and_each_launch_has_its_own_keys():
    a = fanout.parse(["--hosts", "a:2,b:1", "--etcd", "http://e1:2379,http://e2:2379",
                      "--", "python", "t.py"])
    b = fanout.parse(["--hosts", "a:2,b:1", "--etcd", "http://e1:2379", "--", "python", "t.py"])
    assert a.job and b.job and a.job != b.job  # a relaunch starts from generation 0 again
    hosts = [("a", 2), ("b", 1)]
    args = fanout.agent_args(a, 1, hosts, "a:1234")
    assert "--coordinator" not in args
    assert args[args.index("--etcd") + 1] == "http://e1:2379,http://e2:2379"
    assert args[args.index("--job") + 1] == a.job
    assert args[args.index("--job-nproc") + 1] == "3"
    with pytest.raises(ConfigError, match="--etcd entry 'e1:2379' must look like"):
        opts, launcher = resolve(build_parser().parse_args(
            ["--launcher", "inplace", "--hosts", "a:1,b:1", "--etcd", "e1:2379", "--", "t"]))
        launcher.check(opts)
    with pytest.raises(ConfigError, match="--etcd applies with --hosts"):
        opts, launcher = resolve(build_parser().parse_args(
            ["--launcher", "inplace", "--etcd", "http://e1:2379", "--", "t"]))
        launcher.check(opts)
