"""Training state under torchrun: nothing survives in the process (torchrun restarts every
worker), so a commit is only the point the tiers save; recovery is the memory tier's copy of
the last commit, or the durable checkpoint, which every rank reads on start."""

from __future__ import annotations

import logging

from hvd_resilient.backends.torchdist.state import TorchDistState

logger = logging.getLogger(__name__)


class TorchrunState(TorchDistState):
    def sync(self) -> None:
        """DDP's constructor (or `fsdp.shard`) already broadcast rank 0's parameters, and every
        rank loaded the same checkpoint; the agreement proves it (and repairs what differs:
        the optimizer, the scaler, the EMA, which DDP never sends). Then the per-rank parts."""
        if self._collectives is not None and self._size() > 1:
            found = self._agree(self._collectives)
            if found.sent:
                logger.warning("sync: %s differed from rank 0's at start and were sent from it",
                            ", ".join(found.sent))
        self._apply_start_rng()
        self._apply_lr_scaling()
        self._run_hooks(self._after_sync)

    def commit(self) -> None:
        self._run_hooks(self._before_commit)
        self.last_commit_step = self.step

    def restore(self) -> None:
        """Never called: torchrun's recovery restarts every worker, which resume from the
        tiers; a caller that gets here assumed in-process recovery."""
        raise RuntimeError("torchrun keeps no commit in the process to restore: a failure "
                           "restarts every worker, which resume from the memory tier or the "
                           "durable checkpoint")

    def host_change_pending(self) -> bool:
        """torchrun restarts the whole group on any membership change: never anything to do."""
        return False
