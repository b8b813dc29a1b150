"""The checkpoint package's own errors: one root (:class:`CheckpointError`) under the
project's, so the CLI prints each as one line; a store's failures keep theirs
(``stores.StoreError``), since an outage is never a corrupt checkpoint."""

from __future__ import annotations

from hvd_resilient.checkpoint.stores import redact_url
from hvd_resilient.errors import HvdResilientError


class CheckpointError(HvdResilientError):
    """Base of the checkpoint manager's, reader's and supersede's own errors."""


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
    any byte of its folder is written; or a supersede finding another checkpoint where it
    would move one. ``url`` (without credentials) and ``step`` say which.
    """

    def __init__(self, url: str, step: int, hint: str = "") -> None:
        self.url = redact_url(url)
        self.step = step
        super().__init__(
            f"checkpoint {self.url} (step {step}) already exists and is never rewritten"
            + (f"; {hint}" if hint else "; resume from it, or set the checkpoints aside with "
               "`hvd-resilient ckpt supersede URL`")
        )
