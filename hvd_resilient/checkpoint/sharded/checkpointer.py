"""Sharded checkpoints: every rank writes its own shards, in parallel, and training waits only
while they are staged.

Save (collective; every rank calls :meth:`ShardedCheckpointer.save` at the same step):

1. ``dcp.async_save`` copies this rank's shards to host memory (the stall) and returns; a DCP
   thread writes them into a local staging folder (``__<rank>_0.distcp``, plus ``.metadata``
   on rank 0).
2. A thread of ours then uploads the folder through the checkpoint store (``file://`` or
   ``s3://``: the same store, retries and atomic puts as replicated checkpoints), hashing each
   file as it goes, and gathers every rank's ``(name, size, digest)`` on rank 0.
3. Rank 0 stores its own small files (counters, sampler) and writes the manifest LAST. A
   failure on any rank is gathered too, so rank 0 writes no manifest and the checkpoint does
   not exist: ``checkpoint_failed``, never a crash.

Load: rank 0 lists the store and tells the others what it found (so all ranks try the same
checkpoints in the same order); every rank fetches and verifies every file (S3: into a local
temporary folder; file://: checked in place), the ranks agree that all verified, and only then
``dcp.load`` reads them: each rank reads the slices of every shard it needs, so a checkpoint
saved at one world size loads at any other. A checkpoint that fails verification on any rank
is reported (``checkpoint_skipped`` with the reason) and the next older one is tried.

DCP's collectives run on their own Gloo group (``group``): the save's run on a background
thread, and sharing the training's group would interleave them with the step's collectives.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from hvd_resilient import errors
from hvd_resilient import event_names as ev
from hvd_resilient.checkpoint.digest import new_hasher
from hvd_resilient.checkpoint.errors import CheckpointError
from hvd_resilient.checkpoint.events import EventFn, emit
from hvd_resilient.checkpoint.manager import CheckpointManager
from hvd_resilient.checkpoint.manifest import (
    SHARD_DIR,
    SHARDED,
    CheckpointInfo,
    FileEntry,
    step_dir,
)
from hvd_resilient.checkpoint.reader import ScanResult, file_problem
from hvd_resilient.checkpoint.serialize import TensorSpec, check_state_dict
from hvd_resilient.checkpoint.stores import Buffer, StoreError

logger = logging.getLogger(__name__)

_CHUNK = 8 << 20


def first_failure(e: BaseException) -> str:
    """The first line of what went wrong; DCP wraps each rank's error with its traceback."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return errors.one_line(lines[0] if lines else type(e).__name__)


class ShardedCheckpointer:
    """Sharded saves and loads of one run's checkpoints.

    Args:
        manager: the run's checkpoints (its store, retention and manifests).
        rank, world_size: this process and the group's size.
        group: a Gloo process group of all ranks, for DCP and for gathering file lists.
        on_event: ``(name, fields)``; rank 0 emits ``checkpoint_saved`` (ckpt_step, epoch,
            seconds: from the end of the stall to the manifest, stall_seconds, bytes, url,
            layout, shards), ``checkpoint_failed`` (ckpt_step, error),
            ``checkpoint_skipped`` (ckpt_step, reason, url).
        staging_dir: where shards are staged before upload and fetched for a load (default:
            the system temp dir). This rank's folder in it is named after ``name`` and the
            rank, and emptied here: what a killed predecessor left behind is not kept.
        name: the run's name, for the staging folder.
        prune: apply the manager's retention after each save (rank 0).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        rank: int,
        world_size: int,
        group: Any,
        on_event: EventFn | None = None,
        staging_dir: str | None = None,
        name: str = "run",
        prune: bool = True,
    ) -> None:
        self.manager = manager
        self.rank, self.world_size, self.group = rank, world_size, group
        self.on_event = on_event
        self.staging_dir = os.path.join(staging_dir or tempfile.gettempdir(),
                                        f"hvd-resilient-{name}-rank{rank}")
        shutil.rmtree(self.staging_dir, ignore_errors=True)
        os.makedirs(self.staging_dir, exist_ok=True)
        self.prune = prune
        self._thread: threading.Thread | None = None
        self.last_saved: CheckpointInfo | None = None

    # ---- save -----------------------------------------------------------------------------

    def busy(self) -> bool:
        """Whether this rank's previous save is still uploading. Ranks may differ for a moment,
        but each save ends with a gather of all ranks, so waiting for it is safe."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for this rank's part of the save in flight; False if it is still running."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.busy()

    def save(
        self,
        step: int,
        epoch: int,
        state: dict[str, Any],
        files: Mapping[str, Buffer] | None = None,
        *,
        run_id: str = "",
        meta: dict[str, Any] | None = None,
        stall_before: float = 0.0,
    ) -> float:
        """Stages ``state`` (a DCP state dict of this rank's shards) and returns the seconds
        training was blocked; uploading and the manifest happen in the background.
        ``files`` (rank 0 only) are small extra files of the checkpoint. Collective.

        Raises:
            RuntimeError: the previous save of this rank has not finished (call :meth:`wait`).
        """
        import torch.distributed.checkpoint as dcp

        if self.busy():
            raise RuntimeError("a sharded save is still in flight; wait() for it first")
        t0 = time.perf_counter()
        error = ""
        if self.rank == 0:
            try:
                self.manager.begin(step)
            except (StoreError, CheckpointError) as e:  # still take part in the collectives
                error = f"rank 0: {first_failure(e)}"  # (no manifest later); published: untouched
        stage = tempfile.mkdtemp(prefix=f"{step_dir(step)}-", dir=self.staging_dir)
        try:
            # No fsync: the staging copy is thrown away; durability comes from the store.
            writer = dcp.FileSystemWriter(stage, sync_files=False)
            future = dcp.async_save(state, storage_writer=writer, process_group=self.group)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        stall = stall_before + time.perf_counter() - t0
        t0 = time.perf_counter()  # the event's `seconds` is what follows the stall
        self._thread = threading.Thread(
            target=self._finish, name="ckpt-sharded", daemon=True,
            args=(future, stage, step, epoch, dict(files or {}), run_id, meta, stall, t0, error),
        )
        self._thread.start()
        return stall

    def _finish(self, future: Any, stage: str, step: int, epoch: int,
                files: dict[str, Buffer], run_id: str, meta: dict[str, Any] | None,
                stall: float, t0: float, error: str) -> None:
        import torch.distributed as dist

        entries: dict[str, FileEntry] = {}
        try:
            future.result()
            if not error:
                entries = self._upload(stage, step, files)
        except Exception as e:  # gathered below: every rank must reach the gather
            error = f"rank {self.rank}: {first_failure(e)}"
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        try:
            dist.gather_object((entries, error), gathered, dst=0, group=self.group)
        except Exception as e:
            gathered, error = None, error or f"rank {self.rank}: gather failed: {first_failure(e)}"
            logger.warning("sharded checkpoint step %d: %s", step, error)
        if self.rank != 0:
            return
        errors = [err for _, err in gathered or [] if err] or ([error] if error else [])
        if errors:
            logger.warning("sharded checkpoint step %d failed: %s", step, errors[0])
            emit(self.on_event, ev.CHECKPOINT_FAILED, {"ckpt_step": step, "error": errors[0]})
            return
        self._publish(step, epoch, gathered or [], run_id, meta, stall, t0)

    def _upload(self, stage: str, step: int, files: dict[str, Buffer]) -> dict[str, FileEntry]:
        """Stores this rank's staged files (mapped, not read into memory) and its extra files;
        returns their manifest entries."""
        prefix = step_dir(step)
        with contextlib.ExitStack() as stack:
            views: dict[str, Buffer] = {}
            for name in sorted(os.listdir(stage)):
                with open(os.path.join(stage, name), "rb") as f:
                    if os.fstat(f.fileno()).st_size == 0:  # mmap cannot map an empty file
                        views[SHARD_DIR + name] = b""
                        continue
                    m = stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
                view = memoryview(m)
                stack.callback(view.release)
                views[SHARD_DIR + name] = view
            views.update(files)
            return self.manager.store_files(prefix, views)

    def _publish(self, step: int, epoch: int, gathered: list[Any], run_id: str,
                 meta: dict[str, Any] | None, stall: float, t0: float) -> None:
        entries = {name: e for rank_entries, _ in gathered for name, e in rank_entries.items()}
        try:
            info = self.manager.publish(step, epoch, self.world_size, entries, run_id=run_id,
                                        meta=meta, layout=SHARDED)
        except (StoreError, CheckpointError) as e:
            emit(self.on_event, ev.CHECKPOINT_FAILED,
                 {"ckpt_step": step, "error": first_failure(e)})
            return
        self.last_saved = info
        emit(self.on_event, ev.CHECKPOINT_SAVED, {
            "ckpt_step": step, "epoch": epoch, "seconds": round(time.perf_counter() - t0, 6),
            "stall_seconds": round(stall, 6), "bytes": info.total_bytes, "url": info.url,
            "layout": SHARDED, "shards": info.shard_files,
        })
        if self.prune:
            try:
                self.manager.prune()
            except StoreError as e:
                logger.warning("pruning %s failed: %s", self.manager.url, first_failure(e))

    def close(self, timeout: float | None = None) -> bool:
        """Waits for the upload in flight, then releases the checkpoints' process group (its
        creator's to release: left to interpreter teardown, a Gloo group's threads can abort
        a finished worker with "terminate called without an active exception"). False if the
        upload was still running after ``timeout``: it stays invisible (no manifest) unless it
        ends before the process, and the group is left to it."""
        flushed = self.wait(timeout)
        if flushed and self.group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group(self.group)
            self.group = None
        with contextlib.suppress(OSError):  # empty once nothing is in flight
            os.rmdir(self.staging_dir)
        return flushed

    # ---- load -----------------------------------------------------------------------------

    def load_latest(self, state: dict[str, Any]) -> tuple[CheckpointInfo, dict[str, bytes]] | None:
        """Loads the newest sharded checkpoint that verifies on every rank into ``state`` (a
        DCP state dict of this rank's shards, resharded as needed) and returns its info and
        its non-shard files (bytes); ``None`` if there is none. Collective.

        Raises:
            CheckpointError: the newest complete checkpoint is replicated (written without
                FSDP), or it does not fit ``state`` (missing keys, other shapes).
            StoreError: the store failed (never treated as "no checkpoint").
        """
        for step, item in self._candidates():
            if isinstance(item, str):
                self._skipped(step, item)
                continue
            if item.layout != SHARDED:
                raise CheckpointError(
                    f"{item.prefix} holds one full (replicated) state, written without fsdp; "
                    "resume it without --fsdp, or start a new run id")
            with tempfile.TemporaryDirectory(prefix="load-", dir=self.staging_dir) as tmp:
                folder, problem, failure = tmp, "", ""
                try:
                    folder, problem = self._fetch(item, tmp)
                except StoreError as e:  # gathered: the other ranks must not wait for us
                    failure = f"rank {self.rank}: {first_failure(e)}"
                results = self._allgather((problem, failure))
                failure = next((f for _, f in results if f), "")
                if failure:
                    raise StoreError(f"reading {item.url}: {failure}")
                bad = next((p for p, _ in results if p), "")
                if bad:
                    self._skipped(step, bad)
                    continue
                self._load(item, os.path.join(folder, SHARD_DIR), state)
                extras = {}
                for name in item.files:
                    if not name.startswith(SHARD_DIR):
                        with open(os.path.join(folder, *name.split("/")), "rb") as f:
                            extras[name] = f.read()
                return item, extras
        return None

    def _candidates(self) -> list[tuple[int, CheckpointInfo | str]]:
        """Rank 0's listing, newest first, shared with every rank."""
        import torch.distributed as dist

        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box = [self.manager.scan()]
            except StoreError as e:  # broadcast: the other ranks must not wait for a listing
                box = [f"listing {self.manager.url}: {first_failure(e)}"]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if isinstance(box[0], str):
            raise StoreError(box[0])
        scan: ScanResult = box[0]
        out: list[tuple[int, CheckpointInfo | str]] = [(i.step, i) for i in scan.checkpoints]
        out += [(s, f"unreadable manifest: {r}") for s, r in scan.invalid.items()]
        return sorted(out, key=lambda c: c[0], reverse=True)

    def _allgather(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def _skipped(self, step: int, reason: str) -> None:
        if self.rank != 0:
            return
        logger.warning("checkpoint %s is corrupt (%s); falling back to an older one",
                       step_dir(step), reason)
        emit(self.on_event, ev.CHECKPOINT_SKIPPED, {
            "ckpt_step": step, "reason": reason, "url": f"{self.manager.url}/{step_dir(step)}",
        })

    def _fetch(self, info: CheckpointInfo, tmp: str) -> tuple[str, str]:
        """A local folder holding ``info``'s files, each checked against the manifest, and
        the first problem found ("" when all match). A file:// store is checked in place."""
        folder = self.manager.store.local_path(info.prefix)
        if folder is not None:
            for name, entry in sorted(info.files.items()):
                problem = _check_file(os.path.join(folder, *name.split("/")), name, entry)
                if problem:
                    return folder, problem
            return folder, ""
        for name in sorted(info.files):
            data, problem = self.manager.check_file(info, name)
            if data is None:
                return tmp, problem
            path = os.path.join(tmp, *name.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            del data
        return tmp, ""

    def _load(self, info: CheckpointInfo, folder: str, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        from hvd_resilient.checkpoint.sharded.dcp_safe import (
            SafeLoadPlanner,
            SafeReader,
            read_metadata,
        )

        try:
            check_fits(state, read_metadata(folder).state_dict_metadata)
            dcp.load(state, storage_reader=SafeReader(folder), planner=SafeLoadPlanner(),
                     process_group=self.group)
        except Exception as e:
            raise CheckpointError(f"{info.prefix} cannot be loaded into this model: "
                                  f"{first_failure(e)}") from None


def check_fits(state: dict[str, Any], saved: Mapping[str, Any]) -> None:
    """The model part of a DCP ``state`` (this rank's DTensors: ``t.shape`` is the full shape)
    against a checkpoint's DCP metadata (``state_dict_metadata``: ``model.<name>`` ->
    ``TensorStorageMetadata`` with the full ``size`` and ``properties.dtype``): same names,
    shapes and dtypes, or one line naming the first differences.

    Raises:
        CheckpointMismatchError: it does not fit.
    """
    loaded: dict[str, Any] = {}
    for key, md in saved.items():
        if not key.startswith("model."):
            continue
        size, props = getattr(md, "size", None), getattr(md, "properties", None)
        dtype = getattr(props, "dtype", None)
        loaded[key[len("model."):]] = (TensorSpec(tuple(size), dtype)
                                       if size is not None and dtype is not None else md)
    check_state_dict(dict(state.get("model", {})), loaded, "model")


def _check_file(path: str, name: str, entry: FileEntry) -> str:
    """The problem with the file at ``path`` against its manifest entry ("" if none),
    hashed in chunks so a multi-GB shard is never read into memory whole (the in-place
    form of :meth:`CheckpointReader.check_file`, worded by the same ``file_problem``)."""
    try:
        size = os.path.getsize(path)
        if size != entry.size:
            return file_problem(name, entry, size=size)
        h = new_hasher(entry.algorithm)
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    except FileNotFoundError:
        return file_problem(name, entry, missing=True)
    return file_problem(name, entry, digest=h.hexdigest())
