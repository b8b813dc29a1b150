"""In place for a torchrun DDP script, in a few lines (docs/inplace-ddp.md).

    from hvd_resilient import inplace

    inplace.init_process_group(backend="gloo")   # instead of torch.distributed's
    model = DDP(model)                            # as before
    state = inplace.State(model, optimizer, sampler=loader.sampler, epoch=0)

    @inplace.run
    def train(state):
        for epoch in range(state.epoch, epochs):
            ...                                    # the script's own loop, unchanged
            state.epoch = epoch + 1
            state.commit()

    train(state)

Under `hvd-resilient run --launcher inplace` (the in-place agent) a lost worker is dropped from
the next generation and the survivors go on in their own processes: each restores its last
commit (in its memory), the new generation's group is formed, rank 0's state is sent and
verified, every DDP wrapper and `DistributedSampler` in the state is moved to the new group
(`backends.inplace.ddp`), and ``train(state)`` is called again. Anywhere else (plain torchrun,
one process) the same lines do what the script did before: torch's own
`init_process_group`, ``train(state)`` called once, `commit()` a counter.

Process-wide, like torch's own default group: `init_process_group` sets up this worker's
session, which `State` and `run` use.
"""

from __future__ import annotations

import datetime
import functools
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from hvd_resilient import event_names as ev
from hvd_resilient.backends import INPLACE_AGENT_ENV
from hvd_resilient.backends.inplace import reconfigure
from hvd_resilient.backends.inplace.backend import InPlaceBackend
from hvd_resilient.backends.inplace.ddp import DDPSession, DDPState, run_in_place, set_torchrun_env
from hvd_resilient.cli_errors import exit_on_error
from hvd_resilient.errors import ConfigError

__all__ = ["DOCS", "State", "init_process_group", "run", "under_agent"]

T = TypeVar("T")
DOCS = "docs/inplace-ddp.md"
_session: DDPSession | None = None


def under_agent() -> bool:
    """True in a worker the in-place agent started (it sets `HVD_RESILIENT_AGENT`)."""
    return INPLACE_AGENT_ENV in os.environ


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: datetime.timedelta | None = None, **kwargs: Any) -> None:
    """`torch.distributed.init_process_group`, drop-in. Under the in-place agent this worker
    joins the agent's first generation that holds it (the agent sets no RANK: ranks change
    inside the running workers) and torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, ...)
    are set to the generation's; elsewhere it is torch's own call, arguments as given.

    Under the agent: ``backend`` gloo (None means gloo; another one only where torch can
    reconfigure a group in place, `backends.inplace.reconfigure`), ``timeout`` the
    collectives' (default `recovery.pg_timeout_seconds`); the rendezvous is the agent's, so
    ``init_method`` other than env://, ``rank``, ``world_size`` and ``store`` are refused
    (one line, exit 78).
    """
    if not under_agent():
        if timeout is not None:
            kwargs["timeout"] = timeout
        dist.init_process_group(backend=backend, init_method=init_method, **kwargs)
        return
    exit_on_error(_join)(backend, init_method, timeout, kwargs)


def _join(backend: str | None, init_method: str | None, timeout: datetime.timedelta | None,
          kwargs: dict[str, Any]) -> None:
    from hvd_resilient import log
    from hvd_resilient.config import TrainConfig
    from hvd_resilient.events import EventLog

    global _session
    if _session is not None or dist.is_initialized():
        raise ConfigError("inplace.init_process_group: called twice in one worker")
    if kwargs or init_method not in (None, "env://"):
        given = sorted([*kwargs, *(["init_method"] if init_method else [])])
        raise ConfigError(f"inplace.init_process_group: {', '.join(given)} cannot be given "
                          "under --launcher inplace (the agent is the rendezvous and sets the "
                          f"ranks); pass backend= and timeout= only ({DOCS})")
    in_place = reconfigure.available()
    pg_backend = backend or "gloo"
    if pg_backend != "gloo" and not in_place:
        raise ConfigError(f"inplace.init_process_group: backend {pg_backend!r} needs torch's "
                          "in-place reconfigure (torch >= 2.14); on this torch a generation is "
                          f"a new Gloo group: use backend='gloo' ({DOCS})")
    cfg = TrainConfig.from_sources()  # the worker's settings (HVD_RESILIENT_*), once
    recovery = cfg.recovery
    pg_timeout = (timeout.total_seconds() if timeout is not None
                  else recovery.pg_timeout_seconds)
    b = InPlaceBackend(pg_timeout_seconds=pg_timeout,
                       heartbeat_timeout_s=recovery.heartbeat_timeout_seconds,
                       generation_timeout_s=recovery.generation_timeout_seconds,
                       pg_backend=pg_backend, reconfigure=in_place)
    b.init()
    log.setup(rank_fn=b.rank, level=cfg.observability.log_level)
    events = EventLog(f"{cfg.run_dir}/events.jsonl", rank=b.rank, size=b.size,
                      lease_epoch=cfg.checkpoint.lease_epoch)
    session = DDPSession(b, events)
    if b.joining:  # a replacement or standby: a group of its own until it is taken in
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        session.solo = True
    set_torchrun_env(b.rank(), b.size())
    events.emit(ev.START, pid=os.getpid(), host=socket.gethostname(), backend=b.name,
                run_id=cfg.run_id, adapter="ddp", reconfigure=in_place)
    _session = session


class State(DDPState):
    """What survives a fault: ``model`` (the DDP wrapper, or the plain module), ``optimizer``,
    the script's own counters as keywords (``epoch=0``, read and set as ``state.epoch``),
    ``sampler`` (a `DistributedSampler`: re-planned for every generation; this library's
    `ElasticDataSampler`: committed too). Extras with a state dict (a scheduler, a GradScaler)
    are committed and synced as components. `commit()` takes the commit point; every rank
    must call it at the same place in its loop."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 sampler: Any | None = None, **attributes: Any) -> None:
        super().__init__(model, optimizer, session=_session, sampler=sampler, **attributes)


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Decorates ``train(state, ...)``: called once, and again after every fault from the last
    commit, in the survivors' own processes. The function must start from the state (its
    loop from ``state.epoch``, not from 0). Not under the agent: called once."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> T:
        if state.session is None:
            return func(state, *args, **kwargs)
        result: T = run_in_place(state.session, state,
                                 functools.partial(func, state, *args, **kwargs))
        return result

    return wrapper
