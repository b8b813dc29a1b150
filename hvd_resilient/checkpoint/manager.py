"""Saving, finding, verifying, loading and pruning checkpoints on a :class:`CheckpointStore`.

The invariants this module protects:

- files first, manifest last: a checkpoint becomes visible only once all its bytes are stored;
- a checkpoint is loaded only after every file's size and digest (by the algorithm its manifest
  names: xxh3-128, sha256 for older checkpoints) match its manifest; a bad one is reported and
  skipped, and the next older one is tried;
- a store outage is NOT corruption: it propagates instead of silently falling back to an older
  checkpoint (which would lose progress and, after a prune, lose the newer one for good);
- pruning never removes the newest verified checkpoint, and retracts a manifest before the
  files it describes, so a concurrent reader never sees a manifest over missing files;
- write-once: a published checkpoint (a folder whose manifest reads) is never written again.
  A save into it fails with :class:`CheckpointExistsError` before any byte is stored, and the
  manifest itself is created exclusively (``put_new``). Old checkpoints are set aside with
  :meth:`CheckpointManager.supersede`, never overwritten;
- one verification: ``ckpt verify``, resume and retention accept exactly the same checkpoints.
  A manifest is read only through :meth:`CheckpointInfo.from_json` (its own checksum, no
  duplicate keys, valid file names) and a file is checked only by :meth:`CheckpointManager.
  check_file` (size and digest against the manifest).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hvd_resilient.checkpoint.digest import DEFAULT, hex_digest
from hvd_resilient.checkpoint.host_buffers import HostBufferPool
from hvd_resilient.checkpoint.manifest import (
    MANIFEST_NAME,
    REPLICATED,
    CheckpointInfo,
    FileEntry,
    ManifestError,
    NewerManifestError,
    new_info,
    parse_step_dir,
    step_dir,
)
from hvd_resilient.checkpoint.stores import (
    Buffer,
    CheckpointStore,
    SizeMismatchError,
    StoreExistsError,
    StoreNotFoundError,
    open_store,
    redact_url,
    validate_key,
)
from hvd_resilient.errors import HvdResilientError

logger = logging.getLogger(__name__)

#: ``on_event(name, fields)``: the trainer maps these onto its event log.
EventFn = Callable[[str, dict[str, Any]], None]
#: ``decode(file name, verified bytes)``: what :meth:`CheckpointManager.load` returns per file.
Decode = Callable[[str, Buffer], Any]
#: Files downloading and hashing ahead of the one being decoded: two keep every ranged-GET
#: thread of the store busy with 64 MB parts while bounding the bytes held twice.
READ_AHEAD = 2


class CheckpointError(HvdResilientError):
    """Base of the manager's own errors."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's stored bytes do not match its manifest (missing, resized or altered).

    ``reason`` is the short cause, e.g. ``"state.pt xxh3_128 mismatch"``.
    """

    def __init__(self, prefix: str, reason: str) -> None:
        super().__init__(f"checkpoint {prefix} is corrupt ({reason})")
        self.prefix = prefix
        self.reason = reason


class CheckpointExistsError(CheckpointError):
    """A save into a step whose checkpoint is already published (write-once), raised before
    any byte of its folder is written; or :meth:`CheckpointManager.supersede` finding another
    checkpoint where it would move one. ``url`` (without credentials) and ``step`` say which.
    """

    def __init__(self, url: str, step: int, hint: str = "") -> None:
        self.url = redact_url(url)
        self.step = step
        super().__init__(
            f"checkpoint {self.url} (step {step}) already exists and is never rewritten"
            + (f"; {hint}" if hint else "; resume from it, or set the checkpoints aside with "
               "`hvd-resilient ckpt supersede URL`")
        )


_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def default_supersede_tag(now: float | None = None) -> str:
    """``superseded-<UTC yyyymmddTHHMMSS>``: where :meth:`CheckpointManager.supersede` moves
    the checkpoints when no tag is given."""
    return "superseded-" + time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))


def validate_tag(tag: str) -> str:
    """A folder name for :meth:`CheckpointManager.supersede`: letters, digits, ``._-``, one
    path part, and nothing a listing of checkpoints could take for one (``step-...``).

    Raises:
        ValueError: otherwise.
    """
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag.startswith("step-") \
            or tag == MANIFEST_NAME:
        raise ValueError(f"supersede tag {tag!r} must be 1-100 letters, digits, '.', '_' or "
                         "'-' (starting with a letter or digit, not 'step-')")
    return tag


def emit(on_event: EventFn | None, name: str, fields: dict[str, Any]) -> None:
    """Call ``on_event`` and swallow its failures: a broken event sink must not stop training."""
    if on_event is None:
        return
    try:
        on_event(name, fields)
    except Exception:
        logger.exception("on_event(%r) raised; event dropped", name)


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
        # Folders (by key) this process has written or fully re-hashed: prune trusts them
        # without downloading them again.
        self._verified: set[str] = set()
        # Steps whose folder this process checked with begin() and is writing now: their
        # store_files need not look again.
        self._begun: set[int] = set()

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

        Raises:
            ValueError: no files, a bad file name, or a ``meta`` that is not JSON-serializable.
            CheckpointExistsError: ``step`` is already published (nothing was written).
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
        """Checks that ``step`` may be written and returns its folder's key.

        Write-once: a folder whose manifest reads is published and is never written again. A
        folder with files but no manifest, or an unreadable one, is a torn earlier attempt:
        its manifest (if any) is removed so that :meth:`publish` can create the new one.

        Raises:
            CheckpointExistsError: ``step`` is published (or its manifest is of a newer
                format); nothing was written.
            StoreError: the store failed.
        """
        prefix = step_dir(step)
        self._refuse_published(step)
        self._begun.add(step)
        self._verified.discard(prefix)
        return prefix

    def _refuse_published(self, step: int) -> None:
        prefix = step_dir(step)
        found, _ = self.read_manifest(prefix)
        if isinstance(found, CheckpointInfo):
            raise CheckpointExistsError(f"{self.url}/{prefix}", step)
        if isinstance(found, NewerManifestError):
            raise CheckpointExistsError(f"{self.url}/{prefix}", step,
                                        "its manifest is of a newer version")
        if found is not None:
            logger.warning("%s/%s has an unreadable manifest (%s): a torn attempt, rewritten",
                           self.url, prefix, found)
            self.store.delete([f"{prefix}/{MANIFEST_NAME}"])

    def store_files(self, prefix: str, files: Mapping[str, Buffer]) -> dict[str, FileEntry]:
        """Stores ``files`` under ``prefix`` (hashing each by the default digest while it
        uploads) and returns their manifest entries. No manifest: see :meth:`publish`. Unless
        this manager's :meth:`begin` checked the folder, it is checked here first (sharded
        saves: every rank stores its own files).

        Raises:
            ValueError: ``prefix`` is not a checkpoint folder (``step_dir(step)``).
            CheckpointExistsError: the folder holds a published checkpoint; nothing written.
            StoreError: the store failed.
        """
        step = parse_step_dir(prefix)
        if step is None:
            raise ValueError(f"{prefix!r} is not a checkpoint folder (step-NNNNNNNNNN)")
        if step not in self._begun:
            self._refuse_published(step)
        entries: dict[str, FileEntry] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as hasher:
            for name, data in files.items():
                view = memoryview(data).cast("B")
                digest = hasher.submit(hex_digest, view, DEFAULT)
                self.store.put(f"{prefix}/{name}", view)
                entries[name] = FileEntry(len(view), digest.result(), DEFAULT)
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
        rank stores its own files and only rank 0 knows them all. The manifest is created,
        never replaced (``put_new``): of two writers racing for one step only one publishes.

        Raises:
            CheckpointExistsError: a manifest appeared there meanwhile (another writer).
            StoreError: the store failed; the checkpoint stays invisible.
        """
        prefix = step_dir(step)
        info = new_info(
            step, epoch, world_size, dict(entries), run_id=run_id, meta=meta,
            prefix=prefix, url=f"{self.url}/{prefix}", layout=layout,
        )
        try:
            self.store.put_new(f"{prefix}/{MANIFEST_NAME}", info.to_json())
        except StoreExistsError:
            raise CheckpointExistsError(f"{self.url}/{prefix}", step,
                                        "another writer published it meanwhile") from None
        finally:
            self._begun.discard(step)
        self._verified.add(prefix)
        logger.info("saved checkpoint %s (%d bytes)", info.url, info.total_bytes)
        return info

    # ---- find -----------------------------------------------------------------------------

    def _folders(self) -> dict[int, list[str]]:
        """One listing of the store: step -> the keys of its folder. Only top-level
        ``step-...`` folders count: what :meth:`supersede` moved below a tag is ignored."""
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

    def verify(self, info: CheckpointInfo) -> list[str]:
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
            emit(self.on_event, "checkpoint_skipped", {
                "step": step, "reason": reason, "url": f"{self.url}/{step_dir(step)}",
            })
        return None

    # ---- prune ----------------------------------------------------------------------------

    def _newest_verified(self, checkpoints: list[CheckpointInfo]) -> int | None:
        for info in reversed(checkpoints):
            if info.prefix in self._verified or not self.verify(info):
                return info.step
        return None

    def abort_stale_uploads(self, older_than: float = 3600.0, dry_run: bool = False) -> int:
        """Remove what writes killed midway left below the URL (S3: multipart uploads, billed
        until aborted; local disk: temporary files) if older than ``older_than`` seconds;
        return how many (would be) removed.

        Raises:
            ValueError: ``older_than`` < 0.
            StoreError: the store failed.
        """
        n = self.store.abort_stale_uploads(older_than, dry_run=dry_run)
        if n and not dry_run:
            logger.info("aborted %d stale uploads below %s", n, self.url)
        return n

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
        self._verified.discard(step_dir(step))
        self.store.delete(self.store.list(step_dir(step) + "/"))

    # ---- supersede ------------------------------------------------------------------------

    def supersede(self, tag: str) -> list[int]:
        """Move every checkpoint folder here (published or torn) to ``<url>/<tag>/step-...``
        and return their steps: kept, but out of the way of a run that starts over. A
        :class:`CheckpointManager` opened at ``<url>/<tag>`` loads the moved checkpoints;
        listings of ``<url>`` no longer see them.

        Per folder: copy every file, check the copy against the manifest (a published one),
        create the copy's manifest last, then delete the original's manifest first and its
        files after. Safe to re-run after a crash at any point: a copy that is already
        published is checked and the original's remains removed, nothing is ever copied over
        a published checkpoint. No job may write to ``<url>`` meanwhile.

        Raises:
            ValueError: a bad ``tag`` (see :func:`validate_tag`).
            CheckpointExistsError: ``<url>/<tag>`` already holds another checkpoint of a
                step being moved (choose another tag); that folder stays where it was.
            CheckpointError: a copy does not match its original (the original is kept).
            StoreError: the store failed; re-run to finish.
        """
        validate_tag(tag)
        moved = []
        for step, keys in sorted(self._folders().items()):
            self._move(step, keys, tag)
            moved.append(step)
        if moved:
            logger.info("moved checkpoints at steps %s from %s to %s/%s", moved, self.url,
                        self.url, tag)
        return moved

    def _digest(self, key: str) -> str:
        """A fingerprint to tell whether two stored copies hold the same bytes."""
        return hex_digest(self.store.get(key))

    def _move(self, step: int, keys: list[str], tag: str) -> None:
        src = step_dir(step)
        dst = f"{tag}/{src}"
        src_info, src_raw = self.read_manifest(src)
        dst_info, dst_raw = self.read_manifest(dst)
        manifest = f"{src}/{MANIFEST_NAME}"
        names = sorted(k[len(src) + 1:] for k in keys if k != manifest)
        published = isinstance(src_info, CheckpointInfo)
        taken = CheckpointExistsError(f"{self.url}/{dst}", step,
                                      f"it is not a copy of {self.url}/{src}: choose another tag")
        if isinstance(dst_info, CheckpointInfo | NewerManifestError):
            # The copy is published: an earlier, interrupted run got this far (its manifest
            # was created only once every file had been checked), or the tag already holds
            # another checkpoint of this step, and then nothing here may be deleted.
            if published and src_raw != dst_raw:
                raise taken
            if not published:  # the original's manifest went first: its remains must be
                for name in names:  # exactly the copy's files
                    try:
                        same = self._digest(f"{dst}/{name}") == self._digest(f"{src}/{name}")
                    except StoreNotFoundError:
                        same = False
                    if not same:
                        raise taken
        else:
            if published and dst_raw is not None:  # unreadable: a torn copy, replaced below
                self.store.delete([f"{dst}/{MANIFEST_NAME}"])
            for name in names:
                self.store.copy(f"{src}/{name}", f"{dst}/{name}")
            if published:
                assert isinstance(src_info, CheckpointInfo) and src_raw is not None
                self._check_copy(src_info, dataclasses.replace(
                    src_info, prefix=dst, url=f"{self.url}/{dst}"))
                try:
                    self.store.put_new(f"{dst}/{MANIFEST_NAME}", src_raw)
                except StoreExistsError:
                    raise taken from None
            else:
                for name in names:
                    if self._digest(f"{dst}/{name}") != self._digest(f"{src}/{name}"):
                        raise CheckpointError(f"the copy of {self.url}/{src}/{name} at "
                                              f"{self.url}/{dst} differs; the original is kept")
                if src_raw is not None:  # an unreadable manifest: moved as it is
                    self.store.put(f"{dst}/{MANIFEST_NAME}", src_raw)
        # Manifest first: from here the original no longer exists for readers.
        self.store.delete([manifest])
        self._delete_folder(step)

    def _check_copy(self, src: CheckpointInfo, dst: CheckpointInfo) -> None:
        """Every file of the copy ``dst`` matches the manifest, or is byte-for-byte the
        original where the original itself no longer does (a rotten checkpoint stays as
        rotten as it was, and is skipped on load as before)."""
        for name in sorted(src.files):
            _, problem = self.check_file(dst, name)
            if not problem:
                continue
            try:
                same = self._digest(dst.key(name)) == self._digest(src.key(name))
            except StoreNotFoundError:
                same = False
            if not same:
                raise CheckpointError(f"the copy of {src.url} at {dst.url} does not verify "
                                      f"({problem}); the original is kept")
            logger.warning("%s was already damaged (%s); moved as it is", src.url, problem)


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
