"""Finding, verifying and loading the checkpoints below one URL: the read side of
:class:`~hvd_resilient.checkpoint.manager.CheckpointManager`, usable alone by tools that
never write (listing, ``ckpt verify``).

The invariants this module protects:

- a checkpoint is loaded only after every file's size and digest (by the algorithm its manifest
  names: xxh3-128, sha256 for older checkpoints) match its manifest; a bad one is reported and
  skipped, and the next older one is tried;
- a store outage is NOT corruption: it propagates instead of silently falling back to an older
  checkpoint (which would lose progress and, after a prune, lose the newer one for good);
- one verification: ``ckpt verify``, resume and retention accept exactly the same checkpoints.
  A manifest is read only through :meth:`CheckpointInfo.from_json` (its own checksum, no
  duplicate keys, valid file names) and a file is checked only by
  :meth:`CheckpointReader.check_file` (size and digest against the manifest).
"""

from __future__ import annotations

import builtins
import logging
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hvd_resilient import event_names as ev
from hvd_resilient.checkpoint.errors import CheckpointCorruptError
from hvd_resilient.checkpoint.events import EventFn, emit
from hvd_resilient.checkpoint.host_buffers import HostBufferPool
from hvd_resilient.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointInfo,
    FileEntry,
    ManifestError,
    parse_step_dir,
    step_dir,
)
from hvd_resilient.checkpoint.stores import (
    Buffer,
    CheckpointStore,
    SizeMismatchError,
    StoreNotFoundError,
    open_store,
)

logger = logging.getLogger(__name__)

#: ``decode(file name, verified bytes)``: what :meth:`CheckpointReader.load` returns per file.
Decode = Callable[[str, Buffer], Any]
#: Files downloading and hashing ahead of the one being decoded: two keep every ranged-GET
#: thread of the store busy with 64 MB parts while bounding the bytes held twice.
READ_AHEAD = 2


@dataclass
class ScanResult:
    """What a listing of the store found, by step."""

    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    """Complete checkpoints (parseable manifest), sorted by step."""
    partial: dict[int, list[str]] = field(default_factory=dict)
    """Folders without a manifest (upload in progress or died): step -> keys."""
    invalid: dict[int, str] = field(default_factory=dict)
    """Folders whose manifest does not parse: step -> reason."""


class CheckpointReader:
    """The checkpoints of one run below one URL or store, read and verified.

    Args:
        url_or_store: ``file:///...``, ``s3://bucket/prefix``, a path, or an open store.
        on_event: callback ``(name, fields)`` for ``checkpoint_skipped`` (ckpt_step, reason,
            url: a corrupt checkpoint passed over); fields never hold credentials.
        **store_options: passed to :func:`open_store` when ``url_or_store`` is a URL.

    Raises:
        StoreConfigError, StorePermissionError: from opening the store.
    """

    def __init__(
        self,
        url_or_store: str | CheckpointStore,
        on_event: EventFn | None = None,
        **store_options: Any,
    ) -> None:
        if isinstance(url_or_store, CheckpointStore):
            self.store = url_or_store
        else:
            self.store = open_store(url_or_store, **store_options)
        self.on_event = on_event
        # Folders (by key) this process has written or fully re-hashed: retention trusts
        # them without downloading them again.
        self._verified: set[str] = set()

    @property
    def url(self) -> str:
        """The base URL, without credentials."""
        return self.store.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ---- find -----------------------------------------------------------------------------

    def _folders(self) -> dict[int, list[str]]:
        """One listing of the store: step -> the keys of its folder. Only top-level
        ``step-...`` folders count: what a supersede moved below a tag is ignored."""
        by_step: dict[int, list[str]] = {}
        for key in self.store.list("step-"):
            folder, _, rest = key.partition("/")
            step = parse_step_dir(folder)
            if step is not None and rest:
                by_step.setdefault(step, []).append(key)
        return by_step

    def has_checkpoints(self) -> bool:
        """Whether any checkpoint folder exists here, published or torn (what a fresh start
        would collide with).

        Raises:
            StoreError: the store failed (never treated as "none").
        """
        return bool(self._folders())

    def read_manifest(
        self, prefix: str
    ) -> tuple[CheckpointInfo | ManifestError | None, bytes | None]:
        """The manifest of the folder ``prefix`` (``step-...`` or ``TAG/step-...``), read and
        validated the one way every reader does: ``(info, raw)``, ``(ManifestError, raw)``
        when it does not read, ``(None, None)`` when there is none.

        Raises:
            StoreError: the store failed (other than a missing manifest).
        """
        try:
            raw = bytes(self.store.get(f"{prefix}/{MANIFEST_NAME}"))
        except StoreNotFoundError:
            return None, None
        try:
            return CheckpointInfo.from_json(raw, prefix=prefix, url=f"{self.url}/{prefix}"), raw
        except ManifestError as e:
            return e, raw

    def _manifest(self, step: int, keys: list[str]) -> CheckpointInfo | str | None:
        """The folder's checkpoint, the reason its manifest is unreadable, or None (no
        manifest: partial, or pruned since the listing)."""
        prefix = step_dir(step)
        if f"{prefix}/{MANIFEST_NAME}" not in keys:
            return None
        found, _ = self.read_manifest(prefix)
        return str(found) if isinstance(found, ManifestError) else found

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

    def check_file(
        self, info: CheckpointInfo, name: str, buffers: HostBufferPool | None = None
    ) -> tuple[Buffer | None, str]:
        """Fetch file ``name`` of ``info`` and check its size and digest (by the algorithm
        its entry names) against the manifest: ``(data, "")``, or ``(None, problem)`` such as
        ``"state.pt xxh3_128 mismatch"``. The one check of a file behind :meth:`verify`,
        :meth:`load` and sharded loads; ``buffers`` (internal) reuses download memory.

        Raises:
            StoreError: the store failed (an outage is not corruption).
        """
        entry = info.files[name]
        out = None if buffers is None else buffers.borrow(entry.size)
        try:
            data, digest = self.store.get_hashed(info.key(name), entry.size, out,
                                                 algorithm=entry.algorithm)
        except StoreNotFoundError:
            problem = file_problem(name, entry, missing=True)
        except SizeMismatchError:
            problem = file_problem(name, entry, size=-1)
        else:
            problem = file_problem(name, entry, digest=digest)
            if not problem:
                return data, ""
        return None, problem

    def _read_all(
        self, info: CheckpointInfo, reuse: bool = False
    ) -> Iterator[tuple[str, Buffer | None, str]]:
        """Yield ``(name, data, problem)`` for every file of ``info`` in name order.

        :data:`READ_AHEAD` files download and hash on worker threads while the caller works
        on the file just yielded (a split state's parts become tensors while the next parts
        arrive); the bound keeps at most that many files in memory besides what
        the caller kept. With ``reuse`` a file's buffer is recycled for a later file once the
        caller let go of it, so only the first few files fault in fresh memory; a buffer the
        caller still refers to (tensors that are views of it) is never recycled.
        Stopping early cancels what has not started.
        """
        buffers = HostBufferPool() if reuse else None
        pool = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="ckpt-read")
        ahead: deque[tuple[str, Future[tuple[Buffer | None, str]]]] = deque()
        names = iter(sorted(info.files))
        try:
            while True:
                while len(ahead) <= READ_AHEAD and (name := next(names, None)) is not None:
                    ahead.append((name, pool.submit(self.check_file, info, name, buffers)))
                if not ahead:
                    return
                name, fut = ahead.popleft()
                data, problem = fut.result()
                del fut
                yield name, data, problem
                del data  # its buffer serves a later file, unless the caller still holds it
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def verify(self, info: CheckpointInfo) -> builtins.list[str]:
        """Re-download and re-hash every file of ``info``; return the problems (empty = good).

        Raises:
            StoreError: the store failed in a way that says nothing about the checkpoint
                (outage, permissions); corruption is reported in the list instead.
        """
        problems = [problem for _, _, problem in self._read_all(info, reuse=True) if problem]
        if not problems:
            self._verified.add(info.prefix)
        return problems

    def load(self, info: CheckpointInfo, decode: Decode | None = None) -> dict[str, Any]:
        """Fetch every file of ``info``, checking sizes and digests while loading.

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
        for name, data, problem in self._read_all(info, reuse=decode is not None):
            if data is None:
                raise CheckpointCorruptError(info.prefix, problem)
            out[name] = data if decode is None else decode(name, data)
            del data  # a decoded file's bytes are garbage now, not at the end of the loop
        self._verified.add(info.prefix)
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
            emit(self.on_event, ev.CHECKPOINT_SKIPPED, {
                "ckpt_step": step, "reason": reason, "url": f"{self.url}/{step_dir(step)}",
            })
        return None


def file_problem(name: str, entry: FileEntry, *, missing: bool = False, size: int | None = None,
                 digest: str | None = None) -> str:
    """What is wrong with file ``name`` against its manifest ``entry``, "" if nothing: the
    wording every verification reports (``state.pt missing``, ``... size differs from the
    manifest's N bytes``, ``... xxh3_128 mismatch``, naming the entry's algorithm). ``size``
    -1: it differed (not known); ``digest``: computed by ``entry.algorithm``."""
    if missing:
        return f"{name} missing"
    if size is not None and size != entry.size:
        return f"{name} size differs from the manifest's {entry.size} bytes"
    if digest is not None and digest != entry.digest:
        return f"{name} {entry.algorithm} mismatch"
    return ""
