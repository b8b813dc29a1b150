"""`launcher_rank`/`launcher_size` under the in-place agent: the rank is the worker's place in
the newest generation, read from the agent's store (an in-process one here), so it follows
the generations as members are lost and taken in."""

from __future__ import annotations

import json

import pytest
import torch.distributed as dist

from hvd_resilient import launcher_env, launcher_place
from hvd_resilient.backends.inplace import membership
from hvd_resilient.launcher_place import launcher_rank, launcher_size
from tests.support.jobs import free_port

MEMBER = membership.MEMBER_ENV  # the agent's name for its workers' member ids


@pytest.fixture
def agent():
    """The agent's store, as the agent hosts it; yields (store, env of member 0)."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store = dist.PrefixStore(membership.PREFIX, server)
    yield store, {membership.AGENT_ENV: f"127.0.0.1:{server.port}", MEMBER: "0"}
    del store, server


def publish(store: dist.Store, g: int, members: list[int]) -> None:
    store.set(membership.gen_key(g), json.dumps(members))
    store.set("gen", str(g))


def place(env: dict[str, str], member: int) -> tuple[int | None, int | None]:
    env = {**env, MEMBER: str(member)}
    return launcher_rank(env), launcher_size(env)


def test_the_agents_member_variable_is_the_one_launcher_env_reads():
    assert launcher_env.INPLACE_MEMBER_ENV == MEMBER


def test_an_inplace_worker_has_its_place_in_the_newest_generation(agent):
    store, env = agent
    publish(store, 0, [0, 1, 2])
    assert [place(env, m) for m in (0, 1, 2)] == [(0, 3), (1, 3), (2, 3)]
    assert place(env, 3) == (None, 3)  # a standby: started, not taken in
    publish(store, 1, [1, 2, 3])  # member 0 lost, the standby took its place
    assert [place(env, m) for m in (0, 1, 2, 3)] == [(None, 3), (0, 3), (1, 3), (2, 3)]
    publish(store, 2, [2, 3])
    assert place(env, 2) == (0, 2) and place(env, 1) == (None, 2)


def test_the_agents_names_come_before_variables_it_passed_on(agent):
    """An agent started under srun or mpirun hands their variables to every worker."""
    store, env = agent
    publish(store, 0, [0, 1])
    inherited = {**env, MEMBER: "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
                 "RANK": "5", "WORLD_SIZE": "8"}
    assert (launcher_rank(inherited), launcher_size(inherited)) == (1, 2)
    assert (launcher_rank({"RANK": "5"}), launcher_size({"WORLD_SIZE": "8"})) == (5, 8)


def test_without_an_agent_to_ask_it_says_it_does_not_know(monkeypatch):
    monkeypatch.setattr(launcher_place, "INPLACE_LOOKUP_TIMEOUT_S", 0.5)
    assert launcher_rank({MEMBER: "0"}) is None  # no agent address at all
    lost = {membership.AGENT_ENV: f"127.0.0.1:{free_port()}", MEMBER: "0"}
    assert (launcher_rank(lost), launcher_size(lost)) == (None, None)
