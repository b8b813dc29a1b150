"""The memory tier: every commit also kept in host memory outside the training process
(``segments``), readable by the other hosts of the job (``peers``); see docs/memory-tier.md."""

from hvd_resilient.checkpoint.memory.segments import (
    DEFAULT_ROOT,
    SegmentDir,
    SegmentError,
    SegmentInfo,
    TierFull,
)

__all__ = ["DEFAULT_ROOT", "SegmentDir", "SegmentError", "SegmentInfo", "TierFull"]
