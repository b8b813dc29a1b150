"""Monkeypatch: a torchrun worker's `init_process_group` (env:// or tcp://) keys its process
group under the rendezvous round, so a restarted round never reads the dead round's keys.

The hazard, in torch 2.13's own code:
- `DynamicRendezvousHandler.next_rendezvous` (elastic/rendezvous/dynamic_rendezvous.py)
  creates the shared TCPStore server once (`self._shared_tcp_store_server`, "Cached shared
  store server reference") and hands every later round the same cached
  `_bootstrap_store_info`: MASTER_ADDR/MASTER_PORT name the same store in every round.
- The agent tells its workers `TORCHELASTIC_USE_AGENT_STORE=True`
  (local_elastic_agent.py, `_start_workers`), and `_create_c10d_store` (rendezvous.py) then
  returns a plain client of that store, on the assumption written beside it: "We create a new
  TCPStore for every retry so no need to add prefix for each attempt". No new store is
  created per retry; the agent's lives as long as the agent.
- `init_process_group` wraps it in `PrefixStore("default_pg", store)` and
  `_new_process_group_helper` in `PrefixStore(f"{group_name}/", ...)`, with group name "0"
  (`_world.group_count` of a fresh process): the keys are the same in every round.
So the ranks of round N+1 find the addresses the ranks of round N published (Gloo's
connectFullMesh: "timed out connecting: SO_ERROR: Connection refused" to a dead process'
port) and the store-based barrier's counter already full.

`apply_round_store()` wraps `_create_c10d_store`: while the workers use the agent's store, the
store it returns is prefixed with `hvd_resilient/round<R>`, R being the rendezvous round
(`HVD_RESILIENT_RDZV_ROUND`, exported by `warm/torchrun.export_round`, the same on every node)
or else this agent's restart count. With `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (a fresh
store per round) nothing changes. Our own torchrun backend builds its store itself with the
same kind of prefix (`backends/torchrun/backend.py`); this covers an unchanged script.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)
ROUND_ENV = "HVD_RESILIENT_RDZV_ROUND"
PREFIX = "hvd_resilient/round{}"  # PrefixStore adds the "/"
_EXPECTED = ["hostname", "port", "rank", "world_size", "timeout", "use_libuv"]


class RoundStoreMismatch(RuntimeError):
    """The torch in use does not have the function this patch wraps, as this patch knows it."""


def round_of(env: os._Environ[str] | dict[str, str]) -> str:
    """The rendezvous round of this worker (agreed by every node), else the agent's restart
    count (right while no node joins later)."""
    return env.get(ROUND_ENV) or env.get("TORCHELASTIC_RESTART_COUNT", "0")


def apply_round_store() -> None:
    """Wraps `torch.distributed.rendezvous._create_c10d_store` (see the module doc). Raises
    `RoundStoreMismatch` when its target is not the function this patch was written for;
    applying twice is a no-op."""
    import torch.distributed as dist

    # the module: `torch.distributed.rendezvous` the attribute is the function of that name
    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    original = getattr(rendezvous, "_create_c10d_store", None)
    uses_agent = getattr(rendezvous, "_torchelastic_use_agent_store", None)
    if getattr(original, "_hvd_resilient_round_store", False):
        return
    if original is None or uses_agent is None:
        raise RoundStoreMismatch("torch.distributed.rendezvous has no _create_c10d_store / "
                                 "_torchelastic_use_agent_store: this torch is not one the "
                                 "round-store patch knows")
    params = list(inspect.signature(original).parameters)
    if params != _EXPECTED:
        raise RoundStoreMismatch(f"torch.distributed.rendezvous._create_c10d_store takes "
                                 f"{params}, the round-store patch expects {_EXPECTED}")

    def _create_c10d_store(hostname: str, port: int, rank: int, world_size: int,
                           timeout: Any, use_libuv: bool = True) -> Any:
        store = original(hostname, port, rank, world_size, timeout, use_libuv)
        if not uses_agent():
            return store  # a store of this round's own (rank 0 hosts it): nothing stale
        return dist.PrefixStore(PREFIX.format(round_of(os.environ)), store)

    _create_c10d_store._hvd_resilient_round_store = True  # type: ignore[attr-defined]
    setattr(rendezvous, "_create_c10d_store", _create_c10d_store)  # noqa: B010 - module attr
    logger.debug("torchrun round store: env:// and tcp:// groups keyed by rendezvous round")
