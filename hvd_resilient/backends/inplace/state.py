"""Training state of the in-place backend: commits in process memory (`state.commits`),
restored by the survivors of a fault, and a verified sync after every new generation."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from hvd_resilient.backends.torchdist.fsdp import holds_sharded_module
from hvd_resilient.backends.torchdist.state import TorchDistState
from hvd_resilient.state.agreement import Collectives
from hvd_resilient.state.commits import LocalCommits
from hvd_resilient.state.core import InMemoryState


class GenerationChanged(Exception):
    """Raised by `commit()` on every rank at the same step when a newer generation is
    published (a worker joins): the backend moves the members to it, nothing is restored."""


class InPlaceState(InMemoryState, TorchDistState):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 collectives: Collectives,
                 generation_changed: Callable[[], bool] = lambda: False,
                 **kwargs: Any) -> None:
        super().__init__(model, optimizer, collectives=collectives, **kwargs)
        self._generation_changed = generation_changed
        self._move = False
        # A sharded model's commit is the memory tier's (every rank's shards, the lost one's
        # included); the holder re-shards it and `durable_sharded` reloads it at a new
        # generation. Here only what every rank holds whole.
        whole = {} if holds_sharded_module(model) else {"model": model, "optimizer": optimizer}
        self._commits = LocalCommits({**whole, "sampler": self.sampler,
                                      "scheduler": self.scheduler, **self._stateful})
        self._saved_attributes = self._attributes_copy()

    def _attributes_copy(self) -> dict[str, Any]:
        return copy.deepcopy({**self._get_attributes(), "fatal": self.fatal})

    def save(self) -> None:
        """Takes the commit point (local)."""
        self._commits.save()
        self._saved_attributes = self._attributes_copy()

    # -- the protocol ---------------------------------------------------------------------
    def commit(self) -> None:
        self._take_commit()
        if self._move:
            self._move = False
            raise GenerationChanged()

    def restore(self) -> None:
        before = self.step
        self._commits.restore()
        self._put_attributes(copy.deepcopy(self._saved_attributes))
        self._restored(before)

    def sync(self) -> None:
        """Rank 0's resume outcome (a failed resume, the saved random streams), then every
        component agreed and proven equal (`state.agreement`); the result is the commit
        point, so a fault before the next commit comes back here."""
        if self._size() > 1:
            assert self._collectives is not None  # the constructor requires them
            def take_head(everyone: list[Any]) -> None:  # rank 0's, before anything is sent
                self.fatal, self.resume_rng = everyone[0]["fatal"], everyone[0]["resume_rng"]

            head = {"fatal": self.fatal, "resume_rng": self.resume_rng}
            self._agree(self._collectives, rider=head if self._rank() == 0 else None,
                        on_riders=take_head)
        self._after_agreement()

    def reset_done(self) -> None:
        """The backend formed a new generation: the after-reset hooks."""
        self._run_hooks(self._after_reset)

    def host_change_pending(self) -> bool:
        """True on every rank when a newer generation waits (a worker joins): commit now, and
        the move follows. One one-element broadcast a step (rank 0 reads the store)."""
        self._move = self._move or self._generation_changed()
        return self._move
