"""Background checkpoint writing: the training step pays only for a memory snapshot.

One daemon thread serializes and uploads; at most one upload is in flight. When the next
checkpoint is due before the last one finished, only the newest pending snapshot is kept
(the older pending one is dropped and reported as ``checkpoint_superseded``): training never
blocks on storage, and with a callable payload memory holds at most two snapshots (the one
uploading and the newest). A failed upload is reported as ``checkpoint_failed`` and never
raised into training.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.checkpoint.errors import CheckpointExistsError
from hvd_resilient.checkpoint.events import EventFn, emit
from hvd_resilient.checkpoint.fence import CheckpointFencedError
from hvd_resilient.checkpoint.manager import CheckpointManager
from hvd_resilient.checkpoint.manifest import CheckpointInfo, step_dir
from hvd_resilient.checkpoint.serialize import to_buffer
from hvd_resilient.errors import FATAL_EXIT_CODE, exit_now, one_line

logger = logging.getLogger(__name__)

def stop_fenced(e: CheckpointFencedError) -> None:
    """Ends this process at once (from the writer's thread, wherever training is): exit 78, a
    fault no restart fixes, so that no supervisor relaunches the displaced job."""
    print(f"hvd-resilient: stopping: {e}", file=sys.stderr, flush=True)
    exit_now(FATAL_EXIT_CODE)


#: ``{file name: object}``; bytes-like values are stored as is, others go through torch.save.
Files = Mapping[str, Any]
#: A snapshot, or a callable that makes one (called in ``submit``, in the caller's thread).
Payload = Files | Callable[[], Files]


@dataclass
class _Job:
    step: int
    epoch: int
    world_size: int
    files: Files
    run_id: str
    meta: dict[str, Any] | None
    stall_seconds: float


class AsyncCheckpointWriter:
    """Writes checkpoints through ``manager`` on a background thread.

    Args:
        manager: where checkpoints go.
        on_event: ``(name, fields)`` callback; defaults to ``manager.on_event``. Emits
            ``checkpoint_saved`` (ckpt_step, epoch, seconds, serialize_seconds,
            upload_seconds, stall_seconds, bytes, url), ``checkpoint_failed`` (ckpt_step,
            error), ``checkpoint_superseded`` (ckpt_step, by_step: a pending one dropped for
            a newer one before its upload) and ``checkpoint_already_published`` (ckpt_step,
            url: the step was published already, by an earlier rank 0; it counts as saved).
        prune: run ``manager.prune()`` after each successful save (failures only logged).
        serialize: object -> bytes-like; ``torch.save`` into memory by default.
    """

    def __init__(
        self,
        manager: CheckpointManager,
        on_event: EventFn | None = None,
        prune: bool = True,
        serialize: Callable[[Any], bytes | bytearray | memoryview] = to_buffer,
    ) -> None:
        self.manager = manager
        self.on_event = on_event if on_event is not None else manager.on_event
        self.prune = prune
        self._serialize = serialize
        self._cv = threading.Condition()
        self._pending: _Job | None = None
        self._writing: int | None = None  # the step being written now
        self._busy = False
        self._closed = False
        self.last_saved: CheckpointInfo | None = None
        self.saved = self.failed = self.superseded = 0
        self._thread = threading.Thread(target=self._run, name="ckpt-writer", daemon=True)
        self._thread.start()

    # ---- public API -----------------------------------------------------------------------

    def submit(
        self,
        step: int,
        epoch: int,
        world_size: int,
        payload: Payload,
        run_id: str = "",
        meta: dict[str, Any] | None = None,
        stall_seconds: float | None = None,
        stall_before: float = 0.0,
    ) -> None:
        """Queue a checkpoint of ``step`` and return at once.

        ``payload`` is a ready snapshot (``{"state.pt": snapshot_state_dict(...)}``) or a
        callable making one; a callable runs here, after an older pending snapshot has been
        dropped, so at most two snapshots are alive. ``stall_seconds`` defaults to the time
        spent in this call; pass your own when you snapshotted before calling.
        ``stall_before`` is added to it: time the caller already spent on this checkpoint
        (gathering every rank's random streams, say).

        Raises:
            RuntimeError: the writer is closed.
            Whatever ``payload()`` raises (it runs in the caller's thread).
        """
        t0 = time.perf_counter()
        self._supersede(step)
        files = payload() if callable(payload) else payload
        stall = stall_seconds if stall_seconds is not None else time.perf_counter() - t0
        stall += stall_before  # what the caller already spent on this checkpoint (collectives)
        job = _Job(step, epoch, world_size, files, run_id, meta, stall)
        with self._cv:
            if self._closed:
                raise RuntimeError("AsyncCheckpointWriter is closed")
            old, self._pending = self._pending, job
            self._cv.notify_all()
        if old is not None:  # a submit from another thread raced in between
            self._report_superseded(old, step)

    def save_sync(
        self,
        step: int,
        epoch: int,
        world_size: int,
        payload: Payload,
        run_id: str = "",
        meta: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> CheckpointInfo | None:
        """Write a checkpoint now, in the caller's thread (the SIGTERM / preemption path).

        Drops any pending snapshot (superseded), waits up to ``timeout`` seconds for an
        upload in flight, then saves. If the in-flight upload outlasts ``timeout`` this save
        runs alongside it rather than losing the newest state. Returns the checkpoint, or
        ``None`` after reporting ``checkpoint_failed``; never raises for storage failures.
        """
        t0 = time.perf_counter()
        self._supersede(step)
        with self._cv:
            if not self._cv.wait_for(lambda: not self._busy, timeout):
                logger.warning(
                    "checkpoint upload still in flight after %ss; saving step %d alongside it",
                    timeout, step,
                )
            self._busy = True
        try:
            files = payload() if callable(payload) else payload
            job = _Job(step, epoch, world_size, files, run_id, meta, 0.0)
            return self._write(job, t0=time.perf_counter(), stall_since=t0)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or in flight; ``False`` if ``timeout`` ran out."""
        with self._cv:
            return self._cv.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Flush (like :meth:`wait`) and stop the thread; ``False`` if ``timeout`` ran out,
        in which case the daemon thread finishes or dies with the process."""
        deadline = None if timeout is None else time.monotonic() + timeout
        flushed = self.wait(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self._thread.join(left)
        return flushed and not self._thread.is_alive()

    def holds(self, step: int) -> bool:
        """Whether ``step`` is pending, being written or the newest published here: a save
        of the same step again (redone after a reset) would write the same folder twice."""
        with self._cv:
            return step in (self._writing, self._pending.step if self._pending else None,
                            self.last_saved.step if self.last_saved else None)

    @property
    def busy(self) -> bool:
        """Whether a snapshot is pending or being written."""
        with self._cv:
            return self._busy or self._pending is not None

    # ---- internals ------------------------------------------------------------------------

    def _existing(self, step: int) -> CheckpointInfo | None:
        """The published checkpoint of ``step`` if it verifies (a rotten one never counts as
        saved), else ``None``."""
        try:
            info, _ = self.manager.read_manifest(step_dir(step))
            if isinstance(info, CheckpointInfo) and not self.manager.verify(info):
                return info
        except Exception:  # the store failed: report the save as failed, the caller retries
            pass
        return None

    def _supersede(self, by_step: int) -> None:
        with self._cv:
            old, self._pending = self._pending, None
        if old is not None:
            self._report_superseded(old, by_step)

    def _report_superseded(self, old: _Job, by_step: int) -> None:
        self.superseded += 1
        logger.info("checkpoint of step %d superseded by step %d before upload", old.step, by_step)
        emit(self.on_event, ev.CHECKPOINT_SUPERSEDED, {"ckpt_step": old.step, "by_step": by_step})

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return  # closed and drained
                job, self._pending = self._pending, None
                self._busy, self._writing = True, job.step
            try:
                self._write(job, t0=time.perf_counter())
            finally:
                del job  # release the snapshot before waiting for the next one
                with self._cv:
                    self._busy, self._writing = False, None
                    self._cv.notify_all()

    def _write(
        self, job: _Job, *, t0: float, stall_since: float | None = None
    ) -> CheckpointInfo | None:
        """Serialize + save + report; ``stall_since`` set means the caller waited throughout."""
        try:
            blobs = {
                name: v if isinstance(v, bytes | bytearray | memoryview) else self._serialize(v)
                for name, v in job.files.items()
            }
            t1 = time.perf_counter()
            info = self.manager.save(
                job.step, job.epoch, job.world_size, blobs, run_id=job.run_id, meta=job.meta
            )
            t2 = time.perf_counter()
        except CheckpointFencedError as e:
            # A relaunch took the run over: nothing this job writes may count any more, and
            # training on would only burn the machine. One line, and the process ends.
            self.failed += 1
            emit(self.on_event, ev.CHECKPOINT_FENCED, {"ckpt_step": job.step, "epoch": e.epoch,
                                                      "fence": e.fence})
            stop_fenced(e)
            return None
        except CheckpointExistsError as e:
            # Published already (write-once): by a rank 0 that died before the others learned
            # of it, and that state is the one the survivors restored. It counts as saved.
            existing = self._existing(job.step)
            if existing is not None:
                self.last_saved = existing
                logger.info("checkpoint of step %d was published already: %s",
                            job.step, existing.url)
                emit(self.on_event, ev.CHECKPOINT_ALREADY_PUBLISHED,
                     {"ckpt_step": job.step, "url": existing.url})
                return existing
            self.failed += 1
            emit(self.on_event, ev.CHECKPOINT_FAILED, {"ckpt_step": job.step, "error": one_line(e)})
            return None
        except Exception as e:  # anything: a failed checkpoint must never stop training
            self.failed += 1
            logger.warning("checkpoint of step %d to %s failed: %s",
                           job.step, self.manager.url, one_line(e))
            emit(self.on_event, ev.CHECKPOINT_FAILED, {"ckpt_step": job.step, "error": one_line(e)})
            return None
        self.saved += 1
        self.last_saved = info
        emit(self.on_event, ev.CHECKPOINT_SAVED, {
            "ckpt_step": job.step,
            "epoch": job.epoch,
            "seconds": round(t2 - t0, 6),
            "serialize_seconds": round(t1 - t0, 6),
            "upload_seconds": round(t2 - t1, 6),
            "stall_seconds": round(
                t2 - stall_since if stall_since is not None else job.stall_seconds, 6
            ),
            "bytes": info.total_bytes,
            "url": info.url,
        })
        if self.prune:
            try:
                self.manager.prune()
            except Exception as e:
                logger.warning("pruning %s failed: %s", self.manager.url, one_line(e))
        return info
