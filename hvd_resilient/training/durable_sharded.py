"""Durable checkpoints of an FSDP-sharded training state (torchrun with `--fsdp`).

The replicated path (`durable.DurableCheckpoints`) has rank 0 write the whole state; with a
sharded model no rank holds it, and gathering it onto one rank is exactly what FSDP is used
to avoid. Here every rank saves its own shards through `checkpoint.sharded` (DCP async: the
step waits only for the copy to host memory), rank 0 adds the small replicated part (sampler,
counters, every rank's random streams, scheduler, extras) as ``run_state.pt``, and a resume
at any world size reshards model and optimizer state through DCP.

Only the hooks of `DurableCheckpoints` are filled in here: its public methods keep the order
of the collectives, the bounds on every wait, the events and the log lines.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

from hvd_resilient.backends.base import Backend
from hvd_resilient.backends.torchdist import fsdp
from hvd_resilient.checkpoint.errors import CheckpointError
from hvd_resilient.checkpoint.manifest import SHARDED, CheckpointInfo
from hvd_resilient.checkpoint.serialize import from_bytes, to_buffer
from hvd_resilient.checkpoint.sharded.checkpointer import ShardedCheckpointer
from hvd_resilient.config import TrainConfig
from hvd_resilient.errors import RESTARTABLE_EXIT_CODE, HvdResilientError, ResumeError
from hvd_resilient.events import EventLog
from hvd_resilient.state.protocol import TrainingState
from hvd_resilient.training.durable import DurableCheckpoints
from hvd_resilient.training.faults import FaultPlan
from hvd_resilient.training.memory_tier import Found, MemoryCommits

RUN_STATE_FILE = "run_state.pt"
"""Rank 0's file of a sharded checkpoint: `StateCore.run_state` (everything but the model and
the optimizer, which are in the shards)."""

GROUP_TIMEOUT = datetime.timedelta(minutes=10)
"""How long a checkpoint collective (on its own Gloo group) waits for a rank: long enough for
the slowest upload of a shard, finite so a lost rank ends the save instead of hanging it."""


class CommitLost(HvdResilientError):
    """In place, nothing to reload a sharded model from: ends every rank for a restart."""

    exit_code = RESTARTABLE_EXIT_CODE


class ShardedDurableCheckpoints(DurableCheckpoints):
    """Same interface and cadence as :class:`DurableCheckpoints`; every method is collective.

    At most one save is in flight. When the next is due while this rank still uploads the last
    one, the step waits for it (logged, and counted in the next save's ``stall_seconds``)
    rather than skip it: a skipped save could be the last one of the run, and unlike the
    replicated writer there is no cheap snapshot to keep pending, since the staged copy lives
    inside DCP's save. Checkpoints due faster than they upload mean --checkpoint-every is too
    small for the store.
    """

    layout = SHARDED

    def __init__(self, config: TrainConfig, state: TrainingState, events: EventLog,
                 backend: Backend, *, faults: FaultPlan | None = None,
                 memory_tier: MemoryCommits | None = None) -> None:
        super().__init__(config, state, events, backend, faults=faults, memory_tier=memory_tier)
        self.saver = self._new_saver()
        if fsdp.holds_sharded_module(state.model):  # in place: `_reload`
            state.after_reset(self._reload)

    def _new_saver(self) -> ShardedCheckpointer:
        """Created on every rank at the same point (creating a group is a collective)."""
        import torch.distributed as dist

        group = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
        return ShardedCheckpointer(
            self.manager, rank=self.backend.rank(), world_size=self.backend.size(),
            group=group, on_event=self._emit, name=self.config.run_id,
        )

    def _reload(self) -> None:
        """A new generation of the in-place backend (collective): checkpoints on its own
        group, the model re-sharded over it, then the last commit: the memory tier's (every
        old rank's shards, assembled), else the newest durable checkpoint. Neither: the job
        ends for a restart (exit 1), since the survivors' shards alone are not a model.

        A save in flight when the fault came is abandoned: its gather fails on the old
        group, so it never gets a manifest (``checkpoint_failed``)."""
        last = self.saver.last_saved
        self.saver = self._new_saver()
        self.saver.last_saved = last
        self.state.model.reshard()
        if self.memory_tier is not None:
            self.memory_tier.flush()  # this rank's own segment of the last commit, complete
        if self.resume(from_scratch=False) is None:
            raise CommitLost("no commit of the sharded model in the memory tier or the "
                             "durable store to reload in place; the job restarts")

    def _start_warming(self) -> None:
        """Nothing to warm: shards are written by ``torch.distributed.checkpoint``, not through
        the snapshot buffers, and a sharded ``state_dict()`` is collective (never call it from
        a background thread of one rank)."""
        self._warm_started = True

    # -- resume: both collective, and resharded onto this world size -------------------------
    def _apply_memory(self, found: Found) -> None:
        fsdp.apply_full_state(self.state.model, self.state.optimizer, found.files)
        self.state.load_run_state(found.files["run"])

    def _load_durable(self) -> CheckpointInfo | None:
        target = fsdp.sharded_state(self.state.model, self.state.optimizer)
        try:
            found = self.saver.load_latest(target)
        except CheckpointError as e:
            raise ResumeError(f"checkpoint {self._url}: {e}") from None
        if found is None:
            return None
        info, files = found
        fsdp.apply_sharded_state(self.state.model, self.state.optimizer, target)
        self.state.load_run_state(from_bytes(files[RUN_STATE_FILE]))
        return info

    # -- save: every rank its shards, rank 0 the run state ----------------------------------
    def _in_flight(self) -> bool:
        return self.saver.busy()

    def _save(self, streams: list[dict[str, Any]], *, since: float, blocking: bool) -> None:
        files: dict[str, Any] = {}
        if self.backend.rank() == 0:
            files[RUN_STATE_FILE] = to_buffer(self.state.run_state(streams))
        self.saver.save(
            self.state.step, self.state.epoch,
            fsdp.sharded_state(self.state.model, self.state.optimizer), files,
            run_id=self.config.run_id, stall_before=time.perf_counter() - since,
        )
        if blocking:
            self.saver.wait(self.config.checkpoint.grace_seconds)

    def _root_published(self) -> int:
        last = self.saver.last_saved
        return last.step if last is not None else -1

    def _flush(self, timeout: float) -> bool:
        """Every rank uploads its shards: every rank waits for its own before rank 0 can have
        published (the publish itself runs on rank 0 after a gather of all shard lists)."""
        return self.saver.wait(timeout)

    def _close(self, timeout: float) -> bool:
        return self.saver.close(timeout)
