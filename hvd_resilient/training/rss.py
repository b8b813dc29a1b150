"""Resident memory per rank, and a warning when it keeps growing across resets.

Horovod has had leaks that show only across elastic resets (each shutdown/init cycle keeping
some buffers); a job that resets every hour then dies of OOM after a week. Sampling RSS at each
reset and flagging steady growth names the rank before it happens.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch


def sample() -> dict[str, Any]:
    out: dict[str, Any] = {"rss_bytes": psutil.Process().memory_info().rss}
    if torch.cuda.is_available():
        out["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated())
        out["cuda_reserved_bytes"] = int(torch.cuda.memory_reserved())
    return out


class GrowthWatch:
    """Flags RSS that rose at each of the last `resets` resets by `min_growth` in total."""

    def __init__(self, resets: int = 3, min_growth: float = 0.10) -> None:
        self.resets = resets
        self.min_growth = min_growth
        self.history: list[int] = []

    def at_reset(self, rss: int) -> str | None:
        self.history.append(rss)
        window = self.history[-(self.resets + 1):]
        if len(window) <= self.resets:
            return None
        rising = all(b > a for a, b in zip(window, window[1:], strict=False))
        growth = window[-1] / max(window[0], 1) - 1
        if rising and growth >= self.min_growth:
            return (f"resident memory grew at each of the last {self.resets} resets, "
                    f"{window[0] / 2**20:.0f} MiB -> {window[-1] / 2**20:.0f} MiB "
                    f"(+{growth:.0%}): a leak across resets?")
        return None
