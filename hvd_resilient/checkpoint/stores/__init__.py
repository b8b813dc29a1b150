"""Where checkpoints live: the storage contract (base), its backends (file, s3), and the
registry that maps a URL's scheme to a backend, so that nothing above imports a concrete store
and the base never imports its backends."""

from __future__ import annotations

import importlib
from urllib.parse import urlsplit

from hvd_resilient.checkpoint.stores.base import (
    Buffer,
    CheckpointStore,
    Feed,
    SizeMismatchError,
    StoreConfigError,
    StoreError,
    StoreExistsError,
    StoreNotFoundError,
    StorePermissionError,
    TransientStoreError,
    redact_url,
    validate_key,
)

REGISTRY: dict[str, str] = {
    "file": "hvd_resilient.checkpoint.stores.file:FileStore",
    "s3": "hvd_resilient.checkpoint.stores.s3:S3Store",
}
"""URL scheme -> ``module:Class`` of its store; backends are imported on first use (boto3 only
when an s3:// URL is opened)."""


def _store_class(scheme: str) -> type[CheckpointStore]:
    module, _, cls = REGISTRY[scheme].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def open_store(url: str, **options: object) -> CheckpointStore:
    """Open the store behind a checkpoint URL.

    ``file:///abs/path`` and plain paths give a :class:`FileStore`; ``s3://bucket/prefix`` an
    :class:`S3Store` (``options`` go to its constructor: ``endpoint_url``, ``sse``, ...).

    Raises:
        StoreConfigError: unsupported scheme, credentials embedded in the URL, missing bucket,
            or (S3) anything the backend's startup check finds wrong.
    """
    if not isinstance(url, str) or not url.strip():
        raise StoreConfigError("checkpoint URL is empty; use file:///path or s3://bucket/prefix")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise StoreConfigError(f"checkpoint URL {redact_url(url)!r} is malformed: {e}") from None
    scheme = parts.scheme.lower()
    if parts.username is not None or parts.password is not None:
        # Secrets in a URL end up in shell history, process lists and logs: refuse them.
        raise StoreConfigError(
            f"checkpoint URL {redact_url(url)!r} embeds credentials; use the AWS credential "
            "chain (AWS_ACCESS_KEY_ID / AWS_PROFILE / instance role) instead"
        )
    if scheme == "file" or (scheme == "" and url):
        if scheme == "file" and parts.netloc not in ("", "localhost"):
            raise StoreConfigError(
                f"file URL {url!r} names host {parts.netloc!r}; use file:///absolute/path"
            )
        return _store_class("file")(parts.path if scheme == "file" else url, **options)  # type: ignore[arg-type]
    if scheme == "s3":
        if not parts.netloc:
            raise StoreConfigError(f"S3 URL {url!r} has no bucket; use s3://bucket/prefix")
        return _store_class("s3")(parts.netloc, parts.path.strip("/"), **options)  # type: ignore[arg-type]
    raise StoreConfigError(
        f"unsupported checkpoint URL scheme {scheme!r} in {redact_url(url)!r}; "
        "use file:///path or s3://bucket/prefix"
    )


__all__ = [
    'Buffer',
    'CheckpointStore',
    'Feed',
    'REGISTRY',
    'SizeMismatchError',
    'StoreConfigError',
    'StoreError',
    'StoreExistsError',
    'StoreNotFoundError',
    'StorePermissionError',
    'TransientStoreError',
    'open_store',
    'redact_url',
    'validate_key',
]
