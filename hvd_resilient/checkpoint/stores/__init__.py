"""Where checkpoints live: the storage contract (base), its backends (file, s3), and the
registry that maps a URL's scheme to a backend, so that nothing above imports a concrete store
and the base never imports its backends."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any
from urllib.parse import SplitResult, urlsplit

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
    StoreSettingError,
    TransientStoreError,
    redact_url,
    validate_key,
)

REGISTRY: dict[str, str] = {
    "file": "hvd_resilient.checkpoint.stores.file:FileStore",
    "s3": "hvd_resilient.checkpoint.stores.s3:S3Store",
}
"""URL scheme -> ``module:Class`` of its store. Each class parses its own URLs
(``url_args``/``from_url``) and checks its own settings (``check_settings``); a backend module
is cheap to import (boto3 is imported only when an s3:// store is opened)."""


def store_class(scheme: str) -> type[CheckpointStore]:
    """The store registered for ``scheme`` (KeyError when none is)."""
    module, _, cls = REGISTRY[scheme].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


SUPPORTED_URLS = " or ".join(store_class(s).url_form for s in REGISTRY)
"""The checkpoint URLs there are stores for, each registered store's ``url_form`` joined
with " or ": every message that tells a user what to write instead says it with this."""


def _resolve(url: str) -> tuple[str, type[CheckpointStore], SplitResult]:
    """The scheme-independent checks of a checkpoint URL, then its store class; a plain path
    is a file path."""
    if not isinstance(url, str) or not url.strip():
        raise StoreConfigError(f"checkpoint URL is empty; use {SUPPORTED_URLS}")
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise StoreConfigError(f"checkpoint URL {redact_url(url)!r} is malformed: {e}") from None
    if parts.username is not None or parts.password is not None:
        # Secrets in a URL end up in shell history, process lists and logs: refuse them.
        raise StoreConfigError(
            f"checkpoint URL {redact_url(url)!r} embeds credentials; use the AWS credential "
            "chain (AWS_ACCESS_KEY_ID / AWS_PROFILE / instance role) instead"
        )
    scheme = parts.scheme.lower() or "file"
    if scheme not in REGISTRY:
        raise StoreConfigError(f"unsupported checkpoint URL scheme {scheme!r} in "
                               f"{redact_url(url)!r}; use {SUPPORTED_URLS}")
    return scheme, store_class(scheme), parts


def check_url(url: str) -> str:
    """Everything that can be known about ``url`` without opening it (no I/O); returns its
    scheme (``file`` for a plain path).

    Raises:
        StoreConfigError: as :func:`open_store` for a URL it would refuse before any I/O.
    """
    scheme, cls, parts = _resolve(url)
    cls.url_args(parts, url)
    return scheme


def store_options(url: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords for ``open_store(url, ...)`` from the config's ``store`` settings
    (setting name -> value, "" when unset): checked by the store ``url`` names. A setting
    that store does not read is refused rather than silently not applied (encryption asked
    for a file:// URL).

    Raises:
        StoreConfigError: ``url`` is refused (:func:`check_url`).
        StoreSettingError: a setting the store does not read, or cannot use.
    """
    scheme = check_url(url)
    cls = store_class(scheme)
    for name, value in settings.items():
        if value not in ("", None) and name not in cls.settings:
            readers = [f"{s}://" for s in REGISTRY if name in store_class(s).settings]
            raise StoreSettingError(
                name, f"is read by {' and '.join(readers) or 'no'} checkpoint stores only, "
                f"not by {scheme}:// ones", value)
    return cls.check_settings({k: v for k, v in settings.items() if k in cls.settings})


def open_store(url: str, **options: Any) -> CheckpointStore:
    """Open the store behind a checkpoint URL: one of :data:`SUPPORTED_URLS`, or a plain
    path (a file path). ``options`` go to the store's constructor (S3: ``endpoint_url``,
    ``sse``, ...).

    Raises:
        StoreConfigError: an empty, malformed or unsupported URL, credentials embedded in it,
            a URL its store cannot use (a file URL naming a host, an S3 URL without bucket),
            or anything the store's startup check finds wrong.
    """
    _, cls, parts = _resolve(url)
    return cls.from_url(parts, url, **options)


__all__ = [
    'Buffer',
    'CheckpointStore',
    'Feed',
    'REGISTRY',
    'SUPPORTED_URLS',
    'SizeMismatchError',
    'StoreConfigError',
    'StoreError',
    'StoreExistsError',
    'StoreNotFoundError',
    'StorePermissionError',
    'StoreSettingError',
    'TransientStoreError',
    'check_url',
    'open_store',
    'redact_url',
    'store_class',
    'store_options',
    'validate_key',
]
