"""`--launcher inplace --hosts h1:2,h2:2`: one in-place agent per host, host 0's first.

    python -m hvd_resilient.launch.inplace.fanout --hosts h1:2,h2:2 [--ssh-port P]
        [--min-np M] [--last-call S] [--replace] [--standby K] [--etcd URL,...]
        [--env-names A,B] [--die-with-parent] -- CMD...

(or `--discovery SCRIPT [--max-np N]` in place of --hosts: the hosts follow the script's answers
as the job trains, `fanout_discovery.py`).

Host 0's agent coordinates (it hosts the store and decides the generations), so it starts
first, and the others are only started once it has printed where its store listens
(`hvd-resilient-coordinator HOST:PORT`, one line on its stdout): each of them is given that
address (`--coordinator`). A host is started without ssh when its name is an address of this
machine (`hosts.is_local`, the rule the reachability probe uses), else through
`ssh -o BatchMode=yes`, in this directory with this interpreter (the hosts share the
filesystem, as horovodrun assumes).

Every agent runs with `--control-stdin`, and its stdin is a pipe held by this process for as
long as it runs:

* the first line is the environment the agent and its workers get, as JSON: the variables the
  launch forwards (`--env-names`, names only on this command line) and PYTHONPATH, PATH and
  VIRTUAL_ENV. It crosses ssh there rather than on a command line, where `ps` on either side
  would show credentials; it is never logged.
* a SIGTERM or SIGINT to this process becomes a `TERM` or `INT` line to every agent, which
  passes the signal on to its workers (their final checkpoint). Killing ssh instead would cut
  the remote workers off without one. The agents run in sessions of their own, so a signal to
  this process's group (as `hvd-resilient run` sends it) reaches them only this way.
* EOF: this process is gone (however it ended); each agent ends its workers and exits.

The job's exit code is host 0's agent's when it ends on its own; once it has, the others get
`--end-grace` seconds to end, then their stdin is closed. Host 0's agent killed (or its ssh
ending 255, or its agent stopping itself cut off from the others, exit 79): the next host's
agent coordinates (`inplace.embedded`), and the job's code is the one the others end with.

With `--etcd` no agent coordinates: every agent gets the etcd endpoints and a fresh folder of
keys for this launch (`--job`), host 0 still starts first (its line says it is up), and any
host may be lost while the job goes on, so every agent is waited for and the job's code is the
one the survivors end with (`_wait_agreed`).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shlex
import signal
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from types import FrameType

from hvd_resilient.cli_errors import exit_on_error
from hvd_resilient.die_with_parent import die_with_parent
from hvd_resilient.errors import CUT_OFF_EXIT_CODE, ConfigError
from hvd_resilient.launch.executables import require
from hvd_resilient.launch.hosts import hosts_arg, is_local, is_loopback, parse_hosts
from hvd_resilient.launch.inplace.launched import (
    END_WAIT_S,
    SSH_ALIVE,
    SSH_FAILED,
    LaunchedAgent,
    Passthrough,
    end,
    exit_code,
    job_code,
    say,
)

AGENT_MODULE = "hvd_resilient.launch.inplace_agent"
AGENT_MODULE_ENV = "HVD_RESILIENT_INPLACE_AGENT_MODULE"
"""Test hook, and read only by `agent_module`: the module run in place of the agent
(`tests/scripts/fake_inplace_agent.py` in `tests/unit/test_inplace_fanout.py`). Never set it
for a real job."""
CARRIED = ("PYTHONPATH", "PATH", "VIRTUAL_ENV")
"""Sent to every agent beyond the launch's own names: the same interpreter and packages."""
STOPS = {signal.SIGTERM: "TERM", signal.SIGINT: "INT"}
PASS_JOIN_S = 5.0
"""How long host 0's last output lines may take once its agent has exited."""


def worker_command(words: list[str]) -> list[str]:
    """The worker command after ``--``, as the fan-out and the agent both take it."""
    cmd = words[1:] if words[:1] == ["--"] else words
    if not cmd:
        raise ConfigError("no worker command: put it after --, e.g. -- python train.py")
    return cmd


def agent_module() -> str:
    """The one place the test hook is read."""
    return os.environ.get(AGENT_MODULE_ENV) or AGENT_MODULE


def agent_args(a: argparse.Namespace, index: int, hosts: list[tuple[str, int]],
               coordinator: str | None, *, late: tuple[str, int] | None = None) -> list[str]:
    """The agent's options on host ``index``: its own slots as --nproc; the job's sizes (those
    of the first ``hosts``). ``late``: a host a discovery script added to the running job, and
    its slots (its index comes after every one before it; ``coordinator`` lists every agent's
    store, the coordinating one among them)."""
    host, slots = late or hosts[index]
    return ["--nproc", str(slots),
            *(["--min-np", str(a.min_np)] if a.min_np is not None else []),
            *(["--last-call", f"{a.last_call:g}"] if a.last_call is not None else []),
            *(["--replace"] if a.replace else []),
            *(["--standby", str(a.standby)] if a.standby else []),
            *(["--joins"] if a.discovery else []), *(["--late"] if late else []),
            "--host-index", str(index), "--hosts-count", str(max(len(hosts), index + 1)),
            "--job-nproc", str(sum(n for _, n in hosts)), "--address", host,
            *(["--etcd", a.etcd, "--job", a.job] if a.etcd else
              ["--coordinator", coordinator] if coordinator else []),
            "--control-stdin", "--", *a.cmd]


def agent_command(host: str, args: list[str], *, local: bool, ssh_port: int) -> list[str]:
    """This interpreter running the agent: here, or in this directory on ``host`` over ssh
    (every word quoted: the remote shell reads them)."""
    here = [sys.executable, "-m", agent_module(), *args]
    if local:
        return here
    # the agent's own imports happen before its stdin is read: the one variable that decides
    # which code they find travels on the command line (a path, never a secret)
    path = os.environ.get("PYTHONPATH")
    remote = (f"cd {shlex.quote(os.getcwd())} && exec "
              f"{shlex.join([*(['env', f'PYTHONPATH={path}'] if path else []), *here])}")
    return [require("ssh", "install an ssh client (apt-get install openssh-client)"),
            "-p", str(ssh_port), "-o", "BatchMode=yes", *SSH_ALIVE, host, remote]


def environment_line(names: Sequence[str]) -> bytes:
    """The agents' environment, the first line of their stdin: never on a command line."""
    env = {n: os.environ[n] for n in (*names, *CARRIED) if n in os.environ}
    return (json.dumps(env) + "\n").encode()


class Fanout:
    """The agents of one job, host 0's first, and what this process tells them."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.hosts = parse_hosts(a.hosts)
        self.env_line = environment_line([n for n in a.env_names.split(",") if n])
        self.agents: list[LaunchedAgent] = []
        self.told: list[str] = []

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        """Passed on as a line to every agent: each stops its workers gracefully."""
        word = STOPS[signal.Signals(signum)]
        self.told.append(word)
        for agent in self.agents:
            agent.catch_up(self.told)

    def run(self) -> int:
        for sig in STOPS:
            signal.signal(sig, self._on_signal)
        try:
            return self._run()
        except BaseException:
            end(self.agents)
            raise

    def start_agent(self, index: int, coordinator: str | None, *,
               late: tuple[str, int] | None = None) -> LaunchedAgent:
        host, slots = late or self.hosts[index]
        local = is_local(host)
        cmd = agent_command(host, agent_args(self.a, index, self.hosts, coordinator, late=late),
                            local=local, ssh_port=self.a.ssh_port)
        capture = index == 0 or bool(self.a.discovery)  # (every agent's address, to join)
        agent = LaunchedAgent(index, host, cmd, local=local, capture=capture, slots=slots)
        agent.send(self.env_line)
        agent.ready = True
        self.agents.append(agent)
        agent.catch_up(self.told)  # a signal that came while it was being started
        if index and capture:
            assert agent.proc.stdout is not None
            Passthrough(agent.proc.stdout, agent)
        return agent

    def _run(self) -> int:
        if self.told:  # stopped before anything started
            return 128 + next(s for s, w in STOPS.items() if w == self.told[0])
        host0 = self.start_agent(0, None)
        assert host0.proc.stdout is not None
        out = Passthrough(host0.proc.stdout, host0)
        try:
            address = out.address.get(timeout=self.a.start_timeout)
        except queue.Empty:
            address, why = None, (f"printed no coordinator address within "
                                  f"{self.a.start_timeout:g} s")
        else:
            why = "" if address else self._why_no_address(host0)
        if not address:
            end(self.agents)
            if self.told:  # stopped while starting: not a failure to start
                return exit_code(host0.proc.wait())
            say(f"error: in-place agent of {host0.name}, the coordinator, {why}; "
                 f"{self._what_to_check(host0)}; nothing else was started")
            return 1
        try:
            for index in range(1, len(self.hosts)):
                if self.told:
                    break
                self.start_agent(index, address)
        except OSError as e:
            end(self.agents)
            say(f"error: cannot start the in-place agent of host {index} "
                 f"({self.hosts[index][0]}): {e}; every agent started was ended")
            return 1
        if self.a.discovery:
            from hvd_resilient.launch.inplace.fanout_discovery import Discovered

            return Discovered(self, out).supervise()
        return self._wait(host0, out)

    def _why_no_address(self, host0: LaunchedAgent) -> str:
        code = host0.wait(END_WAIT_S)
        if code is None:
            return "closed its output without printing its address"
        if not host0.local and code == SSH_FAILED:
            return "could not be reached: ssh failed (exit 255)"
        return f"exited with code {exit_code(code)} before printing its address"

    def _what_to_check(self, host0: LaunchedAgent) -> str:
        run = f"{sys.executable} -m {agent_module()}"
        if host0.local:
            return f"check its output above, and that `{run}` runs here"
        return (f"check its output above, that `ssh -p {self.a.ssh_port} {host0.host}` logs "
                f"in without a password, and that `{run}` runs there in {os.getcwd()} (the "
                "hosts share the filesystem)")

    def _wait(self, host0: LaunchedAgent, out: Passthrough) -> int:
        """Host 0's exit code, once every agent has ended; the others' own exits say nothing
        of the job (host 0 decides it), beyond an ssh that failed. With etcd no host decides
        alone: `_wait_agreed`."""
        if self.a.etcd:
            return self._wait_agreed(out)
        watchers = [threading.Thread(target=self._watch, args=(a,), daemon=True)
                    for a in self.agents[1:] if not a.local]
        for w in watchers:
            w.start()
        code = host0.proc.wait()
        if len(self.agents) > 1 and (code < 0 or code == CUT_OFF_EXIT_CODE
                                     or (not host0.local and code == SSH_FAILED)):
            # its agent died, stopped itself cut off, or its ssh ended: the others' agents
            # carry on under the next one (or stop too, when they are no majority)
            how = ("stopped itself, cut off from the others" if code == CUT_OFF_EXIT_CODE
                   else f"is gone ({'ssh ' if not host0.local else ''}exit {exit_code(code)})")
            say(f"{host0.name}'s agent {how}: the next host's agent coordinates, the job goes "
                 "on")
            return self._wait_agreed(out, quiet=True)
        out.thread.join(timeout=PASS_JOIN_S)
        self._let_others_end()
        end(self.agents)  # every one has exited by now: only their pipes are closed
        if not host0.local and code == SSH_FAILED:
            say(f"error: ssh to {host0.name}, the coordinator, ended with 255: the "
                 "connection was lost or ssh failed, and its agent's exit code is not known")
            return 1
        return exit_code(code)

    def _wait_agreed(self, out: Passthrough, *, quiet: bool = False) -> int:
        """With etcd any host may be lost and the job go on: every agent is waited for, and
        the job's code is the one the survivors ended with (they all end with the leader's
        decision): `job_code`, as with a discovery script. A cut-off host's "the others go on"
        is not the job's code when the others ended with one of their own."""
        codes = []
        for agent in self.agents:
            code = agent.proc.wait()
            if not agent.local and code == SSH_FAILED:
                if not quiet:  # (said as it happened)
                    say(f"ssh to {agent.name} ended with 255: the connection was lost or "
                         "ssh failed; its workers are gone from the job")
                continue
            codes.append(exit_code(code))
        out.thread.join(timeout=PASS_JOIN_S)
        end(self.agents)
        return job_code(codes)

    def _watch(self, agent: LaunchedAgent) -> None:
        if agent.proc.wait() == SSH_FAILED:
            say(f"ssh to {agent.name} ended with 255: the connection was lost or ssh "
                 "failed; its workers are gone from the job")

    def _let_others_end(self) -> None:
        """Host 0's agent has ended: the others lose their coordinator and end; any that has
        not within --end-grace is told so by EOF on its stdin."""
        deadline = time.monotonic() + self.a.end_grace
        late = [a for a in self.agents[1:] if a.wait(deadline - time.monotonic()) is None]
        if late:
            say(f"{', '.join(a.name for a in late)}: agent still running "
                 f"{self.a.end_grace:g} s after the coordinator's ended; closing its stdin")
            end(late)


def parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hvd_resilient.launch.inplace.fanout",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", default=None, help="host:slots,...; the first coordinates")
    p.add_argument("--discovery", default=None, metavar="SCRIPT",
                   help="host-discovery executable (host:slots lines): the hosts follow its "
                        "answers (in place of --hosts)")
    p.add_argument("--discovery-interval", type=float, default=1.0,
                   help="seconds between two calls of --discovery")
    p.add_argument("--max-np", type=int, default=None,
                   help="with --discovery: the slots of the hosts run never pass this")
    p.add_argument("--ssh-port", type=int, default=22)
    p.add_argument("--min-np", type=int, default=None, help="for the whole job")
    p.add_argument("--last-call", type=float, default=None)
    p.add_argument("--replace", action="store_true")
    p.add_argument("--standby", type=int, default=0)
    p.add_argument("--etcd", default=None, metavar="URL,URL,...",
                   help="agree on the generations in etcd (client URLs): no host coordinates")
    p.add_argument("--job", default=None,
                   help="the launch's keys' folder in etcd (default: a fresh one per launch)")
    p.add_argument("--env-names", default="",
                   help="comma-separated names of the variables every agent gets (values "
                        "from this process's environment, sent on the agents' stdin)")
    p.add_argument("--die-with-parent", action="store_true",
                   help="the kernel ends this process with the one that started it (`hvd-resilient "
                        "run`: killed with its job guard, the agents must not live on)")
    p.add_argument("--start-timeout", type=float, default=60.0,
                   help="seconds host 0's agent has to print its address")
    p.add_argument("--end-grace", type=float, default=30.0,
                   help="seconds the other agents have to end once host 0's has")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the worker command")
    a = p.parse_args(argv)
    a.cmd = worker_command(a.cmd)
    if a.job is None:
        a.job = uuid.uuid4().hex[:12]  # a relaunch starts from generation 0 again
    if (a.hosts is None) == (a.discovery is None):
        raise ConfigError("give --hosts or --discovery (one of them)")
    if a.discovery is not None:
        from hvd_resilient.launch.inplace.fanout_discovery import first_hosts

        first = first_hosts(a.discovery, a.max_np)
        loopback = [h for h, _ in first if is_loopback(h)] if len(first) > 1 else []
        if loopback:
            raise ConfigError(f"discovery script {a.discovery} lists {', '.join(loopback)}, "
                              "which means each host itself; list this machine by an address "
                              "the other hosts reach")
        a.hosts = hosts_arg(first)
    if not parse_hosts(a.hosts):
        raise ConfigError(f"--hosts {a.hosts!r} names no host")
    return a


@exit_on_error
def main(argv: Sequence[str] | None = None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    if a.die_with_parent:  # its agents then read EOF and end their workers
        die_with_parent(os.getppid())
    return Fanout(a).run()


if __name__ == "__main__":
    sys.exit(main())
