"""The storage contract every checkpoint backend satisfies, and its typed errors.

Keys are ``str`` paths relative to the store's base URL (``step-0000000010/state.pt``), never
``pathlib.Path``: a URI such as ``s3://bucket/x`` would be mangled by ``Path``. Backends fill
in the ``_``-prefixed methods; the public methods here own key validation and the retry of
transient errors, so that behaviour lives in one place and backends stay short.
"""

from __future__ import annotations

import abc
import builtins
import logging
import os
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, TypeVar
from urllib.parse import SplitResult

from hvd_resilient.checkpoint.digest import SHA256, new_hasher
from hvd_resilient.checkpoint.host_buffers import allocate
from hvd_resilient.errors import RESTARTABLE_EXIT_CODE, HvdResilientError
from hvd_resilient.masking import mask_text, mask_url

logger = logging.getLogger(__name__)

#: What ``put`` accepts: anything exposing the buffer protocol as contiguous bytes.
Buffer = bytes | bytearray | memoryview
#: Receives the pieces of an object in order while it downloads (see ``get_hashed``).
Feed = Callable[[memoryview], object]

T = TypeVar("T")


class StoreError(HvdResilientError):
    """Base of every error a store raises; the message is one line, free of secrets."""


class TransientStoreError(StoreError):
    """A failure that may pass on its own (throttling, 5xx, timeouts, refused connections).

    The public store methods retry these with capped, jittered exponential backoff before
    letting one escape; one that escapes exits restartable, so a launcher tries again.
    """

    exit_code = RESTARTABLE_EXIT_CODE


class StorePermissionError(StoreError):
    """The credentials are valid but not allowed to do this (HTTP 403 / AccessDenied).

    Deliberately never folded into not-found: a resume that treats "forbidden" as "no
    checkpoint" silently restarts training from step 0.
    """


class StoreNotFoundError(StoreError):
    """The key does not exist."""


class StoreConfigError(StoreError):
    """The store cannot work as configured: bad URL, missing bucket, rejected or absent
    credentials, missing client library. Retrying will not help; the message says what to fix.
    Its message is masked (`hvd_resilient.masking`), whatever URL a caller put into it.
    """

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(mask_text(str(message)), *args)


class StoreSettingError(StoreConfigError):
    """A store setting (the config's `store` section, or the same keyword of a store's
    constructor) with a value this store cannot use. ``setting`` names it, so that the config
    can say which flag and environment variable to fix."""

    def __init__(self, setting: str, detail: str, value: object) -> None:
        super().__init__(f"{setting} {detail}, got {value!r}")
        self.setting, self.detail, self.value = setting, detail, value


class SizeMismatchError(StoreError):
    """The stored object's size differs from the size the caller expected (torn or replaced)."""


class StoreExistsError(StoreError):
    """:meth:`CheckpointStore.put_new` found an object already stored under the key."""


def redact_url(url: str) -> str:
    """Return ``url`` with any ``user:password@`` part masked (``s3://***@bucket/x``), for
    logs and messages; never raises. One rule for the whole package: `masking.mask_url`."""
    return mask_url(url)


def validate_key(key: str) -> str:
    """Reject keys that could escape the base location or alias another key.

    Raises:
        ValueError: empty key, leading ``/``, backslash, or an empty / ``.`` / ``..`` part.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"store key must be a non-empty string, got {key!r}")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ValueError(f"store key {key!r} must be relative and use '/' separators")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"store key {key!r} has an empty, '.' or '..' part")
    return key


class CheckpointStore(abc.ABC):
    """A flat namespace of byte objects under one base URL.

    Args:
        retries: how many times a ``TransientStoreError`` is retried (0 = never).
        backoff_base: first backoff delay in seconds; doubles per attempt.
        backoff_cap: the longest single backoff delay in seconds.
    """

    #: The base URL without credentials; safe to log and to put into events.
    url: str

    #: How this store's URLs look, for messages (``s3://bucket/prefix``); the registry's
    #: ``SUPPORTED_URLS`` joins them.
    url_form: ClassVar[str] = ""
    #: The config's ``store`` settings this kind of store reads (constructor keywords of the
    #: same names); one set for a store that does not read it is refused, not ignored.
    settings: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abc.abstractmethod
    def url_args(cls, parts: SplitResult, url: str) -> dict[str, Any]:
        """The constructor's location arguments for ``url`` (split as ``parts``; its scheme
        is this store's, or empty for a plain path), without any I/O.

        Raises:
            StoreConfigError: the URL names no location this store can use.
        """

    @classmethod
    def from_url(cls, parts: SplitResult, url: str, **options: Any) -> CheckpointStore:
        """The store behind ``url``; ``options`` go to the constructor."""
        return cls(**cls.url_args(parts, url), **options)

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The constructor's keywords for ``settings`` (names from :attr:`settings`; "" or
        None: unset, left out), checked and normalised. The one place a store's settings
        are checked: the config calls it before training, the constructor again for
        keywords given directly.

        Raises:
            StoreSettingError: a value this store cannot use, naming the setting.
        """
        return {k: v for k, v in settings.items() if v not in ("", None)}

    def __init__(
        self, *, retries: int = 3, backoff_base: float = 0.5, backoff_cap: float = 8.0
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.retries = retries
        self.backoff_base = backoff_base
        self.backoff_cap = backoff_cap

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # ---- public contract ------------------------------------------------------------------

    def put(self, key: str, data: Buffer) -> None:
        """Store ``data`` under ``key`` atomically: readers see the old object or the whole new
        one, never a prefix.

        Raises:
            StorePermissionError, StoreConfigError, TransientStoreError (after retries),
            StoreError: anything else the backend reports.
        """
        validate_key(key)
        self._retry("put", key, lambda: self._put(key, memoryview(data).cast("B")))

    def put_new(self, key: str, data: Buffer) -> None:
        """Store ``data`` under ``key`` only if nothing is stored there yet (create, never
        replace), atomically like :meth:`put`. An object already there holding exactly
        ``data`` counts as success: a retry whose first attempt did land is not a conflict.

        How exclusive it is depends on the backend: local disk links the finished temporary
        file to the key (atomic: of two racing writers one wins); S3 looks first and then
        puts with ``If-None-Match: *``, which stores that honour it (AWS since 2024) make
        atomic, while others leave a window between the look and the put.

        Raises:
            StoreExistsError: another object is stored under ``key``.
            StorePermissionError, StoreConfigError, TransientStoreError, StoreError: as ``put``.
        """
        validate_key(key)
        view = memoryview(data).cast("B")
        try:
            self._retry("put", key, lambda: self._put_new(key, view))
        except StoreExistsError:
            try:
                there = self.get(key)
            except StoreNotFoundError:  # removed again meanwhile: it was there, so refuse
                raise StoreExistsError(f"{self.url}/{key} already exists") from None
            if bytes(there) != bytes(view):
                raise

    def copy(self, src: str, dst: str) -> None:
        """Store a copy of the object ``src`` under ``dst`` (atomically, like :meth:`put`),
        without holding it in memory where the backend can avoid that.

        Raises:
            StoreNotFoundError: ``src`` does not exist.
            StorePermissionError, StoreConfigError, TransientStoreError, StoreError.
        """
        validate_key(src)
        validate_key(dst)
        self._retry("copy", src, lambda: self._copy(src, dst))

    def abort_stale_uploads(self, older_than: float, dry_run: bool = False,
                            prefix: str = "", *, writer_gone: bool = False) -> int:
        """Remove what interrupted writes left below the base URL (of keys that start with
        ``prefix`` only, a plain string prefix as in :meth:`list`), invisible but taking
        space (S3: multipart uploads never completed nor aborted, which are billed; local
        disk: temporary files of a killed writer), if started at least ``older_than``
        seconds ago; return how many (that would be) removed. Younger ones may be writes in
        progress and are left alone; ``older_than=0`` removes them all (only when nothing
        writes below the URL, or below ``prefix``). ``writer_gone``: also younger ones that
        the backend knows no live writer owns (local disk: the temporary files of a process
        of this machine that no longer exists); a backend that cannot tell (S3) goes by age
        alone.

        Raises:
            ValueError: ``older_than`` < 0.
            StorePermissionError, StoreConfigError, TransientStoreError, StoreError.
        """
        if older_than < 0:
            raise ValueError(f"older_than must be >= 0 seconds, got {older_than}")
        return self._retry(
            "abort stale uploads", prefix or "<all>",
            lambda: self._abort_stale_uploads(older_than, dry_run, prefix, writer_gone))

    def put_file(self, key: str, path: str) -> None:
        """Store the contents of the local file ``path`` under ``key`` (atomically).

        Raises:
            FileNotFoundError: ``path`` does not exist locally.
            StorePermissionError, StoreConfigError, TransientStoreError, StoreError: as ``put``.
        """
        validate_key(key)
        self._retry("put_file", key, lambda: self._put_file(key, path))

    def get(self, key: str) -> bytes | bytearray:
        """Return the whole object stored under ``key``.

        Raises:
            StoreNotFoundError: no such key.
            StorePermissionError, StoreConfigError, TransientStoreError, StoreError.
        """
        validate_key(key)
        return self._retry("get", key, lambda: self._get(key))

    def get_into(self, key: str, size: int, out: memoryview | None = None) -> Buffer:
        """Return the object under ``key`` in one buffer of exactly ``size`` bytes: ``out``
        (a writable byte view of that length) when given, else a new writable buffer (a
        ``memoryview`` over fresh memory that was not zero-filled first; see
        ``host_buffers.allocate``).

        Knowing the size up front (from a manifest) lets a backend skip a metadata request and
        fetch ranges in parallel straight into their final place; passing ``out`` lets a
        reader reuse memory it already touched instead of faulting in fresh pages per file.

        Raises:
            ValueError: ``size`` < 0, or ``out`` is not ``size`` bytes long.
            StoreNotFoundError: no such key.
            SizeMismatchError: the stored object is not ``size`` bytes long.
            StorePermissionError, StoreConfigError, TransientStoreError, StoreError.
        """
        buf, view = self._destination(key, size, out)
        self._retry("get", key, lambda: self._read_into(key, view))
        return buf

    def get_hashed(
        self, key: str, size: int, out: memoryview | None = None, *, algorithm: str = SHA256
    ) -> tuple[Buffer, str]:
        """:meth:`get_into` plus the hex digest of the bytes read by ``algorithm`` (one of
        ``digest.ALGORITHMS``; checkpoints pass the one their manifest entry names, the
        default sha256 is what data shard indexes record).

        Where a backend reads an object as ordered pieces (S3: one stream for a small object,
        ranges completing in order for a large one), each piece is hashed as soon as it and
        all before it have arrived, so hashing overlaps the transfer instead of following it.
        A retried read starts a fresh hash.

        Raises:
            ValueError: an unknown ``algorithm`` (before any byte is read).
            The rest as :meth:`get_into`.
        """
        buf, view = self._destination(key, size, out)

        def attempt() -> str:
            h = new_hasher(algorithm)
            if not self._read_into(key, view, h.update):
                h.update(view)
            return h.hexdigest()

        return buf, self._retry("get", key, attempt)

    @staticmethod
    def _destination(key: str, size: int, out: memoryview | None) -> tuple[Buffer, memoryview]:
        """The checked arguments of a sized read: the buffer to return (``out`` or fresh
        memory) and a byte view of it for the backend to fill."""
        validate_key(key)
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        if out is not None and out.nbytes != size:
            raise ValueError(f"out holds {out.nbytes} bytes, expected {size}")
        buf = out if out is not None else memoryview(allocate(size))
        return buf, (buf.cast("B") if buf.format != "B" else buf)

    def list(self, prefix: str = "") -> list[str]:
        """Return the sorted keys that start with ``prefix`` (a plain string prefix, like S3).

        Raises:
            StorePermissionError, StoreConfigError, TransientStoreError, StoreError.
        """
        return self._retry("list", prefix or "<all>", lambda: sorted(self._list(prefix)))

    def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys``; keys that do not exist are ignored (deletion is idempotent).

        Raises:
            StorePermissionError, StoreConfigError, TransientStoreError, StoreError.
        """
        todo = [validate_key(k) for k in keys]
        if todo:
            self._retry("delete", f"{len(todo)} keys", lambda: self._delete(todo))

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists.

        Raises:
            StorePermissionError: forbidden to look (never reported as "does not exist").
            StoreConfigError, TransientStoreError, StoreError.
        """
        validate_key(key)
        return self._retry("exists", key, lambda: self._exists(key))

    def local_path(self, key: str) -> str | None:
        """A path on this machine's filesystem holding ``key``, when the store is one (then
        readers may work in place instead of downloading); ``None`` otherwise."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections and threads; the store must not be used afterwards."""

    # ---- backend hooks --------------------------------------------------------------------

    @abc.abstractmethod
    def _put(self, key: str, data: memoryview) -> None: ...

    def _put_file(self, key: str, path: str) -> None:
        """Maps the file instead of reading it: a multi-GB checkpoint file is not copied into
        memory first."""
        import mmap

        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:  # mmap cannot map an empty file
                self._put(key, memoryview(b""))
                return
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    self._put(key, view)
                finally:
                    view.release()

    def _put_new(self, key: str, data: memoryview) -> None:
        """Default: look, then put (not atomic); backends that can do better override it."""
        if self._exists(key):
            raise StoreExistsError(f"{self.url}/{key} already exists")
        self._put(key, data)

    def _copy(self, src: str, dst: str) -> None:
        """Default: through memory."""
        self._put(dst, memoryview(self._get(src)).cast("B"))

    def _abort_stale_uploads(self, older_than: float, dry_run: bool, prefix: str = "",
                             writer_gone: bool = False) -> int:
        """Default: the backend leaves nothing behind."""
        return 0

    @abc.abstractmethod
    def _get(self, key: str) -> bytes | bytearray: ...

    def _read_into(self, key: str, view: memoryview, feed: Feed | None = None) -> bool:
        """Fill ``view`` with the object, which must be exactly ``len(view)`` bytes long.

        A backend that can pass ``feed`` every piece of the object in order, as it arrives,
        does so and returns True; returning False leaves the caller to use ``view`` after.
        """
        data = self._get(key)
        if len(data) != len(view):
            raise SizeMismatchError(
                f"{self.url}/{key}: expected {len(view)} bytes, found {len(data)}"
            )
        view[:] = data
        return False

    @abc.abstractmethod
    def _list(self, prefix: str) -> Iterable[str]: ...

    @abc.abstractmethod
    def _delete(self, keys: builtins.list[str]) -> None: ...

    @abc.abstractmethod
    def _exists(self, key: str) -> bool: ...

    # ---- retry ----------------------------------------------------------------------------

    def _retry(self, op: str, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; retry ``TransientStoreError`` with capped, fully jittered backoff."""
        attempt = 0
        while True:
            try:
                return fn()
            except TransientStoreError as e:
                if attempt >= self.retries:
                    raise
                delay = random.uniform(0, min(self.backoff_cap, self.backoff_base * 2**attempt))
                attempt += 1
                logger.warning(
                    "%s %s/%s failed (%s); retry %d/%d in %.1fs",
                    op, self.url, what, e, attempt, self.retries, delay,
                )
                time.sleep(delay)
