"""The data path's errors: one line each, fatal (no restart reads a bad sample any better)."""

from __future__ import annotations

from hvd_resilient.errors import HvdResilientError


class DataError(HvdResilientError):
    """A sample or shard could not be loaded and `data.on_bad_sample` is `fatal`, or the loader
    cannot go on (its workers keep dying at the same batch). Exits FATAL_EXIT_CODE."""


class BadShardError(Exception):
    """Raised while reading a sample whose shard is unreadable (missing, truncated, not a tar,
    wrong checksum); `shard` names it, so the report says which file to fix."""

    def __init__(self, shard: str, reason: str) -> None:
        super().__init__(f"shard {shard} is unreadable: {reason}")
        self.shard = shard
        self.reason = reason

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (BadShardError, (self.shard, self.reason))
