"""Saving, finding, verifying, loading and pruning checkpoints on a :class:`CheckpointStore`.

The invariants this module protects:

- files first, manifest last: a checkpoint becomes visible only once all its bytes are stored;
- a checkpoint is loaded only after every file's size and sha256 match its manifest; a bad one
  is reported and skipped, and the next older one is tried;
- a store outage is NOT corruption: it propagates instead of silently falling back to an older
  checkpoint (which would lose progress and, after a prune, lose the newer one for good);
- pruning never removes the newest verified checkpoint, and retracts a manifest before the
  files it describes, so a concurrent reader never sees a manifest over missing files.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import threading
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hvd_resilient.checkpoint.host_buffers import HostBuffer, allocate
from hvd_resilient.checkpoint.manifest import (
    MANIFEST_NAME,
    REPLICATED,
    CheckpointInfo,
    FileEntry,
    ManifestError,
    new_info,
    parse_step_dir,
    step_dir,
)
from hvd_resilient.checkpoint.store import (
    Buffer,
    CheckpointStore,
    SizeMismatchError,
    StoreNotFoundError,
    open_store,
    validate_key,
)

logger = logging.getLogger(__name__)

#: ``on_event(name, fields)``: the trainer maps these onto its event log.
EventFn = Callable[[str, dict[str, Any]], None]
#: ``decode(file name, verified bytes)``: what :meth:`CheckpointManager.load` returns per file.
Decode = Callable[[str, Buffer], Any]
#: Files downloading and hashing ahead of the one being decoded: two keep every ranged-GET
#: thread of the store busy with 64 MB parts while bounding the bytes held twice.
READ_AHEAD = 2


class CheckpointError(Exception):
    """Base of the manager's own errors."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's stored bytes do not match its manifest (missing, resized or altered).

    ``reason`` is the short cause, e.g. ``"state.pt sha256 mismatch"``.
    """

    def __init__(self, prefix: str, reason: str) -> None:
        super().__init__(f"checkpoint {prefix} is corrupt ({reason})")
        self.prefix = prefix
        self.reason = reason


def emit(on_event: EventFn | None, name: str, fields: dict[str, Any]) -> None:
    """Call ``on_event`` and swallow its failures: a broken event sink must not stop training."""
    if on_event is None:
        return
    try:
        on_event(name, fields)
    except Exception:
        logger.exception("on_event(%r) raised; event dropped", name)


def sha256_hex(data: Buffer) -> str:
    # hashlib releases the GIL on large buffers, so this overlaps with network I/O.
    return hashlib.sha256(data).hexdigest()


class _Buffers:
    """Download buffers handed back after use. A fresh 100 MB buffer costs ~60 ms of page
    faults on a small machine, as much as downloading it; a restore that reuses a few
    buffers for all its files pays that only for the first ones."""

    def __init__(self) -> None:
        self._free: list[HostBuffer] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> memoryview:
        """A writable view of exactly ``size`` bytes, on the smallest free buffer that fits."""
        with self._lock:
            fits = [b for b in self._free if len(b) >= size]
            buf = min(fits, key=len) if fits else None
            if buf is not None:
                self._free.remove(buf)
        return memoryview(buf if buf is not None else allocate(size))[:size]

    def give(self, view: memoryview) -> None:
        """Return a view's buffer for reuse; the view must not be used afterwards."""
        buf = view.obj
        try:
            view.release()
        except BufferError:  # someone still holds it: let it be garbage, never reuse it
            return
        if isinstance(buf, bytearray | mmap.mmap):
            with self._lock:
                self._free.append(buf)


@dataclass
class ScanResult:
    """What a listing of the store found, by step."""

    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    """Complete checkpoints (parseable manifest), sorted by step."""
    partial: dict[int, list[str]] = field(default_factory=dict)
    """Folders without a manifest (upload in progress or died): step -> keys."""
    invalid: dict[int, str] = field(default_factory=dict)
    """Folders whose manifest does not parse: step -> reason."""


class CheckpointManager:
    """Checkpoints of one run below one URL or store.

    Args:
        url_or_store: ``file:///...``, ``s3://bucket/prefix``, a path, or an open store.
        keep_last: how many of the newest checkpoints :meth:`prune` keeps (0 = keep all).
        keep_every: additionally keep every checkpoint whose ``step % keep_every == 0``
            (0 = none). With ``keep_last=3, keep_every=1000`` the run keeps its 3 newest
            checkpoints plus those of steps 1000, 2000, ...
        on_event: callback ``(name, fields)`` for ``checkpoint_skipped``; fields never hold
            credentials.
        **store_options: passed to :func:`open_store` when ``url_or_store`` is a URL.

    Raises:
        ValueError: negative ``keep_last`` / ``keep_every``.
        StoreConfigError, StorePermissionError: from opening the store.
    """

    def __init__(
        self,
        url_or_store: str | CheckpointStore,
        keep_last: int = 3,
        keep_every: int = 0,
        on_event: EventFn | None = None,
        **store_options: Any,
    ) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        if keep_every < 0:
            raise ValueError(f"keep_every must be >= 0 (0 disables it), got {keep_every}")
        if isinstance(url_or_store, CheckpointStore):
            self.store = url_or_store
        else:
            self.store = open_store(url_or_store, **store_options)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.on_event = on_event
        # Steps this process has written or fully re-hashed: prune trusts them without
        # downloading them again.
        self._verified: set[int] = set()
        # The highest step folder this process has seen (scan or save); a save above it
        # cannot be overwriting a checkpoint, which saves one request per save.
        self._max_seen: int | None = None

    @property
    def url(self) -> str:
        """The base URL, without credentials."""
        return self.store.url

    def __repr__(self) -> str:
        return f"CheckpointManager({self.url!r}, keep_last={self.keep_last})"

    # ---- save -----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        epoch: int,
        world_size: int,
        files: Mapping[str, Buffer],
        run_id: str = "",
        meta: dict[str, Any] | None = None,
    ) -> CheckpointInfo:
        """Store ``files`` as the checkpoint of ``step``, manifest last, and return its info.

        Re-saving an existing step first retracts its manifest, so the folder is never a
        manifest over a mix of old and new files.

        Raises:
            ValueError: no files, a bad file name, or a ``meta`` that is not JSON-serializable.
            StoreError (and subclasses): the store failed; the checkpoint stays invisible.
        """
        if not files:
            raise ValueError("a checkpoint needs at least one file")
        for name in files:
            validate_key(name)
            if name == MANIFEST_NAME:
                raise ValueError(f"{MANIFEST_NAME!r} is reserved for the manifest")
        try:
            json.dumps(meta or {})
        except (TypeError, ValueError) as e:
            raise ValueError(f"checkpoint meta must be JSON-serializable: {e}") from None
        entries = self.store_files(self.begin(step), files)
        return self.publish(step, epoch, world_size, entries, run_id=run_id, meta=meta)

    def begin(self, step: int) -> str:
        """Makes ``step`` safe to write and returns its folder's key: a manifest left there by
        an earlier save is retracted first, so the folder is never a manifest over a mix of
        old and new files.

        Raises:
            StoreError: the store failed.
        """
        prefix = step_dir(step)
        manifest_key = f"{prefix}/{MANIFEST_NAME}"
        self._verified.discard(step)
        # One writer per run (rank 0) is the contract, so a step above everything seen
        # cannot have a manifest yet; otherwise look.
        if (self._max_seen is None or step <= self._max_seen) and self.store.exists(
            manifest_key
        ):
            self.store.delete([manifest_key])
        self._max_seen = max(step, self._max_seen or 0)
        return prefix

    def store_files(self, prefix: str, files: Mapping[str, Buffer]) -> dict[str, FileEntry]:
        """Stores ``files`` under ``prefix`` (hashing each while it uploads) and returns their
        manifest entries. No manifest: see :meth:`publish`.

        Raises:
            StoreError: the store failed.
        """
        entries: dict[str, FileEntry] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as hasher:
            for name, data in files.items():
                view = memoryview(data).cast("B")
                digest = hasher.submit(sha256_hex, view)
                self.store.put(f"{prefix}/{name}", view)
                entries[name] = FileEntry(size=len(view), sha256=digest.result())
        return entries

    def publish(
        self,
        step: int,
        epoch: int,
        world_size: int,
        entries: Mapping[str, FileEntry],
        run_id: str = "",
        meta: dict[str, Any] | None = None,
        layout: str = REPLICATED,
    ) -> CheckpointInfo:
        """Writes the manifest of files already stored under :meth:`begin`'s folder: the last
        write, from which the checkpoint exists. Sharded saves use it directly, since every
        rank stores its own files and only rank 0 knows them all.

        Raises:
            StoreError: the store failed; the checkpoint stays invisible.
        """
        prefix = step_dir(step)
        info = new_info(
            step, epoch, world_size, dict(entries), run_id=run_id, meta=meta,
            prefix=prefix, url=f"{self.url}/{prefix}", layout=layout,
        )
        self.store.put(f"{prefix}/{MANIFEST_NAME}", info.to_json())
        self._verified.add(step)
        logger.info("saved checkpoint %s (%d bytes)", info.url, info.total_bytes)
        return info

    # ---- find -----------------------------------------------------------------------------

    def _folders(self) -> dict[int, list[str]]:
        """One listing of the store: step -> the keys of its folder."""
        by_step: dict[int, list[str]] = {}
        for key in self.store.list("step-"):
            folder, _, rest = key.partition("/")
            step = parse_step_dir(folder)
            if step is not None and rest:
                by_step.setdefault(step, []).append(key)
        if by_step:
            self._max_seen = max(max(by_step), self._max_seen or 0)
        elif self._max_seen is None:
            self._max_seen = -1  # an empty location: nothing to overwrite yet
        return by_step

    def _manifest(self, step: int, keys: list[str]) -> CheckpointInfo | str | None:
        """The folder's checkpoint, the reason its manifest is unreadable, or None (no
        manifest: partial, or pruned since the listing)."""
        prefix = step_dir(step)
        manifest_key = f"{prefix}/{MANIFEST_NAME}"
        if manifest_key not in keys:
            return None
        try:
            raw = self.store.get(manifest_key)
            return CheckpointInfo.from_json(raw, prefix=prefix, url=f"{self.url}/{prefix}")
        except StoreNotFoundError:  # pruned between list and get
            return None
        except ManifestError as e:
            return str(e)

    def scan(self) -> ScanResult:
        """List the store and sort its step folders into complete, partial and invalid.

        Raises:
            StoreError: listing or reading a manifest failed (other than a vanished one).
        """
        result = ScanResult()
        for step, keys in sorted(self._folders().items()):
            found = self._manifest(step, keys)
            if isinstance(found, CheckpointInfo):
                result.checkpoints.append(found)
            elif isinstance(found, str):
                result.invalid[step] = found
            elif f"{step_dir(step)}/{MANIFEST_NAME}" not in keys:
                result.partial[step] = keys
        return result

    def list(self) -> list[CheckpointInfo]:
        """Complete checkpoints (those with a parseable manifest), oldest first.

        Raises:
            StoreError: the store failed.
        """
        return self.scan().checkpoints

    def latest(self) -> CheckpointInfo | None:
        """The newest complete checkpoint, unverified; ``None`` if there is none."""
        found = self.list()
        return found[-1] if found else None

    # ---- verify / load --------------------------------------------------------------------

    def _read(
        self, info: CheckpointInfo, name: str, entry: FileEntry, buffers: _Buffers | None = None
    ) -> tuple[Buffer | None, str]:
        """Fetch one file (into a reused buffer when ``buffers``) and check it; returns
        (data, "") or (None, problem)."""
        out = None if buffers is None else buffers.take(entry.size)
        try:
            data, digest = self.store.get_hashed(info.key(name), entry.size, out)
        except StoreNotFoundError:
            problem = f"{name} missing"
        except SizeMismatchError:
            problem = f"{name} size differs from the manifest's {entry.size} bytes"
        else:
            if digest == entry.sha256:
                return data, ""
            problem = f"{name} sha256 mismatch"
        if out is not None and buffers is not None:
            buffers.give(out)
        return None, problem

    def _read_all(
        self, info: CheckpointInfo, reuse: bool = False, kept: set[str] | None = None
    ) -> Iterator[tuple[str, Buffer | None, str]]:
        """Yield ``(name, data, problem)`` for every file of ``info`` in name order.

        :data:`READ_AHEAD` files download and hash on worker threads while the caller works
        on the file just yielded (a split state's parts become tensors while the next parts
        arrive); the bound keeps at most that many files in memory besides what
        the caller kept. With ``reuse`` a file's buffer is recycled for a later file once the
        caller asks for the next one, so only the first few files fault in fresh memory; a file
        whose name the caller put into ``kept`` before asking for the next is never recycled.
        Stopping early cancels what has not started.
        """
        buffers = _Buffers() if reuse else None
        pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="ckpt-read")
        ahead: deque[tuple[str, Future[tuple[Buffer | None, str]]]] = deque()
        names = iter(sorted(info.files))
        try:
            while True:
                while len(ahead) <= READ_AHEAD and (name := next(names, None)) is not None:
                    ahead.append((name, pool.submit(
                        self._read, info, name, info.files[name], buffers)))
                if not ahead:
                    return
                name, fut = ahead.popleft()
                data, problem = fut.result()
                del fut
                yield name, data, problem
                if buffers is not None and data is not None and name not in (kept or ()):
                    buffers.give(data)  # type: ignore[arg-type]
                del data
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def verify(self, info: CheckpointInfo) -> list[str]:
        """Re-download and re-hash every file of ``info``; return the problems (empty = good).

        Raises:
            StoreError: the store failed in a way that says nothing about the checkpoint
                (outage, permissions); corruption is reported in the list instead.
        """
        problems = [problem for _, _, problem in self._read_all(info, reuse=True) if problem]
        if not problems:
            self._verified.add(info.step)
        return problems

    def load(self, info: CheckpointInfo, decode: Decode | None = None) -> dict[str, Any]:
        """Fetch every file of ``info``, checking sizes and sha256 while loading.

        ``decode(name, data)``, when given, turns each file into what is returned for it
        (``torch.load``, say). It runs in the caller's thread on verified bytes only, while
        the next files download, so deserializing overlaps the download. Its result is
        returned only if every file of the checkpoint verifies. ``data`` is reused for a later
        file once ``decode`` returns: keep a copy, never ``data`` itself (``torch.load``
        copies into new tensors). A ``decode`` that returns ``data`` itself (a raw part whose
        tensors will be views of it) keeps that buffer: it is never recycled.

        Raises:
            CheckpointCorruptError: a file is missing or does not match the manifest.
            StoreError: the store failed.
            Whatever ``decode`` raises.
        """
        out: dict[str, Any] = {}
        kept: set[str] = set()
        for name, data, problem in self._read_all(info, reuse=decode is not None, kept=kept):
            if data is None:
                raise CheckpointCorruptError(info.prefix, problem)
            out[name] = data if decode is None else decode(name, data)
            if out[name] is data:
                kept.add(name)
            del data  # a decoded file's bytes are garbage now, not at the end of the loop
        self._verified.add(info.step)
        return out

    def load_latest(
        self, decode: Decode | None = None
    ) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """Load the newest checkpoint that verifies (see :meth:`load` for ``decode``);
        ``None`` if no checkpoint exists.

        Bad ones (checksum mismatch, missing file, unreadable manifest) are logged, reported
        as ``checkpoint_skipped`` events and passed over for the next older one.

        Raises:
            StoreError: the store failed (never treated as "no checkpoint").
        """
        # Manifests are read newest first and only until one loads: a run that keeps many
        # checkpoints (keep_every) resumes after one listing and one manifest, not one each.
        for step, keys in sorted(self._folders().items(), reverse=True):
            item = self._manifest(step, keys)
            if item is None:
                continue  # partial (an upload in progress or died) or pruned meanwhile
            if isinstance(item, CheckpointInfo):
                try:
                    return item, self.load(item, decode)
                except CheckpointCorruptError as e:
                    reason = e.reason
            else:
                reason = f"unreadable manifest: {item}"
            logger.warning(
                "checkpoint %s is corrupt (%s); falling back to an older one",
                step_dir(step), reason,
            )
            emit(self.on_event, "checkpoint_skipped", {
                "step": step, "reason": reason, "url": f"{self.url}/{step_dir(step)}",
            })
        return None

    # ---- prune ----------------------------------------------------------------------------

    def _newest_verified(self, checkpoints: list[CheckpointInfo]) -> int | None:
        for info in reversed(checkpoints):
            if info.step in self._verified or not self.verify(info):
                return info.step
        return None

    def prune(self, dry_run: bool = False) -> list[int]:
        """Apply retention; return the steps of the folders removed (or that would be).

        Keeps the ``keep_last`` newest checkpoints, every one with ``step % keep_every == 0``
        and always the newest verified one (re-hashed here unless this process wrote or
        loaded it). Also removes partial or invalid folders OLDER than that newest verified
        checkpoint; newer ones may be uploads still in progress and are left alone.

        Raises:
            StoreError: the store failed; whatever was deleted before stays deleted.
        """
        scan = self.scan()
        steps = [i.step for i in scan.checkpoints]
        keep = set(steps[-self.keep_last:]) if self.keep_last else set(steps)
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        newest = self._newest_verified(scan.checkpoints)
        if newest is not None:
            keep.add(newest)
        doomed = [s for s in steps if s not in keep]
        garbage = [] if newest is None else [
            s for s in sorted({*scan.partial, *scan.invalid}) if s < newest
        ]
        if dry_run:
            return sorted(doomed + garbage)
        for step in doomed:
            # Manifest first: from this moment the checkpoint no longer exists for readers.
            self.store.delete([f"{step_dir(step)}/{MANIFEST_NAME}"])
            self._delete_folder(step)
        for step in garbage:
            self._delete_folder(step)
        removed = sorted(doomed + garbage)
        if removed:
            logger.info("pruned checkpoints at steps %s from %s", removed, self.url)
        return removed

    def _delete_folder(self, step: int) -> None:
        self._verified.discard(step)
        self.store.delete(self.store.list(step_dir(step) + "/"))
