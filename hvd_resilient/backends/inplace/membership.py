"""The generations, as the agent's store holds them: what a worker reads and reports.

A worker speaks to its own host's agent (`AGENT_ENV`); where a generation's group forms is
named in that generation's record (``store/<g>``), on whichever agent's store it is: across
hosts, the coordinating agent's (`launch/inplace/`), on one machine the agent's own.

Keys (all under `PREFIX`): ``joins`` is 1 when the agent starts workers that join later; ``gen``
is the newest generation's number; ``gen/<g>`` its members (member ids, JSON, in rank order),
``store/<g>`` the ``host:port`` of the store its group forms on (the door, formed and pg keys
below are there); ``want/<member>`` is the generation a member saw fail (it asks for the next
one). The agent publishes the next generation with the members that asked, once every live
member has (a dead one is reaped in milliseconds), or after its last call, ending the ones that
did not ask. ``evict/<member>`` names a member its peers found silent (frozen, cut off): the
agent ends it. ``ready/<member>`` says a worker is up and waits to be taken in (a replacement
the agent started): the agent publishes a generation with it, which the members notice at their
next step (rank 0 reads, one broadcast) and move to at a commit. ``busy/<member>`` (a wall-clock
time, renewed every `BUSY_EVERY_S`) says a member is inside a section it declared to its
watchdog (an evaluation, a synchronous checkpoint), where it runs no collective and so cannot
ask: the agent's last call waits for it while it is renewed. ``door/<g>/<member>`` says a member
waits at generation g's door (every member of g arrives before the group is formed),
``formed/<g>/<member>`` that it went through; a member that died before it arrived leaves the
others at the door, where the agent counts them as asking for the next generation. ``pg/<g>/``
holds generation g's process-group keys, so a new group never reads a dead generation's
addresses. ``leaving`` (on the worker's own agent's store) says its host was removed from the
job: a member the next generation leaves out then leaves it (exit 0), evicted by nobody.

Member ids are the agent's, never reused: a worker started later (a replacement) gets a new
one, and ranks are positions in a generation's member list.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from hvd_resilient.backends import INPLACE_AGENT_ENV
from hvd_resilient.backends.inplace import reconfigure
from hvd_resilient.launcher_env import INPLACE_MEMBER_ENV

logger = logging.getLogger(__name__)

PREFIX = "hvd_resilient/inplace/"
AGENT_ENV = INPLACE_AGENT_ENV
"""``host:port`` of the agent's store; set by the agent for every worker it starts."""
MEMBER_ENV = INPLACE_MEMBER_ENV
"""The worker's member id; set by the agent for every worker it starts."""
POLL_S = 0.005
FORM_TIMEOUT_S = 30.0
"""How long a generation's group may take to form once every member is at its door (then
the collectives' own timeout is set). A member that dies in between leaves the others in the
formation: their waits for its keys end as soon as the agent publishes the next generation
(`FormationStore`); only a dead peer's address that no longer answers is left to this
timeout, instead of the process-group timeout (300 s)."""
MEMBER_STRIDE = 1_000_000
"""Member ids are ``host_index * MEMBER_STRIDE + n``: each host's agent numbers its own
workers, never reusing an id, and no two hosts can give out the same one."""


def host_of(member: int) -> int:
    """The index of the host whose agent started ``member``."""
    return member // MEMBER_STRIDE


LEAVING_KEY = "leaving"
"""Set by a removed host's agent (`HostAgent.leave`) on its own store."""


def gen_key(g: int) -> str:
    return f"gen/{g}"


def want_key(member: int) -> str:
    return f"want/{member}"


def evict_key(member: int) -> str:
    return f"evict/{member}"


def store_key(g: int) -> str:
    return f"store/{g}"


def ready_key(member: int) -> str:
    return f"ready/{member}"


def busy_key(member: int) -> str:
    return f"busy/{member}"


BUSY_EVERY_S = 0.5
BUSY_FRESH_S = 2.0
"""A `busy/<member>` time older than this is not renewed any more: its member left its
section (then it asks at its next collective) or stopped running Python (frozen, or stuck
holding the interpreter lock), and the last call applies to it again."""


def is_busy(store: Any, member: int) -> bool:
    """True while ``member`` renews its `busy_key` (it is inside a declared section)."""
    key = busy_key(member)
    if not store.check([key]):
        return False
    try:
        return time.time() - float(store.get(key)) < BUSY_FRESH_S
    except ValueError:
        return False


def agent_address(env: Mapping[str, str]) -> tuple[str, int]:
    host, _, port = env[AGENT_ENV].rpartition(":")
    return host, int(port)


def agent_store(env: Mapping[str, str], timeout_s: float) -> TCPStore:
    """A connection to the agent's store (its keys are under `PREFIX`)."""
    return TCPStore(*agent_address(env), is_master=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def newest_place(env: Mapping[str, str], timeout_s: float) -> tuple[int | None, int]:
    """(rank, size) of the worker ``env`` describes (its `MEMBER_ENV`) in the newest
    generation: its position in the member list (None: not in it) and how many members it
    has. Read from the agent's store, on a connection of its own, so it holds before this
    worker's backend is up; waits up to ``timeout_s`` for the store and for generation 0 (the
    agent publishes it just after starting the workers).

    Raises:
        RuntimeError: the agent's store did not answer in time (torch's DistStoreError).
        KeyError, ValueError: ``env`` names no agent or member.
    """
    me = int(env[MEMBER_ENV])
    store = PrefixStore(PREFIX, agent_store(env, timeout_s))
    members = json.loads(store.get(gen_key(int(store.get("gen")))))
    return (members.index(me) if me in members else None), len(members)


def door_key(g: int, member: int) -> str:
    return f"door/{g}/{member}"


def formed_key(g: int, member: int) -> str:
    return f"formed/{g}/{member}"


def group_prefix(g: int) -> str:
    return f"{PREFIX}pg/{g}/"


class FormationStore(Store):
    """The store a generation's group forms over: its waits give up as soon as the generation
    is superseded (a member died after the door, and the agent published the next one),
    where a `PrefixStore` would wait out its timeout for the dead member's keys."""

    def __init__(self, base: Store, prefix: str, superseded: Callable[[], bool],
                 timeout_s: float) -> None:
        super().__init__()
        self.inner = PrefixStore(prefix, base)
        self.superseded = superseded
        self.timeout_s = timeout_s

    def _wait(self, keys: list[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self.inner.check(keys):
            if self.superseded():
                raise RuntimeError(f"generation superseded while its group formed (waited "
                                   f"for {keys})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"keys {keys} not set within {self.timeout_s:.0f}s")
            time.sleep(POLL_S)

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait([key])
        return self.inner.get(key)

    def wait(self, keys: list[str], *_timeout: Any) -> None:
        self._wait(keys)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def add(self, key: str, value: int) -> int:
        return self.inner.add(key, value)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()


def _first_group_name() -> None:
    """Names the group about to be formed "0", as in every member that never tried another.
    torch names a default group from a counter (`_world.group_count`) that it bumps before the
    group is built and resets only at `destroy_process_group()`, and a group's store keys start
    with its name. A formation superseded inside `init_process_group` (a newer generation
    published while the group was forming) has bumped it already: that member's next group was
    "1" while the others' was "0", and each side waited for the other's keys until the store's
    timeout (seen across hosts: a host removed during a fault). No group exists at this
    point (the last one was destroyed), so none is renamed."""
    world = getattr(c10d, "_world", None)
    if world is not None and hasattr(world, "group_count") and not dist.is_initialized():
        world.group_count = 0


class Fenced(Exception):
    """This worker is not in the newest generation: the others went on without it."""


class Membership:
    """A worker's view of the generations (one store connection to the agent)."""

    def __init__(self, timeout_s: float, env: dict[str, str] | None = None, *,
                 backend: str = "gloo", reconfigure: bool = False) -> None:
        env = dict(os.environ if env is None else env)
        self.backend = backend
        """The process groups' torch backend (Gloo unless torch can reconfigure one)."""
        self.reconfigure = reconfigure
        """One group reconfigured per generation (`reconfigure.py`, torch >= 2.14), instead
        of a new group each: the default group outlives the generations."""
        self.me = int(env[MEMBER_ENV])
        self.timeout_s = timeout_s
        self.base = agent_store(env, timeout_s)
        self.address = agent_address(env)
        """The agent's store (``host``, ``port``)."""
        self.store = PrefixStore(PREFIX, self.base)
        self._stores: dict[str, Store] = {f"{self.address[0]}:{self.address[1]}": self.base}
        self.gen_base: Store = self.base
        """The store generation `generation`'s group forms on (`store_key`)."""
        self.gen_store: Store = self.store
        self.gen_port = self.address[1]
        self.joins = self.store.get("joins") == b"1"
        """Whether the agent starts workers that join later (`--replace`, `--standby`); set
        before any worker starts, so every member reads the same."""
        self.generation = -1
        self.members: list[int] = []
        self.group_store: FormationStore | None = None
        self.announced_at: float | None = None
        self._said_busy = False

    def expect_to_join(self) -> bool:
        """True for a worker the newest generation does not hold (the agent started it in
        place of a lost one): it takes the place it will most likely get, last in rank order
        (newcomers come after the survivors), until it is taken in."""
        newest = self.newest()
        members = json.loads(self.store.get(gen_key(newest))) if newest >= 0 else []
        if self.me in members:
            return False
        self.members = [*members, self.me]
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
        those, as long as the agent lives: a standby's wait is the whole run), TimeoutError
        when none comes in time."""
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
            if not joining and time.monotonic() > deadline:
                if not self._others_busy():
                    raise TimeoutError(f"no generation after {g} within {self.timeout_s:.0f}s")
                deadline = time.monotonic() + BUSY_FRESH_S
            time.sleep(POLL_S)

    def _others_busy(self) -> bool:
        """A member inside a declared section (rank 0 alone in an evaluation, say) asks for
        the next generation only when it leaves it, and the agent waits for it: so does this
        one, however long the section (its watchdog ends a member that overruns its budget),
        instead of giving up at its own timeout and ending a job that was only waiting."""
        busy = [m for m in self.members if m != self.me and is_busy(self.store, m)]
        if busy and not self._said_busy:
            logger.warning("waiting past %.0fs for the next generation: member(s) %s busy in a "
                        "declared section", self.timeout_s, ", ".join(map(str, busy)))
        self._said_busy = bool(busy)
        return bool(busy)

    def report_fault(self, g: int) -> None:
        """Generation ``g`` failed here: this member asks to be in the next one."""
        self.store.set(want_key(self.me), str(g))

    def evict(self, members: list[int], detail: str) -> None:
        for m in members:
            self.store.set(evict_key(m), detail)

    def evicted(self) -> bool:
        return self.store.check([evict_key(self.me)])

    def left_out(self) -> bool:
        """The newest generation, newer than this worker's, does not hold it."""
        newest = self.newest()
        return newest > self.generation and self.me not in json.loads(
            self.store.get(gen_key(newest)))

    def host_leaving(self) -> bool:
        """This worker's host was removed from the job: a generation that leaves it out is
        its leave, not an eviction (after a fault, its members ask with the others)."""
        return bool(self.store.check([LEAVING_KEY]))

    def changed(self) -> bool:
        """A newer generation than this worker's is published (a member joins or left)."""
        return self.newest() != self.generation

    @property
    def rank(self) -> int:
        return self.members.index(self.me)

    def enter(self, after: int, pg_timeout: datetime.timedelta, *,
              joining: bool = False) -> None:
        """Takes this worker into the first generation after ``after`` that holds it, and forms
        its process group. Every member meets the others at the door first: one that died
        before it got there (a moment after a join was published, say) would otherwise leave
        them in the group's formation until its timeout; at the door they wait for the
        agent's next generation instead, which leaves the dead one out (`wait_beyond`'s
        `Fenced` and TimeoutError pass through)."""
        while True:
            g = self.wait_beyond(after, joining=joining)
            try:
                if self._at_door(g) and self._form(g, pg_timeout):
                    break
            except RuntimeError as e:  # torch's DistNetworkError among them
                if self.gen_base is self.base:
                    raise  # this host's own agent is gone: so is this worker's job
                # the deciding agent's store died under the door (its host was lost): this
                # member asks its own agent for the next generation, which the agent after
                # it decides
                logger.warning("generation %d's store is gone (%s): asking for the next one",
                               g, str(e).splitlines()[0] if str(e) else type(e).__name__)
                self.report_fault(g)
            after = g  # superseded at the door or in the formation: the next one holds it?
        self.gen_store.set(formed_key(g, self.me), "1")

    def _form(self, g: int, pg_timeout: datetime.timedelta) -> bool:
        """Forms generation ``g``'s group; False when it was superseded meanwhile (a member
        died after the door)."""
        set_timeout = getattr(c10d, "_set_pg_timeout", None)  # feature, not version
        form = min(pg_timeout, datetime.timedelta(seconds=FORM_TIMEOUT_S))
        store = FormationStore(self.gen_base, group_prefix(g), lambda: self.newest() > g,
                               self.timeout_s)
        # Kept alive with the group: the C++ side calls back into this Python object, and a
        # group made later on it (`dist.new_group`) fails with "Not implemented" once it is
        # collected.
        self.group_store = store
        try:
            if self.reconfigure:
                reconfigure.form(store, self.rank, len(self.members), g, self.backend,
                                 pg_timeout, self.gen_port)
                return True
            _first_group_name()
            dist.init_process_group(self.backend, store=store, rank=self.rank,
                                    world_size=len(self.members),
                                    timeout=form if set_timeout else pg_timeout)
        except Exception:
            if self.newest() > g:
                return False
            raise
        if set_timeout:
            set_timeout(pg_timeout)
        return True

    def _at_door(self, g: int) -> bool:
        """True once every member of generation ``g`` is at its door; False when a newer
        generation was published meanwhile."""
        self._use_store_of(g)
        self.gen_store.set(door_key(g, self.me), "1")
        others = [door_key(g, m) for m in self.members]
        deadline = time.monotonic() + self.timeout_s
        while not self.gen_store.check(others):
            if self.newest() > g:
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {g}: members {self.members} not all at the "
                                   f"door within {self.timeout_s:.0f}s")
            time.sleep(POLL_S)
        return True

    def _use_store_of(self, g: int) -> None:
        """Generation ``g``'s store (its record names it; a record without one: the agent's
        own), one connection per store for the worker's life."""
        key = store_key(g)
        address = (self.store.get(key).decode() if self.store.check([key])
                   else f"{self.address[0]}:{self.address[1]}")
        base = self._stores.get(address)
        if base is None:
            host, _, port = address.rpartition(":")
            base = self._stores[address] = TCPStore(
                host, int(port), is_master=False,
                timeout=datetime.timedelta(seconds=self.timeout_s))
        self.gen_base, self.gen_store = base, PrefixStore(PREFIX, base)
        self.gen_port = int(address.rpartition(":")[2])
