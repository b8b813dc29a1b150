"""S3 (and S3-compatible: SeaweedFS, MinIO, Ceph) backend on boto3.

Large objects move in parallel parts: multipart upload out of one memory buffer and ranged
GETs into one preallocated buffer, so a checkpoint of a few GB uses the link instead of one
TCP stream. The endpoint and credentials come from the standard AWS chain
(``AWS_ENDPOINT_URL``, ``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``, instance roles) unless given
explicitly; no credential ever appears in a message, a log line or ``repr``.

A multipart upload that does not complete is aborted (an incomplete one stays invisible but
billed): when a part or the completion fails, when the store is closed, and when the process
exits while one is still running (the writer thread abandoned: the abort runs before the
interpreter waits for the part threads). A process killed outright aborts nothing; ``hvd-resilient
ckpt prune`` aborts what such processes left (:meth:`CheckpointStore.abort_stale_uploads`).
"""

from __future__ import annotations

import atexit
import datetime
import email.utils
import functools
import logging
import re
import threading
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar
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
    StoreSettingError,
    TransientStoreError,
    redact_url,
)

logger = logging.getLogger(__name__)

MiB = 1 << 20
T = TypeVar("T")

_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "InvalidClientTokenId",
    "AuthorizationHeaderMalformed",
}
_PERMISSION_CODES = {"AccessDenied", "AllAccessDisabled", "Forbidden", "403"}
_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404", "NoSuchUpload"}
_TRANSIENT_CODES = {
    "Throttling",
    "ThrottlingException",
    "SlowDown",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "InternalError",
    "ServiceUnavailable",
    "RequestLimitExceeded",
    "TooManyRequests",
    "OperationAborted",
}
_CONTENT_RANGE = re.compile(r"bytes \d+-\d+/(\d+)")
SSE_MODES = ("AES256", "aws:kms")
"""S3's server-side encryption modes."""
#: copy_object's limit; larger objects are copied in parts (upload_part_copy).
_COPY_LIMIT = 5 << 30

#: Stores with multipart uploads in flight, for the abort at process exit.
_LIVE: weakref.WeakSet[S3Store] = weakref.WeakSet()
_exit = {"hooked": False, "exiting": False}
_exit_lock = threading.Lock()


def _abort_at_exit() -> None:
    """Abort every multipart upload still running in this process (its thread abandoned)."""
    with _exit_lock:
        _exit["exiting"] = True
        stores = list(_LIVE)
    for store in stores:
        store.abort_inflight("the process is exiting")


def _hook_exit() -> None:
    """Run :func:`_abort_at_exit` at interpreter exit, BEFORE the thread pools are joined
    (``threading._register_atexit``, whose hooks run newest first, so ahead of the one
    ``concurrent.futures`` registered on import): a part stuck on a dead link would
    otherwise hold the exit until its timeout, and the upload would outlive the process."""
    with _exit_lock:
        if _exit["hooked"]:
            return
        _exit["hooked"] = True
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_abort_at_exit)
            return
        except RuntimeError:  # already shutting down: the next best place
            pass
    atexit.register(_abort_at_exit)


def _import_boto3() -> Any:
    try:
        import boto3  # noqa: F401  (imported for its side effect of availability)
        import botocore.config  # noqa: F401
    except ImportError:
        raise StoreConfigError(
            "s3:// checkpoints need boto3, which is not installed: pip install boto3"
        ) from None
    return boto3


def _server_time(resp: dict[str, Any]) -> datetime.datetime:
    """The time by the server's clock (its ``Date`` header), else by ours."""
    date = (resp.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("date")
    if date:
        try:
            return email.utils.parsedate_to_datetime(date)
        except (TypeError, ValueError):
            pass
    return datetime.datetime.now(datetime.timezone.utc)


class _InOrder:
    """Passes the ranges of one object to ``feed`` in order as they complete out of order: a
    range that completes hands on itself and every completed one after it."""

    def __init__(self, view: memoryview, ranges: list[tuple[int, int]], feed: Feed) -> None:
        self._view, self._ranges, self._feed = view, ranges, feed
        self._next = 0
        self._done: set[int] = set()
        self._lock = threading.Lock()

    def done(self, i: int) -> None:
        with self._lock:
            self._done.add(i)
            while self._next in self._done:
                a, b = self._ranges[self._next]
                self._feed(self._view[a:b])
                self._next += 1


class S3Store(CheckpointStore):
    """Objects under ``s3://bucket/prefix/``.

    Args:
        bucket: the bucket; it must exist (checked at construction when ``check``).
        prefix: key prefix inside the bucket, without leading/trailing ``/``.
        endpoint_url: an S3-compatible endpoint; default: the AWS chain (``AWS_ENDPOINT_URL``).
        region: the region; default: the AWS chain.
        profile: a named profile from ``~/.aws/config``; default: the AWS chain.
        sse: server-side encryption, ``"AES256"`` or ``"aws:kms"``.
        sse_kms_key_id: a KMS key id/ARN; implies ``sse="aws:kms"``.
        max_attempts: botocore's own attempts per request (adaptive mode: backs off and rate
            limits itself on throttling).
        connect_timeout, read_timeout: seconds; a dead endpoint fails instead of hanging.
        part_size: bytes per multipart part and per ranged GET (S3 needs >= 5 MiB).
        multipart_threshold: objects larger than this go in parts; default ``2 * part_size``.
        threads: parallel parts in flight per upload/download.
        check: list the prefix once now, so a missing bucket or rejected credentials fail at
            startup with one clear line rather than at the first checkpoint hours later.
        retries, backoff_base, backoff_cap: our retries around botocore's, see
            :class:`CheckpointStore`; they cover outages longer than botocore's few attempts.

    Raises:
        StoreConfigError: boto3 missing, unknown profile, bad option, missing bucket, no or
            rejected credentials.
        StorePermissionError: the credentials may not list the prefix.
        TransientStoreError: the endpoint could not be reached (after retries).
    """

    url_form = "s3://bucket/prefix"
    settings = ("sse", "sse_kms_key_id")

    @classmethod
    def url_args(cls, parts: SplitResult, url: str) -> dict[str, Any]:
        if not parts.netloc:
            raise StoreConfigError(f"S3 URL {redact_url(url)!r} has no bucket; use {cls.url_form}")
        return {"bucket": parts.netloc, "prefix": parts.path.strip("/")}

    @classmethod
    def check_settings(cls, settings: Mapping[str, Any]) -> dict[str, Any]:
        """A KMS key implies ``sse="aws:kms"``; with any other mode it is refused, as is a
        mode S3 does not have."""
        out = super().check_settings(settings)
        sse, key = out.get("sse"), out.get("sse_kms_key_id")
        if key and sse not in (None, "aws:kms"):
            raise StoreSettingError("sse_kms_key_id", "needs sse=aws:kms (or no sse: a key "
                                    f"implies it), not sse={sse!r}", key)
        if key:
            out["sse"] = "aws:kms"
        elif sse is not None and sse not in SSE_MODES:
            raise StoreSettingError("sse", f"must be {' or '.join(SSE_MODES)} (or empty: the "
                                    "bucket's default)", sse)
        return out

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        sse: str | None = None,
        sse_kms_key_id: str | None = None,
        max_attempts: int = 5,
        connect_timeout: float = 10.0,
        read_timeout: float = 60.0,
        part_size: int = 16 * MiB,
        multipart_threshold: int | None = None,
        threads: int = 8,
        check: bool = True,
        retries: int = 3,
        backoff_base: float = 0.5,
        backoff_cap: float = 8.0,
    ) -> None:
        super().__init__(retries=retries, backoff_base=backoff_base, backoff_cap=backoff_cap)
        if not bucket:
            raise StoreConfigError(f"S3 bucket name is empty; use {self.url_form}")
        if part_size < 5 * MiB:
            raise StoreConfigError(f"part_size must be >= 5 MiB (S3's minimum), got {part_size}")
        if threads < 1:
            raise StoreConfigError(f"threads must be >= 1, got {threads}")
        checked = self.check_settings({"sse": sse, "sse_kms_key_id": sse_kms_key_id})
        sse, sse_kms_key_id = checked.get("sse"), checked.get("sse_kms_key_id")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.part_size = part_size
        self.multipart_threshold = multipart_threshold or 2 * part_size
        self.threads = threads
        self._sse_args: dict[str, str] = {}
        if sse:
            self._sse_args["ServerSideEncryption"] = sse
        if sse_kms_key_id:
            self._sse_args["SSEKMSKeyId"] = sse_kms_key_id
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        # Multipart uploads in flight: upload id -> (store key, full key).
        self._inflight: dict[str, tuple[str, str]] = {}
        self._conditional_put = True  # If-None-Match: *, until the server says it cannot

        boto3 = _import_boto3()
        import botocore.config
        import botocore.exceptions as bexc

        self._bexc = bexc
        try:
            session = boto3.session.Session(profile_name=profile, region_name=region)
        except bexc.ProfileNotFound:
            raise StoreConfigError(f"AWS profile {profile!r} is not configured") from None
        config = botocore.config.Config(
            retries={"mode": "adaptive", "max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            max_pool_connections=threads + 4,
        )
        try:
            self.client = session.client("s3", endpoint_url=endpoint_url, config=config)
        except ValueError as e:  # botocore reports a malformed endpoint URL this way
            raise StoreConfigError(
                f"invalid S3 endpoint URL {redact_url(endpoint_url or '')!r}: {e}"
            ) from None
        self.endpoint = redact_url(self.client.meta.endpoint_url or "")
        # Remember the secrets (only) to scrub them from any server-provided message.
        creds = session.get_credentials()
        self._secrets = [
            s for s in (getattr(creds, "access_key", None), getattr(creds, "secret_key", None),
                        getattr(creds, "token", None)) if s
        ] if creds is not None else []
        if check:
            self._retry("check", self.prefix or "<bucket>", self._check)

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"

    # ---- helpers --------------------------------------------------------------------------

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return " ".join(text.split())  # one line

    def _error(self, e: BaseException, op: str, key: str) -> StoreError:
        """Map a botocore exception to our typed errors (one line, no secrets)."""
        bexc = self._bexc
        where = f"{self.url}/{key}" if key else self.url
        if isinstance(e, bexc.ClientError):
            err = e.response.get("Error", {}) or {}
            code = str(err.get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            detail = self._scrub(str(err.get("Message") or code or status))
            if code == "NoSuchBucket":
                return StoreConfigError(
                    f"S3 bucket {self.bucket!r} does not exist at {self.endpoint}"
                )
            if code in _CREDENTIAL_CODES:
                return StoreConfigError(
                    f"{self.endpoint} rejected the AWS credentials ({code}) for {op} {where}; "
                    "check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE"
                )
            if code in _NOT_FOUND_CODES or status == 404:
                return StoreNotFoundError(f"{where} does not exist")
            if code in _PERMISSION_CODES or status == 403:
                return StorePermissionError(f"access denied: {op} {where} ({code or status})")
            if code in _TRANSIENT_CODES or status == 429 or status >= 500:
                return TransientStoreError(f"{op} {where}: {code or status} {detail}")
            return StoreError(f"{op} {where} failed: {code or status} {detail}")
        if isinstance(e, bexc.NoCredentialsError | bexc.PartialCredentialsError):
            return StoreConfigError(
                f"no usable AWS credentials for {where}: set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
            )
        if isinstance(e, bexc.HTTPClientError | bexc.ConnectionError):  # refused, reset, timeouts
            return TransientStoreError(
                f"{op} {where}: cannot reach {self.endpoint} ({type(e).__name__})"
            )
        return StoreError(f"{op} {where} failed: {type(e).__name__}: {self._scrub(str(e))}")

    def _call(self, op: str, key: str, fn: Callable[..., T], **kwargs: Any) -> T:
        try:
            return fn(**kwargs)
        except (self._bexc.BotoCoreError, self._bexc.ClientError) as e:
            raise self._error(e, op, key) from None

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="s3store")
            return self._pool

    def _run_parallel(self, fns: list[Callable[[], T]]) -> list[T]:
        """Run ``fns`` on the pool; on the first failure cancel what has not started."""
        pool = self._executor()
        futures: list[Future[T]] = [pool.submit(fn) for fn in fns]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        wait(pending)
        for f in futures:
            if f.done() and not f.cancelled() and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]

    def _ranges(self, start: int, size: int) -> list[tuple[int, int]]:
        return [(a, min(a + self.part_size, size)) for a in range(start, size, self.part_size)]

    def _check(self) -> None:
        self._call(
            "list", "", self.client.list_objects_v2,
            Bucket=self.bucket, Prefix=self._key(""), MaxKeys=1,
        )

    def close(self) -> None:
        """Abort the multipart uploads still running, then stop the part threads."""
        self.abort_inflight("the store is closing")
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # ---- upload ---------------------------------------------------------------------------

    def _put(self, key: str, data: memoryview) -> None:
        full = self._key(key)
        if len(data) <= self.multipart_threshold:
            # S3 PUT is atomic: readers see the old object or the new one, never a prefix.
            self._call(
                "put", key, self.client.put_object,
                Bucket=self.bucket, Key=full, Body=bytes(data), **self._sse_args,
            )
            return

        def part(upload_id: str, number: int, a: int, b: int) -> dict[str, Any]:
            resp = self._call(
                "put", key, self.client.upload_part,
                Bucket=self.bucket, Key=full, UploadId=upload_id, PartNumber=number,
                Body=bytes(data[a:b]),
            )
            return {"PartNumber": number, "ETag": resp["ETag"]}

        self._multipart(key, lambda upload_id: [
            functools.partial(part, upload_id, n, a, b)
            for n, (a, b) in enumerate(self._ranges(0, len(data)), start=1)])

    def _multipart(
        self, key: str, parts: Callable[[str], list[Callable[[], dict[str, Any]]]]
    ) -> None:
        """One multipart upload to ``key``: ``parts(upload_id)`` makes the part calls, run in
        parallel; any failure, or an exit of the process meanwhile, aborts the upload."""
        full = self._key(key)
        with _exit_lock:
            if _exit["exiting"]:
                raise StoreError(f"put {self.url}/{key}: the process is exiting")
            _LIVE.add(self)
        _hook_exit()
        upload_id = self._call(
            "put", key, self.client.create_multipart_upload,
            Bucket=self.bucket, Key=full, **self._sse_args,
        )["UploadId"]
        with self._pool_lock:
            self._inflight[upload_id] = (key, full)
        try:
            done = self._run_parallel(parts(upload_id))
            self._call(
                "put", key, self.client.complete_multipart_upload,
                Bucket=self.bucket, Key=full, UploadId=upload_id,
                MultipartUpload={"Parts": done},
            )
        except BaseException:
            # An abandoned multipart upload is invisible but billed: abort it.
            self._abort(upload_id, key, full)
            raise
        finally:
            with self._pool_lock:
                self._inflight.pop(upload_id, None)

    def _abort(self, upload_id: str, key: str, full: str) -> bool:
        """Abort one multipart upload, best effort; whether the server confirmed it."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
            return True
        except Exception as e:  # the server may be the thing that just failed
            logger.debug("abort of multipart upload of %s/%s failed: %s",
                         self.url, key, type(e).__name__)
            return False

    def abort_inflight(self, why: str) -> int:
        """Abort the multipart uploads this store is running now (their parts then fail);
        return how many were aborted."""
        with self._pool_lock:
            running = list(self._inflight.items())
        n = 0
        for upload_id, (key, full) in running:
            if self._abort(upload_id, key, full):
                n += 1
                logger.warning("aborted the unfinished upload of %s/%s: %s", self.url, key, why)
        return n

    def _put_new(self, key: str, data: memoryview) -> None:
        # Look first: a store that ignores If-None-Match must still not overwrite what was
        # there before this call (a race with another writer stays possible on such stores).
        if self._exists(key):
            raise StoreExistsError(f"{self.url}/{key} already exists")
        if self._conditional_put:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self._key(key),
                                       Body=bytes(data), IfNoneMatch="*", **self._sse_args)
                return
            except self._bexc.ClientError as e:
                code = str(e.response.get("Error", {}).get("Code", ""))
                status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                             or 0)
                if code == "PreconditionFailed" or status == 412:
                    raise StoreExistsError(f"{self.url}/{key} already exists") from None
                if code == "ConditionalRequestConflict" or status == 409:
                    raise TransientStoreError(
                        f"put {self.url}/{key}: a concurrent conditional write") from None
                if code != "NotImplemented" and status != 501:
                    raise self._error(e, "put", key) from None
                self._conditional_put = False
                logger.warning("%s does not support conditional puts (If-None-Match); "
                               "manifests are created by look-then-put", self.endpoint)
            except self._bexc.BotoCoreError as e:
                raise self._error(e, "put", key) from None
        self._put(key, data)

    def _copy(self, src: str, dst: str) -> None:
        head = self._call("copy", src, self.client.head_object,
                          Bucket=self.bucket, Key=self._key(src))
        size = int(head.get("ContentLength", 0))
        source = {"Bucket": self.bucket, "Key": self._key(src)}
        if size <= _COPY_LIMIT:  # one request; the server copies
            self._call("copy", src, self.client.copy_object, Bucket=self.bucket,
                       Key=self._key(dst), CopySource=source, **self._sse_args)
            return

        def part(upload_id: str, number: int, a: int, b: int) -> dict[str, Any]:
            resp = self._call(
                "copy", src, self.client.upload_part_copy,
                Bucket=self.bucket, Key=self._key(dst), UploadId=upload_id, PartNumber=number,
                CopySource=source, CopySourceRange=f"bytes={a}-{b - 1}",
            )
            return {"PartNumber": number, "ETag": resp["CopyPartResult"]["ETag"]}

        step = max(self.part_size, -(-size // 10_000))  # S3 allows 10,000 parts
        spans = [(a, min(a + step, size)) for a in range(0, size, step)]
        self._multipart(dst, lambda upload_id: [
            functools.partial(part, upload_id, n, a, b)
            for n, (a, b) in enumerate(spans, start=1)])

    def _abort_stale_uploads(self, older_than: float, dry_run: bool, prefix: str = "",
                             writer_gone: bool = False) -> int:
        """Multipart uploads below the prefix (and of keys starting with ``prefix``) started
        more than ``older_than`` seconds ago by the server's clock (its ``Date`` header), so
        a skewed local clock cannot make a running upload look stale. Who started one is not
        known, so ``writer_gone`` changes nothing: only the age counts."""
        root = self._key("")
        with self._pool_lock:
            mine = set(self._inflight)
        found = 0
        paginator = self.client.get_paginator("list_multipart_uploads")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=root + prefix):
                now = _server_time(page)
                for up in page.get("Uploads", []) or []:
                    started = up.get("Initiated")
                    if up.get("UploadId") in mine or not isinstance(started, datetime.datetime):
                        continue
                    if started.tzinfo is None:
                        started = started.replace(tzinfo=datetime.timezone.utc)
                    if older_than > 0 and (now - started).total_seconds() < older_than:
                        continue
                    key = str(up["Key"])[len(root):]
                    if dry_run or self._abort(str(up["UploadId"]), key, str(up["Key"])):
                        found += 1
        except (self._bexc.BotoCoreError, self._bexc.ClientError) as e:
            raise self._error(e, "list uploads", "") from None
        return found

    # ---- download -------------------------------------------------------------------------

    def _read_body(self, resp: dict[str, Any], view: memoryview, key: str,
                   feed: Feed | None = None) -> int:
        """Stream a response body into ``view``, passing each chunk to ``feed`` once it is in
        place; return the byte count (fails if it overflows)."""
        pos = 0
        body = resp["Body"]
        try:
            for chunk in body.iter_chunks(MiB):
                end = pos + len(chunk)
                if end > len(view):
                    raise SizeMismatchError(f"{self.url}/{key}: object larger than expected")
                view[pos:end] = chunk
                if feed is not None:
                    feed(view[pos:end])
                pos = end
        except (self._bexc.BotoCoreError, self._bexc.ClientError) as e:
            raise self._error(e, "get", key) from None
        finally:
            body.close()
        return pos

    def _get_range(self, key: str, view: memoryview, a: int, b: int, total: int,
                   done: Callable[[], object] | None = None) -> None:
        resp = self._call(
            "get", key, self.client.get_object,
            Bucket=self.bucket, Key=self._key(key), Range=f"bytes={a}-{b - 1}",
        )
        m = _CONTENT_RANGE.match(resp.get("ContentRange") or "")
        if m and int(m.group(1)) != total:
            raise SizeMismatchError(
                f"{self.url}/{key}: expected {total} bytes, found {m.group(1)} (replaced?)"
            )
        n = self._read_body(resp, view[a:b], key)
        if n != b - a:
            raise SizeMismatchError(f"{self.url}/{key}: short read at byte {a + n} of {total}")
        if done is not None:
            done()

    def _read_into(self, key: str, view: memoryview, feed: Feed | None = None) -> bool:
        size = len(view)
        if size <= self.multipart_threshold:
            resp = self._call(
                "get", key, self.client.get_object, Bucket=self.bucket, Key=self._key(key)
            )
            if int(resp.get("ContentLength", -1)) != size:
                resp["Body"].close()
                raise SizeMismatchError(
                    f"{self.url}/{key}: expected {size} bytes, found {resp.get('ContentLength')}"
                )
            if self._read_body(resp, view, key, feed) != size:
                raise SizeMismatchError(f"{self.url}/{key}: short read")
            return True
        # One HEAD first: a wrong size must fail as a mismatch, not as a pile of range errors.
        head = self._call(
            "get", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key)
        )
        if int(head.get("ContentLength", -1)) != size:
            raise SizeMismatchError(
                f"{self.url}/{key}: expected {size} bytes, found {head.get('ContentLength')}"
            )
        ranges = self._ranges(0, size)
        ordered = None if feed is None else _InOrder(view, ranges, feed)
        self._run_parallel(
            [functools.partial(self._get_range, key, view, a, b, size,
                               None if ordered is None else functools.partial(ordered.done, i))
             for i, (a, b) in enumerate(ranges)]
        )
        return True

    def _get(self, key: str) -> bytes | bytearray:
        # The first part doubles as the size probe (Content-Range carries the total), so small
        # objects cost one request and large ones fetch their first part for free.
        try:
            resp = self.client.get_object(
                Bucket=self.bucket, Key=self._key(key), Range=f"bytes=0-{self.part_size - 1}"
            )
        except self._bexc.ClientError as e:
            if e.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""  # only an empty object cannot satisfy bytes=0-N
            raise self._error(e, "get", key) from None
        except self._bexc.BotoCoreError as e:
            raise self._error(e, "get", key) from None
        m = _CONTENT_RANGE.match(resp.get("ContentRange") or "")
        total = int(m.group(1)) if m else int(resp["ContentLength"])
        buf = bytearray(total)
        view = memoryview(buf)
        first = self._read_body(resp, view, key)
        if first < total:
            self._run_parallel(
                [functools.partial(self._get_range, key, view, a, b, total)
                 for a, b in self._ranges(first, total)]
            )
        return buf

    # ---- listing --------------------------------------------------------------------------

    def _list(self, prefix: str) -> list[str]:
        base = f"{self.prefix}/" if self.prefix else ""
        out: list[str] = []
        paginator = self.client.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                out.extend(obj["Key"][len(base):] for obj in page.get("Contents", []))
        except (self._bexc.BotoCoreError, self._bexc.ClientError) as e:
            raise self._error(e, "list", prefix) from None
        return out

    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = keys[i:i + 1000]
            resp = self._call(
                "delete", batch[0], self.client.delete_objects,
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": self._key(k)} for k in batch], "Quiet": True},
            )
            for err in resp.get("Errors", []) or []:
                if err.get("Code") in _NOT_FOUND_CODES:
                    continue
                fake = self._bexc.ClientError({"Error": err}, "DeleteObjects")
                raise self._error(fake, "delete", err.get("Key", batch[0]))

    def _exists(self, key: str) -> bool:
        try:
            self._call(
                "exists", key, self.client.head_object, Bucket=self.bucket, Key=self._key(key)
            )
        except StoreNotFoundError:
            return False
        return True
