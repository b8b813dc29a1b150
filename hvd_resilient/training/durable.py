"""Durable checkpoints of a training state: what survives the loss of the whole job.

Only rank 0 writes to the store. A save is one collective (every rank's random streams are
gathered, since a bit-identical resume needs them all), then rank 0 copies the tensors to host
memory inside the step and hands the copy to a background writer: the other ranks never wait
for S3, and rank 0 waits only for the copy. On start, rank 0 reads the newest checkpoint
(Horovod: a sync spreads it) or every rank does (torchrun: all workers start together).

A step counts as saved only once its manifest is published and every rank has learned so
(``state.ckpt_published``, exchanged at the next commit): an upload that dies with rank 0 is
redone by the next rank 0 after the reset (:meth:`_after_sync`), and the run does not end
before its final checkpoint is published (:meth:`finish`). A failed start (a checkpoint that
does not fit, a store that stays unreachable, checkpoints that a --no-checkpoint-resume run
would overwrite) is recorded in the state and stops every rank at the first sync.

The public methods own the order of the collectives, the bookkeeping, the bound on every wait,
the events and the log lines; the sharded form (``durable_sharded``) fills in the hooks
(``_apply_memory``, ``_load_durable``, ``_save``, ``_in_flight``, ``_flush``,
``_root_published``, ``_close``, ``_start_warming``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, TypedDict

from hvd_resilient import event_names as ev
from hvd_resilient.backends.base import Backend
from hvd_resilient.checkpoint.fence import fenced, raise_fence
from hvd_resilient.checkpoint.host_buffers import pool
from hvd_resilient.checkpoint.manager import CheckpointManager
from hvd_resilient.checkpoint.manifest import REPLICATED, CheckpointInfo
from hvd_resilient.checkpoint.serialize import check_state_dict
from hvd_resilient.checkpoint.split import (
    decode_file,
    join_state,
    split_state,
    warm_buffers,
)
from hvd_resilient.checkpoint.stores import StoreError, TransientStoreError, redact_url
from hvd_resilient.checkpoint.writer import AsyncCheckpointWriter
from hvd_resilient.config import TrainConfig
from hvd_resilient.errors import RESTARTABLE_EXIT_CODE, HvdResilientError, ResumeError
from hvd_resilient.events import EventLog
from hvd_resilient.state import rng
from hvd_resilient.state.protocol import TrainingState
from hvd_resilient.training.fault_hooks import before_publish
from hvd_resilient.training.faults import FaultPlan
from hvd_resilient.training.memory_tier import Found, MemoryCommits

logger = logging.getLogger(__name__)

UPLOAD_WAIT_SECONDS = 1800.0
"""The longest a wait for checkpoint uploads in flight lasts (a save's for the previous one,
the final checkpoint's, a close without a timeout): an upload that takes longer means a store
that hangs, and the run ends with one line (a restart resumes from the newest published
checkpoint) rather than wait forever."""


class _SaveArgs(TypedDict):
    """What every save hands the writer, blocking or not."""

    step: int
    epoch: int
    world_size: int
    run_id: str


class StartRefused(HvdResilientError):
    """The job must not train: a start failed on some rank (the message says why)."""


class FinalCheckpointError(HvdResilientError):
    """The run reached its end but its final checkpoint could not be published. A relaunch
    resumes from the newest published one, so this one is worth a restart."""

    exit_code = RESTARTABLE_EXIT_CODE


class UploadStalled(HvdResilientError):
    """A save had to wait for the previous checkpoint's upload, which was still running after
    :data:`UPLOAD_WAIT_SECONDS`: the store hangs. A relaunch resumes from the newest
    published checkpoint."""

    exit_code = RESTARTABLE_EXIT_CODE


class DurableCheckpoints:
    """Durable checkpoints for a training state; custom loops use it like the trainer does::

        checkpoints = DurableCheckpoints(cfg, state, events, backend)
        checkpoints.start()          # every rank, before the (elastic) train function
        ...                          # in the loop: if checkpoints.due(): checkpoints.save()
        checkpoints.finish()         # every rank, at the end of the train function
    """

    layout = REPLICATED
    """What a save writes (the manifest's ``layout``; a memory-tier resume reports it)."""

    def __init__(self, config: TrainConfig, state: TrainingState, events: EventLog,
                 backend: Backend, *, faults: FaultPlan | None = None,
                 memory_tier: MemoryCommits | None = None) -> None:
        self.config = config
        self.memory_tier = memory_tier
        """The memory tier, looked at first on resume (None: durable checkpoints only)."""
        self.backend = backend
        self.state = state
        self.events = events
        self._faults = faults
        self._manager: CheckpointManager | None = None
        self._writer: AsyncCheckpointWriter | None = None
        self._last_save_time: float | None = None
        self._warm_started = False
        state.on_sync(self._after_sync)
        state.on_commit(self._before_commit)

    def _emit(self, name: str, fields: dict[str, Any]) -> None:
        self.events.emit(name, **fields)

    @property
    def _url(self) -> str:
        """The checkpoint location for messages (no credentials)."""
        return redact_url(self.config.checkpoint.url)

    @property
    def manager(self) -> CheckpointManager:
        if self._manager is None:
            opts = self.config.checkpoint
            hook = before_publish(self._faults, self.backend.rank())
            self._manager = manager = CheckpointManager(
                opts.url, keep_last=opts.keep_last, keep_every=opts.keep_every,
                on_event=self._emit, before_publish=hook,
                **self.config.store.store_options(opts.url),
            )
            # a relaunch that took the run over fences this job out; a newer generation (in
            # place) fences out the writers of the older ones
            if opts.lease_epoch or self.backend.numbers_generations:
                manager.before_publish = fenced(lambda: manager.store, opts.lease_epoch, hook,
                                                generation=self.backend.generation)
        return self._manager

    @property
    def writer(self) -> AsyncCheckpointWriter:
        if self._writer is None:
            self._writer = AsyncCheckpointWriter(self.manager, on_event=self._emit)
        return self._writer

    # -- start -----------------------------------------------------------------------------
    def start(self) -> None:
        """Every rank, before training: resumes (rank 0 under Horovod, every rank under
        torchrun) or refuses to start over existing checkpoints with --no-checkpoint-resume. A
        failure is never raised here on one rank alone: it is recorded in the state, and the
        first sync stops every rank with it (under torchrun the ranks agree on it right here)."""
        error = ""
        if self.backend.rank() == 0 or self.backend.resume_on_every_rank:
            try:
                if self.config.checkpoint.resume:
                    self.resume()
                else:
                    self._refuse_existing()
                if self.config.checkpoint.lease_epoch:  # once the store answered (resume's wait)
                    raise_fence(self.manager.store, self.config.checkpoint.lease_epoch)
            except (HvdResilientError, StoreError) as e:
                error = " ".join(str(e).split())
                self.events.emit(ev.FATAL, error=error, restartable=False)
        if self.backend.resume_on_every_rank:
            errors = [e for e in self.backend.allgather_object(error) if e]
            steps = set(self.backend.allgather_object(self.state.step))
            if not errors and len(steps) > 1:
                errors = [f"ranks resumed from different steps {sorted(steps)}: the store "
                          "changed while they read it; relaunch"]
            error = errors[0] if errors else ""
        if error:
            self.state.mark_fatal(error)

    def _published_steps(self) -> list[int]:
        """Steps whose folder holds a manifest, readable or not: a start from scratch would
        write them again."""
        scan = self.manager.scan()
        return sorted([c.step for c in scan.checkpoints] + list(scan.invalid))

    def _refuse_existing(self, why: str = "--no-checkpoint-resume was given") -> None:
        """A run must not write a second history over the first one."""
        steps = self._published_steps()
        if steps:
            raise ResumeError(
                f"checkpoints exist at {self._url} (newest step {steps[-1]}) and {why}: they "
                "are never rewritten; resume from them, set them aside with `hvd-resilient "
                "ckpt supersede URL` (or `hvd-resilient run --fresh-start`), or use another "
                "--run-id")

    def _start_from_scratch(self) -> None:
        """No checkpoint loaded: fine when there is none, refused when some exist that none
        verifies (a start from scratch would train over them)."""
        self._refuse_existing("none of them verifies (see checkpoint_skipped events and "
                              "`hvd-resilient ckpt verify`)")
        logger.info("no checkpoint at %s: starting from scratch", self._url)

    def _load_latest(self) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """`load_latest`, retried while the store is unreachable, up to store_wait_seconds:
        a relaunch often races a store that restarts with it."""
        wait = self.config.checkpoint.store_wait_seconds
        deadline = time.monotonic() + wait
        delay = 1.0
        while True:
            try:
                return self.manager.load_latest(decode=decode_file)
            except TransientStoreError as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreError(
                        f"checkpoint store {self._url} unreachable for {wait:g}s at start "
                        f"({e}); not starting from scratch over its checkpoints") from None
                logger.warning("checkpoint store unreachable at start (%s); retrying for %.0fs",
                            e, left)
                time.sleep(min(delay, left))
                delay = min(delay * 2, 10.0)

    # -- resume ----------------------------------------------------------------------------
    def resume(self, *, from_scratch: bool = True) -> int | None:
        """Loads the newest commit into the state: from the memory tier when it holds one at
        least as new as the newest durable checkpoint, else the newest verified durable one
        (rank 0 under Horovod, every rank under torchrun: there the memory tier's choice is a
        collective, and nothing before it may raise). Returns the step resumed from (None:
        none found; then ``from_scratch`` says whether a start from scratch is fine, or only
        where no checkpoint exists at all)."""
        t0 = time.perf_counter()
        tier = self.memory_tier
        if tier is not None and tier.enabled:  # else one scan: load_latest's
            floor = self._durable_floor()
            found = tier.newest(floor)
            if found is not None:
                self._apply_memory(found)
                return self._resumed(found.source, found.info.world_size, self.layout,
                                     published=floor, fetched=found.fetched, since=t0)
        info = self._load_durable()
        if info is None:
            if from_scratch:
                self._start_from_scratch()
            return None
        self._last_save_time = info.created
        return self._resumed("durable", info.world_size, info.layout, published=info.step,
                             since=t0)

    def _durable_floor(self) -> int:
        """The newest step with a durable manifest (-1: none, or the store unreachable: then
        a memory copy is all there is)."""
        try:
            steps = self._published_steps()
        except (HvdResilientError, StoreError, OSError):
            return -1
        return steps[-1] if steps else -1

    def _apply_memory(self, found: Found) -> None:
        """Hook: loads a commit the memory tier found into the state."""
        self._apply(found.files, found.info.step, found.info.world_size)

    def _load_durable(self) -> CheckpointInfo | None:
        """Hook: loads the newest verified durable checkpoint into the state and returns its
        manifest (None: there is none). No collective here: under Horovod a worker that joins
        later runs this code too, while the others wait in sync."""
        found = self._load_latest()
        if found is None:
            return None
        info, files = found
        if info.layout != REPLICATED:
            raise ResumeError(
                f"checkpoint {self._url} step {info.step} is {info.layout} (written with fsdp "
                f"at world size {info.world_size}); resume it with --fsdp under torchrun, or "
                "start a new run id")
        self._apply(files, info.step, info.world_size)
        return info

    def _apply(self, files: Mapping[str, Any], step: int, world_size: int) -> None:
        """Loads checkpoint files into the state, or one line saying why they do not fit."""
        try:  # a manifest that verifies can still hold what this model cannot take
            sd = join_state(files)
            check_state_dict(self.state.model_state(), sd["model"])
            self.state.load_checkpoint_state(sd)
        except Exception as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            more = f" (+{len(lines) - 1} more lines)" if len(lines) > 1 else ""
            raise ResumeError(
                f"checkpoint {self._url} step {step} cannot be loaded into this model: "
                f"{lines[0].strip()}{more}") from None

    def _resumed(self, source: str, world_size: int, layout: str, *, published: int,
                 since: float, fetched: list[int] | None = None) -> int:
        """Bookkeeping once a checkpoint is in the state: the resume event and log line.
        ``published`` is the newest durable step (a commit from memory is not durable)."""
        self.state.ckpt_requested = self.state.ckpt_published = published
        self.state.mark_commit_point()  # Horovod: what the first sync spreads
        seconds = time.perf_counter() - since
        if self.backend.rank() == 0:
            extra: dict[str, Any] = {"fetched_by": fetched} if fetched else {}
            if not self.state.sharded():  # a sharded digest would be a collective
                extra["digests"] = self.state.state_digests()  # = the saved step's, checkable
            self.events.emit(ev.RESUME, from_step=self.state.step, epoch=self.state.epoch,
                             saved_world_size=world_size, layout=layout, source=source,
                             durable_step=published, seconds=round(seconds, 3), **extra)
        logger.info("resumed from %s step %d (epoch %d, saved at world size %d) in %.1fs",
                 "checkpoint" if source == "durable" else f"the {source} copy of commit",
                 self.state.step, self.state.epoch, world_size, seconds)
        return self.state.step

    # -- save --------------------------------------------------------------------------------
    def seconds_since_save(self) -> float | None:
        """Time since the newest checkpoint this process handed to the store (what a crash
        now would cost, at most)."""
        return None if self._last_save_time is None else time.time() - self._last_save_time

    def due(self) -> bool:
        every, step = self.config.checkpoint.every, self.state.step
        if every > 0 and step >= 1 and not self._warm_started:
            self._start_warming()
        return every > 0 and step % every == 0 and step != self.state.ckpt_requested

    def _owed(self) -> bool:
        """The durable checkpoint is a whole interval behind the state: a save lost with rank 0
        (the survivors restored the commit before it, or one taken after it was requested, as
        the epoch's end commits right after a checkpoint step), or skipped because a host
        change interrupted the commit it follows. The same answer on every rank (synced state;
        a collective only when the save of this very step was requested but not published)."""
        every, st = self.config.checkpoint.every, self.state
        newest = max(st.ckpt_published, st.ckpt_requested)
        if every <= 0 or st.step <= 0:
            return False
        if st.step - newest >= every:
            return True
        if st.step - st.ckpt_published < every:
            return False
        if st.step != newest:
            return True
        # Requested at this step and not known published: owed unless this rank 0 is the
        # process uploading it (a reset that kept rank 0, e.g. a host added).
        held = self.backend.rank() == 0 and self._writer is not None and \
            self._writer.holds(st.step)
        return not self.backend.allgather_object(held)[0]

    def _after_sync(self) -> None:
        """Every rank, after each sync: stop if the start failed anywhere; redo what a reset
        lost."""
        if self.state.fatal:
            raise StartRefused(self.state.fatal)
        if self._owed():
            if self.backend.rank() == 0:
                logger.warning("durable checkpoint behind (newest published step %d, state at "
                            "step %d): saving now", self.state.ckpt_published, self.state.step)
            self.save()

    def _before_commit(self) -> None:
        """Learn what rank 0 published since the last commit, so the commit carries it."""
        if self.state.ckpt_requested > self.state.ckpt_published:
            self._confirm()

    def _root_published(self) -> int:
        """Hook, rank 0: the newest step whose manifest this process published."""
        last = self._writer.last_saved if self._writer is not None else None
        return last.step if last is not None else -1

    def _flush(self, timeout: float) -> bool:
        """Hook, every rank: waits up to ``timeout`` for this process's part of the uploads in
        flight (here rank 0's writer); False if they are still running."""
        if self.backend.rank() != 0 or self._writer is None:
            return True
        return self._writer.wait(timeout)

    def _in_flight(self) -> bool:
        """Hook: whether this rank must wait for its previous save before the next one. Never
        here: the writer keeps the newest snapshot pending instead (see writer.py)."""
        return False

    def _confirm(self) -> None:
        """Collective: every rank learns rank 0's newest published step."""
        mine = self._root_published() if self.backend.rank() == 0 else -1
        published = self.backend.allgather_object(mine)[0]
        if published > self.state.ckpt_published:
            self.state.ckpt_published = published

    def finish(self) -> None:
        """Every rank, at the end of training: the final state is saved and published before
        anyone returns. A rank 0 lost during the upload fails this collective, and the next
        rank 0 saves again after the reset; an upload that fails, or still runs after
        :data:`UPLOAD_WAIT_SECONDS`, stops the run with an error (a relaunch resumes from the
        newest published checkpoint)."""
        deadline = time.monotonic() + UPLOAD_WAIT_SECONDS
        stalled = False
        for attempt in range(2):
            if self.state.ckpt_requested != self.state.step or attempt:
                self.save()
            if not self._flush(max(0.0, deadline - time.monotonic())) and not stalled:
                stalled = True
                logger.error("the final checkpoint (step %d) was still uploading to %s after "
                          "%.0fs", self.state.step, self._url, UPLOAD_WAIT_SECONDS)
            self._confirm()
            if self.state.ckpt_published >= self.state.step:
                return
        why = f"still uploading after {UPLOAD_WAIT_SECONDS:.0f}s" if stalled else \
            "see checkpoint_failed in the event log"
        raise FinalCheckpointError(
            f"the final checkpoint (step {self.state.step}) could not be published to "
            f"{self._url} ({why}); the newest published one is step "
            f"{self.state.ckpt_published}")

    def _start_warming(self) -> None:
        """Hook, once the optimizer has its state (after the first step): here rank 0 faults
        in the snapshot buffers on a background thread, so that the first checkpoint's copy
        does not pay for fresh memory inside the step (see ``split.warm_buffers``)."""
        self._warm_started = True
        if self.backend.rank() != 0 or not pool().enabled:
            return

        def warm() -> None:
            try:
                n = warm_buffers(self.state.checkpoint_state([]))
                logger.debug("snapshot buffers warmed: %d bytes", n)
            except Exception as e:  # the state changed under us: the first save pays instead
                logger.debug("snapshot buffers not warmed: %s", e)

        threading.Thread(target=warm, name="ckpt-warm", daemon=True).start()

    def save(self, *, blocking: bool = False) -> None:
        """Collective: every rank must call it at the same step. ``blocking``: the save is
        written before this returns (the preemption path), within grace_seconds."""
        t0 = time.perf_counter()
        if self._in_flight():
            if not self._flush(UPLOAD_WAIT_SECONDS):
                raise UploadStalled(
                    f"step {self.state.step}: the previous checkpoint's upload to {self._url} "
                    f"was still running after {UPLOAD_WAIT_SECONDS:.0f}s")
            if self.backend.rank() == 0:
                logger.warning("step %d waited %.1fs for the previous checkpoint's upload "
                            "(consider a larger --checkpoint-every)", self.state.step,
                            time.perf_counter() - t0)
        streams = self.backend.allgather_object(rng.capture())
        self.state.ckpt_requested = self.state.step
        self._last_save_time = time.time()
        self._save(streams, since=t0, blocking=blocking)

    def _save(self, streams: list[dict[str, Any]], *, since: float, blocking: bool) -> None:
        """Hook, every rank, once the streams are gathered: hands this step's state to the
        upload (here rank 0's writer); ``since``: when the save began (its stall counts from
        there)."""
        if self.backend.rank() != 0:
            return
        if self.writer.holds(self.state.step):
            return  # in flight or published by this process already (a save redone after a reset)

        def payload() -> dict[str, Any]:  # the copy into host memory: split_state snapshots
            return split_state(self.state.checkpoint_state(streams))

        kwargs = _SaveArgs(step=self.state.step, epoch=self.state.epoch,
                           world_size=self.backend.size(), run_id=self.config.run_id)
        if blocking:
            self.writer.save_sync(**kwargs, payload=payload,
                                  timeout=self.config.checkpoint.grace_seconds)
        else:
            # A callable: the writer drops an older pending snapshot before making this one, so
            # at most two copies of the state are in host memory (one uploading, one pending).
            self.writer.submit(**kwargs, payload=payload, stall_before=time.perf_counter() - since)

    def close(self, timeout: float | None = None) -> None:
        """Waits up to ``timeout`` seconds (None: :data:`UPLOAD_WAIT_SECONDS`) for the uploads
        in flight, then stops them. One still running then stays invisible (no manifest)
        unless it finishes before the process exits; a warning says so."""
        wait = UPLOAD_WAIT_SECONDS if timeout is None else timeout
        if not self._close(wait):
            logger.warning("a checkpoint upload to %s was still running after %.0fs at close: it "
                        "stays invisible (no manifest) unless it ends before this process",
                        self._url, wait)

    def _close(self, timeout: float) -> bool:
        """Hook: stops the uploads within ``timeout``; False if one is still running."""
        return self._writer.close(timeout) if self._writer is not None else True
