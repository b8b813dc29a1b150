"""`@hvd_resilient.run` for a Horovod script ported with the migration page's lines: the
backend's elastic run loop, plus what makes a full restart resume instead of start over.

Why: the backend's loop (`backends/horovod/run.py`) recovers in memory while some worker
survives. When none does (horovodrun's driver killed, the job preempted), the supervisor
relaunches the script, and without the tiers the relaunch trained from epoch 1 again. The
Trainer wires the memory tier and durable checkpoints itself (`trainer.py`); a ported script
has no Trainer, so this wrapper wires the same parts around the user's loop:

* resume, before the first sync, on rank 0 (`DurableCheckpoints.start`): the newest commit in
  the host's memory tier, else the newest verified durable checkpoint; the sync then spreads
  it, so plain attributes (``epoch``, ``batch``), the sampler's position and the random
  streams come back as a restore brings them back. A `resume` event says from which commit
  and from where (``source``: memory or durable), so the report counts what was redone;
* every commit also in the memory tier (a no-op where it is off);
* durable checkpoints only where the run was given a checkpoint location of its own
  (`hvd-resilient run --checkpoint URL`, or ``HVD_RESILIENT_CHECKPOINT_URL``): at commits,
  every ``checkpoint.every`` commits, or with ``every`` 0 (the default) at the first commit
  of each new epoch (the Trainer's "end of each epoch": a ported loop's epoch end is not a
  point this wrapper sees; its first commit after it is), and a final one when the loop
  returns. Without a location of its own, `hvd-resilient run` would write the run folder's
  default one: a checkpoint of every epoch that nobody asked for.

Only inside a run (``HVD_RESILIENT_RUN_ID`` set, as `hvd-resilient run` sets it): a script
under a plain `horovodrun` has no run identity to resume under, and would otherwise resume
another script's commits of the default run id. Not where the script wired the tiers itself
(this project's examples and jobs build their own `DurableCheckpoints`), nor where it writes
its own `start` (an instrumented job that owns its lifecycle): a second resume would fight
the first.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from typing import Any, TypeVar

from hvd_resilient import backends
from hvd_resilient.backends.horovod import ported as backend_ported
from hvd_resilient.backends.horovod.run import HEARTBEAT_TIMEOUT_S
from hvd_resilient.backends.horovod.run import run as backend_run
from hvd_resilient.config import TrainConfig
from hvd_resilient.launcher_env import RUN_ID_ENV
from hvd_resilient.state.core import StateCore
from hvd_resilient.state.protocol import TrainingState
from hvd_resilient.training.durable import DurableCheckpoints
from hvd_resilient.training.memory_tier import MemoryCommits

logger = logging.getLogger(__name__)
T = TypeVar("T")



def run(func: Any = None, *, heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        progress_timeout_s: float | None = None) -> Any:
    """`hvd_resilient.run`: the backend's `run` (same arguments, same semantics) with the
    memory tier and durable checkpoints around a ported loop (module doc)."""
    if func is None:
        return functools.partial(run, heartbeat_timeout_s=heartbeat_timeout_s,
                                 progress_timeout_s=progress_timeout_s)
    tiers: list[PortedTiers] = []  # the call in progress's, set by the begin hook

    def body(state: TrainingState, *args: Any, **kwargs: Any) -> Any:
        result = func(state, *args, **kwargs)
        if tiers:  # inside the attempt: a rank lost during the final save is recovered
            tiers[-1].finish()
        return result

    inner = backend_run(functools.wraps(func)(body), heartbeat_timeout_s=heartbeat_timeout_s,
                        progress_timeout_s=progress_timeout_s)

    @functools.wraps(func)
    def wrapper(state: TrainingState, *args: Any, **kwargs: Any) -> Any:
        def begin(loop: backend_ported.PortedLoop) -> None:
            made = PortedTiers.wire(loop)
            if made is not None:
                tiers.append(made)

        try:
            with backend_ported.extended(begin):
                result = inner(state, *args, **kwargs)
            if tiers:
                tiers[-1].discard()  # the run is over: nothing resumes from its commits
            return result
        finally:
            if tiers:
                tiers.pop().close()

    return wrapper


def explicit_location(cfg: TrainConfig) -> bool:
    """Whether the run's checkpoint location is one of its own, not the run folder's default
    that `hvd-resilient run` hands every worker when --checkpoint was not given."""
    return cfg.checkpoint.url != Path(cfg.run_dir, "checkpoints").as_uri()


def wired_already(state: StateCore) -> bool:
    """The script built its own `DurableCheckpoints` or `MemoryCommits` over this state (they
    register their hooks on it at construction; the state keeps them in its hook lists).

    A `StateCore`, not a `TrainingState`: the hook lists are the base class's own, which every
    backend's state is; the protocol registers hooks and never lists them."""
    hooks = [*state._after_sync, *state._before_commit]
    return any(isinstance(getattr(h, "__self__", None), (DurableCheckpoints, MemoryCommits))
               for h in hooks)


class PortedTiers:
    """The memory tier and durable checkpoints of one ported loop, every rank (module doc)."""

    def __init__(self, cfg: TrainConfig, state: TrainingState) -> None:
        self.cfg, self.state = cfg, state
        backend = backends.get("horovod", fsdp=False, recovery=cfg.recovery,
                               deterministic=cfg.deterministic)  # no init: the script's
        self.memory = MemoryCommits(cfg, state, state.events, backend)
        self.durable = DurableCheckpoints(cfg, state, state.events, backend,
                                          memory_tier=self.memory)
        self.saves = explicit_location(cfg)
        """Durable checkpoints are written (resumed from in any case, where they exist)."""
        self._epoch = state.epoch

    @classmethod
    def wire(cls, loop: backend_ported.PortedLoop) -> PortedTiers | None:
        """The begin hook: builds the tiers and resumes (rank 0; the first sync spreads it),
        or None where this wrapper must leave the state alone (module doc)."""
        state = loop.state
        if RUN_ID_ENV not in os.environ or not loop.writes_events or wired_already(state):
            return None
        cfg = TrainConfig.from_sources()  # the worker's settings (HVD_RESILIENT_*), once
        tiers = cls(cfg, state)
        # A failure is recorded in the state and stops every rank at the first sync, never
        # rank 0 alone while the others train from scratch.
        tiers.durable.start()
        if tiers.saves:
            state.on_sync(tiers._note_epoch)
            state.on_commit(tiers._at_commit)
        return tiers

    def _note_epoch(self) -> None:
        """After every sync (the start, a reset): the synced epoch, the same on every rank,
        is the one the next commit compares with."""
        self._epoch = self.state.epoch

    def _at_commit(self) -> None:
        """Every rank at each commit, before the commit point is taken (so the checkpoint is
        the commit's state and step, and the request is committed with it): the Trainer's
        policy on commits, the ported loop's step unit."""
        every = self.cfg.checkpoint.every
        if every > 0:
            if self.durable.due():
                self.durable.save()
            return
        changed = self.state.epoch != self._epoch
        self._epoch = self.state.epoch
        if changed:
            self.durable.save()

    def finish(self) -> None:
        """Every rank, when the loop returned: the final durable checkpoint, published
        before anyone returns (where checkpoints are written)."""
        if self.saves:
            self.durable.finish()

    def discard(self) -> None:
        self.memory.discard()

    def close(self) -> None:
        self.durable.close(timeout=self.cfg.checkpoint.grace_seconds)
        self.memory.close()
