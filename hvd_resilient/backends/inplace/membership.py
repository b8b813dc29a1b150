"""The generations, as the agent's store holds them: what a worker reads and reports.

Keys (all under `PREFIX`): ``joins`` is 1 when the agent starts workers that join later;
``gen`` is the newest generation's number; ``gen/<g>`` its members
(member ids, JSON, in rank order); ``want/<member>`` is the generation a member saw fail (it
asks for the next one). The agent publishes the next generation with the members that asked,
once every live member has (a dead one is reaped in milliseconds), or after its last call,
ending the ones that did not ask. ``evict/<member>`` names a member its peers found silent
(frozen, cut off): the agent ends it. ``ready/<member>`` says a worker is up and waits to be
taken in (a replacement the agent started): the agent publishes a generation with it, which
the members notice at their next step (rank 0 reads, one broadcast) and move to at a commit.
``pg/<g>/`` holds generation g's process-group keys, so a new group never reads a dead
generation's addresses.

Member ids are the agent's, never reused: a worker started later (a replacement) gets a new
one, and ranks are positions in a generation's member list.
"""

from __future__ import annotations

import datetime
import json
import os
import time

import torch.distributed as dist

from hvd_resilient.backends import INPLACE_AGENT_ENV

PREFIX = "hvd_resilient/inplace/"
AGENT_ENV = INPLACE_AGENT_ENV
"""``host:port`` of the agent's store; set by the agent for every worker it starts."""
MEMBER_ENV = "HVD_RESILIENT_MEMBER"
POLL_S = 0.005


def gen_key(g: int) -> str:
    return f"gen/{g}"


def want_key(member: int) -> str:
    return f"want/{member}"


def evict_key(member: int) -> str:
    return f"evict/{member}"


def ready_key(member: int) -> str:
    return f"ready/{member}"


def group_prefix(g: int) -> str:
    return f"{PREFIX}pg/{g}/"


class Fenced(Exception):
    """This worker is not in the newest generation: the others went on without it."""


class Membership:
    """A worker's view of the generations (one store connection to the agent)."""

    def __init__(self, timeout_s: float, env: dict[str, str] | None = None) -> None:
        env = dict(os.environ if env is None else env)
        host, _, port = env[AGENT_ENV].rpartition(":")
        self.me = int(env[MEMBER_ENV])
        self.timeout_s = timeout_s
        self.base = dist.TCPStore(host, int(port), is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout_s))
        self.store = dist.PrefixStore(PREFIX, self.base)
        self.joins = self.store.get("joins") == b"1"
        """Whether the agent starts workers that join later (`--replace`); set before any
        worker starts, so every member reads the same."""
        self.generation = -1
        self.members: list[int] = []
        self.announced_at: float | None = None

    def expect_to_join(self) -> bool:
        """True for a worker the newest generation does not hold (the agent started it in
        place of a lost one): it takes the place it will most likely get, last in rank order
        (member ids only grow), until it is taken in."""
        newest = self.newest()
        members = json.loads(self.store.get(gen_key(newest))) if newest >= 0 else []
        if self.me in members:
            return False
        self.members = sorted([*members, self.me])
        return True

    def announce(self) -> None:
        """Up and waiting to be taken in (what the agent waits for before it lets a
        replacement join)."""
        self.announced_at = time.time()
        self.store.set(ready_key(self.me), "1")

    def newest(self) -> int:
        return int(self.store.get("gen"))

    def wait_beyond(self, g: int, *, joining: bool = False) -> int:
        """The first generation after ``g`` that holds this worker; raises `Fenced` when one
        was published without it (``joining``: a worker not taken in yet waits on through
        those), TimeoutError when none comes in time."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            newest = self.newest()
            if newest > g:
                members = json.loads(self.store.get(gen_key(newest)))
                if self.me in members:
                    self.generation, self.members = newest, members
                    return newest
                if not joining:
                    raise Fenced(f"generation {newest} ({members}) goes on without member "
                                 f"{self.me}")
                g = newest
            if time.monotonic() > deadline:
                raise TimeoutError(f"no generation after {g} within {self.timeout_s:.0f}s")
            time.sleep(POLL_S)

    def report_fault(self, g: int) -> None:
        """Generation ``g`` failed here: this member asks to be in the next one."""
        self.store.set(want_key(self.me), str(g))

    def evict(self, members: list[int], detail: str) -> None:
        for m in members:
            self.store.set(evict_key(m), detail)

    def evicted(self) -> bool:
        return self.store.check([evict_key(self.me)])

    def changed(self) -> bool:
        """A newer generation than this worker's is published (a member joins or left)."""
        return self.newest() != self.generation

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def form(self, pg_timeout: datetime.timedelta) -> None:
        """This generation's process group (the default group), over its own prefix."""
        dist.init_process_group("gloo", store=dist.PrefixStore(group_prefix(self.generation),
                                                               self.base),
                                rank=self.rank, world_size=len(self.members),
                                timeout=pg_timeout)
