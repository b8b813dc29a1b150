"""Durable checkpoints of a training state: what survives the loss of the whole job.

Only rank 0 writes to the store. A save is one collective (every rank's random streams are
gathered, since a bit-identical resume needs them all), then rank 0 copies the tensors to host
memory inside the step and hands the copy to a background writer: the other ranks never wait
for S3, and rank 0 waits only for the copy. On start, rank 0 reads the newest checkpoint
(Horovod: a sync spreads it) or every rank does (torchrun: all workers start together).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hvd_resilient import rng
from hvd_resilient.backends.base import Backend
from hvd_resilient.checkpoint.host_buffers import pool
from hvd_resilient.checkpoint.manager import CheckpointManager
from hvd_resilient.checkpoint.manifest import REPLICATED, CheckpointInfo
from hvd_resilient.checkpoint.serialize import check_state_dict_keys
from hvd_resilient.checkpoint.split import (
    LEGACY_FILE,
    decode_file,
    join_state,
    split_state,
    warm_buffers,
)
from hvd_resilient.checkpoint.writer import AsyncCheckpointWriter
from hvd_resilient.config import TrainConfig
from hvd_resilient.errors import ResumeError
from hvd_resilient.events import EventLog
from hvd_resilient.log import get
from hvd_resilient.state_core import StateCore

log = get("durable")
STATE_FILE = LEGACY_FILE


class DurableCheckpoints:
    def __init__(self, config: TrainConfig, state: StateCore, events: EventLog,
                 backend: Backend) -> None:
        self.config = config
        self.backend = backend
        self.state = state
        self.events = events
        self._manager: CheckpointManager | None = None
        self._writer: AsyncCheckpointWriter | None = None
        self.last_saved_step = -1
        self._last_save_time: float | None = None
        self._warm_started = False

    def _emit(self, name: str, fields: dict[str, Any]) -> None:
        self.events.emit(name, **fields)

    @property
    def manager(self) -> CheckpointManager:
        if self._manager is None:
            self._manager = CheckpointManager(
                self.config.checkpoint_url, keep_last=self.config.keep_last,
                keep_every=self.config.keep_every, on_event=self._emit,
            )
        return self._manager

    @property
    def writer(self) -> AsyncCheckpointWriter:
        if self._writer is None:
            self._writer = AsyncCheckpointWriter(self.manager, on_event=self._emit)
        return self._writer

    # -- resume ----------------------------------------------------------------------------
    def resume(self) -> int | None:
        """Loads the newest verified checkpoint into the state (rank 0 under Horovod, every
        rank under torchrun). No collective here: under Horovod a worker that joins later runs
        this code too, while the others wait in sync."""
        found = self.manager.load_latest(decode=decode_file)
        if found is None:
            log.info("no checkpoint at %s: starting from scratch", self.config.checkpoint_url)
            return None
        info, files = found
        if info.layout != REPLICATED:
            raise ResumeError(
                f"checkpoint {self.config.checkpoint_url} step {info.step} is {info.layout} "
                f"(written with fsdp at world size {info.world_size}); resume it with --fsdp "
                "under torchrun, or start a new run id")
        expected = self.state.model_keys()
        try:
            sd = join_state(files)
            check_state_dict_keys(expected, set(sd["model"]))
        except Exception as e:
            raise ResumeError(f"checkpoint {self.config.checkpoint_url} step {info.step}: {e}") \
                from None
        self.state.load_checkpoint_state(sd)
        return self._resumed(info)

    def _resumed(self, info: CheckpointInfo) -> int:
        """Bookkeeping once a checkpoint is in the state: the resume event and log line."""
        self.last_saved_step = self.state.step
        self._last_save_time = info.created
        if self.backend.rank() == 0:
            self.events.emit("resume", from_step=self.state.step, epoch=self.state.epoch,
                             saved_world_size=info.world_size, layout=info.layout)
        log.info("resumed from checkpoint step %d (epoch %d, saved at world size %d)",
                 self.state.step, self.state.epoch, info.world_size)
        return self.state.step

    # -- save --------------------------------------------------------------------------------
    def seconds_since_save(self) -> float | None:
        """Time since the newest checkpoint this process handed to the store (what a crash
        now would cost, at most)."""
        return None if self._last_save_time is None else time.time() - self._last_save_time

    def due(self) -> bool:
        every, step = self.config.checkpoint_every, self.state.step
        if every > 0 and step >= 1 and not self._warm_started:
            self._start_warming()
        return every > 0 and step % every == 0 and step != self.last_saved_step

    def _start_warming(self) -> None:
        """Rank 0, once the optimizer has its state (after the first step): fault in the
        snapshot buffers on a background thread, so that the first checkpoint's copy does not
        pay for fresh memory inside the step (see ``split.warm_buffers``)."""
        self._warm_started = True
        if self.backend.rank() != 0 or not pool().enabled:
            return

        def warm() -> None:
            try:
                n = warm_buffers(self.state.checkpoint_state([]))
                log.debug("snapshot buffers warmed: %d bytes", n)
            except Exception as e:  # the state changed under us: the first save pays instead
                log.debug("snapshot buffers not warmed: %s", e)

        threading.Thread(target=warm, name="ckpt-warm", daemon=True).start()

    def save(self, *, blocking: bool = False) -> None:
        """Collective: every rank must call it at the same step."""
        t0 = time.perf_counter()
        streams = self.backend.allgather_object(rng.capture())
        self.last_saved_step = self.state.step
        self._last_save_time = time.time()
        if self.backend.rank() != 0:
            return
        def payload() -> dict[str, Any]:  # the copy into host memory: split_state snapshots
            return split_state(self.state.checkpoint_state(streams))

        kwargs = dict(step=self.state.step, epoch=self.state.epoch, world_size=self.backend.size(),
                      run_id=self.config.run_id)
        if blocking:
            self.writer.save_sync(**kwargs, payload=payload, timeout=self.config.grace_seconds)
        else:
            # A callable: the writer drops an older pending snapshot before making this one, so
            # at most two copies of the state are in host memory (one uploading, one pending).
            self.writer.submit(**kwargs, payload=payload, stall_before=time.perf_counter() - t0)

    def close(self, timeout: float | None = None) -> None:
        if self._writer is not None:
            self._writer.close(timeout)
