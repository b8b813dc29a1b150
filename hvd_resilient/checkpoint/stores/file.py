"""Local disk / NFS backend.

Every write goes to a temporary name in the destination folder, is fsynced, renamed over the
final name with ``os.replace`` (atomic within one filesystem) and the folder is fsynced, so a
crash or power loss leaves either the old file or the complete new one, never a torn one.
:meth:`~CheckpointStore.put_new` (manifests) hard-links the finished temporary file to the
final name instead: ``link`` fails if the name exists, so of two racing writers exactly one
creates it (also on NFS, where ``O_EXCL`` was long unreliable but ``link`` is atomic).

A writer killed mid-write (SIGKILL, power loss) leaves its temporary file behind. The name says
who wrote it (`_tmp`), so that the next writer of the folder can tell a dead writer's file from
a live one's at once (`_writer_gone`), instead of only by its age.
"""

from __future__ import annotations

import errno
import functools
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


def _final_name(tmp: str) -> str:
    """The file name a temporary file ``.NAME.tmp-...`` was to get: NAME."""
    return tmp[1:tmp.rindex(TMP_MARKER)]


@functools.cache
def _boot_id() -> str:
    """This boot of this machine ("" where /proc does not say)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip().replace("-", "")[:16]
    except OSError:
        return ""
    return boot if boot.isalnum() else ""


def _machine() -> str:
    """This boot of this machine and this process's pid namespace ("" where there is no
    /proc to say): the scope in which a pid names one process. The boot id tells machines
    (and boots) apart where a shared filesystem joins them, host names need not; the pid
    namespace tells apart containers of one machine (they share its boot id), whose pids
    overlap. Namespaces alive at once have distinct inode numbers. Looked up at each call
    (one stat), never cached: a process may move to another pid namespace."""
    boot = _boot_id()
    try:
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}n{pidns}" if boot else ""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this pid namespace may still write (a zombie cannot)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")  # killed, not reaped yet: it writes nothing any more


def _writer_gone(tmp: str) -> bool:
    """True when the temporary file ``tmp`` (a name) was written by a process that no longer
    exists, so that no one can finish it: its name gives the writer's pid and scope (`_tmp`),
    the scope is this machine's boot and pid namespace, and no process of that pid lives
    here, or it is a zombie.

    Why this never takes a live writer's file: a writer only writes temporary files named
    with its own pid and scope, and within one scope a pid names one process at a time. A
    writer of another machine, boot or container (another scope), or one whose name carries
    no owner (older versions), is never judged gone: its file is left to the age limit. A pid
    reused by a new process makes a dead writer look alive, never the reverse: its file, too,
    waits for the age limit.
    """
    owner = tmp.rpartition(TMP_MARKER)[2].split(".")
    if len(owner) != 3 or not owner[1].isdigit() or int(owner[1]) <= 0:
        return False
    machine = _machine()
    return bool(machine) and owner[2] == machine and not _alive(int(owner[1]))


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
        """(final path, its folder, a fresh temporary path beside it). The temporary name is
        ``.NAME.tmp-RANDOM.PID.MACHINE`` (`_machine`; only ``.NAME.tmp-RANDOM`` where that
        is unknown): who writes it, for `_writer_gone`."""
        path = self._path(key)
        folder, name = os.path.split(path)
        machine = _machine()
        owner = f".{os.getpid()}.{machine}" if machine else ""
        return path, folder, os.path.join(
            folder, f".{name}{TMP_MARKER}{uuid.uuid4().hex[:12]}{owner}")

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

    def _abort_stale_uploads(self, older_than: float, dry_run: bool, prefix: str = "",
                             writer_gone: bool = False) -> int:
        """Temporary files of writers killed mid-write, for keys starting with ``prefix``:
        any last written more than ``older_than`` seconds ago (0: all) and, with
        ``writer_gone``, those of a writer known to be gone (`_writer_gone`). Folders are
        left in place, even emptied: a writer may have just created one for its own file."""
        cutoff = time.time() - older_than
        head, _, _ = prefix.rpartition("/")
        found = 0
        for folder, _, names in os.walk(self._path(head) if head else self.root):
            rel = os.path.relpath(folder, self.root).replace(os.sep, "/")
            for name in names:
                if not _is_tmp(name):
                    continue
                key = _final_name(name) if rel == "." else f"{rel}/{_final_name(name)}"
                if not key.startswith(prefix):
                    continue
                path = os.path.join(folder, name)
                try:
                    if (older_than > 0 and os.lstat(path).st_mtime > cutoff
                            and not (writer_gone and _writer_gone(name))):
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
