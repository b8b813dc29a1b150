"""The in-place backend's launch surface: `hvd-resilient run --backend inplace`, the agent's
options, and the agent's membership decisions over real (tiny, torch-free) worker processes."""

from __future__ import annotations

import json
import sys
import time

import pytest

from hvd_resilient import backends
from hvd_resilient.backends.inplace import membership
from hvd_resilient.errors import ConfigError
from hvd_resilient.launch import inplace_agent
from hvd_resilient.launch.cli import build_parser, launcher_command, resolve


def command(*argv: str) -> list[str]:
    parser = build_parser()
    opts = resolve(parser.parse_args([*argv, "--", "python", "t.py"]), parser)
    return launcher_command(opts, [])


def test_run_builds_the_agent_command_line_with_its_sizes():
    cmd = command("--backend", "inplace", "--np", "4", "--min-np", "2")
    line = " ".join(cmd)
    assert "-m hvd_resilient.launch.inplace_agent --nproc 4 --min-np 2 -- python t.py" in line
    assert "--replace --" in " ".join(command("--backend", "inplace", "--replace"))
    with pytest.raises(ConfigError, match="runs its workers on this machine"):
        command("--backend", "inplace", "--hosts", "h1:2")
    with pytest.raises(ConfigError, match="--replace is the inplace backend's"):
        command("--backend", "torchrun", "--replace")


def test_workers_find_the_backend_from_the_agents_variable():
    assert membership.AGENT_ENV == backends.INPLACE_AGENT_ENV
    assert backends.detect({backends.INPLACE_AGENT_ENV: "127.0.0.1:1"}) == "inplace"
    assert "inplace" in backends.names()
    with pytest.raises(ConfigError, match="--fsdp is not supported by the inplace backend"):
        backends.get("inplace", fsdp=True)


@pytest.mark.parametrize("argv, says", [
    (["--nproc", "2"], "no worker command"),
    (["--nproc", "2", "--min-np", "3", "--", "x"], "1 <= --min-np <= --nproc"),
    (["--nproc", "0", "--", "x"], "--nproc >= 1"),
])
def test_bad_agent_options_stop_with_one_line(argv, says):
    with pytest.raises(ConfigError, match=says):
        inplace_agent.parse(argv)


def _agent(codes: list[str], min_np: int = 1, last_call: float = 5.0) -> inplace_agent.Agent:
    """Workers that run `code[member]` (python -c), started as the agent starts them."""
    agent = inplace_agent.Agent([sys.executable, "-c", "pass"], len(codes), min_np, last_call)
    for m, code in enumerate(codes):
        agent.cmd = [sys.executable, "-c", code]
        agent._start(m)
    agent._publish(list(range(len(codes))))
    return agent


def _until(agent: inplace_agent.Agent, pred, timeout: float = 20.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = agent._step()
        if code is not None or pred():
            return code
        time.sleep(0.01)
    raise AssertionError("the agent never got there")


ASK = """
import os, time, torch.distributed as dist
from hvd_resilient.backends.inplace import membership as m
store = dist.PrefixStore(m.PREFIX, dist.TCPStore(*os.environ[m.AGENT_ENV].split(":")[:1],
                         int(os.environ[m.AGENT_ENV].split(":")[1]), is_master=False))
store.set(m.want_key(int(os.environ[m.MEMBER_ENV])), "0")
time.sleep(60)
"""


def _stop(agent: inplace_agent.Agent) -> None:
    for p in agent.alive.values():
        p.kill()
        p.wait()


def test_a_dead_member_is_left_out_once_every_live_one_asked(tmp_path):
    """Member 0 ends (code 3) once the two others have asked, as a peer's death makes them."""
    flag = tmp_path / "end"
    ends = (f"import os, sys, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)\n"
            "sys.exit(3)")
    agent = _agent([ends, ASK, ASK])

    def asked_then_end() -> bool:
        if agent.store.check([membership.want_key(1), membership.want_key(2)]):
            flag.touch()
        return agent.generation == 1

    try:
        _until(agent, asked_then_end)
        assert agent.members == [1, 2] and agent.failed == {0: 3}
        assert json.loads(agent.store.get(membership.gen_key(1))) == [1, 2]
    finally:
        _stop(agent)


def test_a_live_member_that_never_asks_is_ended_at_the_last_call():
    """A member that asks starts the last call; one still silent after it (frozen, hung in
    a step) is ended and left out."""
    sleeper = "import time; time.sleep(60)"
    agent = _agent([sleeper, ASK, sleeper], last_call=0.5)
    try:
        _until(agent, lambda: agent.generation == 1)
        assert agent.members == [1]
        assert [agent.alive[m].wait(5) for m in (0, 2)] == [-9, -9], "not ended"
    finally:
        _stop(agent)


def test_below_min_np_every_worker_is_ended_and_the_agent_says_restart():
    agent = _agent(["import sys; sys.exit(3)", ASK], min_np=2)
    try:
        assert _until(agent, lambda: False) == 1
        assert agent.generation == 0
        assert agent.alive[1].wait(5) == -9
    finally:
        _stop(agent)


def test_a_finished_run_publishes_nothing_and_exits_0():
    agent = _agent(["pass", "pass"])
    assert _until(agent, lambda: False) == 0
    assert agent.generation == 0 and agent.finished == {0, 1}
