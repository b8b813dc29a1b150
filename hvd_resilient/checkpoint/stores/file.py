"""Local disk / NFS backend.

Every write goes to a temporary name in the destination folder, is fsynced, renamed over the
final name with ``os.replace`` (atomic within one filesystem) and the folder is fsynced, so a
crash or power loss leaves either the old file or the complete new one, never a torn one.
:meth:`~CheckpointStore.put_new` (manifests) hard-links the finished temporary file to the
final name instead: ``link`` fails if the name exists, so of two racing writers exactly one
creates it (also on NFS, where ``O_EXCL`` was long unreliable but ``link`` is atomic).
"""

from __future__ import annotations

import errno
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import SplitResult

from hvd_resilient.checkpoint.stores.base import (
    CheckpointStore,
    Feed,
    SizeMismatchError,
    StoreConfigError,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
    StorePermissionError,
    TransientStoreError,
)

#: Temporary files carry this marker; listings hide them and they never shadow a real key.
TMP_MARKER = ".tmp-"

# Errors an NFS client reports while a server fails over or is briefly unreachable.
_TRANSIENT_ERRNOS = {errno.EIO, errno.EAGAIN, errno.ETIMEDOUT, errno.ESTALE, errno.EINTR}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems (and some NFS setups) refuse fsync on dirs
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _is_tmp(name: str) -> bool:
    return name.startswith(".") and TMP_MARKER in name


def _link_new(tmp: str, path: str) -> None:
    """Give ``tmp`` the name ``path`` only if ``path`` does not exist (FileExistsError)."""
    try:
        os.link(tmp, path)
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK,
                           errno.ENOSYS):
            raise
        # A filesystem without hard links: look, then rename (a window for a racing writer).
        if os.path.lexists(path):
            raise FileExistsError(errno.EEXIST, "exists", path) from None
        os.replace(tmp, path)


class FileStore(CheckpointStore):
    """Objects are files below ``root``; key ``a/b`` is the file ``root/a/b``.

    Args:
        root: the base directory; created by the first write.
        fsync: fsync files and folders on write. Turning it off is only for throwaway data.
        retries, backoff_base, backoff_cap: see :class:`CheckpointStore`.

    Raises:
        StoreConfigError: ``root`` exists but is not a directory.
    """

    url_form = "file:///path"

    @classmethod
    def url_args(cls, parts: SplitResult, url: str) -> dict[str, Any]:
        """``file:///abs/path`` (or ``file://localhost/...``), or a plain path."""
        if not parts.scheme:
            return {"root": url}
        if parts.netloc not in ("", "localhost"):
            raise StoreConfigError(
                f"file URL {url!r} names host {parts.netloc!r}; use {cls.url_form} (an "
                "absolute path)")
        return {"root": parts.path}

    def __init__(
        self,
        root: str,
        *,
        fsync: bool = True,
        retries: int = 3,
        backoff_base: float = 0.5,
        backoff_cap: float = 8.0,
    ) -> None:
        super().__init__(retries=retries, backoff_base=backoff_base, backoff_cap=backoff_cap)
        self.root = os.path.abspath(os.path.expanduser(root))
        self.url = "file://" + self.root
        self.fsync = fsync
        # The folder is created by the first write, not here: a mistyped path given to
        # `hvd-resilient ckpt list` must not leave an empty folder behind.
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise StoreConfigError(f"checkpoint location {self.root!r} is not a directory")

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *key.split("/"))

    def local_path(self, key: str) -> str | None:
        return self._path(key)

    def _err(self, e: OSError, key: str) -> StoreError:
        where = f"{self.url}/{key}"
        if isinstance(e, FileNotFoundError):
            return StoreNotFoundError(f"{where} does not exist")
        if isinstance(e, PermissionError):
            return StorePermissionError(f"{where}: permission denied")
        if e.errno in _TRANSIENT_ERRNOS:
            return TransientStoreError(f"{where}: {e.strerror or e}")
        return StoreError(f"{where}: {e.strerror or e}")

    # ---- hooks ----------------------------------------------------------------------------

    def _makedirs(self, folder: str) -> None:
        """Create ``folder`` and fsync the parent of each folder created: a new file is only
        durable once every directory entry leading to it is."""
        missing = []
        d = folder
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        os.makedirs(folder, exist_ok=True)
        if self.fsync:
            for d in reversed(missing):
                _fsync_dir(os.path.dirname(d))

    def _tmp(self, key: str) -> tuple[str, str, str]:
        """(final path, its folder, a fresh temporary path beside it)."""
        path = self._path(key)
        folder, name = os.path.split(path)
        return path, folder, os.path.join(folder, f".{name}{TMP_MARKER}{uuid.uuid4().hex[:12]}")

    def _write(self, key: str, fill, publish) -> None:  # type: ignore[no-untyped-def]
        """Write through a temporary file: ``fill(file)`` writes it, ``publish(tmp, path)``
        gives it its final name. The temporary file never outlives the call."""
        path, folder, tmp = self._tmp(key)
        try:
            self._makedirs(folder)
            with open(tmp, "wb") as f:
                fill(f)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            try:
                publish(tmp, path)
            except FileExistsError:
                raise StoreExistsError(f"{self.url}/{key} already exists") from None
            if self.fsync:
                _fsync_dir(folder)
        except OSError as e:
            raise self._err(e, key) from None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def _put(self, key: str, data: memoryview) -> None:
        self._write(key, lambda f: f.write(data), os.replace)

    def _put_new(self, key: str, data: memoryview) -> None:
        self._write(key, lambda f: f.write(data), _link_new)

    def _copy(self, src: str, dst: str) -> None:
        try:
            source = open(self._path(src), "rb")
        except IsADirectoryError:
            raise StoreNotFoundError(f"{self.url}/{src} does not exist") from None
        except OSError as e:
            raise self._err(e, src) from None
        with source:
            self._write(dst, lambda f: shutil.copyfileobj(source, f, 8 << 20), os.replace)

    def _abort_stale_uploads(self, older_than: float, dry_run: bool) -> int:
        """Temporary files of writers killed mid-write, older than ``older_than`` seconds."""
        cutoff = time.time() - older_than
        found = 0
        for folder, _, names in os.walk(self.root):
            for name in names:
                if not _is_tmp(name):
                    continue
                path = os.path.join(folder, name)
                try:
                    if older_than > 0 and os.lstat(path).st_mtime > cutoff:
                        continue
                    if not dry_run:
                        os.unlink(path)
                except FileNotFoundError:  # its writer finished meanwhile
                    continue
                except OSError as e:
                    raise self._err(e, os.path.relpath(path, self.root)) from None
                found += 1
        return found

    def _get(self, key: str) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return f.read()
        except IsADirectoryError:
            raise StoreNotFoundError(f"{self.url}/{key} does not exist") from None
        except OSError as e:
            raise self._err(e, key) from None

    def _read_into(self, key: str, view: memoryview, feed: Feed | None = None) -> bool:
        size = len(view)
        try:
            with open(self._path(key), "rb") as f:
                actual = os.fstat(f.fileno()).st_size
                if actual != size:
                    raise SizeMismatchError(
                        f"{self.url}/{key}: expected {size} bytes, found {actual}"
                    )
                done = 0
                while done < size:
                    n = f.readinto(view[done:])
                    if not n:
                        raise SizeMismatchError(
                            f"{self.url}/{key}: expected {size} bytes, file ended at {done}"
                        )
                    done += n
            return False  # one read(2) for the whole file: nothing to overlap with
        except IsADirectoryError:
            raise StoreNotFoundError(f"{self.url}/{key} does not exist") from None
        except OSError as e:
            raise self._err(e, key) from None

    def _walk(self, folder: str, rel: str) -> Iterator[str]:
        try:
            entries = list(os.scandir(folder))
        except FileNotFoundError:
            return
        for entry in entries:
            if _is_tmp(entry.name):
                continue
            key = f"{rel}{entry.name}"
            if entry.is_dir(follow_symlinks=False):
                yield from self._walk(entry.path, key + "/")
            else:
                yield key

    def _list(self, prefix: str) -> list[str]:
        # Start the walk at the deepest folder the prefix pins down instead of the root.
        head, _, _ = prefix.rpartition("/")
        rel = f"{head}/" if head else ""
        start = self._path(head) if head else self.root
        try:
            return [k for k in self._walk(start, rel) if k.startswith(prefix)]
        except OSError as e:
            raise self._err(e, prefix) from None

    def _delete(self, keys: list[str]) -> None:
        folders = set()
        for key in keys:
            path = self._path(key)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise self._err(e, key) from None
            folders.add(os.path.dirname(path))
        # Remove folders left empty, up to (not including) the root, so pruned checkpoints
        # leave nothing behind. A folder another writer just filled is simply not empty.
        for folder in sorted(folders, key=len, reverse=True):
            while folder.startswith(self.root + os.sep):
                try:
                    os.rmdir(folder)
                except OSError:
                    break
                folder = os.path.dirname(folder)

    def _exists(self, key: str) -> bool:
        try:
            os.stat(self._path(key))
        except FileNotFoundError:
            return False
        except OSError as e:
            raise self._err(e, key) from None
        return os.path.isfile(self._path(key))
