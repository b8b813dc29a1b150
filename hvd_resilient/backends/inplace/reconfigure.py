"""torch's own in-place shrink, where the installed torch has it: one group reconfigured per
generation instead of a new group.

torch 2.14 added `init_process_group(..., enable_reconfigure=True)` and
`distributed_c10d._reconfigure(uuid, handles)` (Gloo, and `nccl2`, which 2.15's ``"nccl"``
means): the survivors re-initialise the communicator of the group they have, so
`dist.group.WORLD` stays the same object (measured 0.3-0.8 ms for a Gloo shrink, field notes
2026-12-06), and so does every handle a script holds on it. On torch 2.13, which has none of it,
each generation is a new group (`membership.Membership._form`). Which path runs is decided by
`available()`, a feature check, never a version compare: a build that back-ports the API gets
it, one that drops it (it is marked experimental) falls back.

Not exercised on this project's machines yet (torch 2.13 is what the tests run): the branch is
kept to this file and to two `if`s in `membership` and `backend`.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Store

REQUIRED = ("_reconfigure", "_get_reconfigure_handle", "_supports_reconfigure")
"""The private functions the path calls: all of them, or the fresh-group path."""


def available(module: Any = c10d) -> bool:
    """True when torch can reconfigure a group in place (``module``: for the unit test)."""
    return all(callable(getattr(module, name, None)) for name in REQUIRED)


def handle_key(rank: int) -> str:
    return f"reconfigure/{rank}"


def form(store: Store, rank: int, size: int, generation: int, backend: str,
         timeout: datetime.timedelta, uuid_base: int) -> None:
    """Generation ``generation``'s group as this worker's default group, reconfigured in place:
    created (in the reconfigure regime) the first time, then re-initialised with the members'
    handles, exchanged in rank order over ``store`` (the generation's own prefix, so a handle
    of a dead generation is never read). The uuid must be fresh at every initialisation:
    ``uuid_base`` (the agent's store port, the same for every member) plus the generation."""
    torch_c10d: Any = c10d  # the functions `available()` found (absent from 2.13's stubs)
    if not dist.is_initialized():
        torch_c10d.init_process_group(backend, store=store, rank=rank, world_size=size,
                                      timeout=timeout, enable_reconfigure=True)
    if not torch_c10d._supports_reconfigure():
        raise RuntimeError(f"torch has _reconfigure, but its {backend!r} group does not "
                           "support it; run with a backend that does (gloo, nccl2)")
    store.set(handle_key(rank), torch_c10d._get_reconfigure_handle())
    handles = [store.get(handle_key(r)).decode() for r in range(size)]  # a list: rank order
    torch_c10d._reconfigure(uuid=uuid_base * 1_000_000 + generation, handles=handles,
                      timeout=timeout).wait()
