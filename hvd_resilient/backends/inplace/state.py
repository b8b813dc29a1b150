"""Training state of the in-place backend: commits in process memory (`state.commits`),
restored by the survivors of a fault, and a verified sync after every new generation."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from hvd_resilient.events import EventLog
from hvd_resilient.log import get
from hvd_resilient.state.agreement import Collectives
from hvd_resilient.state.commits import LocalCommits
from hvd_resilient.state.core import StateCore

log = get("state")


class GenerationChanged(Exception):
    """Raised by `commit()` on every rank at the same step when a newer generation is
    published (a worker joins): the backend moves the members to it, nothing is restored."""


class InPlaceState(StateCore):
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        rank: Callable[[], int],
        size: Callable[[], int],
        collectives: Collectives,
        generation_changed: Callable[[], bool] = lambda: False,
        sampler: Any | None = None,
        scheduler: Any | None = None,
        seed: int = 0,
        lr_scaling: str = "none",
        events: EventLog | None = None,
        **extras: Any,
    ) -> None:
        self._init_core(seed=seed, lr_scaling=lr_scaling, events=events, extras=extras)
        self.model, self.optimizer = model, optimizer
        self.sampler, self.scheduler = sampler, scheduler
        self._rank_fn, self._size_fn = rank, size
        self._collectives = collectives
        self._generation_changed = generation_changed
        self._move = False
        for k, v in extras.items():
            setattr(self, k, v)
        self.step = self.samples = 0
        self.lr_scale = 1.0
        self.resume_rng: dict[str, Any] | None = None
        self.ckpt_requested = self.ckpt_published = -1
        self.fatal = ""
        self._synced_once = False
        self._commits = LocalCommits({"model": model, "optimizer": optimizer,
                                      "sampler": sampler, "scheduler": scheduler,
                                      **self._stateful})
        self._saved_attributes = self._attributes_copy()

    def _rank(self) -> int:
        return self._rank_fn()

    def _size(self) -> int:
        return self._size_fn()

    def _attributes_copy(self) -> dict[str, Any]:
        return copy.deepcopy({**self._get_attributes(), "fatal": self.fatal})

    def save(self) -> None:
        """Takes the commit point (local)."""
        self._commits.save()
        self._saved_attributes = self._attributes_copy()

    # -- the protocol ---------------------------------------------------------------------
    def commit(self) -> None:
        self._run_hooks(self._before_commit)
        t0 = time.perf_counter()
        self.save()
        self.last_commit_step = self.step
        if self._rank() == 0:
            self.events.emit("commit", seconds=round(time.perf_counter() - t0, 6))
        if self._move:
            self._move = False
            raise GenerationChanged()

    def restore(self) -> None:
        before = self.step
        self._commits.restore()
        self._put_attributes(copy.deepcopy(self._saved_attributes))
        self.events.emit("restore", from_step=before, to_step=self.step,
                         lost_steps=before - self.step)
        log.warning("restored the last commit: step %d -> %d", before, self.step)

    def sync(self) -> None:
        """Rank 0's resume outcome (a failed resume, the saved random streams), then every
        component agreed and proven equal (`state.agreement`); the result is the commit
        point, so a fault before the next commit comes back here."""
        if self._size() > 1:
            head = self._collectives.broadcast_object(
                {"fatal": self.fatal, "resume_rng": self.resume_rng})
            self.fatal, self.resume_rng = head["fatal"], head["resume_rng"]
            self._agree(self._collectives)
        if not self._synced_once:
            self._apply_start_rng()
            self._synced_once = True
        self._apply_lr_scaling()
        self.save()
        self._run_hooks(self._after_sync)

    def reset_done(self) -> None:
        """The backend formed a new generation: the after-reset hooks."""
        self._run_hooks(self._after_reset)

    def mark_commit_point(self) -> None:
        self.save()

    def mark_fatal(self, error: str) -> None:
        super().mark_fatal(error)
        self.save()

    def host_change_pending(self) -> bool:
        """True on every rank when a newer generation waits (a worker joins): commit now, and
        the move follows. One one-element broadcast a step (rank 0 reads the store)."""
        self._move = self._move or self._generation_changed()
        return self._move

    def load_checkpoint_state(self, sd: dict[str, Any]) -> None:
        """Rank 0 at start; the first sync spreads it."""
        super().load_checkpoint_state(sd)
        self.save()
        self.last_commit_step = self.step
