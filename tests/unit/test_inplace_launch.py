"""The in-place backend's launch surface: `hvd-resilient run --launcher inplace`, the agent's
options, and the agent's membership decisions over real (tiny, torch-free) worker processes."""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time

import pytest
import torch.distributed as dist

from hvd_resilient import backends
from hvd_resilient.backends.inplace import membership
from hvd_resilient.errors import ConfigError
from hvd_resilient.launch import inplace_agent
from hvd_resilient.launch.cli import build_parser, resolve


def command(*argv: str) -> list[str]:
    opts, launcher = resolve(build_parser().parse_args([*argv, "--", "python", "t.py"]))
    return launcher.command(opts, [])


def test_run_builds_the_agent_command_line_with_its_sizes():
    cmd = command("--launcher", "inplace", "--np", "4", "--min-np", "2")
    line = " ".join(cmd)
    # a bare `python` is this environment's interpreter (launch/interpreter.py)
    assert f"-m hvd_resilient.launch.inplace_agent --nproc 4 --min-np 2 -- {sys.executable} t.py" \
        in line
    assert "--replace --" in " ".join(command("--launcher", "inplace", "--replace"))
    assert "-m hvd_resilient.launch.inplace.fanout --hosts h1:2" in " ".join(
        command("--launcher", "inplace", "--hosts", "h1:2", "--np", "2"))  # test_inplace_fanout
    with pytest.raises(ConfigError, match="--replace applies to --launcher inplace only"):
        command("--launcher", "torchrun", "--replace")
    assert f"--nproc 4 --min-np 1 --standby 2 -- {sys.executable} t.py" in " ".join(
        command("--launcher", "inplace", "--np", "4", "--standby", "2"))
    with pytest.raises(ConfigError, match="--standby applies to --launcher inplace only"):
        command("--launcher", "horovod", "--standby", "1")
    with pytest.raises(ConfigError, match="--standby must be >= 0"):
        command("--launcher", "inplace", "--standby", "-1")


def test_workers_find_the_backend_from_the_agents_variable():
    assert membership.AGENT_ENV == backends.INPLACE_AGENT_ENV
    assert backends.detect({backends.INPLACE_AGENT_ENV: "127.0.0.1:1"}) == "inplace"
    assert "inplace" in backends.names()
    sharded = backends.get("inplace", fsdp=True)  # FSDP reduces in backward; all ranks load
    assert sharded.fsdp and sharded.reduces_in_backward and sharded.resume_on_every_rank
    plain = backends.get("inplace")
    assert not (plain.fsdp or plain.reduces_in_backward or plain.resume_on_every_rank)


@pytest.mark.parametrize("argv, says", [
    (["--nproc", "2"], "no worker command"),
    (["--nproc", "2", "--min-np", "3", "--", "x"], "1 <= --min-np <= the job's size"),
    (["--nproc", "0", "--", "x"], "--nproc >= 1"),
    (["--nproc", "2", "--standby", "-1", "--", "x"], "--standby >= 0"),
])
def test_bad_agent_options_stop_with_one_line(argv, says):
    with pytest.raises(ConfigError, match=says):
        inplace_agent.parse(argv)


def _agent(codes: list[str], min_np: int = 1, last_call: float = 5.0) -> inplace_agent.Agent:
    """Workers that run `code[member]` (python -c), started as the agent starts them."""
    agent = inplace_agent.Agent([sys.executable, "-c", "pass"], len(codes), min_np, last_call)
    host = agent.host
    for m, code in enumerate(codes):
        host.cmd = [sys.executable, "-c", code]
        host._start(m)
    host.start_members = list(range(len(codes)))  # generation 0 at the first step
    return agent


def _until(agent: inplace_agent.Agent, pred, timeout: float = 20.0) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code = agent.step()
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
    for p in agent.host.alive.values():
        p.kill()
        p.wait()


def test_a_dead_member_is_left_out_once_every_live_one_asked(tmp_path):
    """Member 0 ends (code 3) once the two others have asked, as a peer's death makes them."""
    flag = tmp_path / "end"
    ends = (f"import os, sys, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.01)\n"
            "sys.exit(3)")
    agent = _agent([ends, ASK, ASK])

    def asked_then_end() -> bool:
        if agent.host.store.check([membership.want_key(1), membership.want_key(2)]):
            flag.touch()
        return agent.decide.generation == 1

    try:
        _until(agent, asked_then_end)
        assert agent.decide.members == [1, 2] and agent.host.failed == {0: 3}
        assert json.loads(agent.host.store.get(membership.gen_key(1))) == [1, 2]
    finally:
        _stop(agent)


def test_a_live_member_that_never_asks_is_ended_at_the_last_call():
    """A member that asks starts the last call; one still silent after it (frozen, hung in
    a step) is ended and left out."""
    sleeper = "import time; time.sleep(60)"
    agent = _agent([sleeper, ASK, sleeper], last_call=0.5)
    try:
        _until(agent, lambda: agent.decide.generation == 1)
        assert agent.decide.members == [1]
        assert [agent.host.alive[m].wait(5) for m in (0, 2)] == [-9, -9], "not ended"
    finally:
        _stop(agent)


def test_below_min_np_every_worker_is_ended_and_the_agent_says_restart():
    agent = _agent(["import sys; sys.exit(3)", ASK], min_np=2)
    try:
        assert _until(agent, lambda: False) == 1
        assert agent.decide.generation == 0
        assert agent.host.alive[1].wait(5) == -9
    finally:
        _stop(agent)


def test_a_finished_run_publishes_nothing_and_exits_0():
    agent = _agent(["pass", "pass"])
    assert _until(agent, lambda: False) == 0
    assert agent.decide.generation == 0 and agent.host.finished == {0, 1}


DOOR = """
import os, time, torch.distributed as dist
from hvd_resilient.backends.inplace import membership as m
store = dist.PrefixStore(m.PREFIX, dist.TCPStore(*os.environ[m.AGENT_ENV].split(":")[:1],
                         int(os.environ[m.AGENT_ENV].split(":")[1]), is_master=False))
me = int(os.environ[m.MEMBER_ENV])
store.set(m.door_key(int(store.get("gen")), me), "1")
if me == {through}:
    store.set(m.formed_key(int(store.get("gen")), me), "1")
time.sleep(60)
"""


def test_members_at_the_door_of_a_generation_whose_member_died_get_the_next_one():
    """A member dies a moment after a generation with it was published (a join): the others
    wait at that generation's door and never ask, as no collective of theirs fails. The agent
    publishes the next one without the dead member at once, not at the last call (60 s)."""
    door = DOOR.replace("{through}", "-1")
    agent = _agent([door, "import sys; sys.exit(3)", door], last_call=60.0)
    try:
        _until(agent, lambda: agent.decide.generation == 1, timeout=15)
        assert agent.decide.members == [0, 2]
    finally:
        _stop(agent)


def test_a_member_through_the_door_must_still_ask():
    """Member 2 went through the door (its group formed): it is training, and it asks when a
    collective with the dead member fails; until then the agent publishes nothing for it."""
    door = DOOR.replace("{through}", "2")
    agent = _agent([door, "import sys; sys.exit(3)", door], last_call=60.0)
    try:
        _until(agent, lambda: 1 in agent.host.failed and agent.host.at_door(0, [0, 2]) == {0},
               timeout=15)
        for _ in range(20):
            assert agent.step() is None
        assert agent.decide.generation == 0
    finally:
        _stop(agent)


def test_a_member_at_the_door_goes_on_to_a_newer_generation():
    """Membership's side: at generation 0's door it waits for every member; the agent's next
    generation (without the one that never came) takes it there instead."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore(membership.PREFIX, server)
    store.set("joins", "0")
    store.set(membership.gen_key(0), json.dumps([0, 1]))
    store.set("gen", "0")
    env = {membership.AGENT_ENV: f"127.0.0.1:{server.port}", membership.MEMBER_ENV: "0"}
    m = membership.Membership(10.0, env)
    assert m.wait_beyond(-1) == 0
    result: list = []
    waiter = threading.Thread(target=lambda: result.append(m._at_door(0)))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "went through the door without member 1"
    store.set(membership.gen_key(1), json.dumps([0]))
    store.set("gen", "1")
    waiter.join(5)
    assert result == [False]
    assert m.wait_beyond(0) == 1 and m._at_door(1) is True


FORMING = """
import datetime, os, torch, torch.distributed as dist
from hvd_resilient.backends.inplace import membership as m
me = m.Membership(30.0)
me.enter(-1, datetime.timedelta(seconds=300))
gloo = dist.group.WORLD._get_backend(torch.device("cpu"))
print(me.generation, dist.get_world_size(), int(gloo.options._timeout.total_seconds()),
      dist.group.WORLD.group_name)
"""


def test_a_member_that_dies_after_the_door_costs_the_others_no_timeout(tmp_path):
    """Member 1 reached generation 0's door, then died before its group formed: member 0 waits
    in the formation for keys that never come. Once the agent publishes the next generation
    (it counts members at the door, not through it, as asking), member 0 must give the
    formation up at once and form that one, not wait out the process-group timeout (300 s);
    its group then has the collectives' own timeout again, and the name ("0") every member
    that never tried generation 0 gives its group: the group's store keys start with it."""
    import subprocess

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore(membership.PREFIX, server)
    store.set("joins", "0")
    store.set(membership.gen_key(0), json.dumps([0, 1]))
    store.set("gen", "0")
    store.set(membership.door_key(0, 1), "1")  # it arrived, and died there
    env = {**os.environ, membership.AGENT_ENV: f"127.0.0.1:{server.port}",
           membership.MEMBER_ENV: "0"}
    keys = server.num_keys()
    proc = subprocess.Popen([sys.executable, "-c", FORMING], env=env, stdout=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 30
        while not store.check([membership.door_key(0, 0)]):
            assert proc.poll() is None and time.monotonic() < deadline, "never at the door"
            time.sleep(0.01)
        while server.num_keys() < keys + 2:  # its door, then its group's first key
            assert proc.poll() is None and time.monotonic() < deadline, "never formed"
            time.sleep(0.01)
        assert not store.check([membership.formed_key(0, 0)])
        store.set(membership.gen_key(1), json.dumps([0]))
        store.set("gen", "1")
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert out.split() == ["1", "1", "300", "0"], out
    assert store.check([membership.formed_key(1, 0)])


STORE_HOST = """
import sys, time, torch.distributed as dist
s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
print(s.port, flush=True)
time.sleep(600)
"""


def test_a_member_at_the_door_of_a_store_that_dies_asks_its_own_agent_for_the_next():
    """Generation 1 forms on another host's agent's store (the coordinator's), and that host
    dies while member 0 waits at the door: the member does not die of the broken connection; it
    asks its own agent for the next generation, and enters the one the next coordinator
    publishes (here: on its own agent's store)."""
    import subprocess

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore(membership.PREFIX, server)
    remote = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert remote.stdout is not None
        port = int(remote.stdout.readline())
        store.set("joins", "0")
        store.set(membership.gen_key(1), json.dumps([0, 1]))
        store.set(membership.store_key(1), f"127.0.0.1:{port}")
        store.set("gen", "1")
        env = {membership.AGENT_ENV: f"127.0.0.1:{server.port}", membership.MEMBER_ENV: "0"}
        m = membership.Membership(10.0, env)
        errors: list[BaseException] = []

        def enter() -> None:
            try:
                m.enter(0, datetime.timedelta(seconds=30))
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)

        waiter = threading.Thread(target=enter)
        waiter.start()
        far = dist.PrefixStore(membership.PREFIX, dist.TCPStore(
            "127.0.0.1", port, is_master=False, wait_for_workers=False))
        far.wait([membership.door_key(1, 0)], datetime.timedelta(seconds=10))
        remote.kill()  # member 1 never comes, and the store goes with its host
        remote.wait()
        deadline = time.monotonic() + 10
        while not store.check([membership.want_key(0)]):
            assert waiter.is_alive() and time.monotonic() < deadline, errors
            time.sleep(0.01)
        assert store.get(membership.want_key(0)) == b"1"
        store.set(membership.gen_key(2), json.dumps([0]))  # the next coordinator's decision
        store.set("gen", "2")
        waiter.join(20)
        assert not waiter.is_alive() and not errors, errors
        assert m.generation == 2 and dist.get_world_size() == 1
    finally:
        remote.kill()
        remote.wait()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_the_agent_runs_ahead_of_its_workers_which_keep_the_launchs_niceness():
    """The agent is its host's control plane: starved by its own workers (their imports, their
    loaders) it goes silent to the other hosts and is taken for lost. Root here, so it may."""
    import subprocess

    probe = ("import os; print(os.getpriority(os.PRIO_PROCESS, 0), "
             "os.getpriority(os.PRIO_PROCESS, os.getppid()))")
    out = subprocess.run([sys.executable, "-m", "hvd_resilient.launch.inplace_agent",
                          "--nproc", "1", "--", sys.executable, "-c", probe],
                         capture_output=True, text=True, timeout=60,
                         preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, 2))
    assert out.returncode == 0, out.stderr[-2000:]
    worker, agent = map(int, out.stdout.split())
    assert worker == 2, "a worker must run at the niceness it was launched with"
    assert agent == (2 - 5 if os.geteuid() == 0 else 2), (worker, agent)


def test_under_srun_each_agent_finds_its_place(monkeypatch):
    """One command line for every node (`srun --ntasks-per-node 1`): the place from Slurm's
    variables, the address from the node's name, the job's size from every node's --nproc."""
    import socket

    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("SLURM_NNODES", "3")
    a = inplace_agent.parse(["--nproc", "2", "--etcd", "http://e1:2379", "--", "x"])
    assert (a.host_index, a.hosts_count, a.job_nproc) == (2, 3, 6)
    assert a.address == socket.gethostname()
    with pytest.raises(ConfigError, match="--coordinator is given to every host's agent"):
        inplace_agent.parse(["--nproc", "2", "--", "x"])  # no etcd: node 2 needs node 0's
    monkeypatch.setenv("SLURM_NODEID", "zero")
    with pytest.raises(ConfigError, match="SLURM_NODEID / SLURM_NNODES must be numbers"):
        inplace_agent.parse(["--nproc", "2", "--etcd", "http://e1:2379", "--", "x"])


def test_in_a_kubernetes_indexed_job_each_pods_agent_finds_its_place(monkeypatch):
    """One agent per pod (docker/k8s/inplace-indexed-job.yaml): the place from the pod's
    completion index, the count and address from the manifest's flags."""
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    a = inplace_agent.parse(["--nproc", "2", "--hosts-count", "3", "--address", "10.1.2.3",
                             "--etcd", "http://etcd:2379", "--", "x"])
    assert (a.host_index, a.hosts_count, a.job_nproc, a.address) == (1, 3, 6, "10.1.2.3")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "one")
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX must be numbers"):
        inplace_agent.parse(["--nproc", "2", "--hosts-count", "3", "--etcd", "http://e:2379",
                             "--", "x"])


def test_a_removed_hosts_workers_read_that_their_host_leaves():
    """After a fault the next generation leaves a removed host's members out as it would an
    evicted one's: the flag on their own agent's store tells the two apart (`recovery.Left`)."""
    from hvd_resilient.launch.inplace.host_agent import HostAgent

    agent = HostAgent(["true"], 0, host_index=2)
    env = {membership.AGENT_ENV: agent.address, membership.MEMBER_ENV: "2000000"}
    agent.store.set("joins", "1")
    m = membership.Membership(10.0, env)
    assert not m.host_leaving()
    agent.leave()
    assert m.host_leaving() and agent.leaving
