"""Setting a run's checkpoints aside: every ``step-...`` folder below a URL moves to
``<url>/<tag>/step-...``, kept but out of the way of a run that starts over
(``hvd-resilient ckpt supersede``, ``hvd-resilient run --fresh-start``).

Checkpoints are write-once, so a move is a copy, checked, then a delete; the invariants:

- the copy's manifest is created last (``put_new``) and only after every copied file matched
  the original's manifest, so a reader of ``<url>/<tag>`` never sees a manifest over files
  that are not there;
- the original's manifest goes first and its files after, so a reader of ``<url>`` never
  does either;
- re-running after a crash at any point finishes the move, and nothing is ever copied over a
  published checkpoint (another one of the same step below the tag stops the move).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from typing import TYPE_CHECKING

from hvd_resilient.checkpoint.digest import hex_digest
from hvd_resilient.checkpoint.errors import CheckpointError, CheckpointExistsError
from hvd_resilient.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointInfo,
    NewerManifestError,
    step_dir,
)
from hvd_resilient.checkpoint.stores import StoreExistsError, StoreNotFoundError

if TYPE_CHECKING:
    from collections.abc import Callable

    from hvd_resilient.checkpoint.reader import CheckpointReader

logger = logging.getLogger(__name__)

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def default_supersede_tag(now: float | None = None) -> str:
    """``superseded-<UTC yyyymmddTHHMMSS>``: where :func:`supersede` moves the checkpoints
    when no tag is given."""
    return "superseded-" + time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))


def validate_tag(tag: str) -> str:
    """A folder name for :func:`supersede`: letters, digits, ``._-``, one path part, and
    nothing a listing of checkpoints could take for one (``step-...``).

    Raises:
        ValueError: otherwise.
    """
    if not isinstance(tag, str) or not _TAG.fullmatch(tag) or tag.startswith("step-") \
            or tag == MANIFEST_NAME:
        raise ValueError(f"supersede tag {tag!r} must be 1-100 letters, digits, '.', '_' or "
                         "'-' (starting with a letter or digit, not 'step-')")
    return tag


def supersede(manager: CheckpointReader, tag: str,
              delete_folder: Callable[[int], None]) -> list[int]:
    """Move every checkpoint folder of ``manager`` (published or torn) to
    ``<url>/<tag>/step-...`` and return their steps. A manager opened at ``<url>/<tag>``
    loads the moved checkpoints; listings of ``<url>`` no longer see them.

    Per folder: copy every file, check the copy against the manifest (a published one),
    create the copy's manifest last, then delete the original's manifest first and its
    files after. Safe to re-run after a crash at any point: a copy that is already
    published is checked and the original's remains removed, nothing is ever copied over
    a published checkpoint. No job may write to ``<url>`` meanwhile. ``delete_folder`` is the
    manager's removal of a step's folder (`CheckpointManager.supersede` passes it): this
    module reads through the reader and removes only through it, so it needs no manager.

    Raises:
        ValueError: a bad ``tag`` (see :func:`validate_tag`).
        CheckpointExistsError: ``<url>/<tag>`` already holds another checkpoint of a
            step being moved (choose another tag); that folder stays where it was.
        CheckpointError: a copy does not match its original (the original is kept).
        StoreError: the store failed; re-run to finish.
    """
    validate_tag(tag)
    moved = []
    for step, keys in sorted(manager._folders().items()):
        _move(manager, step, keys, tag, delete_folder)
        moved.append(step)
    if moved:
        logger.info("moved checkpoints at steps %s from %s to %s/%s", moved, manager.url,
                    manager.url, tag)
    return moved


def _digest(manager: CheckpointReader, key: str) -> str:
    """A fingerprint to tell whether two stored copies hold the same bytes."""
    return hex_digest(manager.store.get(key))


def _same(manager: CheckpointReader, a: str, b: str) -> bool:
    """Both files exist and hold the same bytes."""
    try:
        return _digest(manager, a) == _digest(manager, b)
    except StoreNotFoundError:
        return False


def _move(manager: CheckpointReader, step: int, keys: list[str], tag: str,
          delete_folder: Callable[[int], None]) -> None:
    store, url = manager.store, manager.url
    src = step_dir(step)
    dst = f"{tag}/{src}"
    src_info, src_raw = manager.read_manifest(src)
    dst_info, dst_raw = manager.read_manifest(dst)
    manifest = f"{src}/{MANIFEST_NAME}"
    names = sorted(k[len(src) + 1:] for k in keys if k != manifest)
    published = isinstance(src_info, CheckpointInfo)
    taken = CheckpointExistsError(f"{url}/{dst}", step,
                                  f"it is not a copy of {url}/{src}: choose another tag")
    if isinstance(dst_info, CheckpointInfo | NewerManifestError):
        # The copy is published: an earlier, interrupted run got this far (its manifest
        # was created only once every file had been checked), or the tag already holds
        # another checkpoint of this step, and then nothing here may be deleted.
        if published and src_raw != dst_raw:
            raise taken
        if not published and not all(  # the original's manifest went first: its remains
                _same(manager, f"{dst}/{name}", f"{src}/{name}") for name in names):
            raise taken  # must be exactly the copy's files
    else:
        if published and dst_raw is not None:  # unreadable: a torn copy, replaced below
            store.delete([f"{dst}/{MANIFEST_NAME}"])
        for name in names:
            store.copy(f"{src}/{name}", f"{dst}/{name}")
        if published:
            assert isinstance(src_info, CheckpointInfo) and src_raw is not None
            _check_copy(manager, src_info, dataclasses.replace(
                src_info, prefix=dst, url=f"{url}/{dst}"))
            try:
                store.put_new(f"{dst}/{MANIFEST_NAME}", src_raw)
            except StoreExistsError:
                raise taken from None
        else:
            for name in names:
                if _digest(manager, f"{dst}/{name}") != _digest(manager, f"{src}/{name}"):
                    raise CheckpointError(f"the copy of {url}/{src}/{name} at "
                                          f"{url}/{dst} differs; the original is kept")
            if src_raw is not None:  # an unreadable manifest: moved as it is
                store.put(f"{dst}/{MANIFEST_NAME}", src_raw)
    # Manifest first: from here the original no longer exists for readers.
    store.delete([manifest])
    delete_folder(step)


def _check_copy(manager: CheckpointReader, src: CheckpointInfo, dst: CheckpointInfo) -> None:
    """Every file of the copy ``dst`` matches the manifest, or is byte-for-byte the
    original where the original itself no longer does (a rotten checkpoint stays as
    rotten as it was, and is skipped on load as before)."""
    for name in sorted(src.files):
        _, problem = manager.check_file(dst, name)
        if not problem:
            continue
        if not _same(manager, dst.key(name), src.key(name)):
            raise CheckpointError(f"the copy of {src.url} at {dst.url} does not verify "
                                  f"({problem}); the original is kept")
        logger.warning("%s was already damaged (%s); moved as it is", src.url, problem)
