"""The training-state protocol: everything the trainer, the durable and memory tiers and a
backend's recovery loop call on a state, and nothing else.

Each backend's state implements all of it (`tests/unit/test_state_protocol.py` checks): the
Horovod and in-place ones survive in memory (commit/restore, a sync after every reset or new
generation), the torchrun one survives through the tiers (a restart is a new process; its
commit is a no-op point, its reset hooks never fire). Code above the state calls these
methods, never `hasattr` probes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from hvd_resilient.events import EventLog
from hvd_resilient.state.agreement import Component


@runtime_checkable
class TrainingState(Protocol):
    model: Any
    optimizer: Any
    sampler: Any
    scheduler: Any
    step: int
    samples: int
    epoch: int
    events: EventLog
    last_commit_step: int
    ckpt_requested: int
    ckpt_published: int
    fatal: str

    # -- surviving a failure in memory ----------------------------------------------------
    def commit(self) -> None:
        """A collective: every rank, at the same step. Runs the on_commit hooks first."""

    def restore(self) -> None:
        """Back to the last commit (local)."""

    def sync(self) -> None:
        """A collective after every (re)start: every rank holds rank 0's state, verified."""

    def mark_commit_point(self) -> None:
        """Makes the current state what a restore returns to (after loading a checkpoint)."""

    def host_change_pending(self) -> bool:
        """True on every rank when the membership is about to change (a collective)."""

    # -- hooks ------------------------------------------------------------------------------
    def on_sync(self, fn: Callable[[], None]) -> None: ...

    def on_commit(self, fn: Callable[[], None]) -> None: ...

    def after_reset(self, fn: Callable[[], None]) -> None:
        """After every in-process reset (never under a backend that restarts processes)."""

    def mark_fatal(self, error: str) -> None: ...

    # -- what the tiers save and load -----------------------------------------------------
    def checkpoint_state(self, rng_streams: list[dict[str, Any]]) -> dict[str, Any]: ...

    def run_state(self, rng_streams: list[dict[str, Any]]) -> dict[str, Any]: ...

    def load_checkpoint_state(self, sd: dict[str, Any]) -> None: ...

    def load_run_state(self, sd: dict[str, Any]) -> None: ...

    def model_state(self) -> dict[str, Any]: ...

    def sharded(self) -> bool: ...

    # -- agreement --------------------------------------------------------------------------
    def sync_components(self) -> list[Component]: ...

    def state_digests(self) -> dict[str, str]: ...

    def params_sha256(self) -> str: ...
