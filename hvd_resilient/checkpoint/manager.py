"""Saving and pruning checkpoints on a :class:`CheckpointStore`; finding, verifying and
loading them is the reader's part (:mod:`.reader`, which :class:`CheckpointManager` extends),
setting them aside the supersede's (:mod:`.supersede`).

The invariants this module protects:

- files first, manifest last: a checkpoint becomes visible only once all its bytes are stored;
- pruning never removes the newest verified checkpoint, and retracts a manifest before the
  files it describes, so a concurrent reader never sees a manifest over missing files;
- write-once: a published checkpoint (a folder whose manifest reads) is never written again.
  A save into it fails with :class:`CheckpointExistsError` before any byte is stored, and the
  manifest itself is created exclusively (``put_new``). Old checkpoints are set aside with
  :meth:`CheckpointManager.supersede`, never overwritten.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hvd_resilient.checkpoint import supersede as _supersede
from hvd_resilient.checkpoint.digest import DEFAULT, hex_digest
from hvd_resilient.checkpoint.errors import CheckpointExistsError
from hvd_resilient.checkpoint.events import EventFn
from hvd_resilient.checkpoint.manifest import (
    MANIFEST_NAME,
    REPLICATED,
    CheckpointInfo,
    FileEntry,
    NewerManifestError,
    new_info,
    parse_step_dir,
    step_dir,
)
from hvd_resilient.checkpoint.reader import CheckpointReader
from hvd_resilient.checkpoint.stores import (
    Buffer,
    CheckpointStore,
    StoreError,
    StoreExistsError,
    validate_key,
)

logger = logging.getLogger(__name__)

STALE_UPLOAD_SECONDS = 3600.0
"""Age after which an unfinished upload counts as abandoned whoever started it (the default of
``hvd-resilient ckpt prune --stale-uploads-after``): a save of a step removes older ones from
its folder, and those whose writer the store knows to be gone at once."""


class CheckpointManager(CheckpointReader):
    """Checkpoints of one run below one URL or store: the reader's listing, verification and
    loading, plus saving, retention and :meth:`supersede`.

    Args:
        url_or_store: ``file:///...``, ``s3://bucket/prefix``, a path, or an open store.
        keep_last: how many of the newest checkpoints :meth:`prune` keeps (0 = keep all).
        keep_every: additionally keep every checkpoint whose ``step % keep_every == 0``
            (0 = none). With ``keep_last=3, keep_every=1000`` the run keeps its 3 newest
            checkpoints plus those of steps 1000, 2000, ...
        on_event: callback ``(name, fields)`` for ``checkpoint_skipped`` (ckpt_step, reason,
            url: a corrupt checkpoint passed over); fields never hold credentials.
        before_publish: called with the step between a checkpoint's files and its manifest
            (fault injection: the worst moment for the writer to die); None: nothing.
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
        before_publish: Callable[[int], None] | None = None,
        **store_options: Any,
    ) -> None:
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
        if keep_every < 0:
            raise ValueError(f"keep_every must be >= 0 (0 disables it), got {keep_every}")
        super().__init__(url_or_store, on_event, **store_options)
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.before_publish = before_publish
        # Steps whose folder this process checked with begin() and is writing now: their
        # store_files need not look again.
        self._begun: set[int] = set()

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
        else:
            self._sweep(prefix)
        entries: dict[str, FileEntry] = {}
        with ThreadPoolExecutor(1, thread_name_prefix="ckpt-hash") as hasher:
            for name, data in files.items():
                view = memoryview(data).cast("B")
                digest = hasher.submit(hex_digest, view, DEFAULT)
                self.store.put(f"{prefix}/{name}", view)
                entries[name] = FileEntry(len(view), digest.result(), DEFAULT)
        return entries

    def _sweep(self, prefix: str) -> None:
        """Removes from the folder of a save that this manager began what writers killed
        mid-write left there (local disk: the temporary files of a rank 0 killed while it
        wrote this step before), before this save writes its own; best effort (a failure
        is logged: it costs space, not the checkpoint). Only what no live writer can own
        goes at once: the store judges a writer gone only where it can be sure (local disk:
        a process of this machine and pid namespace that no longer exists), anything else
        only after `STALE_UPLOAD_SECONDS`, like ``hvd-resilient ckpt prune``. The other
        ranks of a sharded save write their files here at the same time, and they are alive.
        Done here, not in :meth:`begin`, which a sharded save runs in the training step."""
        try:
            n = self.store.abort_stale_uploads(STALE_UPLOAD_SECONDS, prefix=prefix + "/",
                                               writer_gone=True)
        except StoreError as e:
            logger.warning("could not clear what killed writers left in %s/%s: %s",
                           self.url, prefix, e)
            return
        if n:
            logger.info("removed %d unfinished upload(s) of killed writers from %s/%s",
                        n, self.url, prefix)

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
        if self.before_publish is not None:
            self.before_publish(step)
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

    # ---- prune ----------------------------------------------------------------------------

    def _newest_verified(self, checkpoints: list[CheckpointInfo]) -> int | None:
        for info in reversed(checkpoints):
            if info.prefix in self._verified or not self.verify(info):
                return info.step
        return None

    def abort_stale_uploads(self, older_than: float = STALE_UPLOAD_SECONDS,
                            dry_run: bool = False) -> int:
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
        """Removes the folder of ``step`` whole: first what unfinished writes left in it
        (local disk: temporary files, which no listing shows, and which would keep the
        folder), of any age: a folder removed is published (write-once: no one writes into
        it) or torn and older than the newest verified checkpoint; then its files, with the
        last of which the folder goes."""
        prefix = step_dir(step)
        self._verified.discard(prefix)
        self.store.abort_stale_uploads(0, prefix=prefix + "/")
        self.store.delete(self.store.list(prefix + "/"))

    # ---- supersede ------------------------------------------------------------------------

    def supersede(self, tag: str) -> list[int]:
        """Move every checkpoint folder here (published or torn) to ``<url>/<tag>/step-...``
        and return their steps: kept, but out of the way of a run that starts over (see
        :func:`.supersede.supersede` for how, and what it raises)."""
        return _supersede.supersede(self, tag, self._delete_folder)
